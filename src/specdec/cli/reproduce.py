"""`specdec reproduce alpha | bigram | coverage | steps`: the papers' tables on our models
(Leviathan et al. 2023 Table 3, §3.6 and Fig. 1; SpecInfer's coverage figure), written as
markdown and raw JSON (docs/reproductions.md says what each shows)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markdown import Markdown

from ..models import catalogue as registry
from ..errors import SpecdecError
from .common import DRAFTER_DTYPE_HELP, TARGET_DTYPE_HELP, _csv, _fail, _load, app, err

reproduce_app = typer.Typer(no_args_is_help=True, help="The papers' tables on our models: Leviathan et al. 2023 "
                            "(Table 3's α, §3.6's bigram drafter, Fig. 1's steps) and SpecInfer's top-k coverage.")
app.add_typer(reproduce_app, name="reproduce")

OUT_HELP = "Folder for the markdown and the raw JSON (continuations are kept there and reused)."
TOKENS_HELP = "Target tokens to score per temperature (Leviathan et al. used about 10,000)."
CORPUS_HELP = ("Text or JSONL file ('text', 'prompt' or 'turns' per row) the unigram and bigram tables count "
               "(default: Python's standard library, disjoint from the Spec-Bench prompts).")


def _command() -> str:
    return "specdec " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["reproduce"] else "specdec reproduce …"


def _check_sizes(tokens: int, max_new_tokens: int) -> None:
    if tokens < 1:
        raise SpecdecError(f"--tokens must be >= 1, got {tokens}")
    if max_new_tokens < 1:
        raise SpecdecError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")


def _continuations(target_model, sampler, label: str, tokens: int, max_new_tokens: int, seed: int, out: Path):
    """The target's continuations under `sampler`, Spec-Bench's prompts in turn until they hold
    `tokens` tokens: read from `out` where an earlier run wrote such ones (same target, sampler,
    seed and length, at least as many tokens), else generated and written there."""
    from ..bench.leviathan import Continuations, generate_continuations, spec_bench_prompts

    chosen = spec_bench_prompts()
    path = out / f"continuations-{label}.json"
    if path.is_file():
        kept = Continuations.load(path)
        if (kept.target, kept.sampler, kept.seed, kept.max_new_tokens) == \
                (target_model.name, sampler.describe(), seed, max_new_tokens) and kept.total >= tokens:
            err.print(f"[dim]continuations ({sampler.describe()}): reusing {path}[/]", highlight=False)
            return kept
    ids = [target_model.encode(text, chat=True) for _, text in chosen]
    made = generate_continuations(target_model, ids, sampler, max_new_tokens, seed, [task for task, _ in chosen],
                                  console=err, until=tokens)
    if made.total < tokens:
        err.print(f"[yellow]all {len(chosen)} prompts' continuations hold {made.total} tokens, fewer than --tokens "
                  f"{tokens}; raise --max-new-tokens[/]", highlight=False)
    made.save(path)
    return made


def _write(out: Path, name: str, markdown: str, raw: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(f"command: `{_command()}`\n\n" + markdown)
    (out / f"{name}.json").write_text(json.dumps(raw, indent=1) + "\n")
    Console().print(Markdown(markdown))
    err.print(f"[dim]wrote {out / name}.md and {out / name}.json[/]", highlight=False)


def _scorers(names: list[str], target_model, ctx, device: str, drafter_dtype: str) -> tuple[dict, dict]:
    """(scorers by drafter name, {left-out drafter: why}) for `names`: registry entries
    (`bench.reproduce.DRAFTERS`) and catalogue models (scored where the vocabulary is the target's)."""
    from ..bench.leviathan import DRAFTERS, ModelScorer
    from ..backends.text import check_pair

    scorers, left_out = {}, {}
    for name in names:
        if name in DRAFTERS:
            scorers[name] = DRAFTERS[name].make(ctx)
            continue
        model = _load(name, drafter_dtype, device, "drafter")
        try:
            check_pair(target_model, model)
        except SpecdecError as why:
            left_out[name] = f"another vocabulary ({why})"
            continue
        scorers[name] = ModelScorer(model)
    return scorers, left_out


def _drafter_names(drafters: Optional[str], target: str) -> list[str]:
    from ..bench.leviathan import DRAFTERS, catalogue_drafters

    names = _csv(drafters) if drafters else catalogue_drafters(target) + list(DRAFTERS)
    unknown = [n for n in names if n not in DRAFTERS and n not in registry.MODELS]
    if unknown:
        raise SpecdecError(f"unknown drafter {', '.join(unknown)}; choose from {', '.join(registry.MODELS)}, "
                           f"{', '.join(DRAFTERS)}")
    if target in names:
        raise SpecdecError(f"{target} is the target; a drafter must be another model")
    return names


def _table(target_model, corpus: Optional[str]):
    from ..drafters.bigram import corpus_table

    made = []

    def table():  # counted at the first use, once
        if not made:
            with err.status("counting the unigram and bigram corpus…"):
                made.append(corpus_table(target_model.tokenizer, target_model.vocab_size, corpus))
        return made[0]
    return table


def _alpha(target: str, names: list[str], tokens: int, max_new_tokens: int, seed: int, out: Path,
           corpus: Optional[str], dtype: str, drafter_dtype: str, device: str) -> dict:
    from ..bench.leviathan import Context, score
    from ..core.samplers import Sampler

    target_model = _load(target, dtype, device, "target", exact_rows=True)  # the engine: row-exact passes
    ctx = Context(target_model, lambda name: _load(name, drafter_dtype, device, "drafter"),
                  _table(target_model, corpus), seed)
    scorers, left_out = _scorers(names, target_model, ctx, device, drafter_dtype)
    if not scorers:
        raise SpecdecError("no drafter left to score: " + "; ".join(f"{n}: {why}" for n, why in left_out.items()))
    rows: dict[str, dict] = {name: {} for name in scorers}
    positions, prompts = {}, 0
    for temperature in (0, 1):
        sampler = Sampler(temperature=float(temperature))
        made = _continuations(target_model, sampler, f"t{temperature}", tokens, max_new_tokens, seed, out)
        prompts = len(made.prompts)
        for name, row in score(made, target_model, scorers, sampler, err).items():
            rows[name][str(temperature)] = row
            positions[str(temperature)] = row["positions"]
    return {"target": target_model.name, "prompts": prompts, "positions": positions, "drafters": rows,
            "left_out": left_out, "corpus": corpus or "Python's standard library", "seed": seed,
            "max_new_tokens": max_new_tokens, "command": _command()}


@reproduce_app.command("alpha")
def alpha_command(
    target: str = typer.Option(registry.DEFAULT_TARGET),
    drafters: Optional[str] = typer.Option(None, help="Comma-separated drafters (default: every catalogue model "
                                           "but the target, self-skip, early-exit, lookup, ngram, suffix, unigram, bigram)."),
    tokens: int = typer.Option(10_000, help=TOKENS_HELP),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", help="Tokens per continuation at most."),
    seed: int = typer.Option(0, help="Seeds the T = 1 continuations (prompt i: seed + i)."),
    corpus: Optional[str] = typer.Option(None, help=CORPUS_HELP),
    out: Path = typer.Option(Path("docs/reproductions"), help=OUT_HELP),
    dtype: str = typer.Option("auto", "--dtype", help=TARGET_DTYPE_HELP),
    drafter_dtype: str = typer.Option("auto", help=DRAFTER_DTYPE_HELP),
    device: str = typer.Option("auto", help="auto, cpu or cuda."),
):
    """Leviathan et al. Table 3: α of every drafter against the target, at T = 0 and T = 1."""
    from ..bench.leviathan import alpha_markdown

    try:
        _check_sizes(tokens, max_new_tokens)
        result = _alpha(target, _drafter_names(drafters, target), tokens, max_new_tokens, seed, out, corpus, dtype,
                        drafter_dtype, device)
    except SpecdecError as exc:
        _fail(str(exc))
    _write(out, "alpha", alpha_markdown(result), result)


@reproduce_app.command("bigram")
def bigram_command(
    target: str = typer.Option(registry.DEFAULT_TARGET),
    tokens: int = typer.Option(10_000, help=TOKENS_HELP),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", help="Tokens per continuation at most."),
    seed: int = typer.Option(0, help="Seeds the T = 1 continuations (prompt i: seed + i)."),
    corpus: Optional[str] = typer.Option(None, help=CORPUS_HELP),
    out: Path = typer.Option(Path("docs/reproductions"), help=OUT_HELP),
    dtype: str = typer.Option("auto", "--dtype", help=TARGET_DTYPE_HELP),
    device: str = typer.Option("auto", help="auto, cpu or cuda."),
):
    """Leviathan et al. §3.6: the bigram drafter's α (and the unigram's), and the command that
    times its speed-up at γ = 3."""
    from ..bench.leviathan import alpha_markdown

    try:
        _check_sizes(tokens, max_new_tokens)
        result = _alpha(target, ["unigram", "bigram"], tokens, max_new_tokens, seed, out, corpus, dtype, "auto",
                        device)
    except SpecdecError as exc:
        _fail(str(exc))
    timing = (f"specdec bench --target {target} --dataset spec-bench --methods ar,bigram-fixed --gamma 3 "
              "--temperature 0,1")
    result["speedup_command"] = timing
    _write(out, "bigram", alpha_markdown(result) + f"\nSpeed-up at γ = 3 (c ≈ 0): `{timing}`\n", result)


@reproduce_app.command("coverage")
def coverage_command(
    target: str = typer.Option(registry.DEFAULT_TARGET),
    drafters: str = typer.Option(f"{registry.DEFAULT_DRAFTER},self-skip",
                                 help="Comma-separated drafter models (catalogue names, or self-skip)."),
    tokens: int = typer.Option(10_000, help=TOKENS_HELP),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", help="Tokens per continuation at most."),
    top_p: float = typer.Option(0.9, "--top-p", help="The nucleus continuations' top-p (at T = 1)."),
    seed: int = typer.Option(0, help="Seeds the nucleus continuations (prompt i: seed + i)."),
    out: Path = typer.Option(Path("docs/reproductions"), help=OUT_HELP),
    dtype: str = typer.Option("auto", "--dtype", help=TARGET_DTYPE_HELP),
    drafter_dtype: str = typer.Option("auto", help=DRAFTER_DTYPE_HELP),
    device: str = typer.Option("auto", help="auto, cpu or cuda."),
):
    """SpecInfer's coverage: the share of the target's tokens in a drafter's top-k, k = 1..5."""
    from ..bench.coverage import coverage, coverage_markdown
    from ..core.samplers import Sampler
    from ..backends.text import check_pair

    try:
        _check_sizes(tokens, max_new_tokens)
        names = _csv(drafters)
        unknown = [n for n in names if n != "self-skip" and n not in registry.MODELS]
        if not names or unknown:
            raise SpecdecError(f"--drafters takes catalogue models or self-skip, got {drafters!r}")
        nucleus = Sampler(temperature=1.0, top_p=top_p)
        target_model = _load(target, dtype, device, "target", exact_rows=True)  # the engine: row-exact passes
        models = {}
        for name in names:
            if name == "self-skip":
                from ..bench.leviathan import registry_drafter

                models[name] = registry_drafter("self-skip", target_model)().model
            else:
                models[name] = _load(name, drafter_dtype, device, "drafter")
                check_pair(target_model, models[name])
        runs = {"greedy": _continuations(target_model, Sampler(temperature=0.0), "t0", tokens, max_new_tokens, seed,
                                         out),
                "nucleus": _continuations(target_model, nucleus, f"t1-top-p{top_p:g}", tokens, max_new_tokens, seed,
                                          out)}
        rows = {name: {kind: coverage(model, made, target_model.vocab_size, console=err, label=f"{name} {kind}")
                       for kind, made in runs.items()} for name, model in models.items()}
    except SpecdecError as exc:
        _fail(str(exc))
    result = {"target": target_model.name, "top_p": top_p, "drafters": rows, "seed": seed,
              "positions": max(m.total for m in runs.values()), "command": _command()}
    _write(out, "coverage", coverage_markdown(result), result)


@reproduce_app.command("steps")
def steps_command(
    prompt: str = typer.Option("Write a Python function that returns the n-th Fibonacci number.",
                               help="The prompt (chat template applied)."),
    target: str = typer.Option(registry.DEFAULT_TARGET),
    drafter: str = typer.Option(registry.DEFAULT_DRAFTER),
    gamma: int = typer.Option(4, help="Tokens drafted a step (fixed)."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens"),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    seed: int = typer.Option(0),
    out: Path = typer.Option(Path("docs/reproductions"), help=OUT_HELP),
    html: bool = typer.Option(False, help="Also write steps.html, in the paper's colours."),
    dtype: str = typer.Option("auto", "--dtype", help=TARGET_DTYPE_HELP),
    drafter_dtype: str = typer.Option("auto", help=DRAFTER_DTYPE_HELP),
    device: str = typer.Option("auto", help="auto, cpu or cuda."),
):
    """Leviathan et al. Fig. 1: one generation step by step (drafted, accepted, rejected, the target's token)."""
    from ..bench.steps import step_rows, steps_html, steps_markdown
    from ..decoding.loop import speculative_generate
    from ..decoding.speculation import Speculation
    from ..core.samplers import Sampler

    try:
        if gamma < 1 or max_new_tokens < 1:
            raise SpecdecError(f"--gamma and --max-new-tokens must be >= 1, got {gamma} and {max_new_tokens}")
        sampler = Sampler(temperature=temperature)
        target_model = _load(target, dtype, device, "target", exact_rows=True)  # the engine: row-exact passes
        drafter_model = _load(drafter, drafter_dtype, device, "drafter")
        steps = []
        result = speculative_generate(target_model.encode(prompt, chat=True), target_model,
                                      Speculation.of(drafter_model, gamma=gamma), sampler=sampler,
                                      max_new_tokens=max_new_tokens, seed=seed,
                                      on_step=steps.append)
    except SpecdecError as exc:
        _fail(str(exc))
    rows = step_rows(steps, lambda ids: target_model.decode(ids, skip_special_tokens=False))
    raw = {"target": target_model.name, "drafter": drafter_model.name, "gamma": gamma, "sampler": sampler.describe(),
           "seed": seed, "prompt": prompt, "tokens": result.tokens, "steps": rows, "command": _command()}
    _write(out, "steps", steps_markdown(rows), raw)
    if html:
        (out / "steps.html").write_text(steps_html(rows))
