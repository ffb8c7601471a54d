"""Linear layers for scoring several tokens at once: faster ones on the CPU, and row-exact ones
(every row as a one-token pass computes it) on the CPU and CUDA.

On CPUs with native bf16, and on AVX512 and AVX2 ones without it where our kernel sums bf16 pairs
widened to fp32 (`fast_bf16`), bf16 weights get `PackedBf16Linear`, packed once at load: in tiles for
our kernel where it is built (`native.linear`: rows exact in calls of any size, a few-row call at
the memory's speed, on AMX's tiles where the CPU has them; docs/kernels.md#tiled-bf16-linears), else into
oneDNN's blocked layout (as vLLM's CPU backend does), the same results as `F.linear`, which
reorders them on every call, and faster (docs/kernels.md#packed-bf16-linears); a drafter's int8
short path (`Int8Linear`) stays in front.

On CPUs without any of these (or where our kernels cannot be built), PyTorch's default GEMM for a
handful of rows costs about as much per row as a matrix-vector product, which leaves speculative
decoding nothing to gain; oneDNN with the weight prepacked into its blocked layout makes the extra rows cheap
(docs/kernels.md#what---dtype-auto-picks). oneDNN has no bf16 path on such CPUs, so:

- a target in fp32 gets `PackedLinear` everywhere (same fp32 dot products, another summation order);
- a drafter in bf16 keeps its bf16 weights for 1-2-row passes (half the weight traffic wins
  there) and also holds a packed fp32 copy for longer passes such as the prompt prefill, which
  emulated bf16 would make slow. A drafter's rounding can only change acceptance, never
  the output, so mixing precisions there is safe.
- a drafter in int8 (`Int8Linear`) reads a quarter of fp32's bytes on its few-row passes, on
  every CPU kind; its longer passes go where they went before.
"""

from __future__ import annotations

import contextlib
import functools
import platform
import warnings

import torch
from torch import nn

from . import native
from .rows import row_exact_active


