"""c of Medusa drafting: one heads pass (blocks + the frozen head over the scored ids) against a
1-token target pass, alternating, median of 30 each (docs/BENCHMARKS.md, "Self-drafting").

    .venv/bin/python scripts/medusa_cost.py heads/qwen2.5-coder-1.5b
"""

import statistics
import sys
import time

from specdec import load
from specdec.drafters.medusa import MedusaDrafter

target = load("qwen2.5-coder-1.5b")
drafter = MedusaDrafter(sys.argv[1])
drafter.check_target(target)
cache = target.new_cache()
ids = target.encode("def quicksort(arr):\n    ")
pending = target.prefill(ids, cache)
target.forward(pending, cache)
heads, passes = [], []
for i in range(30):
    start = time.perf_counter()
    drafter.head_probs(target.last_hidden[-1])
    heads.append(time.perf_counter() - start)
    start = time.perf_counter()
    target.forward([ids[-1]], cache)
    passes.append(time.perf_counter() - start)
    target.crop(cache, len(ids))
h, p = statistics.median(heads), statistics.median(passes)
print(f"heads pass {h * 1e3:.1f} ms, target 1-token pass {p * 1e3:.1f} ms, c = {h / p:.3f}")
