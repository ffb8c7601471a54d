"""How well a self-drafter's q predicts acceptance: per bin of q, the tree nodes verification tried
and the share it accepted, with calibrated node values and without (docs/BENCHMARKS.md,
"Calibrated node values").

    .venv/bin/python scripts/calibration.py eagle:heads/qwen2.5-coder-1.5b-eagle [N]
    .venv/bin/python scripts/calibration.py medusa:heads/qwen2.5-coder-1.5b [N]

Greedy, 128 new tokens on the first N HumanEval prompts (default 3), each generated once with
TreeCost(calibrate=False) (the drafter's q sizes the trees) and once with calibration (the
default), alternating. Tokens per target pass are hardware-independent; the speeds are not
(the bench measures those).
"""

import sys

from specdec import load, speculative_generate
from specdec.bench.datasets import load_prompts
from specdec.cli import self_drafter, self_drafter_spec
from specdec.schedules import TreeCost

spec = self_drafter_spec(sys.argv[1])
if spec is None or spec[0] == "self-skip":
    sys.exit("give medusa:DIR or eagle:DIR")
count = int(sys.argv[2]) if len(sys.argv) > 2 else 3
target = load("qwen2.5-coder-1.5b")
prompts = [target.encode(p.text) for p in load_prompts("humaneval", count)]
totals = {}
for ids in prompts:
    for calibrate in (False, True):
        drafter = self_drafter(spec, target)
        drafter.policy = TreeCost(calibrate=calibrate)
        out = speculative_generate(ids, target, drafter, gamma=20, max_new_tokens=128)
        rows = drafter.policy.calibrated.table()
        total = totals.setdefault(calibrate, {"bins": [[low, high, 0, 0] for low, high, _, _ in rows],
                                              "tokens": 0, "passes": 0, "nodes": 0, "seconds": 0.0})
        for row, (_, _, tries, hits) in zip(total["bins"], rows):
            row[2] += tries
            row[3] += hits
        total["tokens"] += len(out.tokens)
        total["passes"] += out.stats.target_forwards
        total["nodes"] += sum(len(step.draft_tokens) for step in out.steps)
        total["seconds"] += out.stats.wall_seconds
        print(f"calibrate={calibrate}: {len(out.tokens)} tokens, {out.stats.target_forwards} target passes, "
              f"{len(out.tokens) / out.stats.wall_seconds:.2f} tok/s", flush=True)

for calibrate, total in totals.items():
    print(f"\ncalibrate={calibrate}: {total['tokens'] / total['passes']:.3f} tokens per target pass, "
          f"{total['nodes'] / total['passes']:.2f} nodes per step, {total['tokens'] / total['seconds']:.2f} tok/s")
    print("q bin        tried  accepted")
    for low, high, tries, hits in total["bins"]:
        rate = f"{hits / tries:.3f}" if tries else "-"
        print(f"[{low:.2f}, {high:.2f})  {tries:6d}  {rate}")