def has_onednn() -> bool:
    return torch.backends.mkldnn.is_available()


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True when the CPU computes bf16 natively (AMX or AVX512-BF16), where bf16 beats fp32.

    Without it (AVX2-only CPUs, and AVX512 ones without its BF16 extension) bf16 matmuls are
    emulated: a 1-token forward costs about what fp32's does, but the cost grows with the tokens
    scored at once, which removes the point of speculative decoding, and a prompt costs several
    times fp32's. See docs/kernels.md. On x86 Linux the CPU's flags decide: oneDNN's own probe
    says yes for AVX512 without BF16, where it emulates bf16 (and rounds rows of 4-row calls
    otherwise than of 1-2-row ones, docs/kernels.md). Elsewhere, oneDNN's probe.
    """
    flags = _cpu_flags()
    if flags is not None and platform.machine().lower() in ("x86_64", "amd64"):
        return bool(flags & {"avx512_bf16", "amx_bf16"})
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a private probe: absent in some builds
        return False


def fast_bf16() -> bool:
    """Whether bf16 weights run at bf16's memory speed here: on CPUs with native bf16, and where our
    tiled kernel sums them with fused multiply-adds (AVX512 without BF16, and AVX2: `tiled_bf16_supported`).
    There bf16 beats fp32, whose weights take twice the bytes (docs/kernels.md#what---dtype-auto-picks)."""
    return cpu_has_native_bf16() or tiled_bf16_supported()


def bf16_rows_exact() -> bool:
    """Whether this CPU's bf16 GEMMs compute a row the same in calls of 2..ROW_CHUNK rows, which
    row-exact bf16 passes rely on: yes with native bf16 and with AVX2's emulation, no with AVX512's
    emulation (docs/kernels.md#what---dtype-auto-picks); assumed yes where unmeasured."""
    flags = _cpu_flags()
    if flags is None or platform.machine().lower() not in ("x86_64", "amd64"):
        return True
    return cpu_has_native_bf16() or "avx512f" not in flags


def x86_without_avx512() -> bool:
    """True on an x86 CPU whose flags (Linux's /proc/cpuinfo) lack AVX512F: AVX2-only ones, where
    oneDNN builds no bf16 matmul (vLLM's CPU build then falls back to torch's emulated bf16).
    Elsewhere, or where the flags cannot be read, False."""
    flags = _cpu_flags()
    return flags is not None and platform.machine().lower() in ("x86_64", "amd64") and "avx512f" not in flags


def _cpu_flags() -> set[str] | None:
    """The CPU's feature flags (Linux's /proc/cpuinfo), or None where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def cpu_has_amx() -> bool:
    """True when the CPU has AMX tiles (Linux's `amx_tile` flag). There bf16 matmuls cost about the
    same for 1 and 16 rows, so a drafter's int8 short path pays only up to 2 rows; on a CPU with
    native bf16 but no AMX (AVX512-BF16) it paid up to 8 (`int8_short_rows`). Elsewhere, or where
    the flags cannot be read, False."""
    flags = _cpu_flags()
    return flags is not None and "amx_tile" in flags


def int8_short_rows() -> int:
    """The most rows a drafter's int8 layers and head take before its bf16 path does, where bf16 is
    native: 2 on AMX; 8 where our int8 kernel runs them (`int8_kernel_supported`) in front of tiled
    bf16 (the 0.5B drafter's pass cost the same at 16 rows either way), 2 where both run on AVX2
    (docs/kernels.md#on-avx2); where the bf16 path is
    packed for oneDNN (`PackedBf16Linear`), 4 if the layers
    fed by a norm run fbgemm's int8 GEMM (`dynamic_int8_supported`), else 2; else 8 (plain bf16):
    the break-evens probed (docs/kernels.md#the-drafter-int8-weights-and-a-frequent-token-head)."""
    if cpu_has_amx():
        return 2
    if int8_kernel_supported() and tiled_bf16_supported():
        return 2 if native.linear_i8_on_avx2() else 8
    if packed_bf16_supported():
        return 4 if dynamic_int8_supported() else 2
    return 8


class PackedLinear(nn.Module):
    """y = x W^T + b with W prepacked for oneDNN (fp32, CPU).

    dense_rows > 0 keeps the original (e.g. bf16) weight too and uses it for inputs of at most
    that many rows; longer inputs go through the packed fp32 copy and come back in x's dtype.

    In a row-exact pass (backends/rows.py) the rows go in calls of 2..ROW_CHUNK (`row_exact_calls`):
    oneDNN takes another path for one row, and only from 2 rows on (up to 32 measured) is each
    row's result independent of how many rows the call holds.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, dense_rows: int = 0):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dense_rows = dense_rows
        weight = weight.detach()
        self.register_buffer("packed_weight", weight.float().contiguous().to_mkldnn(), persistent=False)
        self.register_buffer("packed_bias", None if bias is None else bias.detach().float().clone(),
                             persistent=False)
        self.register_buffer("dense_weight", weight if dense_rows else None, persistent=False)
        self.register_buffer("dense_bias", None if bias is None or not dense_rows else bias.detach(),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features], in x's dtype."""
        rows = x.numel() // self.in_features
        if rows <= self.dense_rows:
            return nn.functional.linear(x, self.dense_weight, self.dense_bias)
        flat = x.reshape(rows, self.in_features).float()
        if row_exact_active():
            y = row_exact_calls(self._packed, flat)
        else:
            y = self._packed(flat)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def _packed(self, flat: torch.Tensor) -> torch.Tensor:
        return torch._C._nn.mkldnn_linear(flat.contiguous().to_mkldnn(), self.packed_weight, self.packed_bias).to_dense()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dense_rows={self.dense_rows}"


class PackedBf16Linear(nn.Module):
    """y = x W^T + b with a bf16 W packed once at load (CPUs where bf16 is fast: `fast_bf16`), in one
    of two layouts:

    - tiles for our kernel (`native.linear`, where it is built: AVX512, with or without BF16, or AVX2): a row's result is the
      same in a call of any number of rows by construction, and a few-row call streams the weight
      at the memory's speed (docs/kernels.md#tiled-bf16-linears);
    - else oneDNN's blocked layout, the way vLLM's CPU backend runs its linears. `F.linear` on a
      plain bf16 weight has oneDNN copy the weight into that layout on every call, so a pass reads
      each weight twice (docs/kernels.md#packed-bf16-linears); the results are the same bit for bit
      as `F.linear`'s at every row count measured. Calls of fewer than `least_rows` rows are padded
      with zero rows (oneDNN's kernel streams the weight fastest at 4-6 rows on the AVX512-BF16
      EPYC), and a row comes out the same in calls of 2..ROW_CHUNK rows.

    The dense weight is not kept (`dense` unpacks it, `set_weight` packs a new one).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, least_rows: int = 2,
                 tiled: bool | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.least_rows = max(2, least_rows)
        # tiles where our kernel runs (None: wherever it does here), for an even input width
        self.tiled = (tiled_bf16_supported() if tiled is None else tiled) and self.in_features % 2 == 0
        self.register_buffer("packed_weight", self._pack(weight), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.bfloat16).clone(),
                             persistent=False)

    def _pack(self, weight: torch.Tensor) -> torch.Tensor:
        weight = weight.detach().to(torch.bfloat16).contiguous()
        if self.tiled:
            return native.huge_pages(native.pack_tiles(weight))
        return torch.ops.mkldnn._reorder_linear_weight(weight, None)

    def dense(self) -> torch.Tensor:
        """The weight [out_features, in_features] bf16, unpacked."""
        if self.tiled:
            return native.unpack_tiles(self.packed_weight, self.out_features)
        return self.packed_weight.to_dense()

    def set_weight(self, weight: torch.Tensor) -> None:
        """Compute with `weight` [out_features, in_features] from now on (packed anew)."""
        self.packed_weight = self._pack(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] bf16 -> [..., out_features] bf16."""
        rows = x.numel() // self.in_features
        flat = x.reshape(rows, self.in_features)
        if self.tiled:  # any number of rows: each comes out as it would alone
            y = native.linear(flat, self.packed_weight, self.out_features, self.bias)
        # short calls are padded either way (faster); outside a row-exact pass long ones go whole
        elif row_exact_active() or rows < self.least_rows:
            y = row_exact_calls(self._packed, flat, self.least_rows)
        else:
            y = self._packed(flat)
        return y.view(*x.shape[:-1], self.out_features)

    def _packed(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(flat.contiguous(), self.packed_weight, self.bias, "none", [], "")

    def __deepcopy__(self, memo):
        """A copy packed anew (oneDNN's blocked tensors have no storage to copy)."""
        return PackedBf16Linear(self.dense(), self.bias, self.least_rows, self.tiled)

    def extra_repr(self) -> str:
        layout = "tiles" if self.tiled else "onednn"
        return f"in_features={self.in_features}, out_features={self.out_features}, {layout}, least_rows={self.least_rows}"


# torch 2.13's CPU int8 op returns garbage (inf, NaN) or crashes for other input widths
INT8_K_MULTIPLE = 16


class Int8Linear(nn.Module):
    """y = x W^T + b with W in int8 (one scale per output row) for inputs of at most `short_rows`
    rows; longer inputs go through `long`, the layer this one stands in for.

    torch's weight-only int8 op reads a quarter of fp32's bytes and half of bf16's, so it wins on
    memory-bound passes of a few rows, but its cost grows about linearly with rows, which a
    prompt prefill cannot afford (its break-evens: docs/kernels.md#the-drafter-int8-weights-and-a-frequent-token-head).
    Symmetric per-row rounding: a weight moves by at most max|W[row]| / 254. Only for drafters,
    whose precision steers acceptance alone.

    dynamic: the short path rounds the input to int8 too (one scale over the call's rows) and runs
    fbgemm's int8 GEMM, which streams the weight about twice as fast as the weight-only op
    (`dynamic_int8_supported`). Only for layers whose input an RMSNorm has just scaled
    (`NORMED_INPUTS`): where the input has outlier channels one scale would flatten the rest.

    vnni: the short path runs our kernel (`native.linear_i8`, AVX512-VNNI or AVX2), which rounds each
    input row in groups of `native.I8_GROUP` (an outlier flattens only its group, so every layer can
    take it) and streams the int8 weight at the memory's speed; it replaces both paths above. None: where
    the kernel is built and the input width fits its groups (`int8_kernel_supported`).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, long: nn.Module, short_rows: int,
                 dynamic: bool = False, vnni: bool | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        if self.in_features % INT8_K_MULTIPLE:
            raise ValueError(f"Int8Linear needs in_features divisible by {INT8_K_MULTIPLE}, got {self.in_features}")
        self.short_rows = short_rows
        self.long = long
        self.vnni = (int8_kernel_supported() if vnni is None else bool(vnni)) and self.in_features % native.I8_GROUP == 0 \
            and weight.device.type == "cpu"
        self.dynamic = bool(dynamic) and not self.vnni
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.bfloat16).clone(),
                             persistent=False)
        self._set_weight(weight.detach())

    def _set_weight(self, weight: torch.Tensor) -> None:
        int8, scales = quantize_int8(weight)
        if self.vnni:
            self.register_buffer("packed_i8", native.huge_pages(native.pack_i8(int8)), persistent=False)
            self.register_buffer("scales", scales, persistent=False)
            self.int8_weight = self.dynamic_weight = None
        elif self.dynamic:
            # fbgemm's own packed layout; the int8 values and scales are quantize_int8's
            bias = None if self.bias is None else self.bias.float()
            self.dynamic_weight = torch.ops.quantized.linear_prepack(_per_channel(int8, scales), bias)
            self.int8_weight = self.scales = None
        else:
            self.register_buffer("int8_weight", int8, persistent=False)
            self.register_buffer("scales", scales.to(torch.bfloat16), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features], in x's dtype."""
        rows = x.numel() // self.in_features
        if rows > self.short_rows:
            return self.long(x)
        if self.vnni:
            y = native.linear_i8(x.reshape(rows, self.in_features).to(torch.bfloat16), self.packed_i8, self.scales,
                                 self.out_features, self.bias)
            return y.view(*x.shape[:-1], self.out_features).to(x.dtype)
        if self.dynamic:
            flat = x.reshape(rows, self.in_features).float()
            y = torch.ops.quantized.linear_dynamic(flat, self.dynamic_weight, _reduce_range())
            return y.view(*x.shape[:-1], self.out_features).to(x.dtype)
        # a fresh buffer: the op reads out of bounds (and crashes) on inputs not 32-byte aligned,
        # such as a view into a longer tensor
        flat = torch.empty((rows, self.in_features), dtype=torch.bfloat16, device=x.device)
        y = torch._weight_int8pack_mm(flat.copy_(x.reshape(rows, self.in_features)), self.int8_weight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, short_rows={self.short_rows}, "
                f"dynamic={self.dynamic}, vnni={self.vnni}")


# The Llama family's linears whose input is an RMSNorm's output: one int8 scale for a row's
# activations loses little there (`Int8Linear`'s dynamic path). o_proj's and down_proj's inputs
# carry a few outlier channels; rounded with one scale, the 0.5B drafter's top-1 agreement with
# its bf16 self fell from 0.97 to 0.95 (docs/kernels.md#the-drafter-int8-weights-and-a-frequent-token-head).
NORMED_INPUTS = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})


def _per_channel(int8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] and scales [N] as torch's per-channel quantized tensor (fbgemm's input)."""
    with warnings.catch_warnings():  # torch 2.13 calls quantized tensors deprecated; fbgemm's op still takes only them
        warnings.simplefilter("ignore", UserWarning)
        return torch._make_per_channel_quantized_tensor(int8, scales.double(), torch.zeros_like(scales, dtype=torch.long), 0)


@functools.cache
def dynamic_int8_supported() -> bool:
    """Whether fbgemm's int8 GEMM with int8-rounded inputs runs here (x86 CPUs with AVX2 or
    better, in torch's x86 or fbgemm quantized engine)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    if torch.backends.quantized.engine not in ("x86", "fbgemm"):
        return False
    try:
        weight = _per_channel(torch.ones(8, 32, dtype=torch.int8), torch.ones(8))
        y = torch.ops.quantized.linear_dynamic(torch.ones(1, 32), torch.ops.quantized.linear_prepack(weight, None), True)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return bool(torch.allclose(y, torch.full((1, 8), 32.0), rtol=0.05))


def int8_kernel_supported() -> bool:
    """Whether a drafter's int8 layers run our kernel (`native.linear_i8`): where it is built, on
    CPUs with AVX512-VNNI or AVX2."""
    return native.linear_i8_kernel() is not None


@functools.cache
def _reduce_range() -> bool:
    """fbgemm's 7-bit inputs, needed where its u8*s8 products are summed in 16 bits: everywhere
    but AVX512-VNNI (fbgemm has no AVX-VNNI kernel; those CPUs run its AVX2 one)."""
    return "avx512_vnni" not in (_cpu_flags() or set())


def quantize_int8(weight: torch.Tensor, chunk: int = 16384) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (int8 [N, K], fp32 scales [N]) with weight ≈ int8 * scale[:, None].

    Symmetric, one scale per row (max |row| / 127), rounded to nearest; in chunks of rows, so a
    151,936-row head never needs a whole fp32 copy.
    """
    rows = weight.shape[0]
    out = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scales = torch.empty(rows, dtype=torch.float32, device=weight.device)
    for start in range(0, rows, chunk):
        block = weight[start:start + chunk].float()
        scale = block.abs().amax(dim=1).clamp_min(1e-12) / 127
        out[start:start + chunk] = torch.round(block / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        scales[start:start + chunk] = scale
    return out, scales


def int8_fits(layer: nn.Linear) -> bool:
    """Whether `layer`'s shape suits the int8 op (others keep their own kernel)."""
    return layer.in_features % INT8_K_MULTIPLE == 0


def int8_supported(device: torch.device) -> bool:
    """Whether this torch build runs the weight-only int8 op on `device` (CPU builds do)."""
    if device.type != "cpu":
        return False
    try:
        x = torch.ones(1, 32, dtype=torch.bfloat16)
        torch._weight_int8pack_mm(x, torch.ones(8, 32, dtype=torch.int8), torch.ones(8, dtype=torch.bfloat16))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return True


class TwoRowLinear(nn.Linear):
    """An nn.Linear that, inside a row-exact pass (backends/rows.py), makes its GEMM calls with the row
    counts at which a row's result does not depend on the call (`row_exact_calls`).

    CPU GEMMs may take another path for one row than for several: on an AVX512-BF16 EPYC (no AMX)
    a 1-row bf16 `F.linear` differed from the same row in any 2..160-row call, which all agreed
    with each other whatever the row's position (docs/kernels.md); on an AMX Xeon rows agree over
    2..32-row calls. Padding the 1-row case and cutting wide calls makes a decode step and a
    verification pass meet on the same path on both, at the price of one extra row (bf16 GEMMs of
    1-2 rows cost about the same). On CUDA every call has CUDA_ROWS rows.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_stable_linear(x, self.weight, self.bias)


# The most rows one GEMM call takes in a row-exact pass on the CPU. bf16 `F.linear` on an AMX Xeon
# (torch 2.13, oneDNN) gives every row the same result in calls of 2..32 rows and another from 33
# on (at 1536x8960, 896x4864 and every Qwen shape probed); the EPYC agreed over 2..160 rows, packed
# fp32 over 2..32. A wider row-exact pass (a batch's) is cut into calls of at most this many rows.
ROW_CHUNK = 32

# The rows of every row-dependent call (GEMMs, norms) in a row-exact pass on CUDA. cuBLAS picks its
# kernel (tiles, split of the reduction) by the call's whole shape, and torch's reductions their
# thread layout by the number of rows, so a row's result can change with the rows that share its
# call; no kernel mixes rows, so in calls of one fixed shape a row comes out the same wherever it
# sits and whatever its neighbours are. Zero rows pad the rest: at 64 rows a GEMM of a model's
# weights is still bound by reading them, so a padded decode step costs about what a 1-row one does.
CUDA_ROWS = 64


def fp32_matmul(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden [T, H] @ weight[V, H]^T with fp32 accumulation and output (CUDA low-precision weights)."""
    try:
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError):  # builds without mm's out_dtype
        return torch.nn.functional.linear(hidden.float(), weight.float())


def row_exact_calls(function, flat: torch.Tensor, least: int = 2) -> torch.Tensor:
    """`function(rows)` over flat [n, K] in calls whose every row comes out as a one-token pass's
    -> [n, N]. CPU: calls of 2..ROW_CHUNK rows, the row counts at which every CPU measured computes
    a row the same whatever else the call holds (a 1-row input, or a last chunk of one row, is the
    first row of a 2-row call); a call of fewer than `least` (2..ROW_CHUNK) rows is padded with
    zero rows to `least`, where a kernel is faster so. CUDA: calls of exactly CUDA_ROWS rows
    (`fixed_row_calls`)."""
    if flat.device.type == "cuda":
        return fixed_row_calls(function, flat, CUDA_ROWS)
    if len(flat) > ROW_CHUNK:
        cuts = list(range(0, len(flat), ROW_CHUNK))
        if len(flat) - cuts[-1] == 1:
            cuts[-1] -= 1  # a last chunk of 2 rows, not 1
        bounds = cuts[1:] + [len(flat)]
        return torch.cat([row_exact_calls(function, flat[a:b], least) for a, b in zip(cuts, bounds)])
    short = max(2, least) - len(flat)
    if short > 0:
        return function(nn.functional.pad(flat, (0, 0, 0, short)))[:len(flat)]
    return function(flat)


def fixed_row_calls(function, flat: torch.Tensor, rows: int) -> torch.Tensor:
    """`function` over flat [n, K] in calls of exactly `rows` rows, the last padded with zeros -> [n, N]."""
    n = len(flat)
    if n % rows:  # one padding op (a pass is bound by launching its many small ops on a GPU)
        flat = nn.functional.pad(flat, (0, 0, 0, rows - n % rows))
    if len(flat) == rows:
        return function(flat)[:n]
    return torch.cat([function(chunk) for chunk in flat.split(rows)])[:n]


def row_stable(function, x: torch.Tensor) -> torch.Tensor:
    """`function(x)` for a function of x's rows (x [..., K] -> [..., N]); inside a row-exact pass
    computed in `row_exact_calls` over x's rows flattened."""
    rows = x.numel() // x.shape[-1]
    if not row_exact_active() or (x.device.type != "cuda" and 2 <= rows <= ROW_CHUNK):
        return function(x)
    y = row_exact_calls(function, x.reshape(rows, x.shape[-1]))
    return y.view(*x.shape[:-1], y.shape[-1])


def row_stable_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, but inside a row-exact pass computed in `row_exact_calls`
    (see TwoRowLinear)."""
    return row_stable(lambda rows: nn.functional.linear(rows, weight, bias), x)


def pad_single_rows(module: nn.Module) -> int:
    """Make every plain nn.Linear inside `module` a TwoRowLinear (in place: same parameters, no
    copy); return how many."""
    count = 0
    for child in module.modules():
        if type(child) is nn.Linear:
            child.__class__ = TwoRowLinear
            count += 1
    return count


def fix_norm_rows(module: nn.Module) -> int:
    """Make every RMSNorm and LayerNorm inside `module` compute its rows in `row_exact_calls` inside
    a row-exact pass on CUDA, where a norm's reduction may be laid out by the number of rows (in
    place: its class becomes a subclass, `_row_stable_norm`); return how many."""
    count = 0
    for child in module.modules():
        cls = type(child)
        if cls.__name__.endswith(("RMSNorm", "LayerNorm")) and not getattr(cls, "_rows_fixed", False):
            child.__class__ = _row_stable_norm(cls)
            count += 1
    return count


@functools.cache
def _row_stable_norm(cls: type) -> type:
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cuda":
            return cls.forward(self, x)  # CPU norms agreed at every row count measured
        return row_stable(lambda rows: cls.forward(self, rows), x)
    return type(f"RowStable{cls.__name__}", (cls,), {"forward": forward, "_rows_fixed": True,
                                                     "__doc__": f"{cls.__name__}, rows fixed (`fix_norm_rows`)."})


@functools.cache
def packed_bf16_supported() -> bool:
    """Whether this torch build and CPU run oneDNN's packed bf16 linear (`PackedBf16Linear`)."""
    if not has_onednn():
        return False
    try:
        weight = torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 32, dtype=torch.bfloat16), None)
        x = torch.ones(2, 32, dtype=torch.bfloat16)
        out = torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return bool((out == 32).all())


