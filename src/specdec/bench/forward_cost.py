"""How a forward pass's cost grows with the number of tokens scored at once.

This ratio decides whether speculative decoding can pay: verifying γ drafts costs one pass over
γ+1 tokens, which must be far cheaper than γ+1 one-token passes.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Iterator

import torch

from ..backends import Backend
from ..models.loading import load
from ..backends.cache import crop_cache
from ..sizing.pass_costs import pass_seconds
from ..core.trees import input_parents


def tree_of_width(nodes: int, branching: int = 2) -> list[int]:
    """Parents of a `nodes`-node tree hung from one pending token, each node having up to
    `branching` children (breadth first): the shape of a wide verification pass."""
    return [-1] + [(i - 1) // branching for i in range(1, nodes)]


def forward_ms(model: Backend, tokens: int, context: int = 128, repeats: int = 5, tree: bool = False) -> float:
    """Median milliseconds of one pass over `tokens` new tokens after `context` cached ones; with
    `tree`, the last token committed plus a (tokens - 1)-node tree under the tree mask."""
    parents = input_parents(1, tree_of_width(tokens - 1)) if tree and tokens > 1 else None
    return 1e3 * pass_seconds(model, tokens, context, repeats, parents)


def rows_as_alone(model: Backend, sizes, context: int = 128) -> list[int]:
    """The widths among `sizes` whose pass gives each row bit for bit what a 1-token pass at its
    position gives (what greedy identity with AR needs of a target), after `context` cached tokens."""
    ids = [(100 + 7 * i) % model.vocab_size for i in range(context + 1 + max(sizes))]
    cache = model.new_cache()
    model.forward(model.prefill(ids[:context + 1], cache), cache, 1)
    tail = ids[context + 1:]
    alone = torch.cat([model.forward([token], cache, 1) for token in tail])
    exact = []
    for width in sizes:
        crop_cache(cache, context + 1)
        if torch.equal(model.forward(tail[:width], cache, width), alone[:width]):
            exact.append(width)
    return exact


def prefill_ms(model: Backend, tokens: int = 128) -> float:
    """Milliseconds to prefill a prompt of `tokens` tokens and score its last one (first token)."""
    start = time.perf_counter()
    cache = model.new_cache()
    model.forward(model.prefill(list(range(1000, 1000 + tokens)), cache), cache, 1)
    return (time.perf_counter() - start) * 1e3


def forward_cost_table(name: str, configs: list[tuple[str, str, str]], sizes=(1, 2, 4, 6, 9),
                       compare_rows: bool = False, tree: bool = False) -> Iterator[str]:
    """Markdown rows, one per (dtype, role, kernels): ms for 1 token and the cost ratio of each size.

    compare_rows: for a model that can run row-exact passes, two rows, row-exact and batched,
    measured alternately on the same loaded model (3 rounds, medians), so their ratio is fair.
    tree: each size is a token-tree pass under the tree mask (the cost a tree drafter pays).
    """
    for dtype, role, kernels in configs:
        model = load(name, dtype=dtype, role=role, kernels=kernels, exact_rows=True if compare_rows else None)
        prefill_ms(model, 16)  # warm-up
        modes = [True, False] if compare_rows and model.exact_rows else [model.exact_rows]
        ms = {mode: {t: [] for t in sizes} for mode in modes}
        for _ in range(3 if compare_rows else 1):
            for mode in modes:
                model.exact_rows = mode
                for t in sizes:
                    ms[mode][t].append(forward_ms(model, t, tree=tree))
        for mode in modes:
            med = {t: statistics.median(v) for t, v in ms[mode].items()}
            model.exact_rows = mode
            exact = set(rows_as_alone(model, sizes))
            cells = " | ".join(f"{med[t] / med[1]:.2f}x" + ("" if t in exact else " ≠") for t in sizes[1:])
            rows = "exact" if mode else "batched"
            kernel_name = model.kernels if dtype != "gguf" else f"{model.kernels} {kernels}"
            yield (f"| {name} | {dtype} | {role} | {kernel_name} | {rows} | {med[1]:.0f} | {cells} | "
                   f"{prefill_ms(model):.0f} |")
        del model
        gc.collect()  # free one model's weights before loading the next
