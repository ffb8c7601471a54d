"""Medusa heads (Cai et al. 2024): drafting with the target's own last hidden state.

Head k (k = 1..K) is one residual block on the target's final hidden state h_t (what its output
head reads when it picks token t+1), h + SiLU(W_k h + b_k), fed to the target's own frozen output
head; it predicts token t+1+k. No vocabulary-sized matrix is new: a head adds H·(H+1) weights.
The heads score the N most frequent ids only; q is 0 on the other ids, which exact verification
handles like any q.

A checkpoint is a folder: `heads.safetensors` (the blocks and the scored ids) and `medusa.json`
(the shapes and the provenance: the target's fingerprint, corpus, tokens, steps, loss, held-out
top-1 accuracy per head). `load_heads` refuses a damaged folder or one made for another target.
Drafting with them: drafters/medusa.py; fitting them: training/fit_medusa.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..errors import SpecdecError
from .checkpoints import FILES, bound_copy, check_checkpoint_target, read_checkpoint, save_checkpoint

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
