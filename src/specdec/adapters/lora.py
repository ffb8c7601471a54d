"""Drafter distillation: a low-rank adapter that moves a drafter model's q towards the target's p.

DistillSpec (Zhou et al. 2023) trains the drafter on its own samples (on-policy data) with a
divergence chosen for acceptance: a sampled draft token is accepted with probability
Σ_x min(p(x), q(x)) = 1 − TVD(p, q), so total variation is the loss that acceptance reads.
OSD (Liu et al. 2023) keeps updating the drafter while it serves, from the positions the target
rejected.

Both train the same module here: `DraftAdapter`, LoRA (Hu et al. 2021) on every projection of
the drafter's decoder layers, ΔW = B·A of rank r with B zero at the start (so an untrained
adapter leaves the drafter as it was): 4.4M weights at rank 8 on a 0.5B Qwen, under 1% of it.
Training runs the drafter with the adapter as forward hooks (`hooked`); drafting runs it merged
into the weights (`attach`), in whatever layout the drafter's kernels keep them (int8, packed),
so a distilled drafter costs what the plain one costs per pass.

Exactness does not depend on it: verification compares the target's p with whatever q drafted.
Online updates happen between requests only (`OnlineDistiller.update`), so that every output is
decided by one drafter from its first token to its last.

- `distill_drafter` (training/fit_distilled.py): the offline run (`specdec distill-drafter`):
  contexts from a corpus, each continued by the drafter's own samples, scored once by the target.
- `load_distilled`: `--drafter distilled:DIR`, the drafter model named in the checkpoint with the
  adapter merged in.
- `OnlineDistiller`: `--online`: records (position, the target's p) where a draft was rejected;
  between requests it takes a few optimiser steps on the finished sequences' records.
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from ..backends.transformers import TransformersModel

from .checkpoints import read_checkpoint, target_fingerprint
from ..errors import SpecdecError
from ..backends.kernels import dense_weight, differentiable_linears, set_dense_weight

TOP = 64  # the target's most likely ids kept per position; the rest of its mass is kept as one number
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # Llama, Qwen, Gemma


class DraftAdapter(nn.Module):
    """LoRA on named linear layers: for each, ΔW = B·A, A [rank, in], B [out, rank] (zero at first).

    shapes: {layer name (as `named_modules` of the decoder gives it): (out, in)}."""

    def __init__(self, shapes: dict[str, Sequence[int]], rank: int):
        super().__init__()
        if rank < 1 or not shapes:
            raise SpecdecError(f"an adapter needs rank >= 1 and layers to adapt, got rank {rank} and {len(shapes)} layers")
        self.shapes = {name: (int(out), int(inp)) for name, (out, inp) in sorted(shapes.items())}
        self.rank = rank
        self.a = nn.ParameterDict()
        self.b = nn.ParameterDict()
        for name, (out, inp) in self.shapes.items():
            self.a[_key(name)] = nn.Parameter(torch.randn(rank, inp) / math.sqrt(inp))
            self.b[_key(name)] = nn.Parameter(torch.zeros(out, rank))

    def delta(self, name: str) -> torch.Tensor:
        """ΔW [out, in] fp32 of layer `name`."""
        return self.b[_key(name)].float() @ self.a[_key(name)].float()

    def extra(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> ΔW x [..., out] fp32 (the adapter's share of the layer's output)."""
        return (x.float() @ self.a[_key(name)].t()) @ self.b[_key(name)].t()


def _key(name: str) -> str:
    return name.replace(".", "__")  # parameter dicts take no dots


def adapted_layers(model) -> dict[str, tuple[int, int]]:
    """{name: (out, in)} of the drafter's projections an adapter adapts (`PROJECTIONS`)."""
    if not isinstance(model, TransformersModel):  # the projections adapted are transformers' modules
        raise SpecdecError(f"an adapter needs a drafter on transformers' weights, not {model.name} ({model.kernels})")
    decoder = model._decoder
    shapes = {name: (module.out_features, module.in_features) for name, module in decoder.named_modules()
              if name.rsplit(".", 1)[-1] in PROJECTIONS and hasattr(module, "in_features")}
    if not shapes:
        raise SpecdecError(f"{model.name} has none of the projections an adapter adapts ({', '.join(PROJECTIONS)})")
    return shapes


# ---------------------------------------------------------------- the math


