"""Fitting an EAGLE layer (adapters/eagle_layer.py; Li et al. 2024): `specdec train-heads --kind eagle`.

Trained here by self-distillation (distill.py): the target's features over a corpus are cached
once, and the layer learns to predict f_{t+1} from (x_{t+1}, f_t): a smooth-L1 loss on the
feature, plus the cross-entropy of the head's law at the prediction against the target's own law
at f_{t+1} (over the N most frequent ids). Inputs carry uniform noise, and with `unroll` > 1 the
layer also learns from its own predicted features as inputs (what drafting deeper than one token
feeds it), each unrolled pass one position shorter.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch.nn import functional as F

from ..adapters.eagle_layer import Eagle, EagleLayer, EagleShape, check_embeddings, load_eagle, save_eagle
from ..errors import SpecdecError
from .distill import fit, finish, prepare


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
    from ..backends.transformers import TransformersModel

    if isinstance(target, TransformersModel):  # the others are refused by `prepare`, which needs its hidden states
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
