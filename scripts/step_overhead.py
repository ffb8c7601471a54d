"""Where a step's time goes (issue 13, item 4): wall time of greedy `sd-cost` and AR on the default
pair against the time inside the models' passes (forward and prefill, timed by wrapping them), on
the first HumanEval prompts; what is left is our loop's own per-step overhead. Usage:
    .venv/bin/python scripts/step_overhead.py [--prompts 3] [--max-new-tokens 128]
"""
import argparse
import time

from specdec import autoregressive_generate, load, speculative_generate
from specdec.bench.datasets import load_prompts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    target, drafter = load("qwen2.5-coder-1.5b"), load("qwen2.5-coder-0.5b", role="drafter")
    spent = {"target": 0.0, "drafter": 0.0}

    def timed(model, key: str, attr: str) -> None:
        inner = getattr(model, attr)

        def call(*a, **k):
            start = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                spent[key] += time.perf_counter() - start
        setattr(model, attr, call)

    for attr in ("forward", "prefill"):
        timed(target, "target", attr)
        timed(drafter, "drafter", attr)
    n = args.max_new_tokens
    for prompt in load_prompts("humaneval", args.prompts):
        ids = target.encode(prompt.text)
        for name, run in (("sd-cost", lambda: speculative_generate(ids, target, drafter, max_new_tokens=n)),
                          ("ar", lambda: autoregressive_generate(ids, target, max_new_tokens=n))):
            spent.update(target=0.0, drafter=0.0)
            start = time.perf_counter()
            result = run()
            wall = time.perf_counter() - start
            rest = wall - spent["target"] - spent["drafter"]
            steps = result.stats.target_forwards
            print(f"{prompt.task} {name}: wall {wall:.2f} s, target passes {spent['target']:.2f} s, drafter passes "
                  f"{spent['drafter']:.2f} s, loop {rest:.3f} s = {1e3 * rest / steps:.1f} ms per step over {steps} "
                  f"steps ({100 * rest / wall:.1f}% of wall)", flush=True)


if __name__ == "__main__":
    main()
