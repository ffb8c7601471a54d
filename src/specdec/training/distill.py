"""What the fits of the target's own drafting modules share (Medusa heads, fit_medusa.py; the
EAGLE layer, fit_eagle.py; a parallel drafter, fit_parallel.py; a distilled drafter, fit_distilled.py).

- The training data: a corpus's token ids and the target's final hidden states over it
  (`collect_features`), cached in the output folder so that a stopped run resumes.
- The resumable training loop (`fit`): AdamW with a cosine schedule, seeded, its state saved
  after every epoch and picked up by a rerun with the same arguments.

The checkpoints these write, and the target's fingerprint and head, are the run time's:
adapters/checkpoints.py.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from ..adapters.checkpoints import head_rows, target_fingerprint
from ..errors import SpecdecError

STATE, FEATURES = "train_state.pt", "features.pt"
SAVE_EVERY = 25  # optimiser steps between saves of the training state within an epoch


# ---------------------------------------------------------------- training data


def corpus_ids(tokenizer, corpus: str) -> tuple[list[int], str]:
    """Token ids of a named corpus and its identity: "stdlib" (Python's standard library sources),
    "humaneval", "spec-bench", or a text file's path."""
    from ..models.vocab import corpus_texts

    if corpus == "stdlib":
        texts, identity = corpus_texts(None)
    elif corpus in ("humaneval", "spec-bench"):
        from ..bench.datasets import load_prompts

        texts, identity = [p.text for p in load_prompts(corpus, None)], corpus
    else:
        texts, identity = corpus_texts(corpus)
    ids: list[int] = []
    for text in texts:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise SpecdecError(f"corpus {corpus} holds no tokens")
    return ids, identity


def text_ids(tokenizer, corpus: str | Sequence[int]) -> tuple[list[int], str]:
    """`corpus_ids` of a named corpus, or token ids given as they are (identity "ids")."""
    if isinstance(corpus, str):
        return corpus_ids(tokenizer, corpus)
    return [int(i) for i in corpus], "ids"


@torch.inference_mode()
def collect_features(target, ids: Sequence[int], seq_len: int,
                     on_chunk: Callable[[int, int], None] = lambda done, total: None) -> torch.Tensor:
    """The target's final hidden states over `ids` in chunks of `seq_len`: [chunks, seq_len, H] bf16."""
    chunks = [list(ids[i:i + seq_len]) for i in range(0, len(ids) - seq_len + 1, seq_len)]
    if not chunks:
        raise SpecdecError(f"the corpus has {len(ids)} tokens, fewer than one chunk of {seq_len}")
    out = []
    for done, chunk in enumerate(chunks, 1):
        batch = torch.tensor([chunk], device=target.device)
        hidden = target._decoder(input_ids=batch, use_cache=False).last_hidden_state[0]
        out.append(hidden.to(torch.bfloat16).cpu())
        on_chunk(done, len(chunks))
    return torch.stack(out)


@dataclass
class Prepared:
    """A training run's data: the corpus ids (cut to whole chunks: [chunks, seq_len]), the
    target's features over them [chunks, seq_len, H] bf16, the scored ids [N] and the frozen
    head's rows for them [N, H] fp32 (on the target's device), and the cache key."""

    ids: torch.Tensor
    features: torch.Tensor
    vocab_ids: torch.Tensor
    weight: torch.Tensor
    identity: str
    tokens: int
    fingerprint: str
    key: dict


def progress_columns():
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn

    return TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn()


def prepare(target, corpus: str | Sequence[int], out: Path, tokens: int, seq_len: int, vocab: int,
            say: Callable[[str], None]) -> Prepared:
    """The corpus's ids, the target's cached features over them (computed once, kept in `out`
    until the checkpoint is saved) and the scored sub-vocabulary (`vocab.frequent_ids`)."""
    from rich.progress import Progress

    from ..models.vocab import frequent_ids

    from ..backends.transformers import TransformersModel

    if not isinstance(target, TransformersModel):  # hidden states of every position: transformers' backend
        raise SpecdecError(f"training needs the target's hidden states; {target.name} "
                           f"({target.kernels}) gives none; use --dtype auto (transformers' weights)")
    if isinstance(corpus, str):
        ids, identity = corpus_ids(target.tokenizer, corpus)
    else:
        ids = [int(i) for i in corpus]
        identity = "ids-" + hashlib.sha256(str(ids).encode()).hexdigest()[:16]
    ids = ids[:tokens]
    fingerprint = target_fingerprint(target)
    key = {"target_sha256": fingerprint, "corpus": identity, "tokens": len(ids), "seq_len": seq_len}
    features = cached(out / FEATURES, key)
    if features is None:
        say(f"running {target.name} over {len(ids)} tokens of {identity} to cache its hidden states")
        with Progress(*progress_columns(), transient=True) as progress:
            task = progress.add_task("hidden states", total=None)
            features = collect_features(target, ids, seq_len,
                                        lambda done, total: progress.update(task, completed=done, total=total))
        torch.save({"key": key, "features": features}, out / FEATURES)
    if len(features) < 2:
        raise SpecdecError(f"{len(ids)} tokens make {len(features)} chunk(s) of {seq_len}: "
                           "need at least 2 (one held out); give more --tokens or a shorter --seq-len")
    if vocab >= target.vocab_size:
        vocab_ids = torch.arange(target.vocab_size)
    elif target.tokenizer is None:
        raise SpecdecError(f"{target.name} has no tokenizer to rank its ids by frequency: train with vocab >= "
                           f"{target.vocab_size} (all ids)")
    else:
        vocab_ids = frequent_ids(target.tokenizer, target.vocab_size, vocab, say=say)
    # trained where the target runs (a GPU trains faster); features stay in host memory
    weight = head_rows(target, vocab_ids).detach().float()
    chunk_ids = torch.tensor(ids[:len(features) * seq_len]).view(len(features), seq_len)
    return Prepared(chunk_ids, features, vocab_ids, weight, identity, len(ids), fingerprint, key)


def fit(module: nn.Module, batch_loss: Callable[[torch.Tensor, int], torch.Tensor], examples: int, out: Path,
        key: dict, config, say: Callable[[str], None], label: str) -> tuple[int, float]:
    """Train `module` on `examples` examples (`batch_loss(indices [B], step)` -> the mean loss of
    those; any randomness it draws should come from the step number, which a resume repeats)
    for `config.epochs` epochs of shuffled batches of `config.batch`, AdamW at `config.lr` with a
    cosine schedule, seeded by `config.seed`. The state is saved in `out` after every epoch and
    every SAVE_EVERY steps, and a rerun with the same `key` and config resumes it bitwise.
    Returns (steps, last loss)."""
    from rich.progress import Progress, TextColumn

    torch.manual_seed(config.seed)
    optimizer = torch.optim.AdamW(module.parameters(), lr=config.lr, weight_decay=0.0)
    steps_per_epoch = math.ceil(examples / config.batch)
    total_steps = steps_per_epoch * config.epochs
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps)))
    step, last_loss = 0, float("nan")
    full_key = {**key, **vars(config), "module": type(module).__name__}  # another kind's state is stale
    state = cached(out / STATE, full_key)
    if state is not None:
        module.load_state_dict(state["module"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        step, last_loss = state["step"], state["loss"]
        say(f"resuming at step {step} of {total_steps}")
    generator = torch.Generator().manual_seed(config.seed)

    def save() -> None:
        torch.save({"key": full_key, "module": module.state_dict(), "optimizer": optimizer.state_dict(),
                    "schedule": schedule.state_dict(), "step": step, "loss": last_loss}, out / STATE)

    with torch.enable_grad(), Progress(*progress_columns(), TextColumn("loss {task.fields[loss]:.3f}"),
                                       transient=True) as progress:
        task = progress.add_task(label, total=total_steps, completed=step, loss=last_loss)
        for epoch in range(config.epochs):
            order = torch.randperm(examples, generator=generator)  # drawn every epoch: resumes alike
            for index, begin in enumerate(range(0, examples, config.batch)):
                if epoch * steps_per_epoch + index < step:  # done before a resume
                    continue
                loss = batch_loss(order[begin:begin + config.batch], step)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                schedule.step()
                step, last_loss = step + 1, float(loss.detach())
                progress.update(task, completed=step, loss=last_loss)
                if step % SAVE_EVERY == 0:  # a long epoch is resumable part way
                    save()
            save()
    return step, last_loss


def finish(out: Path) -> None:
    """Drop the resumption files once the checkpoint is saved."""
    for leftover in (STATE, FEATURES):
        (out / leftover).unlink(missing_ok=True)


def cached(path: Path, key: dict):
    """What `path` holds when it was written for `key` (else None: stale or damaged files are redone)."""
    if not path.is_file():
        return None
    try:
        data = torch.load(path, weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != key:
        return None
    return data.get("features", data)


def drafter_source(model) -> str:
    """What `load` takes to load `model` again: its registry name, else its directory or file."""
    return model.source or model.name
