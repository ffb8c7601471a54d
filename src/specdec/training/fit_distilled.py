"""Fitting a distilled drafter (DistillSpec, Zhou et al. 2023): `specdec distill-drafter`.

Contexts from a corpus, each continued by the drafter's own samples (on-policy data); the target
scores every position once (its top `TOP` probabilities are kept); the adapter (adapters/lora.py's
`DraftAdapter`) is trained on them towards total variation, the loss that acceptance reads
(`distill.fit`: resumable, seeded), and saved with its provenance and its held-out acceptance
before and after. `--drafter distilled:DIR` loads it (adapters/lora.py's `load_distilled`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..adapters.checkpoints import save_checkpoint, target_fingerprint
from ..adapters.lora import (TOP, DraftAdapter, Distilled, Head, _check_drafter, adapted_layers, load_adapter,
                             sequence_loss, teacher)
from ..errors import SpecdecError
from .distill import cached, drafter_source, finish, fit, progress_columns, text_ids

DATA = "distill_data.pt"  # the collected sequences and the target's laws, kept in the output folder until the end


@dataclass
class DistillConfig:
    """`distill_drafter`'s settings (all of them in the checkpoint's provenance)."""

    tokens: int = 16384  # positions trained on: contexts and the drafter's continuations
    context: int = 64  # corpus tokens a sequence starts from
    continuation: int = 64  # tokens the drafter samples after it (on-policy data)
    rank: int = 8
    loss: str = "tvd"
    epochs: int = 2
    batch: int = 4  # sequences per optimiser step
    lr: float = 1e-3
    seed: int = 0
    sequences_per_pass: int = 8  # while collecting


@torch.inference_mode()
def sample_continuations(drafter, contexts: torch.Tensor, length: int, generator: torch.Generator) -> torch.Tensor:
    """contexts [B, C] -> [B, C + length]: each continued by the drafter's own samples at T = 1."""
    from transformers import DynamicCache

    cache = DynamicCache()
    logits = drafter.forward_rows(contexts, cache)
    tokens = [contexts]
    for step in range(length):
        token = torch.multinomial(torch.softmax(logits.float(), dim=-1).cpu(), 1, generator=generator)
        tokens.append(token.to(contexts.device))
        if step + 1 < length:
            logits = drafter.forward_rows(tokens[-1], cache)
    return torch.cat(tokens, dim=1)


@torch.inference_mode()
def target_laws(target, sequences: torch.Tensor, top: int = TOP) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's next-token law in brief at every position of sequences [B, L] but the last:
    (ids [B, L-1, k], probs [B, L-1, k])."""
    hidden = target._decoder(input_ids=sequences.to(target.device), use_cache=False).last_hidden_state[:, :-1]
    ids, probs = teacher(target._logits(hidden.reshape(-1, hidden.shape[-1]), exact=False), top)
    return ids.view(*hidden.shape[:2], -1).cpu(), probs.view(*hidden.shape[:2], -1).cpu()


def score(model, adapter: DraftAdapter | None, head: Head, data: dict, context: int, chunk: int = 4) -> dict:
    """Mean acceptance of a sampled draft token (1 − TVD) and greedy agreement over every position
    of `data`'s sequences, and over the drafter-written ones alone (`adapter` None: the drafter as it is)."""
    accept, agree, mine = [], [], []
    sequences = data["sequences"]
    length = sequences.shape[1] - 1
    with torch.inference_mode():
        for begin in range(0, len(sequences), chunk):
            part = sequences[begin:begin + chunk]
            rows = (torch.arange(len(part))[:, None] * sequences.shape[1] + torch.arange(length)).view(-1)
            tvd, same = sequence_loss(model, adapter, head, part, rows, data["top_ids"][begin:begin + chunk].reshape(rows.numel(), -1),
                                      data["top_probs"][begin:begin + chunk].reshape(rows.numel(), -1))
            accept.append(1 - tvd)
            agree.append(same.float())
            mine.append((torch.arange(length) + 1 >= context).repeat(len(part)))  # it reads a drafter-written token
    accept, agree, mine = torch.cat(accept), torch.cat(agree), torch.cat(mine)
    return {"acceptance": float(accept.mean()), "greedy_agreement": float(agree.mean()),
            "acceptance_on_policy": float(accept[mine].mean()), "greedy_agreement_on_policy": float(agree[mine].mean())}


