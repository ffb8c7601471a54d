"""Medusa heads (Cai et al. 2024): drafting with the target's own last hidden state.

Head k (k = 1..K) is one residual block on the target's final hidden state h_t (what its output
head reads when it picks token t+1), h + SiLU(W_k h + b_k), fed to the target's own frozen output
head; it predicts token t+1+k. No vocabulary-sized matrix is new: a head adds H·(H+1) weights.

Trained here by self-distillation: the target runs once over a corpus and its final hidden
states are cached; head k then learns the target's own distribution at position t+k (computed
from the cached h_{t+k} through the frozen head), not the corpus's next token. The loss and the
drafting score the N most frequent ids only (`vocab.frequent_ids`), which makes CPU training
affordable; q is 0 on the other ids, which exact verification handles like any q.

A checkpoint is a folder: `heads.safetensors` (the blocks and the scored ids) and `medusa.json`
(the shapes and the provenance: the target's fingerprint, corpus, tokens, steps, loss, held-out
top-1 accuracy per head). `load_heads` refuses a damaged folder or one made for another target.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from . import registry
from .errors import SpecdecError

FORMAT = 1
WEIGHTS, CONFIG, STATE, FEATURES = "heads.safetensors", "medusa.json", "train_state.pt", "features.pt"


class MedusaHeads(nn.Module):
    """K residual blocks: hidden [..., H] -> [..., K, H], the inputs of the frozen output head.

    The blocks start at zero (each head begins as the target's own next-token head)."""

    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        if num_heads < 1 or hidden_size < 1:
            raise SpecdecError(f"Medusa needs >= 1 head and a hidden size >= 1, got {num_heads}, {hidden_size}")
        self.blocks = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_heads))
        for block in self.blocks:
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.stack([hidden + nn.functional.silu(block(hidden)) for block in self.blocks], dim=-2)


@dataclass
class Heads:
    """A loaded checkpoint: the blocks, the ids their head scores ([N] sorted) and its info."""

    heads: MedusaHeads
    vocab_ids: torch.Tensor
    info: dict = field(default_factory=dict)


def target_fingerprint(model) -> str:
    """What a checkpoint's target is: the registry file's sha256 for an embedded model, else the
    sha256 of its output head's first rows in bf16 (equal for fp32 and bf16 loads of one model)."""
    spec = registry.MODELS.get(getattr(model, "name", ""))
    if spec is not None:
        return spec.sha256
    rows = head_rows(model, torch.arange(min(1024, model.vocab_size)))
    data = rows.to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes()
    return hashlib.sha256(data + str(tuple(rows.shape)).encode()).hexdigest()


def head_rows(model, ids: torch.Tensor) -> torch.Tensor:
    """The target's output-head rows for `ids` [N] -> [N, H] (its weight dtype; fp32 when packed)."""
    weight = getattr(model, "_head_weight", None)
    if weight is None:
        packed = getattr(getattr(model, "_head", None), "packed_weight", None)
        if packed is None:
            raise SpecdecError(f"{model.name}: its output head cannot be read for Medusa heads")
        weight = packed.to_dense()
    return weight.index_select(0, ids.to(weight.device))


