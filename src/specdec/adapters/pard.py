"""A parallel drafter (PARD, An et al. 2025): a drafter model adapted to propose k tokens in one pass.

The pass feeds the context's new tokens, then k − 1 mask tokens. The last real token's row
predicts token t + 1 as it always did; the mask at position t + i predicts token t + i + 1
without seeing tokens t + 1 … t + i. So a draft of k tokens costs one drafter pass instead of k.

The adaptation (`ParallelAdapter`) is two parts, both small, and both touch the mask rows only:
- the mask token's input embedding, one vector of the hidden size (`mask_id` is an id past the
  drafter's embedding table, which no tokenizer produces; a hook on the embedding layer puts the
  vector there), and
- a LoRA adapter (adapters/lora.py's `DraftAdapter`) on the drafter's projections, added to the mask
  rows' outputs alone (`parallel_hooks`).
So every real token's row, and its cache entry, is the plain drafter's bit for bit: the first
token of a parallel draft is the one the drafter's chain would propose, and the masks only add.
(PARD adapts the whole model; keeping the real rows as they are is our choice: a LoRA merged
into every row cost the first token acceptance, docs/methods.md#parallel-drafters.) Unlike a
distilled drafter's adapter, this one cannot be merged into the weights: it runs as hooks, a
small matmul pair per projection over the masks' rows.

It is target-independent (trained on text, not on a target's outputs): one adapted drafter
serves every target of its tokenizer. Exactness never depends on it: verification compares the
target's p with whatever q drafted. Training: training/fit_parallel.py (`specdec train-parallel-drafter`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from .lora import DraftAdapter, _check_drafter, adapted_layers
from ..errors import SpecdecError
from .checkpoints import read_checkpoint, target_fingerprint


class ParallelAdapter(nn.Module):
    """The mask token's embedding `mask` [H] and a LoRA adapter (`lora`) over the drafter's layers."""

    def __init__(self, shapes: dict, rank: int, hidden_size: int, k: int):
        super().__init__()
        if k < 2:
            raise SpecdecError(f"a parallel drafter proposes k >= 2 tokens a pass, got k = {k}")
        self.lora = DraftAdapter(shapes, rank)
        self.mask = nn.Parameter(torch.zeros(hidden_size))
        self.k = k


def mask_id(model) -> int:
    """The id that stands for the mask token in `model`'s inputs: one past its embedding table."""
    return model._decoder.get_input_embeddings().num_embeddings


def install(model, adapter: ParallelAdapter) -> None:
    """Hooks on `model` from now on (`remove` undoes them): its embedding layer embeds
    `mask_id(model)` as `adapter.mask`, and each projection `adapter.lora` adapts adds the LoRA's
    share to the rows of mask tokens alone. Gradients reach the adapter where it requires them."""
    remove(model)
    embedding = model._decoder.get_input_embeddings()
    token = embedding.num_embeddings
    rows: list[torch.Tensor] = [torch.zeros(0, dtype=torch.long)]  # the pass's mask rows, flat

    def before(module, inputs):
        ids = inputs[0]
        hit = ids == token
        rows[0] = hit.reshape(-1).nonzero().squeeze(1)
        return (ids.masked_fill(hit, 0), *inputs[1:])

    def after(module, inputs, output):
        if len(rows[0]) == 0:
            return output
        flat = output.reshape(-1, output.shape[-1])
        vector = adapter.mask.to(output.dtype).expand(len(rows[0]), -1)
        return flat.index_copy(0, rows[0], vector).view_as(output)

    def adapted(name: str):
        def hook(module, inputs, output):
            if len(rows[0]) == 0:
                return output
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).index_select(0, rows[0])
            flat = output.reshape(-1, output.shape[-1])
            return flat.index_add(0, rows[0], adapter.lora.extra(name, x).to(output.dtype)).view_as(output)
        return hook

    modules = dict(model._decoder.named_modules())
    handles = [embedding.register_forward_pre_hook(before), embedding.register_forward_hook(after)]
    handles += [modules[name].register_forward_hook(adapted(name)) for name in adapter.lora.shapes]
    model._parallel_hooks = handles


def remove(model) -> None:
    """Undo `install`."""
    for handle in model._parallel_hooks:
        handle.remove()
    model._parallel_hooks = ()


@contextlib.contextmanager
def installed(model, adapter: ParallelAdapter):
    """`install` within the block only."""
    install(model, adapter)
    try:
        yield
    finally:
        remove(model)


def new_adapter(model, k: int, rank: int) -> ParallelAdapter:
    """An untrained adapter for `model`: LoRA at zero, the mask embedded as the mean of its
    embedding table (a neutral start: no token in particular)."""
    _check_drafter(model)
    embedding = model._decoder.get_input_embeddings().weight
    adapter = ParallelAdapter(adapted_layers(model), rank, embedding.shape[1], k)
    with torch.no_grad():
        adapter.mask.copy_(embedding.float().mean(0).cpu())
    return adapter


@dataclass
class Parallel:
    """A loaded checkpoint: the adapter (fp32, on the CPU) and its info (provenance, held-out scores)."""

    adapter: ParallelAdapter
    info: dict


def load_adapter(folder: str | Path) -> Parallel:
    """Read a parallel drafter checkpoint folder; SpecdecError naming what is wrong with it."""
    module, _, info = read_checkpoint(folder, "parallel", lambda info: ParallelAdapter(
        info["shapes"], int(info["rank"]), int(info["hidden_size"]), int(info["k"])))
    return Parallel(module, info)


def make_parallel(model, adapter: ParallelAdapter) -> None:
    """Turn `model` (the drafter `adapter` was trained on) into a parallel drafter: the adapter
    hooked in (`install`, a copy on the model's device), `model.parallel_k` set (declared in its `features()`)."""
    _check_drafter(model)
    if adapter.lora.shapes != adapted_layers(model):
        raise SpecdecError(f"this parallel drafter was made for other layers than {model.name}'s (another model's shapes)")
    kept = ParallelAdapter(adapter.lora.shapes, adapter.lora.rank, adapter.mask.shape[0], adapter.k)
    kept.load_state_dict(adapter.state_dict())
    install(model, kept.to(model.device).eval().requires_grad_(False))
    model.parallel_k = adapter.k


def load_parallel(folder: str | Path, load_model: Callable[[str], object]) -> object:
    """The drafter a checkpoint was trained on, loaded by `load_model(name)`, made a parallel
    drafter. SpecdecError for a bad folder (before any loading) or other weights."""
    made = load_adapter(folder)
    model = load_model(made.info["drafter"])
    if target_fingerprint(model) != made.info.get("drafter_sha256"):
        raise SpecdecError(f"the parallel drafter in {folder} was trained on {made.info['drafter']}'s weights "
                           f"(sha256 {str(made.info.get('drafter_sha256'))[:12]}…), which {model.name} does not have")
    make_parallel(model, made.adapter)
    model.name = f"{model.name}+parallel"
    return model
