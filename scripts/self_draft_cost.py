"""c of self-drafting: a drafter pass against a 1-token target pass, alternating, median of 30
each (docs/BENCHMARKS.md, "Self-drafting" and "EAGLE").

    .venv/bin/python scripts/self_draft_cost.py medusa:heads/qwen2.5-coder-1.5b
    .venv/bin/python scripts/self_draft_cost.py eagle:heads/qwen2.5-coder-1.5b-eagle

Medusa: one heads pass (the blocks and the frozen head over the scored ids). EAGLE: one layer
pass over 1 token after the prompt (a tree's root) and over 4 tree nodes (one depth of an
EAGLE-2 tree of width 4), each with the head over the scored ids.
"""

import statistics
import sys
import time

from specdec import LanguageModel, load
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.medusa import MedusaDrafter

kind, folder = sys.argv[1].split(":", 1)
target = load("qwen2.5-coder-1.5b")
cache = target.new_cache()
ids = target.encode("def quicksort(arr):\n    ")
pending = target.prefill(ids, cache)
hidden = target.pass_hidden  # the prompt's features but the last token's
target.forward(pending, cache)


def alternate(draft) -> list[float]:
    """Median seconds of `draft()` and of a 1-token target pass, alternating."""
    drafts, passes = [], []
    for _ in range(30):
        start = time.perf_counter()
        draft()
        drafts.append(time.perf_counter() - start)
        start = time.perf_counter()
        target.forward([ids[-1]], cache)
        passes.append(time.perf_counter() - start)
        LanguageModel.crop(cache, len(ids))
    return statistics.median(drafts), statistics.median(passes)


if kind == "medusa":
    drafter = MedusaDrafter(folder)
    drafter.check_target(target)
    h, p = alternate(lambda: drafter.head_probs(target.last_hidden[-1]))
    print(f"heads pass {h * 1e3:.1f} ms, target 1-token pass {p * 1e3:.1f} ms, c = {h / p:.3f}")
else:
    drafter = EagleDrafter(folder)
    drafter.check_target(target)
    model = drafter.model
    model.reset()
    model.add_features(hidden)
    own = model.new_cache()
    model.forward(ids[:-1], own, 1)  # the layer's cache over the prompt

    def root():
        model.forward(ids[-1:], own, 1)
        LanguageModel.crop(own, len(ids) - 1)

    def depth():
        model.forward(ids[-1:], own, 1)
        model.forward(ids[:4], own, 4, parents=[-1, -1, -1, -1], tree_start=len(ids))
        LanguageModel.crop(own, len(ids) - 1)

    r, p = alternate(root)
    d, _ = alternate(depth)
    print(f"EAGLE root pass (1 token) {r * 1e3:.1f} ms, 4-node depth pass {(d - r) * 1e3:.1f} ms, "
          f"target 1-token pass {p * 1e3:.1f} ms: c = {r / p:.3f} (root), {(d - r) / p:.3f} (depth)")
