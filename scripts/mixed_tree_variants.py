"""The default (mixed) tree with and without its two newest parts, on the default pair
(docs/BENCHMARKS.md, "Token trees: the seventh run"): the model chain valued by calibrated
acceptance (`TreeCost(calibrate=...)`), and lookup from the chain's end (`chain_lookup`).

Greedy, seeded, so every variant must give AR's tokens (checked) and only the cost differs: per
prompt, repeat and variant the wall time, target passes and drafter passes, the variants in
turn. Then the calibration table of the default variant's last generation on each prompt:
tokens tried per bin of the drafter's q, and how many the target accepted. Usage:
    .venv/bin/python scripts/mixed_tree_variants.py [--tasks summarization,rag] [--humaneval 3]
        [--repeats 2] [--max-new-tokens 128]
"""
import argparse

from specdec import load, speculative_generate
from specdec.bench.datasets import load_prompts
from specdec.drafters import MixedDrafter
from specdec.schedules import TreeCost

VARIANTS = {
    "default (calibrated, chain lookup)": dict(calibrate=True, chain_lookup=True),
    "raw q chain": dict(calibrate=False, chain_lookup=True),
    "no lookup from the chain's end": dict(calibrate=True, chain_lookup=False),
}


def make(drafter, calibrate: bool, chain_lookup: bool) -> MixedDrafter:
    return MixedDrafter(drafter, policy=TreeCost(calibrate=calibrate), chain_lookup=chain_lookup)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", default="summarization", help="Spec-Bench tasks, comma-separated ('' for none)")
    parser.add_argument("--humaneval", type=int, default=3, help="HumanEval prompts (the first is skipped: warm-up)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    target, drafter = load("qwen2.5-coder-1.5b"), load("qwen2.5-coder-0.5b")
    tasks = [t for t in args.tasks.split(",") if t]
    prompts = [p for p in load_prompts("spec-bench", 1) if p.task in tasks]
    prompts += load_prompts("humaneval", args.humaneval + 1)[1:] if args.humaneval else []
    warm = target.encode(load_prompts("humaneval", 1)[0].text)
    speculative_generate(warm, target, make(drafter, True, True), gamma=20, max_new_tokens=8)
    for p in prompts:
        ids = target.encode(p.text, chat=p.dataset == "spec-bench")
        reference, last = None, None
        for repeat in range(args.repeats):
            for name, options in VARIANTS.items():
                mixed = make(drafter, **options)
                result = speculative_generate(ids, target, mixed, gamma=20, max_new_tokens=args.max_new_tokens, seed=0)
                reference = reference or result.tokens
                assert result.tokens == reference, (p.task, name)
                s = result.stats
                print(f"{p.task} ({len(ids)} tokens) #{repeat + 1} {name}: {s.wall_seconds:.2f} s, "
                      f"{s.target_forwards} target passes, {sum(s.drafter_passes_per_step)} drafter passes", flush=True)
                if options["calibrate"] and options["chain_lookup"]:
                    last = mixed
        print(f"{p.task}: calibration (q from, q to, tried, accepted):")
        for low, high, tries, hits in last.policy.calibrated.table():
            if tries:
                print(f"  {low:.2f}-{high:.2f}: {hits}/{tries}")


if __name__ == "__main__":
    main()