# what `packed_bf16_label` may say: a model's kernels name where its linears are `PackedBf16Linear`s
PACKED_BF16_LABELS = ("onednn-packed-bf16", "tiled-bf16", "tiled-bf16-amx", "tiled-bf16-fma")
TILED_LABELS = ("tiled-bf16", "tiled-bf16-amx", "tiled-bf16-fma")  # our kernels: a row rounds alike in calls of any size


def packed_bf16_label() -> str:
    """What `PackedBf16Linear` runs here, for a model's `kernels` name (and the pass-cost cache's
    key): "tiled-bf16" (our kernel, `native.linear`), "tiled-bf16-amx" (the same layout rounded as
    AMX rounds, on an AMX CPU), "tiled-bf16-fma" (the same layout summed by fused multiply-adds, on
    AVX512 without BF16 and on AVX2, with the same bits) or "onednn-packed-bf16"."""
    if not tiled_bf16_supported():
        return "onednn-packed-bf16"
    if native.linear_amx_kernel() is not None:
        return "tiled-bf16-amx"
    return "tiled-bf16-fma" if native.linear_widens() else "tiled-bf16"


def tiled_bf16_supported() -> bool:
    """Whether `PackedBf16Linear` packs its weight in tiles for our kernel (`native.linear`): where
    it is built (AVX512, with or without its BF16 extension, or AVX2 with FMA), and on a CPU with AMX where its AMX
    kernel runs too (a prompt's GEMMs run several times faster on AMX's tiles than on the
    dot-product instruction)."""
    if native.linear_kernel() is None:
        return False
    return not cpu_has_amx() or native.linear_amx_kernel() is not None


