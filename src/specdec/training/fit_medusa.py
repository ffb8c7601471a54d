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

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from ..errors import SpecdecError
from .distill import (FILES, bound_copy, check_checkpoint_target, fit, finish, head_rows, prepare,
                      read_checkpoint, save_checkpoint, target_fingerprint)  # noqa: F401 (target_fingerprint: re-exported)

WEIGHTS, CONFIG = FILES["medusa"]


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
    _bound: dict = field(default_factory=dict, repr=False, compare=False)

    def heads_for(self, device: torch.device, dtype: torch.dtype) -> MedusaHeads:
        """A copy of the blocks on `device` in `dtype`, made once (the loaded weights stay as they are)."""
        return bound_copy(self.heads, self._bound, device, dtype)


def save_heads(folder: str | Path, heads: Heads) -> None:
    """Write `heads` into `folder` (the weights first, the json last: a folder without it is unfinished)."""
    save_checkpoint(folder, "medusa", heads.heads, heads.vocab_ids,
                    {**heads.info, "hidden_size": heads.heads.blocks[0].in_features, "num_heads": heads.heads.num_heads})


def load_heads(folder: str | Path) -> Heads:
    """Read a checkpoint folder; SpecdecError naming what is wrong with a missing or damaged one."""
    module, ids, info = read_checkpoint(folder, "medusa",
                                        lambda info: MedusaHeads(int(info["hidden_size"]), int(info["num_heads"])))
    return Heads(module, ids, info)


def check_heads_target(heads: Heads, target) -> None:
    """SpecdecError unless `heads` were trained for `target` (same weights, width and vocabulary)."""
    check_checkpoint_target(heads.info, heads.vocab_ids, target, "Medusa heads")


# ---------------------------------------------------------------- training


@dataclass
class TrainConfig:
    num_heads: int = 5  # as Medusa (Cai et al. 2024) drafts: heads for the 2nd..6th token
    tokens: int = 32768  # corpus tokens run through the target (a tenth held out)
    vocab: int = 32768  # ids the loss and the drafting score
    seq_len: int = 256  # tokens per target pass while caching hidden states
    epochs: int = 3
    batch: int = 64
    lr: float = 1e-3
    seed: int = 0


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
    if config.num_heads < 1 or config.epochs < 1 or config.batch < 1 or config.vocab < 1 or config.seq_len <= config.num_heads:
        raise SpecdecError("train-heads needs heads >= 1, epochs >= 1, batch >= 1, vocab >= 1 and seq-len > heads")
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    data = prepare(target, corpus, out, config.tokens, config.seq_len, config.vocab, say)
    held = max(1, len(data.features) // 10)
    train, heldout = data.features[:-held], data.features[-held:]
    weight = data.weight
    heads = MedusaHeads(weight.shape[1], config.num_heads).to(weight.device)
    positions_per_chunk = config.seq_len - config.num_heads

    def batch_loss(pick: torch.Tensor, step: int) -> torch.Tensor:
        return distill_loss(heads, weight, train, pick // positions_per_chunk, pick % positions_per_chunk)[0]

    step, last_loss = fit(heads, batch_loss, len(train) * positions_per_chunk, out, data.key, config, say,
                          "training heads")
    say("scoring the held-out chunks")
    with torch.inference_mode():
        full_argmax = torch.stack([target._logits(chunk.to(target.device, target.dtype)).argmax(-1).cpu()
                                   for chunk in heldout])
    heldout_loss, accuracy = heldout_accuracy(heads, weight, data.vocab_ids, heldout, full_argmax)
    before_loss, _ = heldout_accuracy(MedusaHeads(weight.shape[1], config.num_heads).to(weight.device), weight,
                                      data.vocab_ids, heldout, full_argmax)
    info = {"target": target.name, "target_sha256": data.fingerprint, "corpus": data.identity, "tokens": data.tokens,
            "heldout_tokens": held * config.seq_len, "steps": step, "epochs": config.epochs, "batch": config.batch,
            "lr": config.lr, "seed": config.seed, "seq_len": config.seq_len, "train_loss": last_loss,
            "heldout_loss": heldout_loss, "heldout_loss_untrained": before_loss,
            "heldout_top1": accuracy, "seconds": round(time.perf_counter() - began, 1),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    result = Heads(heads.cpu().eval().requires_grad_(False), data.vocab_ids, info)
    save_heads(out, result)
    finish(out)
    return Heads(result.heads, data.vocab_ids, load_heads(out).info)
