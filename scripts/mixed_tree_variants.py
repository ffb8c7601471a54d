"""The default (mixed) tree against variants of itself and against `sd-cost`'s chain, on the
default pair (docs/BENCHMARKS.md, "Token trees: the seventh run" and "What a row costs here"):
the model chain valued by raw q instead of calibrated acceptance (`TreeCost(calibrate=...)`),
no lookup from the chain's end (`chain_lookup`), no side leaves (width 1), and `sd-cost`.

Greedy, seeded, so every variant must give AR's tokens (checked) and only the cost differs: per
prompt and repeat the wall time, target passes and drafter passes of each variant, their order
reversed on every other run; at the end each variant's total and its per-prompt speed against
`sd-cost` (geometric mean of time ratios). Then the calibration table of the default variant's
last generation on each prompt: tokens tried per bin of the drafter's q, and how many the target
accepted; and, from one more (untimed) generation of the default, its nodes by kind: the main
chain, side leaves, lookup's own (both lookup from the context and from the chain's end), each
counted as proposed, tried (its parent accepted) and accepted. With --passes, each variant's
passes timed one by one during its runs (a clock read around each call): the target's median ms
by width, the drafter's by tokens fed, and its drafting time outside drafter passes per pass.
Usage:
    .venv/bin/python scripts/mixed_tree_variants.py [--tasks summarization,rag] [--humaneval 3]
        [--skip 1] [--repeats 2] [--max-new-tokens 128] [--variants default,sd-cost] [--passes]
"""
import argparse
import statistics
import time
from collections import defaultdict

from specdec import load, speculative_generate
from specdec.bench.datasets import load_prompts
from specdec.drafters import MixedDrafter
from specdec.schedules import TreeCost, make_schedule, tried_nodes

GAMMA_MAX = 20  # the bench's --gamma-max for trees-7: the trees' depth bound, sd-cost's longest draft


class CountingMixed(MixedDrafter):
    """The default tree, counting its nodes by kind as verification leaves them."""

    def __init__(self, drafter):
        super().__init__(drafter)
        self.counts = {kind: [0, 0, 0] for kind in ("chain", "side", "lookup")}  # proposed, tried, accepted

    def keep_path(self, start, path):
        q, parents, lookup = self._q, self._parents, self.lookup._proposed
        on_path, chain = set(path), 0
        while chain < len(parents) and parents[chain] == chain - 1 and q[chain] is not None:
            chain += 1  # the main chain: nodes 0..D-1, each the first child of the one before
        tried = {i for i, _ in tried_nodes(parents, path)}
        for i in range(len(parents)):
            kind = "chain" if i < chain else "side" if q[i] is not None else "lookup" if i in lookup else None
            if kind:
                counts = self.counts[kind]
                counts[0] += 1
                counts[1] += i in tried
                counts[2] += i in on_path
        super().keep_path(start, path)


class PassClock:
    """Times every `forward` of a model, by the number of tokens fed, for the variant named in
    `variant` (None: passes not counted)."""

    def __init__(self, model):
        self.variant, self.seconds = None, defaultdict(list)  # (variant, tokens fed) -> seconds of each pass
        forward = model.forward

        def timed(ids, *args, **kwargs):
            began = time.perf_counter()
            out = forward(ids, *args, **kwargs)
            if self.variant is not None:
                self.seconds[self.variant, len(ids)].append(time.perf_counter() - began)
            return out
        model.forward = timed

    def medians(self, variant: str, most: int = 32, least: int = 3) -> str:
        """'tokens: count x median ms' for each number of tokens fed with at least `least` passes."""
        return ", ".join(f"{k}: {len(v)}x{1000 * statistics.median(v):.0f}"
                         for (name, k), v in sorted(self.seconds.items()) if name == variant and k <= most and len(v) >= least)

    def total(self, variant: str, most: int = 32) -> tuple[float, int]:
        """Seconds and count of `variant`'s passes of at most `most` tokens (by default: not the
        prompt pass)."""
        passes = [t for (name, k), v in self.seconds.items() if name == variant and k <= most for t in v]
        return sum(passes), len(passes)


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
    parser.add_argument("--passes", action="store_true", help="time each pass, by width (see above)")
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
    drafting = {name: 0.0 for name in names}  # the drafter's share of the wall clock (passes and the rest)
    clocks = (PassClock(target), PassClock(drafter)) if args.passes else ()
    runs = 0
    nodes = {kind: [0, 0, 0] for kind in ("chain", "side", "lookup")}
    for p in prompts:
        ids = target.encode(p.text, chat=p.dataset == "spec-bench")
        reference, last = None, None
        for repeat in range(args.repeats):
            runs += 1
            for name in (names if runs % 2 else names[::-1]):
                drafts, options = VARIANTS[name](drafter)
                for clock in clocks:
                    clock.variant = name
                result = speculative_generate(ids, target, drafts, max_new_tokens=args.max_new_tokens, seed=0,
                                              **options)
                for clock in clocks:
                    clock.variant = None
                reference = reference or result.tokens
                assert result.tokens == reference, (p.task, name)
                s = result.stats
                seconds[name].append(s.wall_seconds)
                drafting[name] += s.drafter_seconds
                print(f"{p.task} ({len(ids)} tokens) #{repeat + 1} {name}: {s.wall_seconds:.2f} s, "
                      f"{s.target_forwards} target passes, {sum(s.drafter_passes_per_step)} drafter passes", flush=True)
                if name == "default":
                    last = drafts
        if last is not None:
            print(f"{p.task}: calibration (q from, q to, tried, accepted):")
            for low, high, tries, hits in last.policy.calibrated.table():
                if tries:
                    print(f"  {low:.2f}-{high:.2f}: {hits}/{tries}")
        if "default" in names:
            counting = CountingMixed(drafter)
            speculative_generate(ids, target, counting, gamma=GAMMA_MAX, max_new_tokens=args.max_new_tokens, seed=0)
            for kind, total in nodes.items():
                total[:] = [a + b for a, b in zip(total, counting.counts[kind])]
    if "default" in names:
        print("default's nodes by kind, all prompts (proposed, tried, accepted): " +
              ", ".join(f"{kind} {a}/{b}/{c}" for kind, (a, b, c) in nodes.items()))
    base = seconds.get("sd-cost")
    for name, times in seconds.items():
        against = "" if base is None else \
            f", per run {statistics.geometric_mean([b / t for b, t in zip(base, times)]):.3f}x sd-cost " \
            f"(faster on {sum(t < b for b, t in zip(base, times))} of {len(times)})"
        print(f"{name}: {sum(times):.2f} s in all{against}")
    for clock, role in zip(clocks, ("target passes, ms by width", "drafter passes, ms by tokens fed")):
        for name in names:
            print(f"{name}, {role}: {clock.medians(name)}")
    if clocks:
        for name in names:
            passed, count = clocks[1].total(name, most=10 ** 9)
            print(f"{name}: drafting outside drafter passes {1000 * (drafting[name] - passed) / max(count, 1):.2f} ms "
                  f"per drafter pass ({count} passes)")


if __name__ == "__main__":
    main()