def packed_bf16_least_rows() -> int:
    """The rows a packed bf16 GEMM call is padded to (`PackedBf16Linear`): 6 on a CPU with
    AVX512-BF16 and no AMX, where oneDNN's blocked kernel streams the weight fastest at 5-6 rows a
    call (docs/kernels.md#packed-bf16-linears); 2 elsewhere (AMX computes up to 16 rows a tile: unmeasured)."""
    return 2 if cpu_has_amx() else 6


def pack_bf16_linears(module: nn.Module, int8_rows: int = 0) -> int:
    """Replace every nn.Linear inside `module` by a PackedBf16Linear (int8_rows > 0: an Int8Linear
    for inputs of at most that many rows in front of it, where the int8 op takes the shape);
    return how many."""
    count = 0
    least = packed_bf16_least_rows()
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            packed = PackedBf16Linear(child.weight, child.bias, least)
            if int8_rows and int8_fits(child):
                packed = Int8Linear(child.weight, child.bias, packed, int8_rows, _dynamic(name))
            setattr(module, name, packed)
            count += 1
        else:
            count += pack_bf16_linears(child, int8_rows)
    return count


def pack_linears(module: nn.Module, dense_rows: int = 0, int8_rows: int = 0) -> int:
    """Replace every nn.Linear inside `module` by a PackedLinear (int8_rows > 0: an Int8Linear for
    inputs of at most that many rows, over a PackedLinear for longer ones); return how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            int8 = int8_rows > 0 and int8_fits(child)
            # a layer the int8 op cannot take keeps the bf16 short path the drafter had before
            rows = dense_rows if int8 or not int8_rows else max(dense_rows, 2)
            packed = PackedLinear(child.weight, child.bias, rows)
            setattr(module, name, Int8Linear(child.weight, child.bias, packed, int8_rows) if int8 else packed)
            count += 1
        else:
            count += pack_linears(child, dense_rows, int8_rows)
    return count


def quantize_linears(module: nn.Module, short_rows: int) -> int:
    """Replace every nn.Linear inside `module` by an Int8Linear that keeps the original layer for
    inputs of more than `short_rows` rows; return how many were replaced."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and int8_fits(child):
            setattr(module, name, Int8Linear(child.weight, child.bias, child, short_rows))
            count += 1
        else:
            count += quantize_linears(child, short_rows)
    return count


