"""`specdec bench`, `measure`, `theory`, `forward-cost`, `profile`: measurements."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from ..models import catalogue as registry
from ..errors import SpecdecError
from .common import (app, err, _fail, check_vocab_options, _drafter_weights, _check_runs_on, _measured_costs, _load,
                     TARGET_DTYPE_HELP, DRAFTER_DTYPE_HELP, DRAFTER_VOCAB_HELP, DRAFTER_VOCAB_CORPUS_HELP,
                     EXACT_ROWS_HELP, METHOD_HELP, _lookahead_shape, TREE_HELP, LOOKAHEAD_SHAPE_HELP,
                     TREE_SCHEME_HELP, spec_config, _first_drafter, _positive_ints, _skip_layers, _csv)


@app.command()
def bench(
    dataset: str = typer.Option("humaneval", help="Comma-separated: humaneval, spec-bench (chat template; its "
                                "dev subset, carried), json-tasks (extraction and function calls, each output "
                                "constrained by its JSON Schema and checked against it; carried), or JSONL files "
                                "with a 'prompt' or 'turns' field (and optionally 'schema'). Each may carry "
                                "its own limit and temperatures: NAME:LIMIT:T+T, e.g. spec-bench:1:0+1."),
    limit: int = typer.Option(20, help="Prompts per dataset (per task for datasets with tasks)."),
    tasks: Optional[str] = typer.Option(None, help="Comma-separated tasks to keep (spec-bench: mt_bench, "
                                        "translation, summarization, qa, math_reasoning, rag; json-tasks: "
                                        "extraction, function-call)."),
    methods: str = typer.Option(None, help="Default: ar,sd-cost,hf (with --concurrency: ar,sd-cost,lookup,"
                                "tree-mixed,hf-cb,hf-padded). Comma-separated: ar, sd, sd-cost, sd-typical (LOSSY), sd-heuristic, sd-confidence, sd-egag, "
                                "ngram, lookup, suffix, retrieval (--datastore DIR), tree-sides, tree-eagle2, tree-sequoia, tree-lookup, tree-mixed, "
                                "tree-suffix, tree-mixed-suffix, lookahead, beam and beam-sd (beam search, plain and speculative; greedy prompts), cascade, "
                                "sd-distilled (--distilled DIR), sd-parallel (--parallel DIR), sd-online (the drafter learning between prompts), medusa, eagle, medusa-uncalibrated, eagle-uncalibrated, self-skip (ours); hf, "
                                "hf-assisted, hf-assisted-fixed, hf-lookup (transformers' generate: plain, with the "
                                "drafter at its defaults or at our γ, with prompt lookup); sd-other-tokenizer and "
                                "hf-assisted-other-tokenizer (ours and transformers' universal assisted generation, "
                                "with --other-drafter); llama-cpp, llama-cpp-spec, "
                                "llama-cpp-lookup (llama.cpp: plain, drafter model, prompt lookup; the peers extra); vllm, "
                                "vllm-draft, vllm-ngram (vLLM's CPU build: plain, the same drafter model, n-gram; "
                                "`make vllm`), vllm-specdec-suffix, -lookup, -ngram, -retrieval (our drafters as "
                                "vLLM's proposers: specdec.vllm). With --concurrency: ar, sd-cost, lookup, tree-mixed "
                                "(ours, through the engine), hf-cb (transformers' continuous batching), hf-padded "
                                "(its generate on padded batches), and the vllm methods."),
    concurrency: Optional[str] = typer.Option(None, "--concurrency", help="Comma-separated levels, e.g. 1,2,4,8: "
                                              "each method serves all prompts with that many in flight (the engine's "
                                              "batch), reporting total and per-sequence tok/s, TTFT and TPOT p50/p99 "
                                              "and outputs identical to level 1 (one --temperature)."),
    repeats: int = typer.Option(1, "--repeats", help="With --concurrency: run each level this many times, each "
                                "repeat's methods in the next counterbalanced order; figures are over all "
                                "repeats, and the ratio to ar is also shown per repeat (the machine's drift)."),
    target: str = typer.Option(registry.DEFAULT_TARGET),
    drafter: str = typer.Option(registry.DEFAULT_DRAFTER),
    gamma: Optional[int] = typer.Option(None, help="γ of the fixed schedule (sd, ngram-fixed, lookup-fixed, "
                                        "hf-assisted-fixed, hf-lookup; default 5) and heuristic's start; the other "
                                        "methods' bound, as --gamma-max."),
    gamma_min: int = typer.Option(1, "--gamma-min", help="Smallest γ of the heuristic and egag schedules."),
    gamma_max: Optional[int] = typer.Option(None, "--gamma-max", help="Largest γ of cost, heuristic, confidence "
                                            "and egag, a tree's depth (default 20; egag's: γ)."),
    egag_beta: float = typer.Option(0.0, "--egag-beta", help="EGAG's EMA weight on past entropy (0 = none)."),
    confidence: float = typer.Option(0.4, help="Threshold τ of sd-confidence."),
    ngram_n: int = typer.Option(4, "--ngram-n", help="Longest n-gram of the ngram drafter."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    temperature: str = typer.Option("0", help="Comma-separated temperatures; 0 = greedy (checks identity to ar)."),
    seed: int = typer.Option(0, help="Base seed; prompt i is sampled with seed + i by every method (its sample k "
                             "with seed + i + 100003·k)."),
    samples: int = typer.Option(1, help="Generations per method of each prompt at a temperature > 0, summed "
                                "into one result (a sampled output's length, and so its speed, is a draw)."),
    markdown: Optional[str] = typer.Option(None, help="Write a markdown report to this file."),
    json_path: Optional[str] = typer.Option(None, "--json", help="Write info, summary, groups and records as JSON."),
    plot: Optional[str] = typer.Option(None, help="Write a PNG of tokens/s per method and per task."),
    dtype: str = typer.Option("auto", "--dtype", "--weights", help=TARGET_DTYPE_HELP),
    drafter_dtype: str = typer.Option("auto", help=DRAFTER_DTYPE_HELP),
    drafter_vocab: Optional[int] = typer.Option(None, "--drafter-vocab", help=DRAFTER_VOCAB_HELP),
    drafter_vocab_corpus: Optional[str] = typer.Option(None, "--drafter-vocab-corpus",
                                                       help=DRAFTER_VOCAB_CORPUS_HELP),
    device: str = typer.Option("auto", help="auto, cpu or cuda."),
    exact_rows: Optional[bool] = typer.Option(None, "--exact-rows/--batched-rows", help=EXACT_ROWS_HELP),
    tree_nodes: int = typer.Option(64, "--tree-nodes", help="Most nodes per token tree (tree-* methods)."),
    tree_scheme: str = typer.Option("without-replacement", "--tree-scheme", help=TREE_SCHEME_HELP),
    flat_at16: float = typer.Option(1.2, "--flat-at16", help="The machine the projection (and the -flat methods' "
                                    "sizing) assumes: scoring 16 drafted tokens costs this many one-token passes."),
    heads: Optional[str] = typer.Option(None, "--heads", help="Medusa heads' folder (the medusa method)."),
    eagle: Optional[str] = typer.Option(None, "--eagle", help="An EAGLE drafter's folder (the eagle method)."),
    distilled: Optional[str] = typer.Option(None, "--distilled", help="A distilled drafter adapter's folder (the "
                                            "sd-distilled method; `specdec distill-drafter`)."),
    parallel: Optional[str] = typer.Option(None, "--parallel", help="A parallel drafter's folder (the sd-parallel "
                                           "method; `specdec train-parallel-drafter`)."),
    other_drafter: str = typer.Option("smollm2-135m", "--other-drafter", help="The drafter model with another "
                                      "tokenizer (sd-other-tokenizer, hf-assisted-other-tokenizer)."),
    datastore: Optional[str] = typer.Option(None, "--datastore", help="A datastore folder (the retrieval method; "
                                            "`specdec datastore build`)."),
    skip_layers: Optional[str] = typer.Option(None, "--skip-layers", help="Comma-separated layers the self-skip "
                                              "method skips (default: chosen by its search at start)."),
    lookahead_shape: Optional[str] = typer.Option(None, "--lookahead-shape", help=LOOKAHEAD_SHAPE_HELP),
    num_beams: int = typer.Option(4, "--num-beams", help="Beams of the beam and beam-sd methods."),
    vllm_threads: str = typer.Option("tuned", "--vllm-threads", help="The vllm methods' threads: tuned (OpenMP "
                                     "threads bound to every core, Intel OpenMP preloaded, as vLLM's CPU docs "
                                     "advise) or default (vLLM's own: one core kept for its front end on 2 cores)."),
    vllm_eager: bool = typer.Option(False, "--vllm-eager", help="The vllm methods without torch.compile: a load "
                                    "in a third of the time, passes slower (say so beside their figures)."),
    vllm_dtype: str = typer.Option("bfloat16", "--vllm-dtype", help="The vllm methods' weights: bfloat16 (ours "
                                   "under --dtype auto) or float32 (on a CPU without AVX512, where vLLM's bf16 "
                                   "linears fall back to torch's emulated bf16)."),
):
    """Compare methods on datasets in one run: interleaved per prompt, after a warm-up."""
    from ..bench.runners import Settings
    from ..bench.run import run_benchmark

    try:
        check_vocab_options(drafter_vocab, drafter_vocab_corpus)  # before minutes of loading
        try:
            temperatures = [float(t) for t in _csv(temperature)]
        except ValueError:
            raise SpecdecError(f"--temperature takes comma-separated numbers, got {temperature!r}") from None
        from ..drafters import check_tree_options

        check_tree_options("mixed", tree_nodes, tree_scheme)
        if not flat_at16 >= 1:
            raise SpecdecError(f"--flat-at16 must be >= 1 (a wide pass costs at least a 1-token one), got {flat_at16}")
        spec = dict(gamma=gamma, gamma_min=gamma_min, gamma_max=gamma_max, egag_beta=egag_beta, confidence=confidence,
                    ngram_n=ngram_n, tree_nodes=tree_nodes, tree_scheme=tree_scheme, lookahead_shape=_lookahead_shape(lookahead_shape))
        settings = Settings(max_new_tokens=max_new_tokens, spec=spec, flat_at16=flat_at16, heads=heads, eagle=eagle,
                            datastore=datastore, distilled=distilled, parallel=parallel, other_drafter=other_drafter,
                            skip_layers=_skip_layers(skip_layers), num_beams=num_beams, vllm_threads=vllm_threads,
                            vllm_eager=vllm_eager, vllm_dtype=vllm_dtype)
        if num_beams < 1:
            raise SpecdecError(f"--num-beams must be >= 1, got {num_beams}")
        if concurrency is not None:
            if len(temperatures) != 1 or dtype != "auto" or samples != 1 or plot or exact_rows is False or \
                    drafter_vocab is not None or drafter_vocab_corpus is not None:
                raise SpecdecError("--concurrency takes one --temperature, --dtype auto, one sample, and none of "
                                   "--plot, --batched-rows, --drafter-vocab, --drafter-vocab-corpus")
            _load_bench(concurrency, dataset, limit, methods, target, drafter, settings, temperatures[0], seed,
                        markdown, json_path, device, drafter_dtype, tasks, repeats)
            return
        if repeats != 1:
            raise SpecdecError("--repeats goes with --concurrency (without it, --samples repeats each prompt)")
        methods = methods or "ar,sd-cost,hf"
        run_benchmark(datasets=_csv(dataset), limit=limit, methods=_csv(methods), target=target, drafter=drafter,
                      settings=settings, temperatures=temperatures, tasks=_csv(tasks) if tasks else None, seed=seed,
                      markdown=markdown, json_path=json_path, plot=plot, argv=sys.argv, dtype=dtype,
                      drafter_dtype=drafter_dtype, device=device, exact_rows=exact_rows,
                      drafter_vocab=drafter_vocab, drafter_vocab_corpus=drafter_vocab_corpus, samples=samples)
    except SpecdecError as exc:
        _fail(str(exc))


def _load_bench(concurrency: str, dataset: str, limit: int, methods: str | None, target: str, drafter: str,
                settings, temperature: float, seed: int, markdown, json_path, device: str, drafter_dtype: str,
                tasks: str | None, repeats: int) -> None:
    """`bench --concurrency`: every method at each level through the engine."""
    from ..bench.concurrency import check_levels, check_load_methods, check_repeats, run_load_benchmark

    try:
        levels = [int(c) for c in _csv(concurrency)]
    except ValueError:
        raise SpecdecError(f"--concurrency takes comma-separated integers >= 1, got {concurrency!r}") from None
    check_levels(levels)
    chosen = _csv(methods or "ar,sd-cost,lookup,tree-mixed,hf-cb,hf-padded")
    check_load_methods(chosen)
    check_repeats(repeats)
    run_load_benchmark(_csv(dataset), limit, chosen, levels, target, drafter, settings, temperature, seed,
                       markdown, json_path, sys.argv, device=device, drafter_dtype=drafter_dtype,
                       tasks=_csv(tasks) if tasks else None, repeats=repeats)


@app.command()
def measure(
    dataset: str = typer.Option("humaneval", help="humaneval, spec-bench or a JSONL file."),
    limit: int = typer.Option(4, help="Prompts (per task for spec-bench)."),
    tasks: Optional[str] = typer.Option(None, help="Comma-separated tasks to keep (spec-bench)."),
    target: str = typer.Option(registry.DEFAULT_TARGET),
    drafter: str = typer.Option(registry.DEFAULT_DRAFTER),
    gammas: str = typer.Option("1,2,3,4,5,6,7,8", help="Comma-separated γ values to sweep."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    seed: int = typer.Option(0),
    markdown: Optional[str] = typer.Option(None, help="Write the table as markdown here."),
    json_path: Optional[str] = typer.Option(None, "--json", help="Write the measurements as JSON here."),
    plot: Optional[str] = typer.Option(None, help="Write a PNG of predicted and measured speedup over γ."),
    dtype: str = typer.Option("auto", "--dtype", "--weights", help=TARGET_DTYPE_HELP),
    drafter_dtype: str = typer.Option("auto", help=DRAFTER_DTYPE_HELP),
    drafter_vocab: Optional[int] = typer.Option(None, "--drafter-vocab", help=DRAFTER_VOCAB_HELP),
    drafter_vocab_corpus: Optional[str] = typer.Option(None, "--drafter-vocab-corpus",
                                                       help=DRAFTER_VOCAB_CORPUS_HELP),
    device: str = typer.Option("auto", help="auto, cpu or cuda."),
    tree_nodes: str = typer.Option("", "--tree-nodes", help="Comma-separated tree sizes: also predict tokens per "
                                   "step of the best tree of each size from the per-rank acceptance, and measure them."),
    lenience: float = typer.Option(1.0, help="1 = exact; l in (0, 1): lenient acceptance (LOSSY under sampling), "
                                   "reporting the TV distance from the target's law it costs."),
):
    """Measure α, c and the verification cost, then predicted vs measured speedup for each γ."""
    from rich.markdown import Markdown

    from ..bench.datasets import load_prompts
    from ..bench.measure import check_measure_options, measure_markdown, measure_plot, run_measure
    from ..core.samplers import Sampler

    try:
        check_vocab_options(drafter_vocab, drafter_vocab_corpus)  # before minutes of loading
        try:
            gamma_values = [int(g) for g in _csv(gammas)]
        except ValueError:
            raise SpecdecError(f"--gammas takes comma-separated integers, got {gammas!r}") from None
        if not gamma_values or min(gamma_values) < 1:
            raise SpecdecError(f"--gammas must be integers >= 1, got {gammas!r}")
        try:
            sizes = [int(n) for n in _csv(tree_nodes)] if tree_nodes else []
        except ValueError:
            raise SpecdecError(f"--tree-nodes takes comma-separated integers, got {tree_nodes!r}") from None
        check_measure_options(lenience, sizes, tree_nodes)
        sampler = Sampler(temperature=temperature)
        prompts = load_prompts(dataset, limit, _csv(tasks) if tasks else None)
        target_model = _load(target, dtype, device, "target")
        drafter_model = _load(drafter, drafter_dtype, device, "drafter", vocab=drafter_vocab,
                              vocab_corpus=drafter_vocab_corpus)
        ids = [target_model.encode(p.text, chat=p.chat) for p in prompts]
        result = run_measure(target_model, drafter_model, ids, gamma_values, max_new_tokens, sampler, seed, err,
                             sizes, lenience)
    except SpecdecError as exc:
        _fail(str(exc))
    text = measure_markdown(result)
    Console().print(Markdown(text))
    if markdown:
        with open(markdown, "w") as f:
            f.write(f"command: `specdec {' '.join(sys.argv[1:])}`\n\n" + text)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    if plot:
        measure_plot(result, plot)


@app.command()
def theory(
    alpha: list[float] = typer.Option([0.6, 0.7, 0.8, 0.9], help="Acceptance rate(s) α (repeat the option)."),
    c: float = typer.Option(0.24, help="Cost coefficient: drafter pass / target pass (measured: docs/kernels.md)."),
    c_hat: float = typer.Option(0.0, "--c-hat", help="Arithmetic ratio ĉ of drafter to target per token."),
    gamma_max: int = typer.Option(10, "--gamma-max", help="Largest γ to tabulate."),
    lenience: float = typer.Option(1.0, help="l in (0, 1): also say where α under lenient acceptance lies "
                                   "(LOSSY under sampling) and the best γ at its top."),
):
    """Expected tokens per step, walltime improvement and extra arithmetic per γ (Leviathan et al. §3)."""
    from rich.table import Table

    from ..sizing.theory import (arithmetic_increase, expected_tokens, lenient_alpha_range, optimal_gamma,
                          oracle_walltime_improvement, rule_of_thumb_gamma, rule_of_thumb_speedup, walltime_improvement)

    try:
        if not 0 < lenience <= 1:
            raise SpecdecError(f"--lenience must be in (0, 1] (1 = exact), got {lenience}")
        console = Console()
        for a in alpha:
            best = optimal_gamma(a, c)
            thumb = f"; rule of thumb's γ* ≈ √(1/c − 1) = {rule_of_thumb_gamma(c):.1f}" if 0 < c <= 1 else ""
            table = Table("γ", "expected tokens / step", "rule of thumb (1 + γα)/(1 + γc)",
                          "walltime improvement (Theorem 3.8)", "arithmetic increase",
                          title=f"α = {a:g}, c = {c:g}, ĉ = {c_hat:g} — optimal γ = {best} "
                                f"({walltime_improvement(a, best, c):.2f}×){thumb}; oracle γ "
                                f"{oracle_walltime_improvement(a, c):.2f}×")
            for g in range(1, gamma_max + 1):
                mark = " ←" if g == best else ""
                table.add_row(str(g), f"{expected_tokens(a, g):.2f}", f"{rule_of_thumb_speedup(a, g, c):.2f}×",
                              f"{walltime_improvement(a, g, c):.2f}×{mark}", f"{arithmetic_increase(a, g, c_hat):.2f}×")
            console.print(table)
            if lenience < 1:
                low, high = lenient_alpha_range(a, lenience)
                top = optimal_gamma(high, c)
                console.print(f"lenience {lenience:g}: α = Σ min(q, p/l) lies in [{low:.3f}, {high:.3f}] (where, p and "
                              f"q decide: `specdec measure --lenience {lenience:g}`); at {high:.3f}, optimal γ = {top} "
                              f"({walltime_improvement(high, top, c):.2f}×)", highlight=False)
        err.print("[dim]assumes iid acceptance and a verification pass that costs one target pass; "
                  "on CPUs it costs more (docs/kernels.md). The rule of thumb counts γα accepted tokens a step, "
                  "as if a rejection did not end acceptance; Theorem 3.8 counts α + … + α^γ. Oracle γ: each "
                  "step drafts exactly what will be accepted, 1 / (1 − α + αc)[/]")
    except SpecdecError as exc:
        _fail(str(exc))


@app.command("forward-cost")
def forward_cost(
    models: str = typer.Option(f"{registry.DEFAULT_TARGET},{registry.DEFAULT_DRAFTER}", help="Comma-separated models."),
    configs: str = typer.Option("fp32:target:stock,fp32:target:auto,bf16:target:stock,bf16:drafter:auto",
                                help="Comma-separated dtype:role:kernels triples."),
    compare_rows: bool = typer.Option(False, "--compare-rows", help="Measure row-exact and batched target passes "
                                      "alternately on the same model (two rows per config)."),
    tree: bool = typer.Option(False, "--tree", help="Token-tree passes under the tree mask, widths 1..64 (the "
                              "cost curve that sizes trees)."),
    sizes_text: Optional[str] = typer.Option(None, "--sizes", help="Comma-separated pass widths, starting at 1 "
                                             "(default: 1,2,4,6,9,16; with --tree 1,2,4,8,16,32,64)."),
):
    """Measure how a forward pass's cost grows with the tokens scored at once (markdown table; ≠
    marks a width whose rows differ from 1-token passes, so a target cannot verify with it exactly)."""
    from ..bench.forward_cost import forward_cost_table

    sizes = (1, 2, 4, 8, 16, 32, 64) if tree else (1, 2, 4, 6, 9, 16)
    if sizes_text:
        try:
            sizes = tuple(int(x) for x in sizes_text.split(","))
        except ValueError:
            _fail(f"--sizes must be comma-separated integers, got {sizes_text!r}")
        if sizes[0] != 1 or any(b <= a for a, b in zip(sizes, sizes[1:])):
            _fail(f"--sizes must rise from 1 (the 1-token pass every ratio is taken against), got {sizes_text!r}")
    print("| model | dtype | role | kernels | rows | 1 token (ms) | " + " | ".join(f"{t} tokens" for t in sizes[1:])
          + " | 128-token prompt, first token (ms) |")
    print("|---|---|---|---|---|---|" + "---|" * (len(sizes) - 1) + "---|")
    try:
        triples = [tuple(c.split(":")) for c in configs.split(",")]
        for name in models.split(","):
            for row in forward_cost_table(name.strip(), triples, sizes, compare_rows, tree):
                print(row, flush=True)
    except (SpecdecError, ValueError) as exc:
        _fail(str(exc))


@app.command()
def profile(
    prompt: str = typer.Argument("def quicksort(arr):", help="The prompt of the profiled generation."),
    target: str = typer.Option(registry.DEFAULT_TARGET, help="Target model: registry name, HF directory or .gguf."),
    drafter: str = typer.Option(registry.DEFAULT_DRAFTER, help="Drafter model, or ngram / lookup / suffix / "
                                "retrieval:DIR."),
    tree: str = typer.Option("off", help=TREE_HELP + " off: a chain under the cost schedule."),
    method: str = typer.Option("default", help=METHOD_HELP),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Tokens of the profiled generation."),
    widths_text: str = typer.Option("1,2,4,8,16", "--widths", help="Target pass widths to time (rows), from 1."),
    batches_text: str = typer.Option("", "--batches", help="Also time the engine's batched pass over this many "
                                     "sequences (comma-separated, e.g. 1,2,4,8), 1 and 4 rows each."),
    kv_text: str = typer.Option("", "--kv-storage", help="Also time KV cache storage (transformers' "
                                "concatenation, paged blocks, our slabs) at these cached lengths, e.g. 256,2048: "
                                "a step's cache work, and the batched pass of 8 sequences × 4 rows."),
    dtype: str = typer.Option("auto", "--dtype", "--weights", help=TARGET_DTYPE_HELP),
    drafter_dtype: str = typer.Option("auto", help=DRAFTER_DTYPE_HELP),
    device: str = typer.Option("auto", help="auto, cpu or cuda."),
    ops_text: str = typer.Option("", "--ops", help="Also split target passes of these widths (e.g. 1,8) into "
                                 "linears, attention, other ops and host time, under torch's profiler."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Also write the numbers to this JSON file."),
):
    """Where a generation's time goes on this machine, and what one more row of a target pass costs."""
    from ..bench.profile import profile_record

    try:
        widths = [int(w) for w in _csv(widths_text)]
        if not widths or widths[0] != 1 or any(b <= a for a, b in zip(widths, widths[1:])):
            raise ValueError
    except ValueError:
        _fail(f"--widths must be comma-separated integers rising from 1, got {widths_text!r}")
    batches = _positive_ints(batches_text, "--batches")
    kv_contexts = _positive_ints(kv_text, "--kv-storage")
    op_widths = _positive_ints(ops_text, "--ops")
    try:
        if max_new_tokens < 1:
            raise SpecdecError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
        config = spec_config(method, drafter, tree)
        if not config.speculative:
            raise SpecdecError("profile times a speculative generation; --method ar drafts nothing")
        _check_runs_on(dtype, config)
        batched = "--batches" if batches else "--kv-storage" if kv_contexts else None
        if batched and dtype == "gguf":
            raise SpecdecError(f"{batched} times the engine's batched pass, which runs on --dtype auto weights")
        target_model = _load(target, dtype, device, "target")
        if batched and not target_model.features().rows_invariant:
            raise SpecdecError(f"{batched} needs row-exact passes for {target_model.name} (the engine's); "
                               "on this machine that is --dtype bf16 on the CPU")
        drafter_model = _load(config.drafter, _drafter_weights(dtype, config.drafter, drafter_dtype, False), device,
                              "drafter") if config.needs_drafter_model() else None
        passes, kv, ops = _time_passes(target_model, drafter_model, widths, batches, kv_contexts, op_widths)
        name = f"tree-{config.tree}" if config.method == "tree" else "sd-cost" if method == "default" else method
        result = _profiled_generation(config, target_model, drafter_model, prompt, max_new_tokens, name)
    except SpecdecError as exc:
        _fail(str(exc))
    out = Console()
    for table in _pass_tables(target_model, drafter_model, passes, widths, kv, kv_contexts, ops):
        out.print(table, highlight=False)
    out.print(_time_split_table(result.stats, name))
    if json_path:
        json_path.write_text(json.dumps(profile_record(passes, result.stats, name, target_model, drafter_model, kv,
                                                       ops), indent=1))
        err.print(f"[dim]wrote {json_path}[/]", highlight=False)


