"""Sibling projections as one GEMM: an attention's q/k/v and an MLP's gate/up read the same input,
so their packed bf16 weights are stacked and multiplied once (vLLM's CPU models hold them merged
too). Four GEMM calls a layer instead of seven, and wider ones: 2-3% less GEMM time at 6-16 rows
on the EPYC measured (docs/kernels.md#merged-projections). Where a stack would change a bit, the
group's layers are held apart behind the same parts (`ApartGemm`) so that what reads one merged
output (the fused rotation, the SwiGLU middle) still runs.

The model's own code still calls `q_proj(x)`, `k_proj(x)`, `v_proj(x)` one after the other, so
each becomes a `MergedPart`: the first call on an input runs the stacked GEMM, and each part hands
out its own columns as a tensor of its own, laid out as the separate layer's output was.

Stacking changes no bit: a column of the stacked GEMM must come out as the separate GEMM computes
it, at every row count a row-exact call takes (so the stack is as row-invariant as the layers
apart) and at a prompt chunk's. In oneDNN's layout that depends on how it blocks the call on this
CPU and its threads (in tiles every output column is summed alone), so each shape is checked once,
on random rows, before any layer of it is stacked. Where the check fails (on AMX a 256-wide k or v
rounds otherwise than its columns of the stack in a prompt chunk), the group's layers stay apart
behind the same parts (`ApartGemm`): their own calls, their outputs side by side, so that the
fused rotary and SwiGLU ops that read one stacked output run there too. Only model families whose
code calls a group's projections on one tensor in one forward are merged (`FAMILIES`); a
cross-attention's q reads another input than its k and v.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from .kernels import ROW_CHUNK, Int8Linear, PackedBf16Linear, StackedPart, dense_weight, set_dense_weight
from .layer_ops import fuse_rotary, fuse_swiglu, rotary_fuses, swiglu_fuses
from .prompts import PREFILL_CHUNK

# the model's attribute names of sibling projections that read one input (stacked in this order)
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

# transformers' model types whose attention and MLP call each group on the same tensor, unchanged
# in between (read in transformers 5.23's modeling files)
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")


class ApartGemm(nn.Module):
    """Sibling layers each called on its own, their outputs side by side [..., sum of outs]: a
    stacked GEMM's output with each part's own bits, where stacking their weights would change
    some (`stacks_exactly`)."""

    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.in_features = layers[0].in_features
        self.out_features = sum(layer.out_features for layer in layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features]."""
        return torch.cat([layer(x) for layer in self.layers], dim=-1)


class MergedGemm(nn.Module):
    """Sibling layers run once per input, their outputs split into the parts': one packed GEMM over
    their weights stacked [sum of outs, in] (`stacked`), else the layers apart (`ApartGemm`)."""

    def __init__(self, layers: list[PackedBf16Linear | Int8Linear], stacked: bool = True):
        super().__init__()
        self.sizes = [layer.out_features for layer in layers]
        self.gemm = _stack(layers) if stacked else ApartGemm(layers)
        # (the input, its parts' outputs, the parts served), until every part took its own
        self._memo: tuple[torch.Tensor, tuple[torch.Tensor, ...], set[int]] | None = None

    @property
    def stacked(self) -> bool:
        """Whether the parts' weights are stacked into one GEMM (else held apart, `ApartGemm`)."""
        return not isinstance(self.gemm, ApartGemm)

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Part `index`'s output for x [..., in] -> [..., sizes[index]] (contiguous)."""
        memo = self._memo  # read once: a part serves only outputs computed from its own input
        if memo is None or memo[0] is not x:  # the same tensor object: the siblings' calls of one forward
            memo = self._memo = (x, self.gemm(x).split(self.sizes, dim=-1), set())
        memo[2].add(index)
        if len(memo[2]) == len(self.sizes) and self._memo is memo:  # hold no tensor between passes
            self._memo = None
        # a copy even where the slice counts as contiguous (one row): a hook may change it in place
        return memo[1][index].clone(memory_format=torch.contiguous_format)

    def offset(self, index: int) -> int:
        return sum(self.sizes[:index])

    def rows(self, index: int) -> slice:
        """Part `index`'s rows of the stacked weight."""
        start = self.offset(index)
        return slice(start, start + self.sizes[index])

    def bias(self, index: int) -> torch.Tensor | None:
        """Part `index`'s bias [sizes[index]], or None."""
        if not self.stacked:
            return self.gemm.layers[index].bias
        return None if self.gemm.bias is None else self.gemm.bias[self.rows(index)]

    def weight(self, index: int) -> torch.Tensor:
        """Part `index`'s weight [sizes[index], in] as it computes with it."""
        if not self.stacked:
            return dense_weight(self.gemm.layers[index])
        return dense_weight(self.gemm)[self.rows(index)]

    @torch.no_grad()
    def set_weight(self, index: int, weight: torch.Tensor) -> None:
        """Part `index` computes with `weight` [sizes[index], in] from now on (a stack packed anew)."""
        if not self.stacked:
            set_dense_weight(self.gemm.layers[index], weight)
        else:
            stacked = dense_weight(self.gemm)
            stacked[self.rows(index)] = weight.to(stacked.dtype)
            set_dense_weight(self.gemm, stacked)
        self._memo = None  # outputs of the old weight


