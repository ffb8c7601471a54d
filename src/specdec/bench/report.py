"""Benchmark reports: a rich table, markdown for the docs, and a plot (matplotlib)."""

from __future__ import annotations

from rich.table import Table

from .runners import BASELINES, RUN_OPTIONS, SPEC_DEFAULTS


def _baselines(summary: dict) -> list[str]:
    """The baselines that ran: a column or a row each (none for those absent from the run)."""
    return [b for b in BASELINES if b in summary]


def _columns(summary: dict) -> list[str]:
    versus = [f"median speedup vs {b}" + (" (faster on)" if b in ("hf-assisted", "sd-cost", "llama-cpp") else "")
              for b in _baselines(summary)]
    return ["method", "median tok/s", "aggregate tok/s", *versus, "acceptance rate", "α", "tokens / target pass",
            "accepted / step", "tree nodes / step", "identical to ar"]


def _fmt(value, spec=".2f", suffix=""):
    return "–" if value is None else format(value, spec) + suffix


def _versus(s: dict, base: str) -> str:
    ratio = s.get(f"median_speedup_vs_{base}")
    if ratio is None:
        return "–"
    won, total = s[f"faster_than_{base}"]
    return f"{ratio:.2f}× ({won}/{total})"


def _cells(method: str, s: dict, baselines: list[str]) -> list[str]:
    identical = f"{s['identical_to_ar']}/{s['greedy_prompts']}" if "identical_to_ar" in s else \
        f"{s['identical_to_beam']}/{s['greedy_prompts']} (to beam)" if "identical_to_beam" in s else "–"
    if "identical_sampled_to_ar" in s:
        sampled = f"{s['identical_sampled_to_ar']}/{s['sampled_prompts']} seeded"
        identical = sampled if identical == "–" else f"{identical}, {sampled}"
    versus = [_versus(s, b) if b in ("hf-assisted", "sd-cost", "llama-cpp") else _fmt(s.get(f"median_speedup_vs_{b}"), ".2f", "×")
              for b in baselines]
    return [method, _fmt(s["median_tokens_per_second"]), _fmt(s["aggregate_tokens_per_second"]), *versus,
            _fmt(s["acceptance_rate"], ".1%"), _fmt(s.get("alpha"), ".3f"), _fmt(s["tokens_per_target_pass"]),
            _fmt(s.get("mean_accepted_per_step")), _fmt(s.get("mean_nodes_per_step"), ".1f"), identical]


def render_table(summary: dict, title: str | None = None) -> Table:
    table = Table(*_columns(summary), title=title)
    for m, s in summary.items():
        table.add_row(*_cells(m, s, _baselines(summary)))
    return table


def _paired_rows(summary: dict) -> list[list[str]]:
    """One row per (method, baseline): the median per-prompt ratio, its 95% bootstrap interval over
    prompts, on how many prompts the method was faster, the ratio of decoding rates after the first
    token, and the method's median time to first token."""
    rows = []
    for base in _baselines(summary):
        for m, s in summary.items():
            ratio = s.get(f"median_speedup_vs_{base}")
            if ratio is None:
                continue
            interval = s.get(f"speedup_vs_{base}_interval95")
            won, total = s[f"faster_than_{base}"]
            rows.append([m, base, f"{ratio:.2f}×", "–" if interval is None else f"{interval[0]:.2f}–{interval[1]:.2f}",
                         f"{won}/{total}", _fmt(s.get(f"median_decode_speedup_vs_{base}"), ".2f", "×"),
                         _fmt(s.get("median_first_token_seconds"), ".2f", " s")])
    return rows


PAIRED_COLUMNS = ("method", "vs", "median per-prompt speedup", "95% interval (bootstrap over prompts)", "faster on",
                  "decoding alone", "method's median time to first token")


def render_paired(summary: dict) -> Table:
    table = Table(*PAIRED_COLUMNS, title="paired speedups")
    for row in _paired_rows(summary):
        table.add_row(*row)
    return table


STRUCTURED_COLUMNS = ("method", "valid outputs", "truncated", "forced tokens", "forced / token", "masks / token",
                      "mask ms / token")


