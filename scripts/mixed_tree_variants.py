"""The default (mixed) tree against variants of itself and against `sd-cost`'s chain, on the
default pair (docs/BENCHMARKS.md, "Token trees: the seventh run" and "What a row costs here"):
the model chain valued by raw q instead of calibrated acceptance (`TreeCost(calibrate=...)`),
no lookup from the chain's end (`chain_lookup`), no side leaves (width 1), and `sd-cost`.

Greedy, seeded, so every variant must give AR's tokens (checked) and only the cost differs: per
prompt and repeat the wall time, target passes and drafter passes of each variant, their order
reversed on every other run; at the end each variant's total and its per-prompt speed against
`sd-cost` (geometric mean of time ratios). Then the calibration table of the default variant's
last generation on each prompt: tokens tried per bin of the drafter's q, and how many the target
accepted. Usage:
    .venv/bin/python scripts/mixed_tree_variants.py [--tasks summarization,rag] [--humaneval 3]
        [--skip 1] [--repeats 2] [--max-new-tokens 128] [--variants default,sd-cost]
"""
import argparse
import statistics

from specdec import load, speculative_generate
from specdec.bench.datasets import load_prompts
from specdec.drafters import MixedDrafter
from specdec.schedules import TreeCost, make_schedule

GAMMA_MAX = 20  # the bench's --gamma-max for trees-7: the trees' depth bound, sd-cost's longest draft


def mixed(calibrate: bool = True, chain_lookup: bool = True, width: int = 2):
    return lambda drafter: (MixedDrafter(drafter, width, policy=TreeCost(calibrate=calibrate), chain_lookup=chain_lookup),
                            dict(gamma=GAMMA_MAX))


VARIANTS = {  # name -> drafter model -> (what speculative_generate drafts with, its other arguments)
    "default": mixed(),
    "raw-q": mixed(calibrate=False),
    "no-chain-lookup": mixed(chain_lookup=False),
    "no-sides": mixed(width=1),
    "sd-cost": lambda drafter: (drafter, dict(schedule=make_schedule("cost", 5, 1, GAMMA_MAX))),
}
HELP = {"default": "the default tree (calibrated chain, lookup from its end, one side per chain token)",
        "raw-q": "its chain valued by the drafter's q", "no-chain-lookup": "no lookup from the chain's end",
        "no-sides": "no side leaves (width 1)", "sd-cost": "sd-cost's chain (no tree)"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", default="summarization", help="Spec-Bench tasks, comma-separated ('' for none)")
    parser.add_argument("--humaneval", type=int, default=3, help="HumanEval prompts, after the skipped ones")
    parser.add_argument("--skip", type=int, default=1, help="HumanEval prompts skipped first (the first warms up)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="; ".join(f"{k}: {v}" for k, v in HELP.items()))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    target, drafter = load("qwen2.5-coder-1.5b"), load("qwen2.5-coder-0.5b", role="drafter")
    tasks = [t for t in args.tasks.split(",") if t]
    prompts = [p for p in load_prompts("spec-bench", 1) if p.task in tasks]
    prompts += load_prompts("humaneval", args.skip + args.humaneval)[args.skip:] if args.humaneval else []
    warm = target.encode(load_prompts("humaneval", 1)[0].text)
    speculative_generate(warm, target, MixedDrafter(drafter), gamma=GAMMA_MAX, max_new_tokens=8)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    runs = 0
    for p in prompts:
        ids = target.encode(p.text, chat=p.dataset == "spec-bench")
        reference, last = None, None
        for repeat in range(args.repeats):
            runs += 1
            for name in (names if runs % 2 else names[::-1]):
                drafting, options = VARIANTS[name](drafter)
                result = speculative_generate(ids, target, drafting, max_new_tokens=args.max_new_tokens, seed=0,
                                              **options)
                reference = reference or result.tokens
                assert result.tokens == reference, (p.task, name)
                s = result.stats
                seconds[name].append(s.wall_seconds)
                print(f"{p.task} ({len(ids)} tokens) #{repeat + 1} {name}: {s.wall_seconds:.2f} s, "
                      f"{s.target_forwards} target passes, {sum(s.drafter_passes_per_step)} drafter passes", flush=True)
                if name == "default":
                    last = drafting
        if last is not None:
            print(f"{p.task}: calibration (q from, q to, tried, accepted):")
            for low, high, tries, hits in last.policy.calibrated.table():
                if tries:
                    print(f"  {low:.2f}-{high:.2f}: {hits}/{tries}")
    base = seconds.get("sd-cost")
    for name, times in seconds.items():
        against = "" if base is None else \
            f", per run {statistics.geometric_mean([b / t for b, t in zip(base, times)]):.3f}x sd-cost " \
            f"(faster on {sum(t < b for b, t in zip(base, times))} of {len(times)})"
        print(f"{name}: {sum(times):.2f} s in all{against}")


if __name__ == "__main__":
    main()