class MergedPart(StackedPart):
    """One of the layers a `MergedGemm` stands in for: same call, same output, same attributes."""

    def __init__(self, merged: MergedGemm, index: int):
        super().__init__()
        self.merged, self.index = merged, index
        self.out_features = merged.sizes[index]
        self.in_features = merged.gemm.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] bf16 -> [..., out_features] bf16."""
        return self.merged.part(x, self.index)

    @property
    def bias(self) -> torch.Tensor | None:
        return self.merged.bias(self.index)

    def dense_weight(self) -> torch.Tensor:
        """[out_features, in_features]: the weight this part computes with."""
        return self.merged.weight(self.index)

    def set_dense_weight(self, weight: torch.Tensor) -> None:
        """Compute with `weight` [out_features, in_features] from now on (a stack packed anew)."""
        self.merged.set_weight(self.index, weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, part {self.index} of {self.merged.sizes}"


def _stack(layers: list[PackedBf16Linear | Int8Linear]) -> nn.Module:
    """One packed GEMM over `layers`' weights stacked [sum of outs, in] (a drafter's int8 layers: one
    int8 call in front of the stacked long path)."""
    weight = torch.cat([dense_weight(layer) for layer in layers])
    bias = None if layers[0].bias is None else torch.cat([layer.bias for layer in layers])
    packed = _packed(layers[0])
    gemm = PackedBf16Linear(weight, bias, packed.least_rows, packed.tiled)
    if isinstance(layers[0], Int8Linear):
        gemm = Int8Linear(weight, bias, gemm, layers[0].short_rows, vnni=True)
    return gemm


def _packed(layer: nn.Module) -> PackedBf16Linear | None:
    """The packed bf16 layer that computes `layer`'s long calls: itself, or the one behind a
    drafter's int8 layer that runs our kernel (`Int8Linear.vnni`; no other int8 layer stacks)."""
    if type(layer) is PackedBf16Linear:
        return layer
    if type(layer) is Int8Linear and layer.vnni and type(layer.long) is PackedBf16Linear:
        return layer.long
    return None


def merge_projections(module: nn.Module, family: str) -> int:
    """Stack every group of sibling projections (`GROUPS`) inside `module`, a model of transformers'
    model type `family` (one of `FAMILIES`, else nothing is stacked), that are all
    `PackedBf16Linear` (or all a drafter's int8 layers in front of them, `_packed`) of one input
    width, with or without bias alike: stacked where the stacked GEMM gives their own bits
    (`stacks_exactly`; the int8 kernel rounds an input row once whatever the outputs, so its stack
    gives each part's own result too), else apart (`ApartGemm`) where the fused rotation or SwiGLU
    middle then runs over their outputs (else left as they are); return how many groups were merged."""
    if family not in FAMILIES:
        return 0
    count = 0
    for child in list(module.modules()):
        for names in GROUPS:
            layers = [child._modules.get(name) for name in names]  # a registered layer, or None
            packed = [_packed(layer) for layer in layers]
            if None in packed or len({type(layer) for layer in layers}) != 1:
                continue
            if len({(layer.in_features, layer.bias is None, p.least_rows, p.tiled,
                     layer.short_rows if isinstance(layer, Int8Linear) else 0) for layer, p in zip(layers, packed)}) != 1:
                continue
            sizes = [layer.out_features for layer in layers]
            mlp = names[0] == "gate_proj"
            stacks = stacks_exactly(layers[0].in_features, tuple(sizes), layers[0].bias is not None,
                                    packed[0].least_rows, torch.get_num_threads(), packed[0].tiled)
            if not stacks and not (swiglu_fuses(child, sizes) if mlp else rotary_fuses(child)):
                continue  # apart behind parts, with nothing fused over their outputs: a copy for nothing
            merged = MergedGemm(layers, stacked=stacks)
            for index, name in enumerate(names):
                setattr(child, name, MergedPart(merged, index))
            if mlp:
                fuse_swiglu(child, merged.sizes)  # its middle in one kernel call (layer_ops.py)
            else:
                fuse_rotary(child)  # q and k rotated out of the merged output in a kernel call each (layer_ops.py)
            count += 1
    return count


@functools.cache
def stacks_exactly(width: int, sizes: tuple[int, ...], bias: bool, least_rows: int, threads: int,
                   tiled: bool = False) -> bool:
    """Whether a stacked packed GEMM returns, column for column, the bits of the separate ones, for
    inputs of `width` and outputs of `sizes`, on random bf16 values, in every call a row-exact
    pass makes (least_rows..ROW_CHUNK rows, fewer padded to least_rows in oneDNN's layout; from 1
    row in `tiled` layers) and in a prompt chunk's, with `threads` threads (oneDNN splits its work
    by them; the caller's count)."""
    generator = torch.Generator().manual_seed(0)
    random = lambda *shape: torch.randn(*shape, generator=generator).to(torch.bfloat16)  # noqa: E731
    layers = [PackedBf16Linear(random(size, width) * 0.05, random(size) if bias else None, least_rows, tiled)
              for size in sizes]
    merged = MergedGemm(layers)
    with torch.inference_mode():
        for rows in [*range(1 if tiled else least_rows, ROW_CHUNK + 1), PREFILL_CHUNK]:
            x = random(rows, width)
            if not torch.equal(merged.gemm(x), torch.cat([layer(x) for layer in layers], dim=-1)):
                return False
    return True