def _structured_rows(summary: dict) -> list[list[str]]:
    """One row per method that ran prompts with a schema: outputs valid against it, those cut off
    at the token limit, the tokens the grammar forced (drafted for free) and the masks' cost."""
    return [[m, f"{s['valid_outputs']}/{s['checked_outputs']}", str(s["truncated_outputs"]), str(s["forced_tokens"]),
             _fmt(s["forced_per_token"], ".1%"), _fmt(s["masks_per_token"]), _fmt(s["mask_ms_per_token"], ".3f")]
            for m, s in summary.items() if "valid_outputs" in s]


def render_structured(summary: dict) -> Table:
    table = Table(*STRUCTURED_COLUMNS, title="structured output (outputs checked against their schema)")
    for row in _structured_rows(summary):
        table.add_row(*row)
    return table


def _markdown_paired(rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(PAIRED_COLUMNS) + " |", "|" + "---|" * len(PAIRED_COLUMNS),
            *("| " + " | ".join(row) + " |" for row in rows)]


def _markdown_table(summary: dict) -> list[str]:
    columns = _columns(summary)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(_cells(m, s, _baselines(summary))) + " |" for m, s in summary.items()]


def _group_name(g: dict) -> str:
    where = g["dataset"] if g["task"] == g["dataset"] else f"{g['dataset']} / {g['task']}"
    return f"{where}, " + ("greedy" if g["temperature"] == 0 else f"temperature {g['temperature']:g}")


def _gamma_bounds(options: dict) -> str:
    """What each schedule's draft lengths were, read through `SpecConfig` as the runs read them."""
    from ..decoding.config import SpecConfig

    def bound(schedule: str) -> int:
        return SpecConfig("chain", schedule=schedule, gamma=options["gamma"],
                          gamma_max=options["gamma_max"]).effective_gamma_max()

    gamma = options["gamma"] or SpecConfig("chain").effective_gamma()
    return (f"γ = {gamma} (fixed), γ in [{options['gamma_min']}, {bound('heuristic')}] (heuristic), "
            f"[{options['gamma_min']}, {bound('egag')}] (egag), up to {bound('cost')} (cost, confidence)")


