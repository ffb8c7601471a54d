"""Fitting Medusa heads (adapters/medusa_heads.py; Cai et al. 2024): `specdec train-heads --kind medusa`.

Trained here by self-distillation: the target runs once over a corpus and its final hidden
states are cached; head k then learns the target's own distribution at position t+k (computed
from the cached h_{t+k} through the frozen head), not the corpus's next token. The loss and the
drafting score the N most frequent ids only (`vocab.frequent_ids`), which makes CPU training
affordable; q is 0 on the other ids, which exact verification handles like any q.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..adapters.medusa_heads import Heads, MedusaHeads, load_heads, save_heads
from ..errors import SpecdecError
from .distill import fit, finish, prepare


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