def teacher(logits: torch.Tensor, top: int = TOP) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's law at T = 1 in brief: logits [..., V] -> (ids [..., k] int64, probs [..., k]
    fp32), its k most likely ids and their probabilities (k = min(top, V))."""
    probs = torch.softmax(logits.float(), dim=-1)
    values, ids = probs.topk(min(top, probs.shape[-1]), dim=-1)
    return ids, values


def divergence(logits: torch.Tensor, slots: torch.Tensor, top_probs: torch.Tensor, kind: str = "tvd") -> torch.Tensor:
    """Per position, how far the drafter's q is from the target's p, as the loss sees it.

    logits: [N, S] the drafter's, over its S scored ids. slots: [N, k] where each of the target's
    top ids sits among them (-1: the drafter does not score it, q = 0 there). top_probs: [N, k]
    the target's probabilities of those ids. kind: "tvd" — ½ Σ|p − q| over the top ids plus
    ½ |p(rest) − q(rest)| for the rest (a lower bound of the full TVD, equal when the rest holds
    no mass of either), which is 1 − the acceptance rate of a sampled draft token; "fkl" —
    cross-entropy of q against p renormalised over its top ids (forward KL up to a constant).
    Returns [N].
    """
    scored = slots >= 0
    log_q = torch.log_softmax(logits.float(), dim=-1)
    log_q_top = log_q.gather(-1, slots.clamp(min=0))
    if kind == "fkl":
        p = top_probs * scored
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-12)
        return -(p * log_q_top.masked_fill(~scored, 0.0)).sum(-1)
    if kind != "tvd":
        raise SpecdecError(f"unknown divergence {kind!r}: tvd or fkl")
    q_top = log_q_top.exp() * scored
    rest_p = (1 - top_probs.sum(-1)).clamp_min(0)
    rest_q = (1 - q_top.sum(-1)).clamp_min(0)
    return 0.5 * ((top_probs - q_top).abs().sum(-1) + (rest_p - rest_q).abs())


def agreement(logits: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[N] bool: whether the drafter's greedy token is the target's (slots[:, 0] is p's argmax's
    place among the scored ids): a greedy draft token's acceptance."""
    return logits.argmax(-1) == slots[:, 0]


# ---------------------------------------------------------------- running a drafter with an adapter


def _check_drafter(model) -> None:
    if not isinstance(model, TransformersModel) or model.role != "drafter":
        raise SpecdecError(f"an adapter attaches to a drafter on transformers' weights, not {model.name} "
                           f"({model.role}, {model.kernels})")


def _check_fits(model, adapter: DraftAdapter) -> None:
    if adapter.shapes != adapted_layers(model):
        raise SpecdecError(f"this adapter was made for other layers than {model.name}'s (another model's shapes)")


@torch.no_grad()
def attach(model, adapter: DraftAdapter | None) -> None:
    """Merge `adapter` into `model`'s weights, in their own layout (None: back to the drafter's own
    weights). The drafter's original weights are kept aside at the first call, so each merge
    starts from them; `model.adapter` holds a copy of what is merged."""
    _check_drafter(model)
    if adapter is not None:
        _check_fits(model, adapter)
    if adapter is None and model.adapter is None:
        return
    modules = dict(model._decoder.named_modules())
    if model.base_weights is None:
        model.base_weights = {name: dense_weight(modules[name]).detach().clone() for name in adapted_layers(model)}
    for name, base in model.base_weights.items():
        weight = base if adapter is None else (base.float() + adapter.delta(name).to(base.device)).to(base.dtype)
        set_dense_weight(modules[name], weight)
    model.adapter = None if adapter is None else \
        copy.deepcopy(adapter).to(model.device, torch.float32).eval().requires_grad_(False)


@contextlib.contextmanager
def hooked(model, adapter: DraftAdapter):
    """Within the block, `model` computes as if `adapter` were merged into its own weights: its
    adapted layers add `adapter`'s share to their outputs through forward hooks, so gradients
    reach it (less the share of the adapter merged in now, if any: an online update trains
    without unmerging first)."""
    merged = model.adapter
    if merged is not None:
        _check_fits(model, adapter)

    def share(name: str, x: torch.Tensor) -> torch.Tensor:
        out = adapter.extra(name, x)
        return out if merged is None else out - merged.extra(name, x)

    modules = dict(model._decoder.named_modules())
    handles = [modules[name].register_forward_hook(
        lambda module, inputs, output, name=name: output + share(name, inputs[0]).to(output.dtype))
        for name in adapter.shapes]
    try:
        with differentiable_linears(model._decoder):
            yield
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class Distilled:
    """A loaded checkpoint: the adapter (fp32, on the CPU) and its info (provenance, held-out scores)."""

    adapter: DraftAdapter
    info: dict