def render_markdown(result: dict) -> str:
    """The whole report: settings, the overall table, one table per group, histograms, mismatches."""
    info, summary = result["info"], result["summary"]
    st = info["settings"]
    options = {**SPEC_DEFAULTS, **{k: st[k] for k in RUN_OPTIONS if k in st}, **st.get("spec", {})}  # older runs: flat
    lines = [f"- datasets: {', '.join(info['datasets'])} ({info['prompts']} prompts"
             + (f", at most {info['limit']} per task" if info.get("limit") else "") + "); temperatures: "
             + ", ".join(f"{t:g}" for t in info["temperatures"]) + f" (0 = greedy); seed {info['seed']}"
             + (f"; {info['samples']} generations per method of each sampled prompt, summed"
                if info.get("samples", 1) > 1 and any(t > 0 for t in info["temperatures"]) else ""),
             f"- {st['max_new_tokens']} new tokens at most (EOS stops earlier); {_gamma_bounds(options)}, "
             f"confidence τ = {options['confidence']:g}, EGAG β = {options['egag_beta']:g}, n-gram n = {options['ngram_n']}",
             f"- target: {info['target']} ({info['target_dtype']}, {info['target_kernels']} linears); "
             f"drafter: {info['drafter']} ({info['drafter_dtype']}, {info['drafter_kernels']}"
             + (f", head over {info['drafter_vocab']} frequent ids" if info.get("drafter_vocab") else "") + ")",
             f"- machine: {info['machine']}"]
    if info.get("command"):
        lines.append(f"- command: `{info['command']}`")
    lines += ["", "### All prompts", "", *_markdown_table(summary)]
    paired = _paired_rows(summary)
    if paired:
        lines += ["", "### Paired speedups (all prompts)", "",
                  "Each method's tok/s over the baseline's on the same prompt; the interval resamples prompts "
                  "(a median over few prompts on a noisy machine is uncertain by a few percent). \"Decoding "
                  "alone\" leaves out the time to first token (the prompt pass): tokens after the first over "
                  "the time after it.", "",
                  *_markdown_paired(paired)]
    for g in result["groups"]:
        lines += ["", f"### {_group_name(g)}", "", *_markdown_table(g["summary"])]
        if any(s.get("prompts", 0) >= 3 for s in g["summary"].values()):  # fewer: no interval to show
            lines += ["", *_markdown_paired(_paired_rows(g["summary"]))]
    structured = _structured_rows(summary)
    if structured:
        lines += ["", "### Structured output (all prompts)", "",
                  "Every output decoded and checked against its prompt's JSON Schema (one cut off at the token "
                  "limit counts as invalid); the tokens the grammar forced, drafted for free and counted apart "
                  "from the drafter's; the masks computed per emitted token and the time inside them "
                  "(the matcher advanced over each draft, masks, rollback).", "",
                  "| " + " | ".join(STRUCTURED_COLUMNS) + " |", "|" + "---|" * len(STRUCTURED_COLUMNS),
                  *("| " + " | ".join(row) + " |" for row in structured)]
        invalid = {m: s["invalid_outputs"] for m, s in summary.items() if s.get("invalid_outputs")}
        if invalid:
            lines += [""] + [f"- {m}, {pid}: {problem}" for m, found in invalid.items() for pid, problem in found.items()]
    split = {m: s for m, s in summary.items() if "time_in_target" in s}
    if split:
        lines += ["", "### Where the time goes (our methods, all prompts)", "",
                  "Shares of the wall clock inside the target's passes (prompt pass included), inside the "
                  "drafter (drafting, rollback), and in the decoding loop itself (verification, sampling, "
                  "the target's cache rollback, the schedule, Python), and the loop's time per target pass.", "",
                  "| method | target passes | drafter | loop | loop ms / step |", "|---|---|---|---|---|"]
        lines += [f"| {m} | {s['time_in_target']:.1%} | {s['time_in_drafter']:.1%} | {s['time_in_loop']:.1%} | "
                  f"{_fmt(s['loop_ms_per_step'])} |" for m, s in split.items()]
    positions = {m: s for m, s in summary.items() if s.get("acceptance_by_position")}
    if positions:
        depth = max(len(s["acceptance_by_position"]) for s in positions.values())
        lines += ["", "### Acceptance by draft position (all prompts)", "",
                  "Of the drafts that reached position i, the share whose accepted prefix reached it; and the "
                  "drafter model's passes per emitted token (a parallel drafter proposes a draft in one).", "",
                  "| method | drafter passes / token | " + " | ".join(str(i + 1) for i in range(depth)) + " |",
                  "|---|---|" + "---|" * depth]
        for m, s in positions.items():
            shares = s["acceptance_by_position"] + [None] * (depth - len(s["acceptance_by_position"]))
            lines.append(f"| {m} | {_fmt(s.get('drafter_passes_per_token'))} | "
                         + " | ".join(_fmt(a, ".1%") for a in shares) + " |")
    lines += _markdown_projection(info, summary)
    hist = {m: s["accepted_histogram"] for m, s in summary.items() if s["accepted_histogram"]}
    if hist:
        top = max(int(k) for h in hist.values() for k in h)
        lines += ["", "### Accepted draft tokens per step (all prompts)", "",
                  "| method | " + " | ".join(str(k) for k in range(top + 1)) + " |", "|---|" + "---|" * (top + 1)]
        for m, h in hist.items():
            counts = {int(k): v for k, v in h.items()}
            lines.append(f"| {m} | " + " | ".join(str(counts.get(k, 0)) for k in range(top + 1)) + " |")
    lines.append("")
    mismatched = {m: s["mismatched_prompts"] for m, s in summary.items() if s.get("mismatched_prompts")}
    if mismatched:
        lines.append(f"- greedy outputs differing from their reference (ar; beam for beam-sd): {mismatched}")
        for m, s in summary.items():
            for i, d in s.get("divergences", {}).items():
                lines.append(f"  - {m}, {i}: first differs at new token {d['position']} (ar {d['reference_token']}, "
                             f"{m} {d['other_token']}); target's top-2 logit gap there: {d['top2_logit_gap']:.4f}")
    elif any("identical_to_ar" in s for s in summary.values()):
        lines.append("- every greedy output is token-identical to ar")
    mismatched = {m: s["mismatched_sampled_prompts"] for m, s in summary.items() if s.get("mismatched_sampled_prompts")}
    if mismatched:
        lines.append(f"- seeded sampled outputs differing from ar's: {mismatched}")
    elif any("identical_sampled_to_ar" in s for s in summary.values()):
        lines.append("- every seeded sampled output of our exact methods is token-identical to ar's")
    methods = list(summary)
    lines += ["", "### Per prompt (tok/s)", "", "| prompt | " + " | ".join(methods) + " |",
              "|---|" + "---|" * len(methods)]
    by_prompt: dict[str, dict] = {}
    for r in result["records"]:
        by_prompt.setdefault(r["prompt_id"], {})[r["method"]] = r["tokens_per_second"]
    for pid, row in by_prompt.items():
        lines.append(f"| {pid} | " + " | ".join(_fmt(row.get(m)) for m in methods) + " |")
    return "\n".join(lines) + "\n"