def _time_passes(target_model, drafter_model, widths: list[int], batches: list[int], kv_contexts: list[int],
                 op_widths: list[int]):
    """The passes' times by width (and batch), KV storage's where asked, and the passes of
    `op_widths` split by op kind (bench/profile.py `op_split`) -> (passes, kv or None, ops or None)."""
    from ..bench.kvstorage import kv_storage_profile
    from ..bench.profile import op_split, pass_profile

    if op_widths and target_model.device.type != "cpu":
        raise SpecdecError("--ops splits CPU passes (on CUDA the ops run asynchronously: use torch's profiler there)")
    with err.status("timing passes…"):
        passes = pass_profile(target_model, drafter_model, widths, [1, 2, 4] if drafter_model else [],
                              batches=batches)
    kv = ops = None
    if kv_contexts:
        with err.status("timing KV cache storage…"):
            kv = kv_storage_profile(target_model, kv_contexts)
    if op_widths:
        with err.status("splitting passes by op…"):
            ops = {w: op_split(target_model, w) for w in op_widths}
    return passes, kv, ops


def _profiled_generation(config, target_model, drafter_model, prompt: str, max_new_tokens: int, name: str):
    """One generation of the config, its time split recorded in its stats."""
    from ..decoding.loop import speculative_generate
    from ..decoding.speculation import Parts, build, open_files

    open_files(config)
    speculation = build(config, Parts(target_model, drafter_model,
                                      costs=lambda model: _measured_costs(target_model, model)))
    drafter_used, plan = _first_drafter(speculation), speculation.schedule()
    with err.status(f"generating {max_new_tokens} tokens ({name})…"):
        return speculative_generate(target_model.encode(prompt), target_model,
                                    speculation.made_once(drafter_used, plan), max_new_tokens=max_new_tokens)