def load_adapter(folder: str | Path) -> Distilled:
    """Read an adapter checkpoint folder; SpecdecError naming what is wrong with it."""
    module, _, info = read_checkpoint(folder, "adapter", lambda info: DraftAdapter(info["shapes"], int(info["rank"])))
    return Distilled(module, info)


def load_distilled(folder: str | Path, load_model: Callable[[str], object]) -> object:
    """The drafter a checkpoint was trained on, loaded by `load_model(name)`, with its adapter
    merged in. SpecdecError for a bad folder (before any loading) or where the loaded weights are
    not the ones it was trained on."""
    distilled = load_adapter(folder)
    model = load_model(distilled.info["drafter"])
    if target_fingerprint(model) != distilled.info.get("drafter_sha256"):
        raise SpecdecError(f"the adapter in {folder} was trained on {distilled.info['drafter']}'s weights "
                           f"(sha256 {str(distilled.info.get('drafter_sha256'))[:12]}…), which {model.name} "
                           "does not have")
    attach(model, distilled.adapter)
    model.adapter_target = distilled.info.get("target_sha256")
    model.name = f"{model.name}+distilled"
    return model


def check_adapter_target(drafter_model, target) -> None:
    """SpecdecError where `drafter_model` carries an adapter trained towards another target."""
    # only transformers' backend carries a distilled adapter (`distilled`)
    wanted = drafter_model.adapter_target if isinstance(drafter_model, TransformersModel) else None
    if wanted is not None and wanted != target_fingerprint(target):
        raise SpecdecError(f"{drafter_model.name}'s adapter was trained for another target than {target.name}; "
                           "distil one for this target (specdec distill-drafter)")