def int8_label(module: nn.Module) -> str:
    """What the int8 layers inside `module` run, for its `kernels` name (and the pass-cost cache's
    key): "int8/vnni" where they run our kernel ("int8/avx2" on AVX2), "int8/fbgemm" where some of
    them round their inputs through fbgemm, else "int8" (weight-only)."""
    layers = [m for m in module.modules() if isinstance(m, Int8Linear)]
    if any(m.vnni for m in layers):
        return "int8/avx2" if native.linear_i8_on_avx2() else "int8/vnni"
    return "int8/fbgemm" if any(m.dynamic for m in layers) else "int8"


def _dynamic(name: str) -> bool:
    """Whether the int8 layer standing in for the linear `name` in front of a packed bf16 layer
    rounds its inputs too (`Int8Linear`, where our int8 kernel does not run): on AVX512-BF16 CPUs,
    the kind measured; AMX keeps the weight-only op."""
    return name in NORMED_INPUTS and not cpu_has_amx() and dynamic_int8_supported()


def weight_count(module: nn.Module) -> int:
    """The weights `module` computes with, whatever layout its linear layers keep them in: packed
    layers hold theirs as buffers, not parameters (an int8 layer's are counted once, by the layer it
    stands in for; a stacked GEMM once). What a pass's cost goes by (drafters/layerskip.py)."""
    packed = 0
    for m in module.modules():
        if isinstance(m, (PackedLinear, PackedBf16Linear)):
            bias = m.packed_bias if isinstance(m, PackedLinear) else m.bias
            packed += m.in_features * m.out_features + (0 if bias is None else bias.numel())
    return packed + sum(p.numel() for p in module.parameters())