def _markdown_projection(info: dict, summary: dict) -> list[str]:
    """Tokens per target pass against sd-cost's, and the speedup each of our methods would have where
    wide passes are nearly free (`schedules.AssumedCosts.projected_speedup`), beside the one measured here."""
    projected = {m: s for m, s in summary.items() if "projected_speedup" in s}
    assumed = info.get("assumed_costs")
    if not projected or not assumed:
        return []
    chain = summary.get("sd-cost", {}).get("tokens_per_target_pass")
    lines = ["", "### Tokens per target pass, and the speedup projected where wide passes are nearly free", "",
             f"Projected: each run's own steps (tokens, target pass widths, drafter passes) priced on a machine where "
             f"scoring 16 drafted tokens costs {assumed['at16']:.2f} one-token passes and a drafter pass "
             f"{assumed['drafter']:.3f} of one (this pair's c, measured here); prompt passes left out; median per "
             f"prompt. The `-flat` methods size their drafts for that machine, the others for this one.", "",
             "| method | tokens / target pass | × sd-cost's | tree nodes / step | measured vs ar here | projected vs ar |",
             "|---|---|---|---|---|---|"]
    for m, s in projected.items():
        tpf = s.get("tokens_per_target_pass")
        ratio = tpf / chain if tpf and chain else None
        here = 1.0 if m == "ar" else s.get("median_speedup_vs_ar")
        lines.append(f"| {m} | {_fmt(tpf)} | {_fmt(ratio, '.2f', '×')} | {_fmt(s.get('mean_nodes_per_step'), '.1f')} | "
                     f"{_fmt(here, '.2f', '×')} | {s['projected_speedup']:.2f}× |")
    return lines


def render_plot(result: dict, path: str) -> None:
    """Grouped bars: median tokens/s of each method, per (dataset, task, temperature) group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = result["groups"]
    if len(groups) > 1:
        groups = [{"dataset": "all", "task": "all", "temperature": None, "summary": result["summary"]}] + groups
    methods = list(result["summary"])
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(groups) * max(1, len(methods) / 4)), 5.0))
    for j, m in enumerate(methods):
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(groups))]
        ys = [g["summary"].get(m, {}).get("median_tokens_per_second", 0.0) for g in groups]
        ax.bar(xs, ys, width, label=m)
    labels = ["all prompts" if g["temperature"] is None else _group_name(g).replace(", ", "\n").replace(" / ", "\n")
              for g in groups]
    ax.set_xticks(range(len(groups)), labels, fontsize=8)
    ax.set_ylabel("median tokens / s")
    info = result["info"]
    ax.set_title(f"{info['target']} ← {info['drafter']}: {info['settings']['max_new_tokens']} new tokens", fontsize=10)
    ax.legend(fontsize=8, ncol=min(len(methods), 6), loc="upper center", bbox_to_anchor=(0.5, -0.14))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
