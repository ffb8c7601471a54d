"""Layer-skip self-speculation (Draft & Verify, Zhang et al. 2023; SWIFT, Xia et al. 2024): the
target drafts for itself with some of its decoder layers skipped. No training, no second model,
no extra weights: the drafter shares the target's modules and keeps only a KV cache of its own.

Which layers to skip is chosen by a short search when the drafter is built (`choose_skipped`):
one full pass over a fixed calibration text ranks the layers by how much each changes the hidden
state (1 - cosine of its input and output; the first and last layers always stay); then a few
skip counts are tried on the same text, each scored by its teacher-forced greedy agreement with
the full model (an estimate of α) against its share of the weights (an estimate of c), and the
count with the best predicted speedup (theory.walltime_improvement at the optimal γ) wins.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch
from torch import nn

from ..backends import Features
from ..backends.kernels import weight_count
from ..backends.transformers import TransformersModel
from ..errors import SpecdecError
from ..sizing.theory import optimal_gamma, walltime_improvement
from .model import ModelDrafter

CALIBRATION = '''def merge_intervals(intervals):
    """Merge overlapping intervals and return them sorted by start."""
    result = []
    for start, end in sorted(intervals):
        if result and start <= result[-1][1]:
            result[-1][1] = max(result[-1][1], end)
        else:
            result.append([start, end])
    return result


The quick summary: speculative decoding lets a cheap drafter propose several tokens, and the
large model checks all of them in a single forward pass. When the drafter is right, many tokens
are produced for the price of one pass; when it is wrong, nothing is lost but a little time.
Question: What is the capital of France, and why is it famous? Answer: Paris is the capital of
France. It is famous for the Eiffel Tower, the Louvre museum, and its cafes and food.
'''
FRACTIONS = (0.25, 0.375, 0.5, 0.625)


class LayerSkipModel:
    """The target with the decoder layers in `skip` left out: a drafter model sharing its weights.

    It has what the model drafters use of a `TransformersModel` (forward over new tokens with a cache,
    token trees included); its logits come from the target's output head without the target's
    exactness refinements (a drafter's logits only steer acceptance).
    """

    role = "drafter"
    exact_rows = False

    def __init__(self, target: TransformersModel, skip: Sequence[int]):
        layers = _layers(target)
        skip = sorted({int(i) for i in skip})
        if any(not 0 < i < len(layers) for i in skip):
            raise SpecdecError(f"layers to skip must lie in 1..{len(layers) - 1} (layer 0 holds the cache length), "
                               f"got {skip}")
        self.target, self.skip = target, skip
        self.kept = nn.ModuleList(layer for i, layer in enumerate(layers) if i not in set(skip))
        self.name = f"{target.name}-skip{len(skip)}of{len(layers)}"
        self.hf, self.tokenizer = target.hf, target.tokenizer
        self.kernels = f"{target.kernels}, {len(self.kept)} of {len(layers)} layers"

    def __getattr__(self, name):  # device, dtype, vocab_size, max_context, eos_token_ids, encode, ...
        if name == "target":
            raise AttributeError(name)
        return getattr(self.target, name)

    def features(self) -> Features:
        """What this view does beyond `Backend` (`backends.Features`): the target's token trees and
        cache size; one sequence a pass, no row exactness, no prompt cache of its own."""
        can = self.target.features()
        return Features(tree_masks=can.tree_masks, kv_bytes_per_token=can.kv_bytes_per_token, embedded=can.embedded)

    def new_cache(self):
        return self.target.new_cache()

    @contextlib.contextmanager
    def _skipping(self):
        decoder = self.target._decoder
        full = decoder.layers
        decoder.layers = self.kept
        try:
            yield
        finally:
            decoder.layers = full

    @torch.inference_mode()
    def forward(self, input_ids: Sequence[int] | torch.Tensor, cache=None, num_logits: int = 1,
                parents: Sequence[int] | None = None, tree_start: int | None = None) -> torch.Tensor:
        """[T] new ids -> logits [num_logits, V] fp32 through the kept layers (see `TransformersModel.forward`)."""
        target = self.target
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=target.device).view(1, -1)
        extra = {} if parents is None else target._tree_inputs(parents, cache, ids.shape[1], tree_start)
        with self._skipping():
            out = target._decoder(input_ids=ids, past_key_values=cache, use_cache=cache is not None, **extra)
        return target._logits(out.last_hidden_state[0, -num_logits:], exact=False)


def _layers(target) -> nn.ModuleList:
    decoder = target._decoder if isinstance(target, TransformersModel) else None  # llama.cpp's, captured: none
    layers = getattr(decoder, "layers", None)  # transformers' decoder module
    if not isinstance(layers, nn.ModuleList) or len(layers) < 3:
        raise SpecdecError(f"self-skip drafting needs a transformers decoder with >= 3 layers; {target.name} "
                           f"({target.kernels}) has none to skip; use --dtype bf16/fp32")
    kinds = set(getattr(target.hf.config, "layer_types", None) or ["full_attention"])
    if len(kinds) > 1:
        raise SpecdecError(f"self-skip drafting does not support {target.name}: its layers mix attention kinds "
                           f"({', '.join(sorted(kinds))})")
    return layers


@torch.inference_mode()
def choose_skipped(target: TransformersModel, text: str = CALIBRATION,
                   fractions: Sequence[float] = FRACTIONS) -> tuple[list[int], dict]:
    """(layers to skip, the search's measurements): see the module docstring."""
    layers = _layers(target)
    count = len(layers)
    ids = torch.tensor([target.tokenizer(text, add_special_tokens=False)["input_ids"]], device=target.device)
    out = target._decoder(input_ids=ids, use_cache=False, output_hidden_states=True)
    states = out.hidden_states  # [count + 1] x [1, T, H]: the embeddings, then each layer's output
    change = [1 - float(nn.functional.cosine_similarity(states[i].float(), states[i + 1].float(), dim=-1).mean())
              for i in range(count)]
    candidates = sorted(range(1, count - 1), key=lambda i: change[i])
    truth = target._logits(out.last_hidden_state[0], exact=False).argmax(-1)
    layer_params = weight_count(layers[0])  # packed layers keep their weights as buffers
    head_params = target.vocab_size * target.hidden_size
    trials = []
    for fraction in fractions:
        skip = sorted(candidates[:max(1, round(fraction * count))])
        drafted = LayerSkipModel(target, skip).forward(ids[0], None, num_logits=ids.shape[1]).argmax(-1)
        alpha = float((drafted == truth).float().mean())
        c = ((count - len(skip)) * layer_params + head_params) / (count * layer_params + head_params)
        gamma = optimal_gamma(min(alpha, 0.99), c) if alpha > 0 else 1
        speedup = walltime_improvement(min(alpha, 0.99), gamma, c) if alpha > 0 else 0.0
        trials.append({"skip": skip, "alpha": round(alpha, 3), "c": round(c, 3), "speedup": round(speedup, 3)})
    best = max(trials, key=lambda t: t["speedup"])
    return best["skip"], {"layer_change": [round(x, 4) for x in change], "trials": trials}


def self_skip_drafter(target: TransformersModel, skip: Sequence[int] | None = None) -> ModelDrafter:
    """A drafter of `target` with layers skipped: `skip` as given, else chosen by `choose_skipped`."""
    search = None
    if skip is None:
        skip, search = choose_skipped(target)
    drafter = ModelDrafter(LayerSkipModel(target, skip))
    drafter.search = search
    return drafter
