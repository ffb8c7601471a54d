"""EAGLE (Li et al. 2024): a one-layer drafter that predicts the target's next feature.

The feature f_t is the target's final hidden state at position t, what its output head reads to
choose token t+1. The drafter reads [embedding of token t+1; f_t], mixes them (`fc`, 2H -> H),
and runs one decoder layer (attention over the earlier positions' inputs, with its own small KV
cache; a SwiGLU MLP) to predict f_{t+1}; the target's frozen output head turns that prediction
into q(token t+2). Drafting goes on at the feature level: the next input is [embedding of the
drafted token; the predicted feature]. The target's embeddings and head are reused, frozen: the
new weights are the layer and `fc` alone.

A checkpoint is a folder: `eagle.safetensors` (the layer and the scored ids) and `eagle.json`
(the shape and the provenance: target's fingerprint, corpus, tokens, steps, losses, held-out
top-1 accuracy per drafting depth). Drafting with it: drafters/eagle.py; fitting it:
training/fit_eagle.py.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import SpecdecError
from .checkpoints import bound_copy, check_checkpoint_target, read_checkpoint, save_checkpoint


@dataclass(frozen=True)
class EagleShape:
    """The layer's sizes: width H (the target's), attention heads x head width, MLP width."""

    hidden_size: int
    heads: int
    head_dim: int
    intermediate: int
    rope_theta: float = 10000.0
    eps: float = 1e-6

    @classmethod
    def for_target(cls, target, intermediate: int | None = None) -> "EagleShape":
        """The target's width and attention heads; an MLP of 8/3·H (SwiGLU's usual) unless given."""
        config = target.hf.config
        hidden = target.hidden_size
        heads = int(getattr(config, "num_attention_heads", max(1, hidden // 64)))
        head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
        width = intermediate or max(64, round(hidden * 8 / 3 / 64) * 64)
        return cls(hidden, heads, head_dim, width, float(getattr(config, "rope_theta", 10000.0) or 10000.0),
                   float(getattr(config, "rms_norm_eps", 1e-6) or 1e-6))


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding (rotate-half form). x [B, A, T, D], positions [B or 1, T] long."""
    half = x.shape[-1] // 2
    inv = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[:, None, :, None] * inv  # [B, 1, T, D/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


class EagleLayer(nn.Module):
    """[embedding of x_{t+1}; f_t] -> predicted f_{t+1}, causal over the earlier positions.

    It starts as the identity on the feature (fc = [0 | I], attention and MLP outputs zero): its
    first prediction of f_{t+1} is f_t, and training moves it from there."""

    def __init__(self, shape: EagleShape):
        super().__init__()
        if min(shape.hidden_size, shape.heads, shape.head_dim, shape.intermediate) < 1 or shape.head_dim % 2:
            raise SpecdecError(f"an EAGLE layer needs positive sizes and an even head width, got {shape}")
        self.shape = shape
        hidden, width = shape.hidden_size, shape.heads * shape.head_dim
        self.fc = nn.Linear(2 * hidden, hidden)
        self.attn_norm = nn.RMSNorm(hidden, eps=shape.eps)
        self.qkv = nn.Linear(hidden, 3 * width)
        self.o = nn.Linear(width, hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden, eps=shape.eps)
        self.gate_up = nn.Linear(hidden, 2 * shape.intermediate, bias=False)
        self.down = nn.Linear(shape.intermediate, hidden, bias=False)
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, hidden:] = torch.eye(hidden)
            self.fc.bias.zero_()
            self.o.weight.zero_()
            self.down.weight.zero_()

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """embeds, features [B, T, H]; positions [B or 1, T] long; mask [1, 1, T, S] bool (True:
        attend; S = cached + T) or None for causal over the T inputs alone; cache: a transformers
        DynamicCache (one layer) that the pass extends, or None. Returns the predictions [B, T, H]."""
        s = self.shape
        batch, length, _ = embeds.shape
        x = self.fc(torch.cat([embeds, features], dim=-1))
        q, k, v = self.qkv(self.attn_norm(x)).view(batch, length, 3, s.heads, s.head_dim).permute(2, 0, 3, 1, 4)
        q, k = rotate(q, positions, s.rope_theta), rotate(k, positions, s.rope_theta)
        if cache is not None:
            k, v = cache.update(k, v, 0)
        if mask is None and k.shape[-2] != length:
            raise SpecdecError("an EAGLE pass after cached positions needs its attention mask")
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        x = x + self.o(attended.transpose(1, 2).reshape(batch, length, -1))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


@dataclass
class Eagle:
    """A loaded checkpoint: the layer, the ids the head scores ([N] sorted) and its info."""

    layer: EagleLayer
    vocab_ids: torch.Tensor
    info: dict = field(default_factory=dict)
    _bound: dict = field(default_factory=dict, repr=False, compare=False)

    def layer_for(self, device: torch.device, dtype: torch.dtype) -> EagleLayer:
        """A copy of the layer on `device` in `dtype`, made once (the loaded weights stay as they are)."""
        return bound_copy(self.layer, self._bound, device, dtype)


def save_eagle(folder: str | Path, eagle: Eagle) -> None:
    """Write `eagle` into `folder` (the weights first, the json last)."""
    save_checkpoint(folder, "eagle", eagle.layer, eagle.vocab_ids, {**eagle.info, **asdict(eagle.layer.shape)})


def load_eagle(folder: str | Path) -> Eagle:
    """Read an EAGLE checkpoint folder; SpecdecError naming what is wrong with a missing or damaged one."""
    def build(info: dict) -> EagleLayer:
        return EagleLayer(EagleShape(int(info["hidden_size"]), int(info["heads"]), int(info["head_dim"]),
                                     int(info["intermediate"]), float(info["rope_theta"]), float(info["eps"])))

    layer, ids, info = read_checkpoint(folder, "eagle", build)
    return Eagle(layer, ids, info)


def check_eagle_target(eagle: Eagle, target) -> None:
    """SpecdecError unless `eagle` was trained for `target` (same weights, width and vocabulary)."""
    check_checkpoint_target(eagle.info, eagle.vocab_ids, target, "EAGLE drafter")
    check_embeddings(target)


def check_embeddings(target) -> None:
    """SpecdecError unless `target`'s input embeddings can be read and are as wide as its features."""
    from ..backends.captured import CapturedModel
    from ..backends.transformers import TransformersModel

    # the backends on a transformers model (`hf`); llama.cpp's keeps its embeddings to itself
    embeddings = target.hf.get_input_embeddings() if isinstance(target, (TransformersModel, CapturedModel)) else None
    if embeddings is None:
        raise SpecdecError(f"an EAGLE drafter reads the target's input embeddings; {target.name} has none to read")
    if getattr(embeddings, "embedding_dim", target.hidden_size) != target.hidden_size:
        raise SpecdecError(f"an EAGLE drafter needs input embeddings as wide as the hidden states; {target.name}'s are "
                           f"{embeddings.embedding_dim} wide against {target.hidden_size}")
