"""How a forward pass's cost grows with the number of tokens scored at once.

This ratio decides whether speculative decoding can pay: verifying γ drafts costs one pass over
γ+1 tokens, which must be far cheaper than γ+1 one-token passes.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Iterator

from ..models import LanguageModel, load


def forward_ms(model: LanguageModel, tokens: int, context: int = 128, repeats: int = 5) -> float:
    """Median milliseconds of one pass over `tokens` new tokens after `context` cached ones."""
    cache = model.new_cache()
    model.forward(list(range(1000, 1000 + context)), cache, 1)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        model.forward(list(range(2000, 2000 + tokens)), cache, tokens)
        times.append(time.perf_counter() - start)
        LanguageModel.crop(cache, context)
    return statistics.median(times[1:]) * 1e3  # the first pass warms up


def prefill_ms(model: LanguageModel, tokens: int = 128) -> float:
    start = time.perf_counter()
    model.forward(list(range(1000, 1000 + tokens)), model.new_cache(), 1)
    return (time.perf_counter() - start) * 1e3


def forward_cost_table(name: str, configs: list[tuple[str, str, str]], sizes=(1, 2, 4, 6, 9)) -> Iterator[str]:
    """Markdown rows, one per (dtype, role, kernels): ms for 1 token and the cost ratio of each size."""
    for dtype, role, kernels in configs:
        model = load(name, dtype=dtype, role=role, kernels=kernels)
        prefill_ms(model, 16)  # warm-up
        ms = {t: forward_ms(model, t) for t in sizes}
        cells = " | ".join(f"{ms[t] / ms[1]:.2f}x" for t in sizes[1:])
        yield f"| {name} | {dtype} | {role} | {model.kernels} | {ms[1]:.0f} | {cells} | {prefill_ms(model):.0f} |"
        del model
        gc.collect()  # free one model's weights before loading the next