def save_heads(folder: str | Path, heads: Heads) -> None:
    """Write `heads` into `folder` (the weights first, the json last: a folder without it is unfinished)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: value.detach().float().cpu().contiguous() for name, value in heads.heads.state_dict().items()}
    tensors["vocab_ids"] = heads.vocab_ids.long().contiguous()
    save_file(tensors, str(folder / WEIGHTS))
    info = {**heads.info, "format": FORMAT, "kind": "medusa", "hidden_size": heads.heads.blocks[0].in_features,
            "num_heads": heads.heads.num_heads, "vocab_ids": len(heads.vocab_ids)}
    partial = folder / (CONFIG + ".part")
    partial.write_text(json.dumps(info, indent=1))
    partial.replace(folder / CONFIG)


def load_heads(folder: str | Path) -> Heads:
    """Read a checkpoint folder; SpecdecError naming what is wrong with a missing or damaged one."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder).expanduser()
    if not (folder / CONFIG).is_file():
        raise SpecdecError(f"no Medusa heads in {folder}: {CONFIG} is missing (train them with `specdec train-heads`)")
    try:
        info = json.loads((folder / CONFIG).read_text())
        hidden, count, vocab = int(info["hidden_size"]), int(info["num_heads"]), int(info["vocab_ids"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise SpecdecError(f"Medusa heads in {folder}: {CONFIG} is damaged ({type(exc).__name__}: {exc})") from None
    if info.get("kind") != "medusa" or info.get("format") != FORMAT:
        raise SpecdecError(f"{folder} holds {info.get('kind')!r} heads of format {info.get('format')!r}, "
                           f"not Medusa heads of format {FORMAT}")
    try:
        tensors = load_file(str(folder / WEIGHTS))
    except (OSError, SafetensorError, RuntimeError) as exc:
        raise SpecdecError(f"Medusa heads in {folder}: {WEIGHTS} cannot be read ({exc})") from None
    heads = MedusaHeads(hidden, count)
    ids = tensors.pop("vocab_ids", None)
    expected = {name: tuple(value.shape) for name, value in heads.state_dict().items()}
    found = {name: tuple(value.shape) for name, value in tensors.items()}
    if ids is None or ids.shape != (vocab,) or found != expected:
        raise SpecdecError(f"Medusa heads in {folder}: {WEIGHTS} does not match {CONFIG} "
                           f"({count} heads of width {hidden} over {vocab} ids)")
    heads.load_state_dict(tensors)
    return Heads(heads.eval().requires_grad_(False), ids.long(), info)


def check_heads_target(heads: Heads, target) -> None:
    """SpecdecError unless `heads` were trained for `target` (same weights, width and vocabulary)."""
    if not hasattr(target, "hidden_size") or not hasattr(target, "last_hidden"):
        raise SpecdecError(f"Medusa heads need a target whose hidden states can be read; {target.name} "
                           f"({getattr(target, 'kernels', '?')}) gives none; use --dtype bf16/fp32")
    info = heads.info
    if info["hidden_size"] != target.hidden_size:
        raise SpecdecError(f"these Medusa heads were trained for hidden size {info['hidden_size']} "
                           f"({info.get('target', '?')}), but {target.name} has {target.hidden_size}")
    if int(heads.vocab_ids.max()) >= target.vocab_size:
        raise SpecdecError(f"these Medusa heads score ids up to {int(heads.vocab_ids.max())}, past "
                           f"{target.name}'s vocabulary of {target.vocab_size}")
    fingerprint = target_fingerprint(target)
    if info.get("target_sha256") != fingerprint:
        raise SpecdecError(f"these Medusa heads were trained for {info.get('target', '?')} "
                           f"(sha256 {str(info.get('target_sha256'))[:12]}…), not {target.name} "
                           f"(sha256 {fingerprint[:12]}…); train heads for this target")


# ---------------------------------------------------------------- training


@dataclass
class TrainConfig:
    num_heads: int = 3
    tokens: int = 32768  # corpus tokens run through the target (a tenth held out)
    vocab: int = 32768  # ids the loss and the drafting score
    seq_len: int = 256  # tokens per target pass while caching hidden states
    epochs: int = 3
    batch: int = 64
    lr: float = 1e-3
    seed: int = 0


def corpus_ids(tokenizer, corpus: str) -> tuple[list[int], str]:
    """Token ids of a named corpus and its identity: "stdlib" (Python's standard library sources),
    "humaneval", "spec-bench", or a text file's path."""
    from .vocab import corpus_texts

    if corpus == "stdlib":
        texts, identity = corpus_texts(None)
    elif corpus in ("humaneval", "spec-bench"):
        from .bench.datasets import load_prompts

        texts, identity = [p.text for p in load_prompts(corpus, None)], corpus
    else:
        texts, identity = corpus_texts(corpus)
    ids: list[int] = []
    for text in texts:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise SpecdecError(f"corpus {corpus} holds no tokens")
    return ids, identity


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


def distill_loss(heads: MedusaHeads, weight: torch.Tensor, features: torch.Tensor, starts: torch.Tensor,
                 positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Self-distillation loss of a batch.

    weight [N, H] the frozen head's scored rows; features [C, T, H]; (starts, positions) [B] pick
    h_t. Head k's target is softmax(weight h_{t+k}), the target's own law at t+k over the N ids.
    Returns (mean cross-entropy over heads, the heads' logits [B, K, N]).
    """
    k, device = heads.num_heads, weight.device
    hidden = features[starts, positions].to(device).float()  # [B, H]
    ahead = torch.stack([features[starts, positions + i] for i in range(1, k + 1)], dim=1).to(device).float()  # [B, K, H]
    with torch.no_grad():
        teacher = (ahead @ weight.T).float()  # [B, K, N]
    student = (heads(hidden) @ weight.T).float()  # [B, K, N]
    loss = -(teacher.softmax(-1) * student.log_softmax(-1)).sum(-1).mean()
    return loss, student


@torch.inference_mode()
def heldout_accuracy(heads: MedusaHeads, weight: torch.Tensor, vocab_ids: torch.Tensor, features: torch.Tensor,
                     full_argmax: torch.Tensor) -> tuple[float, list[float]]:
    """(loss, per-head top-1 accuracy) on held-out chunks: a head is right when its argmax over its
    ids is the target's own greedy token at t+k over the full vocabulary (`full_argmax` [C, T])."""
    k, (chunks, length, _) = heads.num_heads, features.shape
    starts, positions = torch.meshgrid(torch.arange(chunks), torch.arange(length - k), indexing="ij")
    starts, positions = starts.flatten(), positions.flatten()
    hits, losses = torch.zeros(k), []
    for begin in range(0, len(starts), 256):
        s, p = starts[begin:begin + 256], positions[begin:begin + 256]
        loss, student = distill_loss(heads, weight, features, s, p)
        losses.append(float(loss) * len(s))
        guess = vocab_ids[student.argmax(-1).cpu()]  # [B, K]
        truth = torch.stack([full_argmax[s, p + i] for i in range(1, k + 1)], dim=1)
        hits += (guess == truth).float().sum(0)
    return sum(losses) / len(starts), (hits / len(starts)).tolist()


def train_medusa(target, corpus: str | Sequence[int], out: str | Path, config: TrainConfig = TrainConfig(),
                 say: Callable[[str], None] = print) -> Heads:
    """Train Medusa heads for `target` on `corpus` (a name for `corpus_ids`, or token ids) and save
    them in `out` (see the module docstring).

    Resumable: the cached hidden states and the training state are kept in `out` until the heads
    are saved, and a rerun with the same arguments picks up where it stopped. Seeded by `config.seed`.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from .vocab import frequent_ids

    if config.num_heads < 1 or config.epochs < 1 or config.batch < 1 or config.vocab < 1 or config.seq_len <= config.num_heads:
        raise SpecdecError("train-heads needs heads >= 1, epochs >= 1, batch >= 1, vocab >= 1 and seq-len > heads")
    if not hasattr(target, "_decoder"):
        raise SpecdecError(f"training heads needs the target's hidden states; {target.name} "
                           f"({getattr(target, 'kernels', '?')}) gives none; use --dtype bf16/fp32")
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    torch.manual_seed(config.seed)
    if isinstance(corpus, str):
        ids, identity = corpus_ids(target.tokenizer, corpus)
    else:
        ids = [int(i) for i in corpus]
        identity = "ids-" + hashlib.sha256(str(ids).encode()).hexdigest()[:16]
    ids = ids[:config.tokens]
    fingerprint = target_fingerprint(target)
    key = {"target_sha256": fingerprint, "corpus": identity, "tokens": len(ids), "seq_len": config.seq_len}
    progress_columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())

    features = _cached(out / FEATURES, key)
    if features is None:
        say(f"running {target.name} over {len(ids)} tokens of {identity} to cache its hidden states")
        with Progress(*progress_columns, transient=True) as progress:
            task = progress.add_task("hidden states", total=None)
            features = collect_features(target, ids, config.seq_len,
                                        lambda done, total: progress.update(task, completed=done, total=total))
        torch.save({"key": key, "features": features}, out / FEATURES)
    held = max(1, len(features) // 10)
    if len(features) < 2:
        raise SpecdecError(f"{len(ids)} tokens make {len(features)} chunk(s) of {config.seq_len}: "
                           "need at least 2 (one held out); give more --tokens or a shorter --seq-len")
    train, heldout = features[:-held], features[-held:]

    if config.vocab >= target.vocab_size:
        vocab_ids = torch.arange(target.vocab_size)
    elif target.tokenizer is None:
        raise SpecdecError(f"{target.name} has no tokenizer to rank its ids by frequency: train with vocab >= "
                           f"{target.vocab_size} (all ids)")
    else:
        vocab_ids = frequent_ids(target.tokenizer, target.vocab_size, config.vocab, say=say)
    # trained where the target runs (a GPU trains the same heads faster); features stay in host memory
    weight = head_rows(target, vocab_ids).detach().float()
    heads = MedusaHeads(weight.shape[1], config.num_heads).to(weight.device)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=config.lr, weight_decay=0.0)
    positions_per_chunk = config.seq_len - config.num_heads
    total_examples = len(train) * positions_per_chunk
    steps_per_epoch = math.ceil(total_examples / config.batch)
    total_steps = steps_per_epoch * config.epochs
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps)))
    step, last_loss = 0, float("nan")
    state = _cached(out / STATE, {**key, **vars(config)})
    if state is not None:
        heads.load_state_dict(state["heads"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        step, last_loss = state["step"], state["loss"]
        say(f"resuming at step {step} of {total_steps}")
    generator = torch.Generator().manual_seed(config.seed)
    with torch.enable_grad(), Progress(*progress_columns, TextColumn("loss {task.fields[loss]:.3f}"),
                                       transient=True) as progress:
        task = progress.add_task("training heads", total=total_steps, completed=step, loss=last_loss)
        for epoch in range(config.epochs):
            order = torch.randperm(total_examples, generator=generator)  # drawn every epoch: resumes alike
            for index, begin in enumerate(range(0, total_examples, config.batch)):
                if epoch * steps_per_epoch + index < step:  # done before a resume
                    continue
                pick = order[begin:begin + config.batch]
                loss, _ = distill_loss(heads, weight, train, pick // positions_per_chunk, pick % positions_per_chunk)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                schedule.step()
                step, last_loss = step + 1, float(loss.detach())
                progress.update(task, completed=step, loss=last_loss)
            torch.save({"key": {**key, **vars(config)}, "heads": heads.state_dict(), "optimizer": optimizer.state_dict(),
                        "schedule": schedule.state_dict(), "step": step, "loss": last_loss}, out / STATE)

    say("scoring the held-out chunks")
    with torch.inference_mode():
        full_argmax = torch.stack([target._logits(chunk.to(target.device, target.dtype)).argmax(-1).cpu()
                                   for chunk in heldout])
    heldout_loss, accuracy = heldout_accuracy(heads, weight, vocab_ids, heldout, full_argmax)
    before_loss, _ = heldout_accuracy(MedusaHeads(weight.shape[1], config.num_heads).to(weight.device), weight,
                                      vocab_ids, heldout, full_argmax)
    info = {"target": target.name, "target_sha256": fingerprint, "corpus": identity, "tokens": len(ids),
            "heldout_tokens": held * config.seq_len, "steps": step, "epochs": config.epochs, "batch": config.batch,
            "lr": config.lr, "seed": config.seed, "seq_len": config.seq_len, "train_loss": last_loss,
            "heldout_loss": heldout_loss, "heldout_loss_untrained": before_loss,
            "heldout_top1": accuracy, "seconds": round(time.perf_counter() - began, 1),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    result = Heads(heads.cpu().eval().requires_grad_(False), vocab_ids, info)
    save_heads(out, result)
    for leftover in (STATE, FEATURES):
        (out / leftover).unlink(missing_ok=True)
    return Heads(result.heads, vocab_ids, load_heads(out).info)


def _cached(path: Path, key: dict):
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
