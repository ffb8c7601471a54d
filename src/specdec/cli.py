"""The `specdec` command (also `python -m specdec`)."""

from __future__ import annotations

import json
import sys
from enum import Enum
from typing import Optional

import typer
from rich.console import Console

from . import registry
from .errors import SpecdecError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Lossless speculative decoding for Hugging Face language models.")
err = Console(stderr=True)


class Method(str, Enum):
    sd = "sd"
    ar = "ar"


def _fail(message: str) -> None:
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(1)


def _load(name: str, dtype: str, device: str, role: str):
    from .models import load

    with err.status(f"loading {name} ({role})…"):
        return load(name, dtype=dtype, device=device, role=role,
                    say=lambda m: err.print(f"[dim]{m}[/]", highlight=False))


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The prompt text."),
    target: str = typer.Option(registry.DEFAULT_TARGET, help="Target model: registry name, HF directory or .gguf."),
    drafter: str = typer.Option(registry.DEFAULT_DRAFTER, help="Drafter model (same vocabulary as the target)."),
    method: Method = typer.Option(Method.sd, help="sd: speculative decoding; ar: plain autoregressive."),
    gamma: int = typer.Option(5, help="Draft tokens per step (γ ≥ 1)."),
    temperature: float = typer.Option(0.0, help="0 means greedy."),
    top_k: int = typer.Option(0, "--top-k", help="Keep the k most likely tokens (0 = off)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus mass to keep (1 = off)."),
    seed: Optional[int] = typer.Option(None, help="Seed for sampling (repeatable runs)."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", help="Most tokens to generate."),
    chat: bool = typer.Option(False, help="Wrap the prompt in the target's chat template."),
    first_target: bool = typer.Option(True, help="Take the first token from the target's prompt pass."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of coloured text."),
    dtype: str = typer.Option("auto", help="Target dtype: auto, fp32, bf16, fp16."),
    drafter_dtype: str = typer.Option("auto", help="Drafter dtype: auto, fp32, bf16, fp16."),
    device: str = typer.Option("auto", help="auto, cpu or cuda."),
):
    """Generate text, showing which tokens the drafter proposed and which the target chose."""
    from .display import LEGEND, StepPrinter, summary_line
    from .generate import autoregressive_generate, speculative_generate
    from .samplers import Sampler

    try:
        sampler = Sampler(temperature=temperature, top_k=top_k, top_p=top_p)
        if gamma < 1:
            raise SpecdecError(f"--gamma must be >= 1, got {gamma}")
        if not prompt.strip():
            raise SpecdecError("empty prompt")
        target_model = _load(target, dtype, device, "target")
        drafter_model = _load(drafter, drafter_dtype, device, "drafter") if method == Method.sd else None
        ids = target_model.encode(prompt, chat=chat)
        out = Console()
        printer = None if as_json else StepPrinter(target_model, out)
        if printer is not None and method == Method.sd:
            err.print(LEGEND)
        if method == Method.sd:
            result = speculative_generate(ids, target_model, drafter_model, gamma=gamma, sampler=sampler,
                                          max_new_tokens=max_new_tokens, seed=seed, first_target=first_target,
                                          on_step=printer)
        else:
            result = autoregressive_generate(ids, target_model, sampler=sampler, max_new_tokens=max_new_tokens,
                                             seed=seed, on_step=printer)
    except SpecdecError as exc:
        _fail(str(exc))
    if as_json:
        stats = result.stats.to_dict()
        payload = {"text": target_model.decode(result.tokens), "tokens": result.tokens, "stats": stats,
                   "stop_reason": result.stop_reason, "method": method.value, "target": target_model.name,
                   "drafter": drafter_model.name if drafter_model else None, "sampler": sampler.describe(),
                   "gamma": gamma if method == Method.sd else None}
        print(json.dumps(payload, ensure_ascii=False))
    else:
        out.print()
        err.print(f"[dim]{summary_line(result.stats, method.value)} · stop: {result.stop_reason}[/]",
                  highlight=False)


@app.command()
def install(names: list[str] = typer.Argument(None, help="Registry names (default: all).")):
    """Download, verify (sha256) and convert the embedded models into specdec's cache."""
    for name in names or list(registry.MODELS):
        try:
            if registry.is_installed(name):
                err.print(f"{name}: installed", highlight=False)
                continue
            with err.status(f"installing {name}…") as status:
                registry.install(name, say=lambda m: status.update(f"{name}: {m}"))
            err.print(f"{name}: installed in {registry.converted_dir(name)}", highlight=False)
        except SpecdecError as exc:
            _fail(str(exc))


@app.command()
def models():
    """List the embedded models and whether they are installed."""
    from rich.table import Table

    table = Table("name", "installed", "description")
    for spec in registry.MODELS.values():
        table.add_row(spec.name, "yes" if registry.is_installed(spec.name) else "no", spec.description)
    Console().print(table)
    err.print(f"cache: {registry.home()}")


@app.command()
def bench(
    dataset: str = typer.Option("humaneval", help="humaneval, or a JSONL file with a 'prompt' field."),
    limit: int = typer.Option(20, help="Number of prompts."),
    methods: str = typer.Option("ar,sd,hf", help="Comma-separated: ar, sd (ours); hf, hf-assisted, hf-lookup "
                                "(transformers' generate: plain, with the drafter, with prompt lookup)."),
    target: str = typer.Option(registry.DEFAULT_TARGET),
    drafter: str = typer.Option(registry.DEFAULT_DRAFTER),
    gamma: int = typer.Option(5),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    markdown: Optional[str] = typer.Option(None, help="Write a markdown report to this file."),
    json_path: Optional[str] = typer.Option(None, "--json", help="Write summary and records as JSON here."),
    dtype: str = typer.Option("auto", help="Target dtype: auto, fp32, bf16, fp16."),
    drafter_dtype: str = typer.Option("auto", help="Drafter dtype: auto, fp32, bf16, fp16."),
):
    """Compare methods on one dataset in one run: interleaved per prompt, after a warm-up."""
    from .bench.run import run_benchmark

    try:
        run_benchmark(dataset=dataset, limit=limit, methods=[m.strip() for m in methods.split(",") if m.strip()],
                      target=target, drafter=drafter, gamma=gamma, max_new_tokens=max_new_tokens,
                      markdown=markdown, json_path=json_path, argv=sys.argv, dtype=dtype,
                      drafter_dtype=drafter_dtype)
    except SpecdecError as exc:
        _fail(str(exc))


@app.command()
def theory(
    alpha: list[float] = typer.Option([0.6, 0.7, 0.8, 0.9], help="Acceptance rate(s) α (repeat the option)."),
    c: float = typer.Option(0.24, help="Cost coefficient: drafter pass / target pass (measured: docs/KERNELS.md)."),
    c_hat: float = typer.Option(0.0, "--c-hat", help="Arithmetic ratio ĉ of drafter to target per token."),
    gamma_max: int = typer.Option(10, "--gamma-max", help="Largest γ to tabulate."),
):
    """Expected tokens per step, walltime improvement and extra arithmetic per γ (Leviathan et al. §3)."""
    from rich.table import Table

    from .theory import arithmetic_increase, expected_tokens, optimal_gamma, walltime_improvement

    try:
        console = Console()
        for a in alpha:
            best = optimal_gamma(a, c)
            table = Table("γ", "expected tokens / step", "walltime improvement", "arithmetic increase",
                          title=f"α = {a:g}, c = {c:g}, ĉ = {c_hat:g} — optimal γ = {best} "
                                f"({walltime_improvement(a, best, c):.2f}×)")
            for g in range(1, gamma_max + 1):
                mark = " ←" if g == best else ""
                table.add_row(str(g), f"{expected_tokens(a, g):.2f}", f"{walltime_improvement(a, g, c):.2f}×{mark}",
                              f"{arithmetic_increase(a, g, c_hat):.2f}×")
            console.print(table)
        err.print("[dim]assumes iid acceptance and a verification pass that costs one target pass; "
                  "on CPUs it costs more (docs/KERNELS.md)[/]")
    except SpecdecError as exc:
        _fail(str(exc))


@app.command("forward-cost")
def forward_cost(
    models: str = typer.Option(f"{registry.DEFAULT_TARGET},{registry.DEFAULT_DRAFTER}", help="Comma-separated models."),
    configs: str = typer.Option("fp32:target:stock,fp32:target:auto,bf16:target:stock,bf16:drafter:auto",
                                help="Comma-separated dtype:role:kernels triples."),
):
    """Measure how a forward pass's cost grows with the tokens scored at once (markdown table)."""
    from .bench.forward_cost import forward_cost_table

    sizes = (1, 2, 4, 6, 9)
    print("| model | dtype | role | kernels | 1 token (ms) | " + " | ".join(f"{t} tokens" for t in sizes[1:])
          + " | 128-token prefill (ms) |")
    print("|---|---|---|---|---|" + "---|" * (len(sizes) - 1) + "---|")
    try:
        triples = [tuple(c.split(":")) for c in configs.split(",")]
        for name in models.split(","):
            for row in forward_cost_table(name.strip(), triples, sizes):
                print(row, flush=True)
    except (SpecdecError, ValueError) as exc:
        _fail(str(exc))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
