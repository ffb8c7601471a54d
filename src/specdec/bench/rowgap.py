"""Row gaps: how far a backend's multi-token and batched passes are from its one-token passes
(max |logit difference|), the measure of row-exactness that rowprobe and its captured sections
report."""

from __future__ import annotations

import torch

from ..backends import Segment


def row_gap(model, prompt: list[int], more: list[int], width: int) -> tuple[float, int]:
    """One pass over `width` tokens after `prompt` against `width` one-token passes: max |logit
    difference| and how many argmaxes differ."""
    one = model.new_cache()
    pending = model.prefill(prompt, one)
    singles = torch.cat([model.forward(pending, one, 1)] + [model.forward([t], one, 1) for t in more[:width - 1]])
    wide = model.new_cache()
    model.prefill(prompt, wide)
    multi = model.forward(pending + more[:width - 1], wide, width)
    return float((singles - multi).abs().max()), int((singles.argmax(-1) != multi.argmax(-1)).sum())


def batch_gap(model, prompt: list[int], more: list[int], sequences: int, width: int) -> float:
    """`sequences` sequences (prompts prompt[i:]) of `width` new tokens scored together
    (`forward_batch`) against each alone: max |logit difference|."""
    alone, segments = [], []
    for i in range(sequences):
        cache = model.new_cache()
        pending = model.prefill(prompt[i:], cache)
        alone.append(model.forward(pending + more[:width - 1], cache, width))
        cache = model.new_cache()
        segments.append(Segment(model.prefill(prompt[i:], cache) + more[:width - 1], cache, width))
    together = model.forward_batch(segments)
    return max(float((a - b).abs().max()) for a, b in zip(alone, together))
