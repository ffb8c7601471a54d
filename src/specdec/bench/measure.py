"""The theory checked against measurement (Leviathan et al., Table 4): α, c, verification cost,
and predicted vs measured speedup over a sweep of γ, on one target/drafter pair.

Two predictions per γ: the paper's, (1 − α^(γ+1)) / ((1 − α)(γc + 1)), which assumes iid
acceptance and a verification pass that costs one target pass; and the same expected tokens
over γc + v(γ), with v(γ) the measured cost of a (γ+1)-token pass relative to a 1-token one.
A third projects the measured tokens per step onto a machine where wide passes are nearly free
(`theory.flat_verification`: 16 drafted tokens cost 1.2 passes), keeping this machine's c; for
trees the same, with the tree's depth as its drafter passes.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..backends import Backend
from ..errors import SpecdecError
from ..decoding.loop import autoregressive_generate, speculative_generate
from ..core.samplers import Sampler
from ..backends.text import check_pair
from ..sizing.theory import (acceptance_beta, coupled_acceptance, expected_tokens, flat_verification, lenient_first_token_law,
                      oracle_walltime_improvement, rule_of_thumb_speedup, step_speedup, total_variation, trace_speedup,
                      walltime_improvement)
from .forward_cost import forward_ms


@dataclass
class GammaRow:
    gamma: int
    expected_tokens: float  # per target pass, iid theory
    measured_tokens: float  # per target pass (drafting steps only)
    verification_cost: float  # v(γ): (γ+1)-token target pass / 1-token pass
    predicted_iid: float  # the paper's walltime factor
    predicted_measured_cost: float  # expected tokens / (γc + v(γ))
    measured: float  # AR wall time / SD wall time, summed over the prompts
    acceptance_rate: float  # accepted / drafted in this γ's runs (not α: drafts after a rejection count)
    predicted_flat: float  # measured tokens / (γc + flat_verification(γ)): where wide passes are nearly free
    alpha_in_runs: float | None = None  # α in this γ's runs: mean Σ min(p, q) where the loop judged (GenerationStats)
    rule_of_thumb: float = 0.0  # the tutorials' (1 + γα)/(1 + γc), which ignores that a rejection ends acceptance
    trace_speedup: float = 0.0  # fixed γ along the acceptance traces (`oracle_rows`), iid cost γc + 1


RANKS = 8  # per-rank acceptance is measured for the drafter's 8 best tokens


def measure_alpha(target: Backend, drafter: Backend, prompt: list[int], generated: list[int],
                  sampler: Sampler, lenience: float = 1.0,
                  divergence: list[float] | None = None) -> tuple[list[float], torch.Tensor, list[float]]:
    """β = Σ min(p, q) at each position of the target-generated continuation (cache-free passes),
    p(x_r) [n, RANKS] of the drafter's rank-r token x_r there (with deterministic siblings, top-k
    children, the rank-r child is the accepted one with probability exactly p(x_r)), and a seed's
    coupled acceptance there (`theory.coupled_acceptance`; under greedy, β itself). With lenience
    l < 1, β is Σ min(q, p/l), and `divergence` receives at each position TV(p, the law of the
    first token a lenient step emits there) (`theory.lenient_first_token_law`)."""
    ids = prompt + generated
    n = len(generated)
    p = sampler.probs(target.forward(ids[:-1], None, n))  # [n, V]: the distributions each token came from
    drafter_logits = drafter.forward(ids[:-1], None, n)[:, :p.shape[-1]]
    q = sampler.probs(drafter_logits)
    ranked = drafter_logits.topk(RANKS, dim=-1).indices
    beta = acceptance_beta(p, q, lenience)
    if divergence is not None:
        divergence += total_variation(p, lenient_first_token_law(p, q, lenience)).tolist()
    coupled = beta if sampler.is_greedy else coupled_acceptance(p, q)
    return beta.tolist(), p.gather(-1, ranked), coupled.tolist()


def oracle_rows(traces: list[list[float]], c: float, gammas: list[int], greedy: bool, draws: int = 64,
                seed: int = 0) -> dict:
    """The oracle-γ bound (Leviathan et al. §3.5) against fixed γ, on the measured acceptance traces.

    traces: per prompt, β at each position of the target's own continuation (`measure_alpha`).
    A trace of passes says, for each position t, whether the drafter's token there would be
    accepted given the text before it: greedy, β_t itself (1 where the argmaxes agree, else 0);
    sampled, a draw with probability β_t (the standard rule's acceptance chance there), `draws`
    traces per prompt, seeded. Along a trace (`theory.trace_speedup`) a fixed γ drafts γ and keeps
    the run of passes up to γ, cost γc + 1; the oracle drafts exactly the run, cost kc + 1: no draft
    wasted. -> {"tokens", "speedup"} of the oracle, {γ: speedup} fixed, the best fixed γ, and the
    iid closed form 1 / (1 − α + αc) at the traces' α."""
    g = torch.Generator().manual_seed(seed)
    runs = []
    for beta in traces:
        if greedy:
            runs.append([b > 0.5 for b in beta])
        else:
            chances = torch.tensor(beta, dtype=torch.float64)
            runs += (torch.rand(draws, len(beta), generator=g, dtype=torch.float64) < chances).tolist()

    def pooled(gamma: int | None) -> tuple[float, float]:
        # every trace's steps, tokens and cost added up: the rate a long run of them makes
        steps = tokens = cost = 0.0
        for run in runs:
            per_step, speedup = trace_speedup(run, c, gamma)
            if per_step:
                steps, tokens, cost = steps + len(run) / per_step, tokens + len(run), cost + len(run) / speedup
        return (tokens / steps, tokens / cost) if steps else (0.0, 0.0)

    tokens, speedup = pooled(None)
    fixed = {gamma: pooled(gamma)[1] for gamma in gammas}
    best = max(fixed, key=fixed.get) if fixed else None
    alpha = statistics.fmean(b for beta in traces for b in beta) if any(traces) else 0.0
    return {"tokens": tokens, "speedup": speedup, "fixed": fixed, "best_gamma": best,
            "best_fixed": fixed[best] if best is not None else 0.0, "iid": oracle_walltime_improvement(alpha, c)}


def tree_rows(target: Backend, drafter: Backend, prompts: list[list[int]], acceptance: list[float],
              sizes: list[int], max_new_tokens: int, sampler: Sampler, seed: int) -> list[dict]:
    """For each tree size: the tokens per step that `theory.expected_tree_tokens` predicts for the
    best tree of that size (Sequoia's shape under the measured per-rank acceptance, depth <= 8),
    and the tokens per step measured running that shape (Sequoia drafter, acceptance pinned)."""
    from ..drafters.sequoia import SequoiaDrafter, sequoia_shape
    from ..sizing.schedules import TreeCost
    from ..sizing.theory import expected_tree_tokens
    from ..core.trees import depths

    rows = []
    for size in sizes:
        shape = sequoia_shape(acceptance, size, 8)
        parents = [p for p, _ in shape]
        predicted = expected_tree_tokens(parents, [r for _, r in shape], acceptance)
        steps = tokens = 0
        for i, ids in enumerate(prompts):
            # pinned: huge prior weight keeps the measured vector; free costs pick the largest shape
            tree = SequoiaDrafter(drafter, acceptance=acceptance, prior_weight=1e9, prior_costs=(0.0, 0.0, 1.0),
                                  policy=TreeCost(max_nodes=size, threshold=1e-6, node_threshold=1e-6, warmup=10**9))
            result = speculative_generate(ids, target, tree, gamma=8, sampler=sampler,
                                          max_new_tokens=max_new_tokens, seed=seed + i)
            steps += len(result.stats.accepted_per_step)
            tokens += sum(result.stats.accepted_per_step) + len(result.stats.accepted_per_step)
        rows.append({"nodes": size, "shape_nodes": len(shape), "depth": max(depths(parents), default=0),
                     "predicted_tokens": predicted, "measured_tokens": tokens / steps if steps else 0.0})
    return rows


def flat_projection(acceptance: list[float], c: float, max_nodes: int = 64, max_depth: int = 20,
                    at16: float = 1.2) -> dict:
    """The best chain and the best tree on a machine where 16 drafted tokens cost `at16` one-token
    passes (`theory.flat_verification`), from the positional model: tokens per step
    1 + E[accepted] under the per-rank `acceptance` (Sequoia's dynamic programme, every size up to
    `max_nodes` and depth limit up to `max_depth`), cost d·c + v(n) for a tree of n nodes and
    depth limit d (one drafter pass per level); a chain is the tree of rank-0 children only."""
    from ..drafters.sequoia import _ShapeTables

    tables = _ShapeTables(acceptance, max_nodes, max_depth)
    chain = max((step_speedup(expected_tokens(acceptance[0], g), g, c, flat_verification(g, at16)), g)
                for g in range(1, max_depth + 1))
    tree = (0.0, 0, 0, 0.0)
    for depth in range(1, tables.max_depth + 1):
        for nodes in range(1, max_nodes + 1):
            value = tables.expected(nodes, depth)
            if value == float("-inf"):
                continue
            speedup = step_speedup(1 + value, depth, c, flat_verification(nodes, at16))
            if speedup > tree[0]:
                tree = (speedup, nodes, depth, 1 + value)
    return {"c": c, "chain_speedup": chain[0], "chain_gamma": chain[1],
            "chain_tokens": expected_tokens(acceptance[0], chain[1]),
            "tree_speedup": tree[0], "tree_nodes": tree[1], "tree_depth": tree[2], "tree_tokens": tree[3]}


def check_measure_options(lenience: float, tree_sizes: list[int], tree_nodes: str) -> None:
    """`measure`'s --lenience and --tree-nodes (as `tree_sizes`), checked before any model loads
    (a SpecdecError naming the option)."""
    if tree_sizes and min(tree_sizes) < 1:
        raise SpecdecError(f"--tree-nodes must be integers >= 1, got {tree_nodes!r}")
    if not 0 < lenience <= 1:
        raise SpecdecError(f"--lenience must be in (0, 1] (1 = exact), got {lenience}")
    if lenience < 1 and tree_sizes:
        raise SpecdecError("--lenience applies to chains; trees (--tree-nodes) are verified exactly")


def run_measure(target: Backend, drafter: Backend, prompts: list[list[int]], gammas: list[int],
                max_new_tokens: int, sampler: Sampler, seed: int = 0, console: Console | None = None,
                tree_sizes: list[int] | None = None, lenience: float = 1.0) -> dict:
    """Measure α, c and v(γ), then time AR and SD at each γ on every prompt (interleaved per prompt);
    with `tree_sizes`, also the per-rank acceptance and predicted vs measured tokens per step of
    trees of those sizes. lenience l < 1: every speculative run accepts leniently (LOSSY under
    sampling), α is the lenient Σ min(q, p/l), and the result's `lenience_tv` is the mean TV
    between p and the first emitted token's law over the measured positions."""
    console = console or Console(stderr=True)
    check_pair(target, drafter)
    target_ms = forward_ms(target, 1)
    drafter_ms = forward_ms(drafter, 1)
    c = drafter_ms / target_ms
    verification = {g: forward_ms(target, g + 1) / target_ms for g in gammas}

    runs = {"ar": [], **{g: [] for g in gammas}}
    betas: list[float] = []
    traces: list[list[float]] = []  # β per prompt, in order along its continuation (`oracle_rows`)
    coupled: list[float] = []
    rank_p: list[torch.Tensor] = []
    divergence: list[float] = []
    autoregressive_generate(prompts[0][:16], target, sampler, 4, seed=seed)  # warm-up
    speculative_generate(prompts[0][:16], target, drafter, gamma=2, sampler=sampler, max_new_tokens=4, seed=seed)
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=console) as progress:
        bar = progress.add_task("measure", total=len(prompts) * (len(gammas) + 2))
        for i, ids in enumerate(prompts):
            progress.update(bar, description=f"prompt {i + 1}/{len(prompts)}: α")
            ar = autoregressive_generate(ids, target, sampler, max_new_tokens, seed=seed + i, seed_rule="stream")
            if ar.tokens:
                beta, ranked, agree = measure_alpha(target, drafter, ids, ar.tokens, sampler, lenience, divergence)
                betas += beta
                traces.append(beta)
                coupled += agree
                rank_p.append(ranked)
            progress.advance(bar)
            order = ["ar", *gammas]
            order = order[i % len(order):] + order[:i % len(order)]
            for g in order:
                progress.update(bar, description=f"prompt {i + 1}/{len(prompts)}: " + ("ar" if g == "ar" else f"γ={g}"))
                # the standard rule, whose α the theory takes (a seed's coupled draws accept less)
                if g == "ar":
                    result = autoregressive_generate(ids, target, sampler, max_new_tokens, seed=seed + i,
                                                     seed_rule="stream")
                else:
                    result = speculative_generate(ids, target, drafter, gamma=g, sampler=sampler,
                                                  max_new_tokens=max_new_tokens, seed=seed + i, seed_rule="stream",
                                                  lenience=lenience)
                runs[g].append(result.stats)
                progress.advance(bar)
                if not console.is_terminal:  # a log file gets no live bar: one line per generation
                    console.print(f"prompt {i}: {'ar' if g == 'ar' else f'γ={g}'} {result.stats.tokens_per_second:.2f} "
                                  f"tok/s", highlight=False)

    alpha = statistics.fmean(betas)
    ar_seconds = sum(s.wall_seconds for s in runs["ar"])
    oracle = oracle_rows(traces, c, gammas, sampler.is_greedy, seed=seed)
    rows = []
    for g in gammas:
        stats = runs[g]
        drafted = sum(s.drafted for s in stats)
        judged = sum(s.beta_positions for s in stats)
        steps = sum(len(s.accepted_per_step) for s in stats)
        tokens = (sum(s.accepted for s in stats) + steps) / steps if steps else 0.0
        rows.append(GammaRow(
            gamma=g, expected_tokens=expected_tokens(alpha, g),
            measured_tokens=tokens,
            verification_cost=verification[g], predicted_iid=walltime_improvement(alpha, g, c),
            predicted_measured_cost=expected_tokens(alpha, g) / (g * c + verification[g]),
            measured=ar_seconds / sum(s.wall_seconds for s in stats),
            acceptance_rate=sum(s.accepted for s in stats) / drafted if drafted else 0.0,
            predicted_flat=step_speedup(max(1.0, tokens), g, c, flat_verification(g)),
            alpha_in_runs=sum(s.beta_sum for s in stats) / judged if judged else None,
            rule_of_thumb=rule_of_thumb_speedup(alpha, g, c), trace_speedup=oracle["fixed"][g]))
    acceptance = torch.cat(rank_p).mean(0).tolist() if rank_p else [0.0] * RANKS
    trees = tree_rows(target, drafter, prompts, acceptance, tree_sizes, max_new_tokens, sampler, seed) \
        if tree_sizes else []
    projections = [flat_projection(acceptance, cost) for cost in (c, 0.12, 0.05)] if tree_sizes else []
    for t in trees:  # the tree's verification pass here (tree mask), and both projections
        tokens, nodes = max(1.0, t["measured_tokens"]), t["shape_nodes"]
        t["verification_cost"] = forward_ms(target, nodes + 1, tree=True) / target_ms if nodes else 1.0
        t["predicted_here"] = step_speedup(tokens, t["depth"], c, t["verification_cost"])
        t["predicted_flat"] = step_speedup(tokens, t["depth"], c, flat_verification(nodes))
    # a seed's coupled draws: their agreement, and Daliri et al.'s bound (1 − TV)/(1 + TV) = β/(2 − β)
    return {"alpha": alpha, "alpha_coupled": statistics.fmean(coupled),
            "alpha_coupled_bound": statistics.fmean(b / (2 - b) for b in betas), "positions": len(betas), "c": c, "target_ms": target_ms, "drafter_ms": drafter_ms,
            "rows": [vars(r) for r in rows], "sampler": sampler.describe(), "prompts": len(prompts),
            "max_new_tokens": max_new_tokens, "target": target.name, "drafter": drafter.name,
            "rank_acceptance": acceptance, "trees": trees, "flat_projections": projections,
            "oracle": {k: v for k, v in oracle.items() if k != "fixed"},
            "lenience": lenience, "lenience_tv": statistics.fmean(divergence) if divergence else 0.0}


