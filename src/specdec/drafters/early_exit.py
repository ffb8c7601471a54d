"""Early-exit self-drafting (the survey's early exiting, beside layer skip; Draft & Verify's
sibling; LayerSkip, Elhoushi et al. 2024, without its training): the target's own first k decoder
layers draft, the hidden state after layer k read out through the target's final norm and LM head
(a shared exit head, untrained). No second model, no extra weights: the drafter shares the
target's modules and keeps a KV cache of its own for those k layers.

The exit layer is chosen by a short search when the drafter is built (`choose_exit`), as
layerskip's `choose_skipped` chooses its layers: a few exits are tried on the same calibration
text, each scored by its teacher-forced greedy agreement with the full model (an estimate of α)
against its share of the weights (an estimate of c), and the exit with the best predicted speedup
(theory.walltime_improvement at the optimal γ) wins.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..backends.kernels import weight_count
from ..backends.transformers import TransformersModel
from ..errors import SpecdecError
from ..sizing.theory import optimal_gamma, walltime_improvement
from .layerskip import CALIBRATION, LayerSkipModel, _layers
from .model import ModelDrafter

FRACTIONS = (0.25, 0.375, 0.5, 0.625, 0.75)  # exits tried, as shares of the target's layers


class EarlyExitModel(LayerSkipModel):
    """The target's first `exit_layer` decoder layers, then its final norm and LM head: a drafter
    model sharing its weights (the layers after the exit are the ones left out)."""

    def __init__(self, target: TransformersModel, exit_layer: int):
        count = len(_layers(target))
        if isinstance(exit_layer, bool) or not isinstance(exit_layer, int) or not 1 <= exit_layer < count:
            raise SpecdecError(f"the exit layer must be an integer in 1..{count - 1} ({target.name} has {count} "
                               f"decoder layers; the last one is the target itself), got {exit_layer!r}")
        super().__init__(target, range(exit_layer, count))
        self.exit_layer = exit_layer
        self.name = f"{target.name}-exit{exit_layer}of{count}"


@torch.inference_mode()
def choose_exit(target: TransformersModel, text: str = CALIBRATION,
                fractions: Sequence[float] = FRACTIONS) -> tuple[int, dict]:
    """(the exit layer, the search's measurements): see the module docstring."""
    layers = _layers(target)
    count = len(layers)
    ids = calibration_ids(target, text)
    truth = target._logits(target._decoder(input_ids=ids.view(1, -1), use_cache=False).last_hidden_state[0],
                           exact=False).argmax(-1)
    layer_params = weight_count(layers[0])  # packed layers keep their weights as buffers
    head_params = target.vocab_size * target.hidden_size
    trials = []
    for exit_layer in sorted({min(count - 1, max(1, round(f * count))) for f in fractions}):
        drafted = EarlyExitModel(target, exit_layer).forward(ids, None, num_logits=len(ids)).argmax(-1)
        alpha = float((drafted == truth).float().mean())
        c = (exit_layer * layer_params + head_params) / (count * layer_params + head_params)
        gamma = optimal_gamma(min(alpha, 0.99), c) if alpha > 0 else 1
        speedup = walltime_improvement(min(alpha, 0.99), gamma, c) if alpha > 0 else 0.0
        trials.append({"exit": exit_layer, "alpha": round(alpha, 3), "c": round(c, 3), "speedup": round(speedup, 3)})
    best = max(trials, key=lambda t: t["speedup"])
    return best["exit"], {"trials": trials}


def calibration_ids(target, text: str = CALIBRATION) -> torch.Tensor:
    """[T] ids of the calibration text; for a model without a tokenizer (a test's random model), a
    fixed pseudo-random text of its vocabulary."""
    if target.tokenizer is None:
        return torch.randint(target.vocab_size, (128,), generator=torch.Generator().manual_seed(0)).to(target.device)
    return torch.tensor(target.tokenizer(text, add_special_tokens=False)["input_ids"], device=target.device)


def early_exit_drafter(target: TransformersModel, exit_layer: int | None = None) -> ModelDrafter:
    """A drafter of `target`'s first layers: `exit_layer` as given, else chosen by `choose_exit`."""
    search = None
    if exit_layer is None:
        exit_layer, search = choose_exit(target)
    drafter = ModelDrafter(EarlyExitModel(target, exit_layer))
    drafter.search = search
    return drafter
