"""Training a parallel drafter (PARD; the drafter side is adapters/pard.py): `specdec train-parallel-drafter`.

Each training sequence is `seq_len` corpus tokens followed by `groups` groups of k − 1 mask
tokens, all in one pass. A group hangs from an anchor a (a random real position): its mask j
sits at position a + j, sees the real tokens up to a and the group's earlier masks only (a tree
mask, as drafting sees the context and its own masks), and learns token a + j + 1. The loss is
the masks' cross-entropy over the drafter's scored ids; the real rows are the frozen drafter's
(the adapter touches mask rows only: adapters/pard.py), so the backward pass runs over the masks'
rows alone.

Target-independent: the labels are the corpus's tokens, no target runs. A tenth of the corpus
chunks (at least one) is held out; the checkpoint keeps its top-1 accuracy by draft position
(1 = the real row, 2 … k = the masks), before training and after.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..adapters.lora import Head, _check_drafter
from ..errors import SpecdecError
from ..backends.kernels import differentiable_linears
from ..adapters.pard import Parallel, ParallelAdapter, installed, load_adapter, mask_id, new_adapter
from ..adapters.checkpoints import save_checkpoint, target_fingerprint
from .distill import drafter_source, finish, fit, text_ids


@dataclass
class ParallelConfig:
    """`train_parallel_drafter`'s settings (all of them in the checkpoint's provenance)."""

    k: int = 4  # tokens a pass proposes: the real row and k - 1 masks
    tokens: int = 98304  # corpus tokens trained on (a tenth more held out)
    seq_len: int = 256
    groups: int = 64  # mask groups per sequence
    rank: int = 8
    epochs: int = 1
    batch: int = 2  # sequences per optimiser step
    lr: float = 2e-3
    seed: int = 0


def training_layout(length: int, anchors: Sequence[int], k: int) -> tuple[list[int], list[int], list[int]]:
    """The tree of one training pass over `length` real tokens with a group of k − 1 masks after
    each anchor -> (parents [R], label_at [R], place [G, k] flattened).

    parents: each input's parent (core/trees.py's form: real token i after i − 1, a group's first mask
        after its anchor, each later mask after the one before). R = length + G (k − 1).
    label_at: for each input, the index among the real tokens of the token its row learns
        (-1: none; the last real token has no next one).
    place: per anchor, the rows of draft positions 1 … k (the anchor's own row, then its masks).
    """
    if k < 2:
        raise SpecdecError(f"a parallel drafter proposes k >= 2 tokens a pass, got k = {k}")
    parents = list(range(-1, length - 1))
    label_at = list(range(1, length)) + [-1]
    place = []
    for a in anchors:
        if not 0 <= a < length - k:
            raise SpecdecError(f"anchor {a} leaves no room for {k} labels in {length} tokens")
        rows = [a]
        for j in range(1, k):
            parents.append(a if j == 1 else len(parents) - 1)
            label_at.append(a + j + 1)
            rows.append(len(parents) - 1)
        place += rows
    return parents, label_at, place


def parallel_pass(model, adapter: ParallelAdapter, head: Head, ids: torch.Tensor, anchors: Sequence[int],
                  k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One training pass over real tokens ids [L] with a group of k − 1 masks after each of
    `anchors` [G] -> (logits [G, k, S] over the head's scored ids at each anchor's draft positions
    1 … k (its own row, then its masks), label slots [G, k] (-1: a label the head does not score))."""
    parents, label_at, place = training_layout(len(ids), anchors, k)
    inputs = torch.cat([ids, torch.full((len(parents) - len(ids),), mask_id(model), dtype=torch.long)])
    place = torch.tensor(place)
    labels = ids[torch.tensor(label_at)[place]]
    tree = model._tree_inputs(parents, None, len(parents), None)
    with installed(model, adapter), differentiable_linears(model._decoder):
        hidden = model._decoder(input_ids=inputs.view(1, -1).to(model.device), use_cache=False, **tree).last_hidden_state[0]
    logits = head.logits(hidden.index_select(0, place.to(hidden.device))).cpu()
    return logits.view(len(anchors), k, -1), head.slots(labels.view(-1, 1))[:, 0].view(len(anchors), k)


def parallel_loss(logits: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the masks' rows: logits [G, k, S] against label slots [G, k] at draft
    positions 2 … k (-1 ignored; position 1 is the drafter's own row, which nothing adapts)."""
    logits, slots = logits[:, 1:].reshape(-1, logits.shape[-1]), slots[:, 1:].reshape(-1)
    kept = slots >= 0
    if not bool(kept.any()):
        return logits.sum() * 0.0
    return torch.nn.functional.cross_entropy(logits[kept].float(), slots[kept])


def anchors_for(length: int, groups: int, k: int, generator: torch.Generator) -> list[int]:
    """`groups` distinct anchors (fewer where the sequence has fewer) in [0, length - k), sorted:
    an anchor's last label is k tokens after it."""
    room = length - k
    if room < 1:
        raise SpecdecError(f"sequences of {length} tokens leave no room for {k} labels")
    return sorted(torch.randperm(room, generator=generator)[:groups].tolist())


@torch.inference_mode()
def score(model, adapter: ParallelAdapter | None, head: Head, chunks: torch.Tensor, groups: int, k: int,
          seed: int) -> dict:
    """Held-out top-1 accuracy against the corpus by draft position (1 … k) over `chunks` [N, L]
    (`adapter` None: the plain drafter, its mask at the mean embedding)."""
    generator = torch.Generator().manual_seed(seed + 7919)
    adapter = adapter if adapter is not None else new_adapter(model, k, 1).to(model.device)
    right, count = torch.zeros(k), torch.zeros(k)
    for chunk in chunks:
        logits, slots = parallel_pass(model, adapter, head, chunk, anchors_for(len(chunk), groups, k, generator), k)
        right += ((logits.argmax(-1) == slots) & (slots >= 0)).float().sum(0)
        count += (slots >= 0).float().sum(0)
    return {"top1_by_position": [round(float(r / max(c, 1)), 4) for r, c in zip(right, count)]}


def train_parallel_drafter(drafter, corpus: str | Sequence[int], out: str | Path, config: ParallelConfig = ParallelConfig(),
                           say: Callable[[str], None] = print) -> Parallel:
    """Adapt `drafter` to parallel drafting (see the module docstring) and save the adapter in
    `out`. Resumable: the training state stays in `out` until the checkpoint is saved, and a
    rerun with the same arguments picks up where it stopped."""
    for name in ("tokens", "seq_len", "groups", "rank", "epochs", "batch"):
        if getattr(config, name) < 1:
            raise SpecdecError(f"{name} must be >= 1, got {getattr(config, name)}")
    if config.k < 2 or config.seq_len <= config.k:
        raise SpecdecError(f"k must be >= 2 and seq_len > k, got k = {config.k} and seq_len = {config.seq_len}")
    if not config.lr > 0:
        raise SpecdecError(f"lr must be > 0, got {config.lr}")
    _check_drafter(drafter)
    if drafter.adapter is not None or drafter.parallel_k:
        raise SpecdecError(f"{drafter.name} already has an adapter: adapt the plain drafter")
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    ids, identity = text_ids(drafter.tokenizer, corpus)
    train_count = max(1, config.tokens // config.seq_len)
    held = max(1, train_count // 10)
    chunks = [ids[i:i + config.seq_len] for i in range(0, len(ids) - config.seq_len + 1, config.seq_len)]
    if len(chunks) < 2:
        raise SpecdecError(f"the corpus has {len(ids)} tokens: fewer than two chunks of {config.seq_len}")
    if len(chunks) < train_count + held:
        say(f"the corpus gives {len(chunks)} chunks of {config.seq_len} tokens, not {train_count + held}: training on fewer")
        held = max(1, len(chunks) // 10)
        train_count = len(chunks) - held
    step = max(1, len(chunks) // (train_count + held))  # spread over the corpus
    chunks = torch.tensor(chunks[::step][:train_count + held])
    train, heldout = chunks[:-held], chunks[-held:]
    head = Head(drafter)
    torch.manual_seed(config.seed)
    adapter = new_adapter(drafter, config.k, config.rank).to(drafter.device)
    fingerprint = target_fingerprint(drafter)
    key = {"drafter_sha256": fingerprint, "corpus": identity, "chunks": len(chunks), "drafter_weights": drafter.weights,
           "drafter_vocabulary": drafter.draft_vocabulary}

    def batch_loss(pick: torch.Tensor, at: int) -> torch.Tensor:
        losses = []
        for n, index in enumerate(pick.tolist()):
            generator = torch.Generator().manual_seed(config.seed * 1_000_003 + at * 101 + n)
            anchors = anchors_for(config.seq_len, config.groups, config.k, generator)
            losses.append(parallel_loss(*parallel_pass(drafter, adapter, head, train[index], anchors, config.k)))
        return torch.stack(losses).mean()

    say(f"scoring the {held} held-out chunks of {config.seq_len} tokens before training")
    before = score(drafter, None, head, heldout, config.groups, config.k, config.seed)
    say("held-out top-1 by draft position before: " + ", ".join(f"{a:.3f}" for a in before["top1_by_position"]))
    steps, last_loss = fit(adapter, batch_loss, len(train), out, key, config, say,
                           f"adapting {drafter.name} to propose {config.k} tokens a pass")
    after = score(drafter, adapter, head, heldout, config.groups, config.k, config.seed)
    info = {"drafter": drafter_source(drafter), "drafter_sha256": fingerprint, "k": config.k, "rank": config.rank,
            "hidden_size": int(adapter.mask.shape[0]),
            "shapes": {name: list(shape) for name, shape in adapter.lora.shapes.items()}, "corpus": identity,
            "tokens": len(train) * config.seq_len, "heldout_tokens": held * config.seq_len, "seq_len": config.seq_len,
            "groups": config.groups, "steps": steps, "epochs": config.epochs, "batch": config.batch, "lr": config.lr,
            "seed": config.seed, "train_loss": last_loss, "drafter_weights": drafter.weights,
            "drafter_vocabulary": drafter.draft_vocabulary, "heldout_before": before, "heldout_after": after,
            "seconds": round(time.perf_counter() - began, 1),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    save_checkpoint(out, "parallel", adapter.cpu().eval().requires_grad_(False), head.ids, info)
    finish(out)
    return load_adapter(out)