def _pass_tables(target_model, drafter_model, passes, widths: list[int], kv, kv_contexts: list[int],
                 ops: dict | None = None) -> list:
    """What a pass costs by width, by batch, in KV storage, by op kind, and the drafter's passes."""
    tables = [_width_table(target_model, passes, widths)]
    if ops:
        kinds = ("linears", "attention", "other ops", "host")
        tables.append(_table(f"where a target pass goes ({target_model.kernels}; ms a pass under torch's profiler, "
                             "after 128 cached tokens)", ("rows", "pass (ms)", *kinds),
                             [[str(w), f"{split['pass']:.1f}", *(f"{split[k]:.1f} ({split[k] / split['pass']:.0%})"
                                                                  for k in kinds)] for w, split in ops.items()]))
    one = passes.target_ms[1]
    if passes.batch_ms:
        tables.append(_table("the engine's batched pass: sequences × rows each, after 128 cached tokens each",
                             ("sequences", "rows each", "pass (ms)", "× 1 row", "ms per row"),
                             [[str(b), str(r), f"{ms:.1f}", f"{ms / one:.2f}", f"{ms / (b * r):.1f}"]
                              for key, ms in passes.batch_ms.items() for b, r in [map(int, key.split("x"))]]))
    if kv:
        tables.append(_table(f"KV storage: one step's cache work per sequence ({kv['rows']} rows in and rolled back, "
                             f"all layers), and the batched pass of {kv['batch']} sequences × {kv['rows']} rows",
                             ("cached", "step: concatenated (ms)", "paged (ms)", "slab (ms)",
                              "pass: concatenated (ms)", "slab (ms)"),
                             [[str(c), *(f"{kv['step_ms'][s][c]:.2f}" for s in ("dynamic", "paged", "slab")),
                               *(f"{kv['pass_ms'][s][c]:.1f}" for s in ("dynamic", "slab"))] for c in kv_contexts]))
    if passes.drafter_ms:
        tables.append(f"drafter {drafter_model.name} ({drafter_model.weights}, {drafter_model.kernels}): " + ", ".join(
            f"{t} token{'s' if t > 1 else ''} {ms:.1f} ms" for t, ms in passes.drafter_ms.items()))
    return tables