def measure_markdown(m: dict) -> str:
    lines = [f"- {m['target']} ← {m['drafter']}, {m['prompts']} prompts, {m['max_new_tokens']} new tokens, "
             f"{m['sampler']}",
             f"- α = {m['alpha']:.3f} (mean Σ min(p, q) over {m['positions']} positions of the target's own text)",
             *([f"- under a seed (coupled draws, docs/exactness.md#seeds): α = {m['alpha_coupled']:.3f} at the same "
                f"positions (bound (1 − TV)/(1 + TV): {m['alpha_coupled_bound']:.3f})"]
               if "alpha_coupled" in m and m["sampler"] != "greedy" else []),
             *([f"- lenience l = {m['lenience']:g} (LOSSY under sampling; α above is Σ min(q, p/l)): its cost, "
                f"TV(p, law of a step's first token) = {m['lenience_tv']:.4f}, the mean over the same positions "
                "(closed form, `theory.lenient_first_token_law`; 0 under greedy)"] if m.get("lenience", 1) < 1 else []),
             f"- c = {m['c']:.3f} (drafter pass {m['drafter_ms']:.0f} ms / target pass {m['target_ms']:.0f} ms)", "",
             "| γ | expected tokens / step (iid) | measured tokens / step | acceptance rate | "
             + ("exact α in the runs, Σ min(p, q)" if m.get("lenience", 1) < 1 else "α in the runs") + " | "
             "v(γ) = (γ+1)-token pass / 1-token | rule of thumb (1 + γα)/(1 + γc) | predicted speedup (paper, "
             "Theorem 3.8) | predicted with v(γ) | measured speedup | projected where wide passes are nearly free |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in m["rows"]:
        runs_alpha = "–" if r.get("alpha_in_runs") is None else f"{r['alpha_in_runs']:.3f}"
        lines.append(f"| {r['gamma']} | {r['expected_tokens']:.2f} | {r['measured_tokens']:.2f} | "
                     f"{r['acceptance_rate']:.1%} | {runs_alpha} | {r['verification_cost']:.2f} | "
                     f"{r['rule_of_thumb']:.2f}× | {r['predicted_iid']:.2f}× | "
                     f"{r['predicted_measured_cost']:.2f}× | {r['measured']:.2f}× | {r['predicted_flat']:.2f}× |")
    if m.get("oracle"):
        o = m["oracle"]
        lines += ["", f"- oracle γ (each step drafts exactly what will be accepted; Leviathan et al. §3.5) along "
                  f"the α traces: {o['tokens']:.2f} tokens / step, {o['speedup']:.2f}× at cost kc + 1 against "
                  f"{o['best_fixed']:.2f}× for the best fixed γ ({o['best_gamma']}) along the same traces; iid "
                  f"closed form 1 / (1 − α + αc) = {o['iid']:.2f}×",
                  "- the rule of thumb counts γα accepted tokens a step, as if a rejection did not end the "
                  "step's acceptance; Theorem 3.8 counts α + … + α^γ (docs/usage.md#measure-theory-forward-cost-profile)"]
    if m.get("trees"):
        ranks = ", ".join(f"{a:.3f}" for a in m["rank_acceptance"])
        lines += ["", f"- per-rank acceptance (p of the drafter's rank-r token, r = 1..{len(m['rank_acceptance'])}): "
                  f"{ranks}", "",
                  "| tree nodes | nodes in the best shape | depth | predicted tokens / step | measured tokens / step "
                  "| tree pass / 1-token pass | projected speedup here | projected where wide passes are nearly free |",
                  "|---|---|---|---|---|---|---|---|"]
        for t in m["trees"]:
            lines.append(f"| {t['nodes']} | {t['shape_nodes']} | {t['depth']} | {t['predicted_tokens']:.2f} | "
                         f"{t['measured_tokens']:.2f} | {t['verification_cost']:.2f} | {t['predicted_here']:.2f}× | "
                         f"{t['predicted_flat']:.2f}× |")
        lines += ["", "Projections: measured tokens per step over (drafter passes · c + verification cost); the "
                  "chain drafts γ passes, a tree one per level (its depth; a level's siblings share a pass). "
                  "\"Nearly free\": 16 drafted tokens cost 1.2 one-token passes (`theory.flat_verification`), "
                  "this machine's c kept."]
    if m.get("flat_projections"):
        lines += ["", "Best chain against best tree where wide passes are nearly free, from the per-rank "
                  "acceptance (positional model; trees up to 64 nodes, depth up to 20): at this machine's c, "
                  "and at the drafter costs a quantized drafter (0.12) or self-drafting heads (0.05) aim at.", "",
                  "| c | best chain | tokens / step | best tree | tokens / step | tree over chain |",
                  "|---|---|---|---|---|---|"]
        for p in m["flat_projections"]:
            lines.append(f"| {p['c']:.3f} | {p['chain_speedup']:.2f}× (γ = {p['chain_gamma']}) | "
                         f"{p['chain_tokens']:.2f} | {p['tree_speedup']:.2f}× ({p['tree_nodes']} nodes, depth "
                         f"{p['tree_depth']}) | {p['tree_tokens']:.2f} | "
                         f"{p['tree_speedup'] / p['chain_speedup']:.2f}× |")
    return "\n".join(lines) + "\n"


def measure_plot(m: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gammas = [r["gamma"] for r in m["rows"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(gammas, [r["predicted_iid"] for r in m["rows"]], "o--", label="predicted (paper: iid α, v = 1)")
    ax.plot(gammas, [r["predicted_measured_cost"] for r in m["rows"]], "s--", label="predicted with measured v(γ)")
    ax.plot(gammas, [r["measured"] for r in m["rows"]], "o-", linewidth=2, label="measured")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("γ (draft tokens per step)")
    ax.set_ylabel("speedup over autoregressive")
    ax.set_title(f"α = {m['alpha']:.2f}, c = {m['c']:.2f}: {m['target']} ← {m['drafter']}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
