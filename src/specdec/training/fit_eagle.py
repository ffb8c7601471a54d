"""EAGLE (Li et al. 2024): a one-layer drafter that predicts the target's next feature.

The feature f_t is the target's final hidden state at position t, what its output head reads to
choose token t+1. The drafter reads [embedding of token t+1; f_t], mixes them (`fc`, 2H -> H),
and runs one decoder layer (attention over the earlier positions' inputs, with its own small KV
cache; a SwiGLU MLP) to predict f_{t+1}; the target's frozen output head turns that prediction
into q(token t+2). Drafting goes on at the feature level: the next input is [embedding of the
drafted token; the predicted feature]. The target's embeddings and head are reused, frozen: the
new weights are the layer and `fc` alone.

Trained here by self-distillation (distill.py): the target's features over a corpus are cached
once, and the layer learns to predict f_{t+1} from (x_{t+1}, f_t): a smooth-L1 loss on the
feature, plus the cross-entropy of the head's law at the prediction against the target's own law
at f_{t+1} (over the N most frequent ids). Inputs carry uniform noise, and with `unroll` > 1 the
layer also learns from its own predicted features as inputs (what drafting deeper than one token
feeds it), each unrolled pass one position shorter.

A checkpoint is a folder: `eagle.safetensors` (the layer and the scored ids) and `eagle.json`
(the shape and the provenance: target's fingerprint, corpus, tokens, steps, losses, held-out
top-1 accuracy per drafting depth).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import SpecdecError
from .distill import bound_copy, check_checkpoint_target, fit, finish, prepare, read_checkpoint, save_checkpoint


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
    embeddings = getattr(getattr(target, "hf", None), "get_input_embeddings", lambda: None)()
    if embeddings is None:
        raise SpecdecError(f"an EAGLE drafter reads the target's input embeddings; {target.name} has none to read")
    if getattr(embeddings, "embedding_dim", target.hidden_size) != target.hidden_size:
        raise SpecdecError(f"an EAGLE drafter needs input embeddings as wide as the hidden states; {target.name}'s are "
                           f"{embeddings.embedding_dim} wide against {target.hidden_size}")


# ---------------------------------------------------------------- training


@dataclass
class EagleTrainConfig:
    tokens: int = 32768  # corpus tokens run through the target (a tenth held out)
    vocab: int = 32768  # ids the loss and the drafting score
    seq_len: int = 256  # tokens per chunk: the target's caching pass and one training sequence
    epochs: int = 4
    batch: int = 2  # chunks per step
    lr: float = 5e-4
    seed: int = 0
    intermediate: int = 0  # MLP width (0: 8/3 of the hidden size)
    unroll: int = 2  # passes per sequence: the first on the target's features, then on its own predictions
    noise: float = 0.1  # uniform input noise, relative to the features' RMS
    token_weight: float = 0.1  # the cross-entropy's weight beside the feature loss (EAGLE's 0.1 : 1)


def eagle_loss(layer: EagleLayer, weight: torch.Tensor, embeds: torch.Tensor, features: torch.Tensor,
               unroll: int, noise: float = 0.0, token_weight: float = 0.1,
               generator: torch.Generator | None = None) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The training loss of a batch of sequences.

    weight [N, H] the frozen head's scored rows; embeds [B, T, H] the target's embeddings of the
    sequences' tokens x_0..x_{T-1}; features [B, T, H] its features f_0..f_{T-1}. Pass u (u = 1..
    unroll) predicts f_{t+u} from x_{t+u} and pass u-1's prediction of f_{t+u-1} (pass 1: the
    target's f_t, plus noise). Returns (mean loss over passes, each pass's predictions
    [B, T-u, H], the head's logits of each [B, T-u, N]).
    """
    device = weight.device
    embeds, features = embeds.to(device).float(), features.to(device).float()
    inputs = features[:, :-1]
    if noise:
        scale = noise * features.pow(2).mean().sqrt()
        inputs = inputs + (torch.rand(inputs.shape, generator=generator).to(device) * 2 - 1) * scale
    total, predictions, logits = 0.0, [], []
    for u in range(1, unroll + 1):
        length = features.shape[1] - u
        positions = torch.arange(length, device=device).view(1, -1)
        predicted = layer(embeds[:, u:], inputs[:, :length], positions)
        truth = features[:, u:]
        with torch.no_grad():
            teacher = (truth @ weight.T).softmax(-1)
        student = predicted @ weight.T
        token_loss = -(teacher * student.log_softmax(-1)).sum(-1).mean()
        total = total + F.smooth_l1_loss(predicted, truth) + token_weight * token_loss
        predictions.append(predicted)
        logits.append(student)
        inputs = predicted.detach()[:, :-1]
    return total / unroll, predictions, logits