def _width_table(target_model, passes, widths: list[int]):
    """One target pass by rows: its time, against one row's, and per added row (a tree pass's too)."""
    one, rows = passes.target_ms[1], []
    for i, width in enumerate(widths):
        ms = passes.target_ms[width]
        added = "" if i == 0 else f"{(ms - passes.target_ms[widths[i - 1]]) / (width - widths[i - 1]):.1f}"
        rows.append([str(width), f"{ms:.1f}", f"{ms / one:.2f}", added,
                     *([f"{passes.target_tree_ms[width]:.1f}"] if passes.target_tree_ms else [])])
    columns = ("rows", "chain pass (ms)", "× 1 row", "ms per added row") + \
        (("tree pass (ms)",) if passes.target_tree_ms else ())
    return _table(f"{target_model.name} ({target_model.weights}, {target_model.kernels}): one pass after 128 cached "
                  "tokens", columns, rows)


def _time_split_table(stats, name: str):
    """Where the generation's time went: target passes, drafting, the loop."""
    from ..bench.profile import time_split

    rows = [[part, str(count), f"{seconds:.2f}", f"{seconds / stats.wall_seconds if stats.wall_seconds else 0.0:.0%}",
             f"{1e3 * seconds / count:.1f}" if count else ""] for part, count, seconds in time_split(stats)]
    return _table(f"{name}: {stats.new_tokens} tokens in {stats.wall_seconds:.2f} s ({stats.tokens_per_second:.2f} "
                  f"tok/s, {stats.tokens_per_target_pass:.2f} per target pass)",
                  ("part", "passes", "seconds", "share", "ms each"), rows, left=("part",))


def _table(title: str, columns, rows, left=()):
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column, justify="left" if column in left else "right")
    for row in rows:
        table.add_row(*row)
    return table