class StackedPart(nn.Module):
    """A linear layer that computes with its rows of a weight stacked with its siblings'
    (`backends.merged.MergedPart`): it reads and rewrites its own rows, and has `bias`,
    `in_features` and `out_features` as a layer of its own would."""

    def dense_weight(self) -> torch.Tensor:
        """[out_features, in_features]: this layer's rows of the stacked weight."""
        raise NotImplementedError

    def set_dense_weight(self, weight: torch.Tensor) -> None:
        """Compute with `weight` [out_features, in_features] from now on."""
        raise NotImplementedError


def dense_weight(layer: nn.Module) -> torch.Tensor:
    """The [out, in] weight a linear layer of any kind here computes with (nn.Linear, Int8Linear's
    long path, PackedLinear's dense copy or its packed one made dense)."""
    if isinstance(layer, Int8Linear):
        return dense_weight(layer.long)
    if isinstance(layer, PackedLinear):
        return layer.dense_weight if layer.dense_weight is not None else layer.packed_weight.to_dense()
    if isinstance(layer, PackedBf16Linear):
        return layer.dense()
    if isinstance(layer, StackedPart):
        return layer.dense_weight()
    return layer.weight


@torch.no_grad()
def set_dense_weight(layer: nn.Module, weight: torch.Tensor) -> None:
    """Make a linear layer of any kind here compute with `weight` [out, in] from now on, in its
    own layout (int8 rounded again, oneDNN packed again), in place: a drafter's merged adapter."""
    if isinstance(layer, Int8Linear):
        set_dense_weight(layer.long, weight)
        layer._set_weight(weight.detach())
    elif isinstance(layer, PackedLinear):
        layer.packed_weight = weight.detach().float().contiguous().to_mkldnn()
        if layer.dense_weight is not None:
            layer.dense_weight.copy_(weight)
    elif isinstance(layer, PackedBf16Linear):
        layer.set_weight(weight)
    elif isinstance(layer, StackedPart):
        layer.set_dense_weight(weight.detach())
    else:
        layer.weight.copy_(weight)


@contextlib.contextmanager
def differentiable_linears(module: nn.Module):
    """Within the block, the oneDNN-packed layers inside `module` compute with a plain matmul over
    their dense weight, through which autograd can pass (it cannot through a packed one): an
    adapter trained on a drafter's outputs needs gradients through every layer after it."""
    patched = []
    for layer in module.modules():
        if isinstance(layer, Int8Linear):  # neither int8 op has a gradient: the layer it stands in for
            layer.forward = lambda x, long=layer.long: long(x)
            patched.append(layer)
        elif isinstance(layer, (PackedLinear, PackedBf16Linear, StackedPart)):
            weight = dense_weight(layer)
            bias = layer.packed_bias if isinstance(layer, PackedLinear) else layer.bias
            layer.forward = lambda x, w=weight, b=bias: nn.functional.linear(
                x, w.to(x.dtype), None if b is None else b.to(x.dtype))
            patched.append(layer)
    try:
        yield
    finally:
        for layer in patched:
            del layer.forward  # the class's own again