@torch.inference_mode()
def heldout_eagle(layer: EagleLayer, weight: torch.Tensor, vocab_ids: torch.Tensor, embeds: torch.Tensor,
                  features: torch.Tensor, full_argmax: torch.Tensor, unroll: int,
                  token_weight: float) -> tuple[float, list[float]]:
    """(loss, top-1 accuracy per drafting depth) over held-out sequences, one at a time: depth u is
    right where the head's argmax over its ids at pass u's prediction of f_{t+u} is the target's own
    greedy token after f_{t+u} over the full vocabulary (`full_argmax` [C, T]: its choice after f_t). Depths past the first
    read predicted features at every earlier position too, so they understate drafting, which
    reads the target's features up to the tree's root."""
    hits, losses, counts = torch.zeros(unroll), [], torch.zeros(unroll)
    for c in range(len(features)):
        loss, _, logits = eagle_loss(layer, weight, embeds[c:c + 1], features[c:c + 1], unroll,
                                     token_weight=token_weight)
        losses.append(float(loss))
        for u, row in enumerate(logits, 1):
            guess = vocab_ids[row[0].argmax(-1).cpu()]
            hits[u - 1] += float((guess == full_argmax[c, u:]).sum())
            counts[u - 1] += len(guess)
    return sum(losses) / len(losses), (hits / counts).tolist()


def train_eagle(target, corpus: str | Sequence[int], out: str | Path, config: EagleTrainConfig = EagleTrainConfig(),
                say: Callable[[str], None] = print) -> Eagle:
    """Train an EAGLE drafter for `target` on `corpus` (a name for `distill.corpus_ids`, or token
    ids) and save it in `out` (see the module docstring). Resumable and seeded like `train_medusa`."""
    if (config.epochs < 1 or config.batch < 1 or config.vocab < 1 or config.unroll < 1
            or config.seq_len <= config.unroll + 1 or config.intermediate < 0 or config.noise < 0):
        raise SpecdecError("train-heads --kind eagle needs epochs, batch, vocab and unroll >= 1, "
                           "seq-len > unroll + 1, and a non-negative intermediate size and noise")
    if hasattr(target, "hf"):
        check_embeddings(target)
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    data = prepare(target, corpus, out, config.tokens, config.seq_len, config.vocab, say)
    held = max(1, len(data.features) // 10)
    train_features, heldout = data.features[:-held], data.features[-held:]
    weight = data.weight
    embedding = target.hf.get_input_embeddings()
    shape = EagleShape.for_target(target, config.intermediate or None)
    torch.manual_seed(config.seed)
    layer = EagleLayer(shape).to(weight.device)
    untrained = EagleLayer(shape).to(weight.device)

    def embeds_of(chunks: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return embedding(data.ids[chunks].to(target.device)).float()

    def batch_loss(pick: torch.Tensor, step: int) -> torch.Tensor:
        noise = torch.Generator().manual_seed(config.seed * 1_000_003 + step)  # the same draws after a resume
        return eagle_loss(layer, weight, embeds_of(pick), train_features[pick], config.unroll, config.noise,
                          config.token_weight, noise)[0]

    step, last_loss = fit(layer, batch_loss, len(train_features), out, data.key, config, say, "training EAGLE")
    say("scoring the held-out chunks")
    held_range = torch.arange(len(data.features) - held, len(data.features))
    with torch.inference_mode():
        # [c, t]: the target's greedy token t+1, what a prediction of f_t should choose
        full_argmax = torch.stack([target._logits(chunk.to(target.device, target.dtype)).argmax(-1).cpu()
                                   for chunk in heldout])
    held_embeds = embeds_of(held_range)
    heldout_loss, accuracy = heldout_eagle(layer, weight, data.vocab_ids, held_embeds, heldout, full_argmax,
                                           config.unroll, config.token_weight)
    before_loss, _ = heldout_eagle(untrained, weight, data.vocab_ids, held_embeds, heldout, full_argmax,
                                   config.unroll, config.token_weight)
    info = {"target": target.name, "target_sha256": data.fingerprint, "corpus": data.identity, "tokens": data.tokens,
            "heldout_tokens": held * config.seq_len, "steps": step, "epochs": config.epochs, "batch": config.batch,
            "lr": config.lr, "seed": config.seed, "seq_len": config.seq_len, "unroll": config.unroll,
            "noise": config.noise, "token_weight": config.token_weight, "train_loss": last_loss,
            "heldout_loss": heldout_loss, "heldout_loss_untrained": before_loss, "heldout_top1": accuracy,
            "parameters": sum(p.numel() for p in layer.parameters()),
            "seconds": round(time.perf_counter() - began, 1),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    save_eagle(out, Eagle(layer.cpu().eval().requires_grad_(False), data.vocab_ids, info))
    finish(out)
    return load_eagle(out)