def distill_drafter(target, drafter, corpus: str | Sequence[int], out: str | Path, config: DistillConfig = DistillConfig(),
                    say: Callable[[str], None] = print) -> Distilled:
    """Train an adapter for `drafter` towards `target` (DistillSpec, see the module docstring) and
    save it in `out`. A tenth of the sequences (at least one) is held out and scored before and
    after. Resumable: the collected sequences and the training state stay in `out` until the
    adapter is saved, and a rerun with the same arguments picks up where it stopped."""
    from rich.progress import Progress

    from ..backends.text import check_pair
    from ..backends.transformers import TransformersModel

    for name in ("tokens", "context", "continuation", "rank", "epochs", "batch", "sequences_per_pass"):
        if getattr(config, name) < 1:
            raise SpecdecError(f"{name} must be >= 1, got {getattr(config, name)}")
    if not config.lr > 0:
        raise SpecdecError(f"lr must be > 0, got {config.lr}")
    if config.loss not in ("tvd", "fkl"):
        raise SpecdecError(f"unknown divergence {config.loss!r}: tvd or fkl")
    for model, role in ((target, "target"), (drafter, "drafter")):
        if not isinstance(model, TransformersModel):
            raise SpecdecError(f"distillation needs the {role}'s hidden states and logits from transformers' weights; "
                               f"{model.name} runs on {model.kernels}: use --dtype auto")
    _check_drafter(drafter)
    check_pair(target, drafter)
    if drafter.adapter is not None:
        raise SpecdecError(f"{drafter.name} already has an adapter: distil the plain drafter")
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    ids, identity = text_ids(target.tokenizer, corpus)
    length = config.context + config.continuation
    count = max(2, -(-config.tokens // (length - 1)))
    contexts = [ids[i:i + config.context] for i in range(0, len(ids) - config.context + 1, config.context)]
    if len(contexts) < 2:
        raise SpecdecError(f"the corpus has {len(ids)} tokens: fewer than two contexts of {config.context}")
    if len(contexts) < count:
        say(f"the corpus gives {len(contexts)} contexts of {config.context} tokens, not {count}: training on fewer positions")
    contexts = torch.tensor(contexts[::max(1, len(contexts) // count)][:count])  # spread over the corpus
    fingerprints = {"target_sha256": target_fingerprint(target), "drafter_sha256": target_fingerprint(drafter)}
    key = {**fingerprints, "corpus": identity, "sequences": len(contexts), "context": config.context,
           "continuation": config.continuation, "seed": config.seed, "drafter_weights": drafter.weights,
           "drafter_vocabulary": drafter.draft_vocabulary}
    data = cached(out / DATA, key)
    if data is None:
        say(f"{drafter.name} continues {len(contexts)} contexts of {identity} by {config.continuation} sampled tokens; "
            f"{target.name} scores every position")
        generator = torch.Generator().manual_seed(config.seed)
        parts = []
        with Progress(*progress_columns(), transient=True) as progress:
            task = progress.add_task("sequences", total=len(contexts))
            for begin in range(0, len(contexts), config.sequences_per_pass):
                sequences = sample_continuations(drafter, contexts[begin:begin + config.sequences_per_pass].to(drafter.device),
                                                 config.continuation, generator).cpu()
                parts.append((sequences, *target_laws(target, sequences)))
                progress.update(task, advance=len(sequences))
        data = {name: torch.cat([part[i] for part in parts]) for i, name in enumerate(("sequences", "top_ids", "top_probs"))}
        torch.save({"key": key, "features": data}, out / DATA)
    held = max(1, len(contexts) // 10)
    train = {name: value[:-held] for name, value in data.items()}
    heldout = {name: value[-held:] for name, value in data.items()}
    head = Head(drafter)
    torch.manual_seed(config.seed)
    adapter = DraftAdapter(adapted_layers(drafter), config.rank).to(drafter.device)
    positions = length - 1

    def batch_loss(pick: torch.Tensor, _step: int) -> torch.Tensor:
        rows = (torch.arange(len(pick))[:, None] * length + torch.arange(positions)).view(-1)
        tvd, _ = sequence_loss(drafter, adapter, head, train["sequences"][pick], rows,
                               train["top_ids"][pick].reshape(rows.numel(), -1),
                               train["top_probs"][pick].reshape(rows.numel(), -1), config.loss)
        return tvd.mean()

    say(f"scoring the {held} held-out sequences")
    before = score(drafter, None, head, heldout, config.context)
    steps, last_loss = fit(adapter, batch_loss, len(train["sequences"]), out, key, config, say, "training the adapter")
    after = score(drafter, adapter, head, heldout, config.context)
    info = {"drafter": drafter_source(drafter), "target": target.name, **fingerprints, "rank": config.rank,
            "shapes": {name: list(shape) for name, shape in adapter.shapes.items()}, "loss": config.loss,
            "corpus": identity, "sequences": len(contexts), "context": config.context,
            "continuation": config.continuation, "tokens": len(train["sequences"]) * positions,
            "heldout_tokens": held * positions, "steps": steps, "epochs": config.epochs, "batch": config.batch,
            "lr": config.lr, "seed": config.seed, "train_loss": last_loss, "drafter_weights": drafter.weights,
            "drafter_vocabulary": drafter.draft_vocabulary, "heldout_before": before, "heldout_after": after,
            "seconds": round(time.perf_counter() - began, 1),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    save_checkpoint(out, "adapter", adapter.cpu().eval().requires_grad_(False), head.ids, info)
    finish(out)
    (out / DATA).unlink(missing_ok=True)
    return load_adapter(out)