class Head:
    """The drafter's frozen output head as training reads it: rows of its scored ids [S, H] fp32
    (bias [S]), and where each of the target's ids sits among them (`slots`)."""

    def __init__(self, model):
        if not isinstance(model, TransformersModel):
            raise SpecdecError(f"{model.name}: its output head cannot be read for distillation "
                               f"({model.kernels}); use transformers' weights (--dtype auto)")
        weight = model._head_weight
        if weight is None:  # packed for the CPU's kernels, the dense copy let go
            raise SpecdecError(f"{model.name}: its output head cannot be read for distillation")
        scored = model._vocab_ids
        scored = torch.arange(weight.shape[0], device=weight.device) if scored is None else scored
        self.ids = scored.cpu()
        self.weight = weight.detach().index_select(0, scored).float()
        bias = model._head_bias
        self.bias = None if bias is None else bias.detach().index_select(0, scored).float()
        self._place = torch.full((int(self.ids.max()) + 1,), -1, dtype=torch.long)
        self._place[self.ids] = torch.arange(len(self.ids))
        self.transform = model._transform

    def slots(self, top_ids: torch.Tensor) -> torch.Tensor:
        """top_ids [..., k] target ids -> [..., k] their places among the scored ids (-1: not scored)."""
        top_ids = top_ids.cpu()
        inside = top_ids < len(self._place)
        return torch.where(inside, self._place[top_ids.clamp(max=len(self._place) - 1)], -1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, S] fp32 over the scored ids (after the model's output transform)."""
        logits = hidden.float() @ self.weight.t()
        logits = logits if self.bias is None else logits + self.bias
        return logits if self.transform is None else self.transform(logits)


def sequence_loss(model, adapter: DraftAdapter | None, head: Head, sequences: torch.Tensor, rows: torch.Tensor,
                  top_ids: torch.Tensor, top_probs: torch.Tensor, kind: str = "tvd") -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter (through `adapter` as hooks; None: as it is) over sequences [B, L]; at the chosen
    positions rows [N] (flat indices into [B, L]: the hidden state there reads the next token)
    -> (divergence [N] from the target's top_ids / top_probs [N, k], greedy agreement [N])."""
    with hooked(model, adapter) if adapter is not None else contextlib.nullcontext():
        hidden = model._decoder(input_ids=sequences.to(model.device), use_cache=False).last_hidden_state
    picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows.to(hidden.device))
    logits = head.logits(picked).cpu()
    slots = head.slots(top_ids)
    return divergence(logits, slots, top_probs, kind), agreement(logits, slots)


# ---------------------------------------------------------------- online (OSD)


class OnlineDistiller:
    """Online distillation (OSD): the target's p where a drafter model's draft was rejected, kept
    for about the last `capacity` such positions (whole sequences), and `steps` optimiser steps on them between requests
    (`update`), after which the drafter drafts with the updated adapter merged in.

    The decoding loop calls `record` at each rejection and `finish` with the finished sequence;
    training runs the drafter over those sequences (their last `window` tokens before the last
    record) in `update`, so recording costs the loop nothing but a top-k. Starts from the
    drafter's adapter if it has one.
    """

    def __init__(self, model, rank: int = 8, capacity: int = 2048, steps: int = 1, batch: int = 2, lr: float = 1e-3,
                 loss: str = "tvd", seed: int = 0, min_records: int = 16, window: int = 256):
        _check_drafter(model)
        if capacity < 1 or steps < 1 or batch < 1 or window < 2 or not lr > 0:
            raise SpecdecError("online distillation needs capacity, steps and batch >= 1, window >= 2 and lr > 0")
        self.model, self.capacity, self.steps, self.batch, self.loss = model, capacity, steps, batch, loss
        self.min_records, self.window = min_records, window
        torch.manual_seed(seed)
        start = model.adapter
        self.adapter = (DraftAdapter(adapted_layers(model), rank) if start is None else copy.deepcopy(start)).to(model.device)
        self.adapter.requires_grad_(True).train()
        self.head = Head(model)
        self.optimizer = torch.optim.AdamW(self.adapter.parameters(), lr=lr, weight_decay=0.0)
        self.random = random.Random(seed)
        self.pending: dict[int, list] = {}  # a running sequence's records: (position, top ids, top probs)
        self.buffer: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []  # per finished sequence
        self.fresh = False  # whether a sequence finished with records since the last update
        self.updates, self.seconds, self.last_loss = 0, 0.0, float("nan")
        model.online = self  # the model's declared learner (`features().online`): the loop records to it

    def record(self, key: int, position: int, logits: torch.Tensor) -> None:
        """The target's logits [V] at `position` of sequence `key`, where the drafter was rejected."""
        ids, probs = teacher(logits.view(1, -1))
        self.pending.setdefault(key, []).append((position, ids[0].cpu(), probs[0].cpu()))
        while len(self.pending) > 256:  # sequences that never finished (cancelled) must not pile up
            self.pending.pop(next(iter(self.pending)))

    def finish(self, key: int, sequence: Sequence[int]) -> None:
        """Sequence `key` ended as `sequence` (prompt and output): its records wait for `update`,
        as (its last `window` tokens before the last record, their rows, top ids, top probs)."""
        records = self.pending.pop(key, None)
        if not records:
            return
        end = max(position for position, _, _ in records)
        start = max(0, end - self.window)
        records = [r for r in records if r[0] - 1 >= start]  # each needs the hidden state before it
        self.buffer.append((torch.tensor(sequence[start:end]), torch.tensor([r[0] - 1 - start for r in records]),
                            torch.stack([r[1] for r in records]), torch.stack([r[2] for r in records])))
        while self.buffered - len(self.buffer[0][1]) >= self.capacity:
            self.buffer.pop(0)
        self.fresh = True

    @property
    def buffered(self) -> int:
        """Recorded positions held."""
        return sum(len(rows) for _, rows, _, _ in self.buffer)

    def update(self) -> dict | None:
        """Between requests: `steps` optimiser steps, each on `batch` of the buffered sequences,
        then the new adapter merged into the drafter -> what was done (None: no sequence finished
        with records since the last update, or fewer than `min_records` are held)."""
        if not self.fresh or self.buffered < self.min_records:
            return None
        began = time.perf_counter()
        self.fresh = False
        with torch.enable_grad():  # the adapter as hooks over what is merged now
            for _ in range(self.steps):
                losses = []
                for sequence, rows, top_ids, top_probs in self.random.sample(self.buffer, min(self.batch, len(self.buffer))):
                    tvd, _ = sequence_loss(self.model, self.adapter, self.head, sequence.view(1, -1), rows, top_ids,
                                           top_probs, self.loss)
                    losses.append(tvd)
                loss = torch.cat(losses).mean()
                self.optimizer.zero_grad()
                loss.backward()
                self.optimizer.step()
                self.last_loss = float(loss.detach())
        attach(self.model, self.adapter)
        self.updates += 1
        self.seconds += time.perf_counter() - began
        return {"records": self.buffered, "loss": self.last_loss, "seconds": time.perf_counter() - began}
