"""How the default (mixed) tree values a sampled chain token, against `sd-cost`, at T = 1
(docs/BENCHMARKS.md, "Sampled chains"): by the drafter's top probability at the position
(`sampled_value="top"`, the default) or by the sampled token's own q ("token", the rule before).

Unseeded sampling, as the bench times it (a seed would turn the measured-cost policies off), so
each generation draws its own text: per Spec-Bench task, `--samples` generations of each variant,
interleaved (order reversed on every other sample), summed: tokens, seconds, tokens per second,
tokens per target pass. Then, for each tree variant, its calibration counts over all its runs
(the value's bin: tried, accepted), which show what a sampled token's q says of its acceptance.
Usage:
    .venv/bin/python scripts/sampled_chain_value.py [--tasks math_reasoning,rag] [--samples 10]
        [--variants sd-cost,token,top] [--temperature 1]
"""
import argparse
from collections import defaultdict

import torch

from specdec import Sampler, load, speculative_generate
from specdec.bench.datasets import load_prompts
from specdec.bench.methods import Settings, run_method
from specdec.drafters import MixedDrafter

VARIANTS = {"sd-cost": "sd-cost's chain, as the bench runs it", "top": "the default tree (top probability)",
            "token": "the tree valuing a sampled token by its own q"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", default="math_reasoning,rag", help="Spec-Bench tasks, comma-separated")
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--variants", default="sd-cost,token,top",
                        help="; ".join(f"{k}: {v}" for k, v in VARIANTS.items()))
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    names = [v for v in args.variants.split(",") if v]
    if any(v not in VARIANTS for v in names):
        parser.error(f"variants must be among {', '.join(VARIANTS)}")
    if args.temperature <= 0:
        parser.error("this compares sampled chains: --temperature must be > 0")
    target, drafter = load("qwen2.5-coder-1.5b"), load("qwen2.5-coder-0.5b", role="drafter")
    sampler = Sampler(temperature=args.temperature)
    tables = {name: defaultdict(lambda: [0, 0]) for name in names}

    def generate(name: str, ids: list[int], max_new_tokens: int) -> tuple[int, float, int]:
        if name == "sd-cost":
            record = run_method(name, ids, target, drafter, Settings(max_new_tokens=max_new_tokens), sampler)
            return record.new_tokens, record.wall_seconds, record.target_forwards
        tree = MixedDrafter(drafter, sampled_value=name)
        stats = speculative_generate(ids, target, tree, gamma=20, max_new_tokens=max_new_tokens, sampler=sampler).stats
        for low, high, tries, hits in tree.policy.calibrated.table():
            tables[name][low, high][0] += tries
            tables[name][low, high][1] += hits
        return stats.new_tokens, stats.wall_seconds, stats.target_forwards

    warm = target.encode("Hello there", chat=True)
    for name in names:
        generate(name, warm, 8)
    for table in tables.values():
        table.clear()
    for prompt in [p for p in load_prompts("spec-bench", 1) if p.task in args.tasks.split(",")]:
        ids = target.encode(prompt.text, chat=True)
        totals = {name: [0, 0.0, 0] for name in names}  # tokens, seconds, target passes
        for i in range(args.samples):
            for name in (names if i % 2 == 0 else names[::-1]):
                torch.manual_seed(1000 * i + 7)  # the peers' and the drafter's global draws, if any
                for k, v in enumerate(generate(name, ids, args.max_new_tokens)):
                    totals[name][k] += v
        for name, (tokens, seconds, passes) in totals.items():
            print(f"{prompt.task}, {name}: {tokens} tokens in {seconds:.1f} s, {tokens / seconds:.2f} tok/s, "
                  f"{tokens / max(passes, 1):.2f} tokens / target pass", flush=True)
    for name, table in tables.items():
        if table:
            print(f"{name}: calibration over all runs (bin of the value's q: accepted / tried)")
            for (low, high), (tries, hits) in sorted(table.items()):
                if tries:
                    print(f"  {low:.2f}-{high:.2f}: {hits}/{tries} = {hits / tries:.2f}")


if __name__ == "__main__":
    main()
