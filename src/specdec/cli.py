"""The `specdec` command (also `python -m specdec`)."""

from __future__ import annotations

import json
import sys
import time
from enum import Enum
from pathlib import Path
from typing import List, Optional

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


def check_vocab_options(vocab, corpus) -> None:
    from .vocab import check_vocab_options as check

    check(vocab, corpus)


def _drafter_weights(dtype: str, drafter: str | None, drafter_dtype: str, restricted_vocab: bool) -> str:
    """The drafter's dtype with "auto" resolved: a model drafter follows a GGUF target onto its own
    GGUF weights (llama.cpp) unless its vocabulary is restricted (a transformers feature); else
    unchanged. A drafter's weights change acceptance only, never the output."""
    from .models import GGUF_WEIGHTS

    follows = drafter is not None and (drafter in registry.MODELS or drafter.endswith(".gguf"))
    if dtype in GGUF_WEIGHTS and drafter_dtype == "auto" and follows and not restricted_vocab:
        return "gguf"
    return drafter_dtype


def _check_runs_on(dtype: str, config) -> None:
    """One line, before any loading, where a method cannot run on the target's weights: llama.cpp's
    backend (--dtype gguf) takes chains, not trees or self-drafting."""
    from .methods import METHODS
    from .models import GGUF_WEIGHTS

    method = METHODS[config.method]
    if dtype in GGUF_WEIGHTS and config.speculative and (method.trees or method.self_drafting):
        raise SpecdecError(f"{config.method} cannot run on --dtype gguf (llama.cpp's backend takes chain drafts "
                           "only); use --dtype auto (transformers' weights)")


def _weights_of(drafter) -> str | None:
    """The weights a drafter model runs (a model, or a drafter holding one); None for model-free ones."""
    model = drafter if hasattr(drafter, "forward") else getattr(drafter, "model", None)
    return getattr(model, "weights", None)


def _measured_costs(target_model, drafter_model):
    """This machine's pass costs of the pair (passcost.py: measured once, cached), for the cost
    schedule, so that where no draft can pay it drafts nothing from the first step."""
    from .passcost import pass_costs

    with err.status("measuring pass costs…"):
        costs = pass_costs(target_model, drafter_model, say=lambda m: err.print(f"[dim]{m}[/]", highlight=False))
    if costs.never_pays():
        err.print(f"[dim]drafting cannot pay on this machine (a draft accepted in full would make "
                  f"{costs.best_speedup():.2f}x plain decoding): the cost schedule drafts nothing[/]", highlight=False)
    return costs


def _chain_drafter_rows(config, exact_rows: bool | None) -> bool | None:
    """A chain drafter model's `exact_rows`: on (unless --batched-rows), alone and in a batch
    alike, so that the engine can batch its passes across sequences and a seeded sampled prompt
    drafts the same in both. Its passes are a prompt (fed plainly either way) and then 1-2 tokens,
    where row-exact attention is one one-query call a row, as a decode step makes; a tree drafter
    keeps the default (its depth passes would pay a call per row)."""
    from .methods import METHODS

    if METHODS[config.method].trees or exact_rows is False:
        return None
    return True


def _load(name: str, dtype: str, device: str, role: str, exact_rows: bool | None = None,
          vocab: int | None = None, vocab_corpus: str | None = None, sequences: int = 1):
    from .models import load

    with err.status(f"loading {name} ({role})…"):
        return load(name, dtype=dtype, device=device, role=role, exact_rows=exact_rows,
                    say=lambda m: err.print(f"[dim]{m}[/]", highlight=False), vocab=vocab, vocab_corpus=vocab_corpus,
                    sequences=sequences)


TARGET_DTYPE_HELP = ("Target weights: auto (transformers' weights: bf16 on CUDA and on CPUs with native bf16, "
                     "fp32 on other CPUs; the same for every method), fp32, bf16, fp16, or gguf: the GGUF file's own "
                     "quantized weights on llama.cpp (the `peers` extra; AR and chain drafts only).")
DRAFTER_DTYPE_HELP = ("Drafter dtype: auto (gguf beside a gguf target, else int8 weights on the CPU, bf16 on CUDA), "
                      "int8, bf16, fp32, fp16, gguf. Changes acceptance only, never the output.")
DRAFTER_VOCAB_HELP = ("Ids the drafter's output head scores: the N most frequent (FR-Spec; q is 0 elsewhere, so "
                      "the output stays exact). Default: 65536 for vocabularies over twice that, else all; 0: all.")
DRAFTER_VOCAB_CORPUS_HELP = "Text file to count the drafter vocabulary's frequencies in (default: Python's stdlib)."


EXACT_ROWS_HELP = ("Row-exact target passes: each row of a verification pass computed bit for bit as a one-token "
                   "pass would, so greedy output is token-identical to AR in every dtype (default: on for bf16 "
                   "targets on the CPU, off for fp32 ones, where it slows 1-token passes; --batched-rows: plain "
                   "multi-row kernels).")


METHOD_HELP = ("A method or preset (`specdec methods` lists them; the same names as serve, chat and bench): ar "
               "(plain decoding), chain, lookup, tree, sd (a fixed γ), tree-sides, ... default: what --drafter, "
               "--tree and --cascade name (the drafter model's chain, cost-aware).")


def _lookahead_shape(text: str | None) -> tuple[int, int, int] | None:
    """--lookahead-shape W,N,G -> (W, N, G), checked as `LookaheadDrafter` checks it; None: sized by cost."""
    if text is None:
        return None
    try:
        window, ngram, guesses = (int(v) for v in text.split(","))
    except ValueError:
        raise SpecdecError(f"--lookahead-shape takes W,N,G (three integers, e.g. 15,3,15), got {text!r}") from None
    from .drafters.lookahead import check_shape

    check_shape((window, ngram, guesses))
    return window, ngram, guesses


TREE_HELP = ("Token tree per step, verified in one target pass: off (a chain), sides (drafter chain plus its next "
             "best tokens), eagle2 (EAGLE-2 dynamic tree), sequoia (Sequoia static shape), lookup (prompt-lookup "
             "trie), mixed (drafter chain with sides plus lookup branches), suffix (suffix drafting's tree, no drafter model), "
             "mixed-suffix (mixed with suffix-tree branches), lookahead (lookahead decoding: Jacobi window and n-gram pool, no "
             "drafter model). Sized by measured cost.")
LOOKAHEAD_SHAPE_HELP = ("Lookahead decoding's window, n-gram length and guesses as W,N,G (e.g. 15,3,15) instead of the "
                        "shape sized from measured pass costs.")
TREE_SCHEME_HELP = ("How a sampled tree draws the drafter's side tokens: without-replacement (recursive rejection "
                    "sampling), iid (SpecInfer), deterministic (the next ranks). Exact either way; greedy ignores it.")


@app.command()
def generate(
    prompt: Optional[str] = typer.Argument(None, help="The prompt text (or --prompts FILE)."),
    prompts_file: Optional[Path] = typer.Option(None, "--prompts", help="A JSONL file of prompts, one object per "
                                                "line: 'prompt', and optionally 'chat', 'temperature', 'top_k', "
                                                "'top_p', 'seed', 'max_new_tokens' (else the options'); generated "
                                                "--batch-size at a time, one target pass per step for all."),
    batch_size: int = typer.Option(8, "--batch-size", help="With --prompts: the most sequences decoded at once."),
    kv_memory: Optional[str] = typer.Option(None, "--kv-memory", help="With --prompts: a budget for the running "
                                            "sequences' KV caches (e.g. 2GiB, 512MiB); prompts beyond it wait."),
    target: str = typer.Option(registry.DEFAULT_TARGET, help="Target model: registry name, HF directory or .gguf."),
    drafter: str = typer.Option(registry.DEFAULT_DRAFTER, help="Drafter: a model (same vocabulary as the target), "
                                "or 'ngram' (NASD, built online), 'lookup' (prompt lookup), 'suffix' (suffix "
                                "drafting; with --prompts over earlier outputs too) or 'retrieval:DIR' (a "
                                "datastore, `specdec datastore build`), which need no model; "
                                "or the target drafting for itself: 'medusa:DIR' or 'eagle:DIR' (from `specdec "
                                "train-heads`; token trees) or 'self-skip[:LAYERS]' (layers skipped, chosen at start)."),
    method: str = typer.Option("default", help=METHOD_HELP),
    gamma: int = typer.Option(5, help="Draft tokens per step (γ ≥ 1) for the fixed schedule; start of heuristic."),
    schedule: Optional[str] = typer.Option(None, help="Draft length: cost (stop when the draft is unlikely to pay "
                                           "for another token, from measured costs), fixed, heuristic (+2 / −1), "
                                           "confidence (stop below τ), egag (entropy-guided). Default: the method's "
                                           "(cost; fixed for sd)."),
    gamma_min: int = typer.Option(1, "--gamma-min", help="Smallest γ (heuristic, egag)."),
    gamma_max: int = typer.Option(20, "--gamma-max", help="Largest γ (cost, heuristic, confidence, egag)."),
    egag_beta: float = typer.Option(0.0, "--egag-beta", help="EGAG's EMA weight on past entropy (0 = none)."),
    confidence: float = typer.Option(0.4, help="τ of the confidence schedule."),
    ngram_n: int = typer.Option(4, "--ngram-n", help="Longest n-gram of the ngram drafter."),
    lenience: float = typer.Option(1.0, help="1 = exact; l in (0, 1) accepts more drafts and is LOSSY under "
                                   "sampling (no token above p/l)."),
    typical: bool = typer.Option(False, "--typical", help="Medusa's typical acceptance: accept x where "
                                 "p(x) > min(ε, δ·exp(-H(p))); LOSSY under sampling, greedy unchanged; chains only."),
    typical_epsilon: float = typer.Option(0.09, "--typical-epsilon", help="ε of --typical."),
    typical_delta: float = typer.Option(0.3, "--typical-delta", help="δ of --typical."),
    cascade: str = typer.Option("off", "--cascade", help="off, suffix or lookup: a model-free stage guesses the "
                                "drafter model's tokens, which it keeps where its own rule would draw them (exact)."),
    debug: bool = typer.Option(False, help="Print every step: drafts with q, p and the uniform draw, verdicts, "
                               "the target's token, γ and H_norm."),
    temperature: float = typer.Option(0.0, help="0 means greedy."),
    top_k: int = typer.Option(0, "--top-k", help="Keep the k most likely tokens (0 = off)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus mass to keep (1 = off)."),
    seed: Optional[int] = typer.Option(None, help="Seed for sampling (repeatable runs)."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", help="Most tokens to generate."),
    chat: bool = typer.Option(False, help="Wrap the prompt in the target's chat template."),
    first_target: bool = typer.Option(True, help="Take the first token from the target's prompt pass."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of coloured text."),
    dtype: str = typer.Option("auto", "--dtype", "--weights", help=TARGET_DTYPE_HELP),
    drafter_dtype: str = typer.Option("auto", help=DRAFTER_DTYPE_HELP),
    drafter_vocab: Optional[int] = typer.Option(None, "--drafter-vocab", help=DRAFTER_VOCAB_HELP),
    drafter_vocab_corpus: Optional[str] = typer.Option(None, "--drafter-vocab-corpus",
                                                       help=DRAFTER_VOCAB_CORPUS_HELP),
    device: str = typer.Option("auto", help="auto, cpu or cuda."),
    exact_rows: Optional[bool] = typer.Option(None, "--exact-rows/--batched-rows", help=EXACT_ROWS_HELP),
    tree: str = typer.Option("off", help=TREE_HELP),
    tree_nodes: int = typer.Option(64, "--tree-nodes", help="Most nodes in a token tree (its size is chosen by "
                                   "measured cost up to this)."),
    tree_scheme: str = typer.Option("without-replacement", "--tree-scheme", help=TREE_SCHEME_HELP),
    lookahead_shape: Optional[str] = typer.Option(None, "--lookahead-shape", help=LOOKAHEAD_SHAPE_HELP +
                                                  " With --tree lookahead."),
    online: bool = typer.Option(False, "--online", help="With --prompts (--batch-size 1) and a drafter model's "
                                "chains: the drafter learns from its rejected drafts (OSD), its adapter updated "
                                "between prompts. Outputs stay exact."),
):
    """Generate text, showing which tokens the drafter proposed and which the target chose."""
    from .display import LEGEND, DebugPrinter, StepPrinter, summary_line
    from .generate import autoregressive_generate, speculative_generate
    from .drafters import SuffixCache
    from .methods import METHODS, Parts, build, open_files
    from .samplers import Sampler

    try:
        check_vocab_options(drafter_vocab, drafter_vocab_corpus)  # before minutes of loading
        sampler = Sampler(temperature=temperature, top_k=top_k, top_p=top_p)
        if prompts_file is not None:
            if prompt is not None:
                raise SpecdecError("give a prompt or --prompts FILE, not both")
            rows = read_prompt_rows(prompts_file, sampler, max_new_tokens)  # before minutes of loading
            if batch_size < 1:
                raise SpecdecError(f"--batch-size must be >= 1, got {batch_size}")
            if debug:
                raise SpecdecError("--debug shows one generation's steps; drop it with --prompts")
            kv_budget = parse_bytes(kv_memory, "--kv-memory") if kv_memory is not None else None
        elif kv_memory is not None:
            raise SpecdecError("--kv-memory bounds a batch: use it with --prompts")
        elif prompt is None or not prompt.strip():
            raise SpecdecError("empty prompt")
        if gamma < 1:
            raise SpecdecError(f"--gamma must be >= 1, got {gamma}")
        config = spec_config(method, drafter, tree, cascade, schedule, lenience, typical, gamma=gamma,
                             gamma_min=gamma_min, gamma_max=gamma_max, egag_beta=egag_beta, confidence=confidence,
                             ngram_n=ngram_n, tree_nodes=tree_nodes, tree_scheme=tree_scheme,
                             typical_epsilon=typical_epsilon, typical_delta=typical_delta,
                             lookahead_shape=_lookahead_shape(lookahead_shape))
        if _encoder_decoder(target):
            _generate_seq2seq(prompt, target, config, sampler, dtype, device, max_new_tokens, seed, first_target,
                              as_json, prompts_file is not None or chat or dtype == "gguf")
            return
        open_files(config)
        _check_runs_on(dtype, config)
        if config.needs_drafter_model():
            drafter_dtype = _drafter_weights(dtype, config.drafter, drafter_dtype,
                                             bool(drafter_vocab or drafter_vocab_corpus))
        if online and (prompts_file is None or batch_size != 1 or config.method != "chain" or dtype == "gguf"):
            raise SpecdecError("--online updates a drafter model between prompts: use it with --prompts FILE, "
                               "--batch-size 1, --drafter MODEL, chains (no --tree, --cascade) and --dtype auto")
        if prompts_file is not None:  # before minutes of loading
            if config.acceptance != "exact":
                raise SpecdecError("--lenience and --typical apply to one generation; drop them with --prompts")
            if METHODS[config.method].self_drafting:
                raise SpecdecError(f"--drafter {drafter} drafts from the target's hidden states, which batched "
                                   "passes do not keep yet; generate its prompts one at a time")
            if batch_size > 1 and exact_rows is None:
                exact_rows = True  # a sequence's output must not depend on what shares its passes
        sequences = batch_size if prompts_file is not None else 1  # a llama.cpp model's live sequences
        target_model = _load(target, dtype, device, "target", exact_rows, sequences=sequences)
        drafter_model = _load(config.drafter, drafter_dtype, device, "drafter", _chain_drafter_rows(config, exact_rows),
                              vocab=drafter_vocab, vocab_corpus=drafter_vocab_corpus, sequences=sequences) \
            if config.speculative and config.needs_drafter_model() else None
        # measured costs size drafts, but not where a seed's output hangs on them (the stream rule, lossy rules)
        pinned = prompts_file is None and _seed_pins(seed, sampler, config)
        parts = Parts(target_model, drafter_model, costs=None if pinned else
                      lambda model: _measured_costs(target_model, model),
                      suffix_cache=SuffixCache() if prompts_file is not None else None)  # earlier prompts' outputs
        speculation = build(config, parts)
        if prompts_file is not None:
            if online:
                from .adapter import OnlineDistiller

                OnlineDistiller(drafter_model)
            _generate_batch(target_model, speculation, rows, batch_size, as_json, chat, kv_budget,
                            online=drafter_model.online if online else None)
            return
        drafter_used = _first_drafter(speculation)
        plan = speculation.make_schedule() if config.speculative else None
        ids = target_model.encode(prompt, chat=chat)
        out = Console()
        printer = None if as_json else StepPrinter(target_model, out)
        if debug and config.speculative and not as_json:
            printer = DebugPrinter(target_model, out)
        if printer is not None and config.speculative:
            err.print(LEGEND)
        if config.speculative:
            result = speculative_generate(ids, target_model, drafter_used, sampler=sampler,
                                          max_new_tokens=max_new_tokens, seed=seed, first_target=first_target,
                                          on_step=printer, schedule=plan, lenience=config.effective_lenience(),
                                          debug=debug, typical=config.typical(), seed_rule=config.seed_rule)
        else:
            result = autoregressive_generate(ids, target_model, sampler=sampler, max_new_tokens=max_new_tokens,
                                             seed=seed, on_step=printer)
    except SpecdecError as exc:
        _fail(str(exc))
    shown = "sd" if config.speculative else "ar"
    if as_json:
        stats = result.stats.to_dict()
        payload = {"text": target_model.decode(result.tokens), "tokens": result.tokens, "stats": stats,
                   "stop_reason": result.stop_reason, "method": config.method, "spec": config.to_dict(),
                   "target": target_model.name, "drafter": drafter_used.name if drafter_used is not None else None,
                   "weights": {"target": target_model.weights, "drafter": _weights_of(drafter_used)},
                   "sampler": sampler.describe(), "schedule": plan.describe() if plan is not None else None,
                   "steps": [{"drafted": s.draft_tokens, "accepted": s.num_accepted, "next": s.next_token, **s.info,
                              **({"parents": s.tree_parents, "path": s.path} if s.tree_parents is not None else {})}
                             for s in result.steps]}
        print(json.dumps(payload, ensure_ascii=False))
    else:
        out.print()
        if debug and config.speculative:
            out.print(target_model.decode(result.tokens), highlight=False)
        err.print(f"[dim]{summary_line(result.stats, shown)} · stop: {result.stop_reason} · "
                  f"weights: {target_model.weights}[/]",
                  highlight=False)


def spec_config(method: str, drafter: str | None, tree: str = "off", cascade: str = "off",
                schedule: str | None = None, lenience: float = 1.0, typical: bool = False, **fields):
    """The `SpecConfig` of a command's flags (`methods.from_options`)."""
    from .methods import from_options

    return from_options(method, drafter, tree, cascade, schedule, lenience, typical, **fields)


def _seed_pins(seed, sampler, config) -> bool:
    from .generate import seed_pins_drafts

    return seed_pins_drafts(seed, sampler, config.effective_lenience(), config.typical(), config.seed_rule)


def _first_drafter(speculation):
    """One generation's drafter of a built speculation (None for ar); a self-skip drafter's layer
    search is shown as it runs and its choice printed."""
    if speculation.make_drafter is None:
        return None
    if speculation.config.method != "self-skip":
        return speculation.make_drafter()
    with err.status("choosing the layers to skip…"):
        drafter = speculation.make_drafter()
    if drafter.search:
        best = next(t for t in drafter.search["trials"] if t["skip"] == drafter.model.skip)
        err.print(f"[dim]self-skip: skipping layers {drafter.model.skip} (calibration α {best['alpha']}, "
                  f"c ≈ {best['c']})[/]", highlight=False)
    return drafter


def _encoder_decoder(target: str) -> bool:
    """Whether --target names a local encoder-decoder model directory (T5, BART)."""
    from .models import _is_encoder_decoder

    path = Path(target).expanduser()
    return path.is_dir() and (path / "config.json").exists() and _is_encoder_decoder(path)


def _generate_seq2seq(prompt: str, target: str, config, sampler, dtype: str, device: str, max_new_tokens: int,
                      seed: int | None, first_target: bool, as_json: bool, refused: bool) -> None:
    """`generate` on an encoder-decoder target: the source encoded once per model, chain drafts from
    a smaller encoder-decoder of the same vocabulary, or prompt lookup / n-gram over the output.
    refused: options given that it does not take (--prompts, --chat, --dtype gguf)."""
    from .display import LEGEND, StepPrinter, summary_line
    from .generate import speculative_generate_encoder_decoder
    from .methods import Parts, build
    from .models import load_seq2seq

    if refused or config.method not in ("ar", "chain", "lookup", "ngram"):
        raise SpecdecError("an encoder-decoder target (T5, BART) takes one prompt and chain drafts from an "
                           "encoder-decoder model directory, lookup or ngram (--drafter), or none (--method ar): "
                           "drop --prompts, --tree, --chat, --cascade and --dtype gguf")
    if config.method == "chain" and not _encoder_decoder(config.drafter):
        raise SpecdecError(f"an encoder-decoder target drafts with an encoder-decoder model directory, lookup or "
                           f"ngram (--drafter), or not at all (--method ar); {config.drafter!r} is none of these")
    say = lambda m: err.print(f"[dim]{m}[/]", highlight=False)  # noqa: E731
    weights = "fp32" if dtype == "auto" else dtype
    target_model = load_seq2seq(target, weights, device, say)
    drafter_model = load_seq2seq(config.drafter, weights, device, say) if config.method == "chain" else None
    speculation = build(config, Parts(target_model, drafter_model))
    drafter_used = speculation.make_drafter() if config.speculative else None
    out = Console()
    printer = None if as_json else StepPrinter(target_model, out)
    if printer is not None and drafter_used is not None:
        err.print(LEGEND)
    result = speculative_generate_encoder_decoder(
        target_model.encode(prompt), target_model, drafter_used, sampler=sampler, max_new_tokens=max_new_tokens,
        seed=seed, first_target=first_target, on_step=printer,
        schedule=speculation.make_schedule() if drafter_used is not None else None,
        lenience=config.effective_lenience(), typical=config.typical())
    method = "sd" if drafter_used is not None else "ar"
    if as_json:
        print(json.dumps({"text": target_model.decode(result.tokens), "tokens": result.tokens,
                          "stats": result.stats.to_dict(), "stop_reason": result.stop_reason, "method": method,
                          "target": target_model.name, "drafter": getattr(drafter_used, "name", None),
                          "sampler": sampler.describe()}, ensure_ascii=False))
    else:
        out.print()
        err.print(f"[dim]{summary_line(result.stats, method)} · stop: {result.stop_reason}[/]", highlight=False)


UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def _positive_ints(text: str, option: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4] ('' -> []); a one-line error naming `option` otherwise."""
    try:
        values = [int(v) for v in _csv(text)] if text else []
        if any(v < 1 for v in values):
            raise ValueError
    except ValueError:
        _fail(f"{option} must be comma-separated integers >= 1, got {text!r}")
    return values


def parse_bytes(text: str, option: str) -> int:
    """'2GiB', '512MiB', '1.5GB', '1000000' -> bytes; SpecdecError naming `option` otherwise."""
    import re

    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match and match.group(2).lower()
    if not match or unit not in UNITS or float(match.group(1)) * UNITS[unit] < 1:
        raise SpecdecError(f"{option} takes a size such as 2GiB, 512MiB or 1.5GB, got {text!r}")
    return int(float(match.group(1)) * UNITS[unit])


def read_prompt_rows(path: Path, sampler, max_new_tokens: int) -> list[dict]:
    """The rows of a --prompts JSONL file, each with its sampler and limits resolved; a clear error
    naming the line for anything else."""
    from .samplers import Sampler

    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise SpecdecError(f"cannot read --prompts {path}: {exc.strerror or exc}") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise SpecdecError(f"{path}:{number}: not a JSON object") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise SpecdecError(f"{path}:{number}: needs a non-empty string 'prompt'")
        unknown = set(row) - {"prompt", "chat", "temperature", "top_k", "top_p", "seed", "max_new_tokens"}
        if unknown:
            raise SpecdecError(f"{path}:{number}: unknown field(s) {', '.join(sorted(unknown))}")
        try:
            row["sampler"] = Sampler(temperature=row.get("temperature", sampler.temperature),
                                     top_k=row.get("top_k", sampler.top_k), top_p=row.get("top_p", sampler.top_p))
        except (SpecdecError, TypeError) as exc:
            raise SpecdecError(f"{path}:{number}: {exc}") from None
        row["max_new_tokens"] = row.get("max_new_tokens", max_new_tokens)
        seed = row.get("seed")
        if seed is not None and not isinstance(seed, int):
            raise SpecdecError(f"{path}:{number}: 'seed' must be an integer")
        rows.append(row)
    if not rows:
        raise SpecdecError(f"{path} holds no prompt")
    return rows


def _generate_batch(target_model, speculation, rows: list[dict], batch_size: int, as_json: bool, chat: bool,
                    kv_memory: int | None = None, online=None) -> None:
    """Every row of a --prompts file through the engine, `batch_size` at a time; output in the
    file's order (a JSON line per prompt with --json), then one summary line. speculation: the
    built `methods.Speculation`, a drafter and a schedule per row; a row's output is that of its
    prompt alone (greedy, or seeded: the seeded AR output), whatever its batch. online: an
    `adapter.OnlineDistiller` on the drafter, updated after each row (the rows then run one by one)."""
    import time

    from .engine import Engine, Request

    engine = Engine(target_model, batch_size, kv_memory)
    requests = []
    for row in rows:
        requests.append(Request(
            target_model.encode(row["prompt"], chat=bool(row.get("chat", chat))), speculation.make_drafter,
            sampler=row["sampler"], max_new_tokens=row["max_new_tokens"], seed=row.get("seed"),
            schedule=speculation.make_schedule, seed_rule=speculation.config.seed_rule))
    method = speculation.config.method
    began = time.perf_counter()
    if online is None:
        ids = [engine.add(request) for request in requests]
        with err.status(f"generating {len(rows)} prompts, {batch_size} at a time…"):
            results = engine.run()
    else:  # one request at a time, the drafter updated between them
        ids, results = [], {}
        with err.status(f"generating {len(rows)} prompts, the drafter learning between them…") as status:
            for number, request in enumerate(requests, 1):
                ids.append(engine.add(request))
                results.update(engine.run())
                update = online.update()
                if update is not None:
                    status.update(f"prompt {number} of {len(rows)} done; the drafter learnt from "
                                  f"{update['records']} rejected positions")
    seconds = time.perf_counter() - began
    out = Console()
    for number, (row, request_id) in enumerate(zip(rows, ids), 1):
        result = results[request_id]
        text = target_model.decode(result.tokens)
        if as_json:
            print(json.dumps({"text": text, "tokens": result.tokens, "stats": result.stats.to_dict(),
                              "stop_reason": result.stop_reason, "method": method, "target": target_model.name,
                              "weights": {"target": target_model.weights}, "sampler": row["sampler"].describe(),
                              "batch_size": batch_size}, ensure_ascii=False))
        else:
            out.rule(f"prompt {number}", style="dim")
            out.print(text, highlight=False)
    tokens = sum(len(r.tokens) for r in results.values())
    learnt = "" if online is None else f" · {online.updates} drafter updates ({online.seconds:.1f} s)"
    err.print(f"[dim]{len(rows)} prompts · {tokens} tokens in {seconds:.2f} s · {tokens / seconds:.2f} tok/s "
              f"in all · {engine.passes} target passes · batch {batch_size} · weights: {target_model.weights}{learnt}[/]",
              highlight=False)


@app.command()
def chat(
    target: str = typer.Option(registry.DEFAULT_TARGET, help="Target model."),
    drafter: str = typer.Option(registry.DEFAULT_DRAFTER, help="Drafter: a model, ngram, lookup, suffix, "
                                "medusa:DIR, eagle:DIR or self-skip[:LAYERS] (as generate's)."),
    method: str = typer.Option("default", help=METHOD_HELP),
    tree: str = typer.Option("off", help="The tree method's shape (as generate's --tree)."),
    schedule: Optional[str] = typer.Option(None, help="cost, fixed, heuristic, confidence, egag (default: the "
                                           "method's)."),
    gamma: int = typer.Option(5),
    gamma_max: int = typer.Option(20, "--gamma-max"),
    temperature: float = typer.Option(0.0, help="0 means greedy."),
    top_k: int = typer.Option(0, "--top-k"),
    top_p: float = typer.Option(1.0, "--top-p"),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", help="Most tokens per reply."),
    debug: bool = typer.Option(False, help="Start with the step view on."),
    dtype: str = typer.Option("auto", "--dtype", "--weights", help=TARGET_DTYPE_HELP),
    drafter_dtype: str = typer.Option("auto", help=DRAFTER_DTYPE_HELP),
    drafter_vocab: Optional[int] = typer.Option(None, "--drafter-vocab", help=DRAFTER_VOCAB_HELP),
    drafter_vocab_corpus: Optional[str] = typer.Option(None, "--drafter-vocab-corpus",
                                                       help=DRAFTER_VOCAB_CORPUS_HELP),
    device: str = typer.Option("auto"),
):
    """Chat interactively; /help lists the commands that switch method, drafter, schedule, sampler, debug."""
    from .chat import ChatSession
    from .samplers import Sampler

    try:
        check_vocab_options(drafter_vocab, drafter_vocab_corpus)  # before minutes of loading
        sampler = Sampler(temperature=temperature, top_k=top_k, top_p=top_p)
        # the session builds its speculation lazily (outside this handler); a bad value must fail
        # here, before minutes of model loading, as one error line
        config = spec_config(method, drafter, tree, schedule=schedule, gamma=gamma, gamma_max=gamma_max)
        _check_runs_on(dtype, config)
        drafter_dtype = _drafter_weights(dtype, drafter, drafter_dtype, bool(drafter_vocab or drafter_vocab_corpus))
        target_model = _load(target, dtype, device, "target")
        if not getattr(target_model.tokenizer, "chat_template", None):
            raise SpecdecError(f"{target_model.name} has no chat template")

        def load_drafter(name: str):
            return _load(name, drafter_dtype, device, "drafter", vocab=drafter_vocab, vocab_corpus=drafter_vocab_corpus)

        session = ChatSession(target_model, load_drafter, drafter, Console(), method, schedule, gamma,
                              gamma_max, sampler, debug, max_new_tokens, tree)
        session.speculation()  # load it now: a bad name fails before the first prompt
    except SpecdecError as exc:
        _fail(str(exc))
    err.print(f"[dim]{session.describe()} — /help for commands, /quit to leave[/]", highlight=False)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            break
        if not session.handle(line):
            break


@app.command("train-heads")
def train_heads(
    out: str = typer.Option(..., "--out", help="Folder to write the heads into (resumes a run stopped there)."),
    target: str = typer.Option(registry.DEFAULT_TARGET, help="Target model the heads draft for."),
    kind: str = typer.Option("medusa", help="medusa (K heads on the last hidden state) or eagle (a one-layer "
                             "feature drafter)."),
    corpus: str = typer.Option("stdlib", help="Training text: stdlib (Python's standard library sources), "
                               "humaneval, spec-bench, or a text file."),
    tokens: int = typer.Option(32768, help="Corpus tokens to run through the target (a tenth is held out)."),
    heads: int = typer.Option(3, "--heads", help="Medusa: heads; head k predicts the token k+1 ahead."),
    vocab: int = typer.Option(32768, help="Most frequent ids the loss and the drafting score."),
    epochs: Optional[int] = typer.Option(None, help="Passes over the corpus (default: medusa 3, eagle 4)."),
    batch: Optional[int] = typer.Option(None, help="Examples per step (default: medusa 64 positions, eagle 2 "
                                        "sequences)."),
    lr: Optional[float] = typer.Option(None, "--lr", help="Peak learning rate (default: medusa 1e-3, eagle 5e-4)."),
    seq_len: int = typer.Option(256, "--seq-len", help="Tokens per target pass while caching hidden states."),
    unroll: int = typer.Option(2, help="EAGLE: passes per sequence, the later ones on its own predicted features."),
    intermediate: int = typer.Option(0, help="EAGLE: MLP width (0: 8/3 of the hidden size)."),
    seed: int = typer.Option(0),
    dtype: str = typer.Option("auto", "--dtype", help="Target dtype while caching its hidden states (auto, bf16, fp32)."),
    device: str = typer.Option("auto", help="auto, cpu or cuda."),
):
    """Train self-drafting heads for a target (self-distillation: they learn what the target would say)."""
    from .training.eagle import EagleTrainConfig, train_eagle
    from .training.medusa import TrainConfig, train_medusa

    try:
        if kind not in ("medusa", "eagle"):
            raise SpecdecError(f"unknown kind of heads {kind!r}: medusa or eagle")
        defaults = TrainConfig() if kind == "medusa" else EagleTrainConfig()
        epochs = defaults.epochs if epochs is None else epochs
        batch = defaults.batch if batch is None else batch
        lr = defaults.lr if lr is None else lr
        for name, value in (("tokens", tokens), ("heads", heads), ("vocab", vocab), ("epochs", epochs),
                            ("batch", batch), ("unroll", unroll)):
            if value < 1:
                raise SpecdecError(f"--{name} must be >= 1, got {value}")
        if not lr > 0 or intermediate < 0:
            raise SpecdecError(f"--lr must be > 0 and --intermediate >= 0, got {lr} and {intermediate}")
        if corpus not in ("stdlib", "humaneval", "spec-bench") and not Path(corpus).is_file():
            raise SpecdecError(f"corpus not found: {corpus} (stdlib, humaneval, spec-bench or a text file)")
        if dtype == "gguf":
            raise SpecdecError("training heads needs the target's hidden states: use --dtype auto, bf16 or fp32")
        target_model = _load(target, dtype, device, "target", exact_rows=False)
        say = lambda m: err.print(f"[dim]{m}[/]", highlight=False)  # noqa: E731
        if kind == "medusa":
            trained = train_medusa(target_model, corpus, out, TrainConfig(
                num_heads=heads, tokens=tokens, vocab=vocab, seq_len=seq_len, epochs=epochs, batch=batch, lr=lr,
                seed=seed), say=say)
            what = f"{trained.info['num_heads']} Medusa heads"
        else:
            trained = train_eagle(target_model, corpus, out, EagleTrainConfig(
                tokens=tokens, vocab=vocab, seq_len=seq_len, epochs=epochs, batch=batch, lr=lr, seed=seed,
                intermediate=intermediate, unroll=unroll), say=say)
            what = "an EAGLE drafter"
    except SpecdecError as exc:
        _fail(str(exc))
    info = trained.info
    err.print(f"{what} for {info['target']} in {out}: held-out loss {info['heldout_loss']:.3f} (untrained "
              f"{info['heldout_loss_untrained']:.3f}), top-1 per "
              f"{'head' if kind == 'medusa' else 'depth'} " + ", ".join(f"{a:.3f}" for a in info["heldout_top1"])
              + f"; {info['seconds']:.0f} s", highlight=False)


@app.command("distill-drafter")
def distill_drafter_command(
    out: str = typer.Option(..., "--out", help="Folder to write the adapter into (resumes a run stopped there); "
                            "use it as --drafter distilled:OUT."),
    target: str = typer.Option(registry.DEFAULT_TARGET, help="Target model the drafter should agree with."),
    drafter: str = typer.Option(registry.DEFAULT_DRAFTER, help="Drafter model to distil (same tokenizer)."),
    corpus: str = typer.Option("stdlib", help="Where the contexts come from: stdlib (Python's standard library "
                               "sources), humaneval, spec-bench, or a text file."),
    tokens: int = typer.Option(16384, help="Positions to train on: the contexts and the drafter's continuations "
                               "(a tenth of the sequences is held out)."),
    context: int = typer.Option(64, help="Corpus tokens each sequence starts from."),
    continuation: int = typer.Option(64, help="Tokens the drafter samples after each context (on-policy data)."),
    rank: int = typer.Option(8, help="LoRA rank on each projection of the drafter's layers."),
    loss: str = typer.Option("tvd", help="tvd (1 - acceptance: the loss acceptance reads) or fkl."),
    epochs: int = typer.Option(2),
    batch: int = typer.Option(4, help="Sequences per optimiser step."),
    lr: float = typer.Option(1e-3, "--lr", help="Peak learning rate (cosine schedule)."),
    seed: int = typer.Option(0),
    drafter_dtype: str = typer.Option("auto", "--drafter-dtype", help="The drafter's weights while training; "
                                      "train on the weights it will draft with. " + DRAFTER_DTYPE_HELP),
    device: str = typer.Option("auto", help="auto, cpu or cuda."),
):
    """Distil a drafter towards a target (DistillSpec): a LoRA adapter on the drafter's layers,
    trained on the drafter's own samples scored by the target. Prints held-out acceptance before
    and after."""
    from .adapter import DistillConfig, distill_drafter

    try:
        if corpus not in ("stdlib", "humaneval", "spec-bench") and not Path(corpus).is_file():
            raise SpecdecError(f"corpus not found: {corpus} (stdlib, humaneval, spec-bench or a text file)")
        if drafter_dtype == "gguf":
            raise SpecdecError("distillation needs the drafter's hidden states: --drafter-dtype auto, int8, bf16 or fp32")
        config = DistillConfig(tokens=tokens, context=context, continuation=continuation, rank=rank, loss=loss,
                               epochs=epochs, batch=batch, lr=lr, seed=seed)
        for name in ("tokens", "context", "continuation", "rank", "epochs", "batch"):
            if getattr(config, name) < 1:
                raise SpecdecError(f"--{name} must be >= 1, got {getattr(config, name)}")
        if not lr > 0 or loss not in ("tvd", "fkl"):
            raise SpecdecError(f"--lr must be > 0 and --loss tvd or fkl, got {lr} and {loss!r}")
        if drafter.startswith("distilled:"):
            raise SpecdecError("distil the plain drafter model, not a distilled one")
        target_model = _load(target, "auto", device, "target", exact_rows=False)
        drafter_model = _load(drafter, drafter_dtype, device, "drafter")
        made = distill_drafter(target_model, drafter_model, corpus, out, config,
                               say=lambda m: err.print(f"[dim]{m}[/]", highlight=False))
    except SpecdecError as exc:
        _fail(str(exc))
    info = made.info
    before, after = info["heldout_before"], info["heldout_after"]
    err.print(f"an adapter for {info['drafter']} towards {info['target']} in {out} (--drafter distilled:{out}): "
              f"held-out acceptance {before['acceptance']:.3f} -> {after['acceptance']:.3f}, greedy agreement "
              f"{before['greedy_agreement']:.3f} -> {after['greedy_agreement']:.3f} over {info['heldout_tokens']} "
              f"positions; {info['seconds']:.0f} s", highlight=False)


@app.command("export-heads")
def export_heads_command(
    folder: str = typer.Argument(..., help="A folder of heads trained here (specdec train-heads --out)."),
    out: str = typer.Option(..., "--out", help="New folder to write the exported heads into."),
    fmt: str = typer.Option("medusa", "--format", help="medusa (vLLM's Medusa layout). eagle is refused: "
                            "the engines' EAGLE layer differs from ours."),
    target: Optional[str] = typer.Option(None, help="The target the heads were trained for (default: the one "
                                         "their checkpoint names); its output-head rows are copied."),
    dtype: str = typer.Option("auto", "--dtype", help="Target dtype: the exported head rows keep it."),
):
    """Write heads trained here in the layout another engine loads (vLLM's Medusa)."""
    from .export import check_format, export_heads
    from .training.medusa import load_heads

    try:
        check_format(fmt)  # before minutes of loading
        heads = load_heads(folder)
        if dtype == "gguf":
            raise SpecdecError("exporting copies the target's output-head rows: use --dtype auto, bf16 or fp32")
        target_model = _load(target or heads.info.get("target") or registry.DEFAULT_TARGET, dtype, "cpu", "target",
                             exact_rows=False)
        with err.status("writing…"):
            written = export_heads(heads, target_model, out, fmt)
    except SpecdecError as exc:
        _fail(str(exc))
    err.print(f"{heads.heads.num_heads} Medusa heads for {target_model.name} in {written} (vLLM: speculative_config "
              f"{{\"model\": \"{written}\", \"num_speculative_tokens\": {heads.heads.num_heads}}})", highlight=False)


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


@app.command("methods")
def methods_command(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object: each name's config and summary."),
):
    """List the speculation methods and presets that generate, chat, serve and bench take."""
    from rich.table import Table

    from .methods import METHODS as REGISTRY, names, preset, summary

    if as_json:
        print(json.dumps({name: {"config": preset(name).to_dict(), "summary": summary(name),
                                 "kind": "method" if name in REGISTRY else "preset"} for name in names()},
                         ensure_ascii=False))
        return
    table = Table("name", "is", "what it does", title="methods (--method NAME; serve: speculative.method)",
                  title_justify="left")
    for name in names():
        config = {k: v for k, v in preset(name).to_dict().items() if k != "method"}
        kind = "method" if name in REGISTRY else preset(name).method + "".join(
            f", {k}={v}" for k, v in config.items())
        table.add_row(name, kind, summary(name))
    Console().print(table)
    err.print("[dim]options (--gamma, --tree-nodes, --schedule, ...) apply on top; `specdec bench --methods` also "
              "takes its peers (hf*, llama-cpp*), beam, beam-sd, sd-distilled, sd-online, sd-other-tokenizer[/]",
              highlight=False)


@app.command()
def models():
    """List the embedded models and whether they are installed."""
    from rich.table import Table

    table = Table("name", "installed", "description")
    for spec in registry.MODELS.values():
        table.add_row(spec.name, "yes" if registry.is_installed(spec.name) else "no", spec.description)
    Console().print(table)
    err.print(f"cache: {registry.home()}")


def _skip_layers(text: str | None) -> list[int] | None:
    """--skip-layers 5,10,15 -> [5, 10, 15]; None: chosen by the self-skip search."""
    if not text:
        return None
    from .spec import from_flags

    return list(from_flags(f"self-skip:{text}")["skip_layers"])


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


@app.command()
def bench(
    dataset: str = typer.Option("humaneval", help="Comma-separated: humaneval, spec-bench (chat template; its "
                                "dev subset, carried), or JSONL files with a 'prompt' or 'turns' field. Each may carry "
                                "its own limit and temperatures: NAME:LIMIT:T+T, e.g. spec-bench:1:0+1."),
    limit: int = typer.Option(20, help="Prompts per dataset (per task for datasets with tasks)."),
    tasks: Optional[str] = typer.Option(None, help="Comma-separated tasks to keep (spec-bench: mt_bench, "
                                        "translation, summarization, qa, math_reasoning, rag)."),
    methods: str = typer.Option(None, help="Default: ar,sd-cost,hf (with --concurrency: ar,sd-cost,lookup,"
                                "tree-mixed,hf-cb,hf-padded). Comma-separated: ar, sd, sd-cost, sd-typical (LOSSY), sd-heuristic, sd-confidence, sd-egag, "
                                "ngram, lookup, suffix, retrieval (--datastore DIR), tree-sides, tree-eagle2, tree-sequoia, tree-lookup, tree-mixed, "
                                "tree-suffix, tree-mixed-suffix, lookahead, beam and beam-sd (beam search, plain and speculative; greedy prompts), cascade, "
                                "sd-distilled (--distilled DIR), sd-online (the drafter learning between prompts), medusa, eagle, medusa-uncalibrated, eagle-uncalibrated, self-skip (ours); hf, "
                                "hf-assisted, hf-assisted-fixed, hf-lookup (transformers' generate: plain, with the "
                                "drafter at its defaults or at our γ, with prompt lookup); sd-other-tokenizer and "
                                "hf-assisted-other-tokenizer (ours and transformers' universal assisted generation, "
                                "with --other-drafter); llama-cpp, llama-cpp-spec, "
                                "llama-cpp-lookup (llama.cpp: plain, drafter model, prompt lookup; the peers extra). With --concurrency: ar, sd-cost, lookup, tree-mixed "
                                "(ours, through the engine), hf-cb (transformers' continuous batching), hf-padded "
                                "(its generate on padded batches)."),
    concurrency: Optional[str] = typer.Option(None, "--concurrency", help="Comma-separated levels, e.g. 1,2,4,8: "
                                              "each method serves all prompts with that many in flight (the engine's "
                                              "batch), reporting total and per-sequence tok/s, TTFT and TPOT p50/p99 "
                                              "and outputs identical to level 1 (one --temperature)."),
    target: str = typer.Option(registry.DEFAULT_TARGET),
    drafter: str = typer.Option(registry.DEFAULT_DRAFTER),
    gamma: int = typer.Option(5, help="γ of the fixed schedule (sd, ngram, lookup, hf-assisted-fixed, hf-lookup)."),
    gamma_min: int = typer.Option(1, "--gamma-min", help="Smallest γ of the heuristic and egag schedules."),
    gamma_max: int = typer.Option(20, "--gamma-max", help="Largest γ of cost, heuristic, confidence and egag."),
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
    other_drafter: str = typer.Option("smollm2-135m", "--other-drafter", help="The drafter model with another "
                                      "tokenizer (sd-other-tokenizer, hf-assisted-other-tokenizer)."),
    datastore: Optional[str] = typer.Option(None, "--datastore", help="A datastore folder (the retrieval method; "
                                            "`specdec datastore build`)."),
    skip_layers: Optional[str] = typer.Option(None, "--skip-layers", help="Comma-separated layers the self-skip "
                                              "method skips (default: chosen by its search at start)."),
    lookahead_shape: Optional[str] = typer.Option(None, "--lookahead-shape", help=LOOKAHEAD_SHAPE_HELP),
    num_beams: int = typer.Option(4, "--num-beams", help="Beams of the beam and beam-sd methods."),
):
    """Compare methods on datasets in one run: interleaved per prompt, after a warm-up."""
    from .bench.methods import Settings
    from .bench.run import run_benchmark

    try:
        check_vocab_options(drafter_vocab, drafter_vocab_corpus)  # before minutes of loading
        try:
            temperatures = [float(t) for t in _csv(temperature)]
        except ValueError:
            raise SpecdecError(f"--temperature takes comma-separated numbers, got {temperature!r}") from None
        from .drafters import check_tree_options

        check_tree_options("mixed", tree_nodes, tree_scheme)
        if not flat_at16 >= 1:
            raise SpecdecError(f"--flat-at16 must be >= 1 (a wide pass costs at least a 1-token one), got {flat_at16}")
        settings = Settings(max_new_tokens=max_new_tokens, gamma=gamma, gamma_min=gamma_min, gamma_max=gamma_max,
                            egag_beta=egag_beta, confidence=confidence, ngram_n=ngram_n, tree_nodes=tree_nodes,
                            tree_scheme=tree_scheme, flat_at16=flat_at16, heads=heads, eagle=eagle, datastore=datastore,
                            distilled=distilled, other_drafter=other_drafter, skip_layers=_skip_layers(skip_layers),
                            lookahead_shape=_lookahead_shape(lookahead_shape), num_beams=num_beams)
        if num_beams < 1:
            raise SpecdecError(f"--num-beams must be >= 1, got {num_beams}")
        if concurrency is not None:
            from .bench.concurrency import check_levels, check_load_methods, run_load_benchmark

            try:
                levels = [int(c) for c in _csv(concurrency)]
            except ValueError:
                raise SpecdecError(f"--concurrency takes comma-separated integers >= 1, got {concurrency!r}") from None
            check_levels(levels)
            chosen = _csv(methods or "ar,sd-cost,lookup,tree-mixed,hf-cb,hf-padded")
            check_load_methods(chosen)
            if len(temperatures) != 1 or dtype != "auto" or samples != 1 or plot or exact_rows is False or \
                    drafter_vocab is not None or drafter_vocab_corpus is not None:
                raise SpecdecError("--concurrency takes one --temperature, --dtype auto, one sample, and none of "
                                   "--plot, --batched-rows, --drafter-vocab, --drafter-vocab-corpus")
            run_load_benchmark(_csv(dataset), limit, chosen, levels, target, drafter, settings, temperatures[0], seed,
                               markdown, json_path, sys.argv, device=device, drafter_dtype=drafter_dtype,
                               tasks=_csv(tasks) if tasks else None)
            return
        methods = methods or "ar,sd-cost,hf"
        run_benchmark(datasets=_csv(dataset), limit=limit, methods=_csv(methods), target=target, drafter=drafter,
                      settings=settings, temperatures=temperatures, tasks=_csv(tasks) if tasks else None, seed=seed,
                      markdown=markdown, json_path=json_path, plot=plot, argv=sys.argv, dtype=dtype,
                      drafter_dtype=drafter_dtype, device=device, exact_rows=exact_rows,
                      drafter_vocab=drafter_vocab, drafter_vocab_corpus=drafter_vocab_corpus, samples=samples)
    except SpecdecError as exc:
        _fail(str(exc))


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
):
    """Measure α, c and the verification cost, then predicted vs measured speedup for each γ."""
    from rich.markdown import Markdown

    from .bench.datasets import load_prompts
    from .bench.measure import measure_markdown, measure_plot, run_measure
    from .samplers import Sampler

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
        if sizes and min(sizes) < 1:
            raise SpecdecError(f"--tree-nodes must be integers >= 1, got {tree_nodes!r}")
        sampler = Sampler(temperature=temperature)
        prompts = load_prompts(dataset, limit, _csv(tasks) if tasks else None)
        target_model = _load(target, dtype, device, "target")
        drafter_model = _load(drafter, drafter_dtype, device, "drafter", vocab=drafter_vocab,
                              vocab_corpus=drafter_vocab_corpus)
        ids = [target_model.encode(p.text, chat=p.chat) for p in prompts]
        result = run_measure(target_model, drafter_model, ids, gamma_values, max_new_tokens, sampler, seed, err,
                             sizes)
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
                  "on CPUs it costs more (docs/kernels.md)[/]")
    except SpecdecError as exc:
        _fail(str(exc))


datastore_app = typer.Typer(no_args_is_help=True, help="Retrieval datastores (REST) for --drafter retrieval:DIR.")
app.add_typer(datastore_app, name="datastore")


@datastore_app.command("build")
def datastore_build(
    corpus: str = typer.Option(..., "--corpus", help="python-stdlib (this Python's standard library, whole "
                               "files), or a text file."),
    out: Path = typer.Option(..., "--out", help="Folder to write (tokens.npy, suffixes.npy, meta.json)."),
    target: str = typer.Option(registry.DEFAULT_TARGET, help="The target whose tokenizer the datastore is for "
                               "(registry name or Hugging Face directory)."),
):
    """Tokenize a corpus and write its suffix array: the datastore `--drafter retrieval:DIR` drafts from."""
    import time

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .datastore import CORPORA, build_from_corpus, corpus_documents

    try:
        if corpus not in CORPORA:
            corpus_documents(corpus)  # a missing or empty file fails before the tokenizer loads
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise SpecdecError(f"--out {out} exists and is not an empty folder; name a new one")
        tokenizer = _tokenizer(target)
        began = time.perf_counter()
        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
        with Progress(*columns, console=err) as progress:
            task = progress.add_task("tokenizing", total=None)

            def advance(done: int, total: int) -> None:
                progress.update(task, completed=done, total=total,
                                description="tokenizing" if done < total else "sorting suffixes")

            meta = build_from_corpus(corpus, tokenizer, len(tokenizer), out, advance)
    except SpecdecError as exc:
        _fail(str(exc))
    size = sum(f.stat().st_size for f in out.iterdir())
    err.print(f"wrote {out}: {meta['tokens']:,} tokens from {meta['documents']} documents ({meta['corpus']}), "
              f"{size / 2**20:.0f} MiB, in {time.perf_counter() - began:.0f} s", highlight=False)


def _tokenizer(target: str):
    """A registry model's or a Hugging Face directory's tokenizer (no weights loaded)."""
    from transformers import AutoTokenizer

    path = Path(target).expanduser()
    if target in registry.MODELS:
        path = registry.require_installed(target)
    elif not path.is_dir():
        raise SpecdecError(f"--target must be a registry model or a Hugging Face directory, not {target}")
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # transformers raises its own types for folders without a tokenizer
        raise SpecdecError(f"could not load the tokenizer of {target}: {exc}") from None


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
    from .bench.forward_cost import forward_cost_table

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
    json_path: Optional[Path] = typer.Option(None, "--json", help="Also write the numbers to this JSON file."),
):
    """Where a generation's time goes on this machine, and what one more row of a target pass costs."""
    from rich.table import Table

    from .bench.kvstorage import kv_storage_profile
    from .bench.profile import pass_profile, profile_record, time_split
    from .generate import speculative_generate
    from .methods import Parts, build, open_files

    try:
        widths = [int(w) for w in _csv(widths_text)]
        if not widths or widths[0] != 1 or any(b <= a for a, b in zip(widths, widths[1:])):
            raise ValueError
    except ValueError:
        _fail(f"--widths must be comma-separated integers rising from 1, got {widths_text!r}")
    batches = _positive_ints(batches_text, "--batches")
    kv_contexts = _positive_ints(kv_text, "--kv-storage")
    try:
        if max_new_tokens < 1:
            raise SpecdecError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
        config = spec_config(method, drafter, tree)
        if not config.speculative:
            raise SpecdecError("profile times a speculative generation; --method ar drafts nothing")
        _check_runs_on(dtype, config)
        open_files(config)
        batched = "--batches" if batches else "--kv-storage" if kv_contexts else None
        if batched and dtype == "gguf":
            raise SpecdecError(f"{batched} times the engine's batched pass, which runs on --dtype auto weights")
        target_model = _load(target, dtype, device, "target")
        if batched and not getattr(target_model, "rows_invariant", False):
            raise SpecdecError(f"{batched} needs row-exact passes for {target_model.name} (the engine's); "
                               "on this machine that is --dtype bf16 on the CPU")
        drafter_model = _load(config.drafter, _drafter_weights(dtype, config.drafter, drafter_dtype, False), device,
                              "drafter") if config.needs_drafter_model() else None
        with err.status("timing passes…"):
            passes = pass_profile(target_model, drafter_model, widths, [1, 2, 4] if drafter_model else [],
                                  batches=batches)
        kv = None
        if kv_contexts:
            with err.status("timing KV cache storage…"):
                kv = kv_storage_profile(target_model, kv_contexts)
        speculation = build(config, Parts(target_model, drafter_model,
                                          costs=lambda model: _measured_costs(target_model, model)))
        drafter_used, plan = _first_drafter(speculation), speculation.make_schedule()
        method = f"tree-{config.tree}" if config.method == "tree" else "sd-cost" if method == "default" else method
        with err.status(f"generating {max_new_tokens} tokens ({method})…"):
            result = speculative_generate(target_model.encode(prompt), target_model, drafter_used,
                                          max_new_tokens=max_new_tokens, schedule=plan)
    except SpecdecError as exc:
        _fail(str(exc))
    out = Console()
    table = Table(title=f"{target_model.name} ({target_model.weights}, {target_model.kernels}): one pass after "
                        "128 cached tokens", title_justify="left")
    table.add_column("rows", justify="right")
    table.add_column("chain pass (ms)", justify="right")
    table.add_column("× 1 row", justify="right")
    table.add_column("ms per added row", justify="right")
    if passes.target_tree_ms:
        table.add_column("tree pass (ms)", justify="right")
    one = passes.target_ms[1]
    for i, width in enumerate(widths):
        ms = passes.target_ms[width]
        added = "" if i == 0 else f"{(ms - passes.target_ms[widths[i - 1]]) / (width - widths[i - 1]):.1f}"
        cells = [str(width), f"{ms:.1f}", f"{ms / one:.2f}", added]
        table.add_row(*cells, *([f"{passes.target_tree_ms[width]:.1f}"] if passes.target_tree_ms else []))
    out.print(table)
    if passes.batch_ms:
        batched = Table(title="the engine's batched pass: sequences × rows each, after 128 cached tokens each",
                        title_justify="left")
        for column in ("sequences", "rows each", "pass (ms)", "× 1 row", "ms per row"):
            batched.add_column(column, justify="right")
        for key, ms in passes.batch_ms.items():
            b, r = (int(x) for x in key.split("x"))
            batched.add_row(str(b), str(r), f"{ms:.1f}", f"{ms / one:.2f}", f"{ms / (b * r):.1f}")
        out.print(batched)
    if kv:
        storage = Table(title=f"KV storage: one step's cache work per sequence ({kv['rows']} rows in and rolled "
                              f"back, all layers), and the batched pass of {kv['batch']} sequences × {kv['rows']} rows",
                        title_justify="left")
        for column in ("cached", "step: concatenated (ms)", "paged (ms)", "slab (ms)", "pass: concatenated (ms)",
                       "slab (ms)"):
            storage.add_column(column, justify="right")
        for context in kv_contexts:
            storage.add_row(str(context), *(f"{kv['step_ms'][s][context]:.2f}" for s in ("dynamic", "paged", "slab")),
                            *(f"{kv['pass_ms'][s][context]:.1f}" for s in ("dynamic", "slab")))
        out.print(storage)
    if passes.drafter_ms:
        out.print(f"drafter {drafter_model.name} ({drafter_model.weights}, {drafter_model.kernels}): " + ", ".join(
            f"{t} token{'s' if t > 1 else ''} {ms:.1f} ms" for t, ms in passes.drafter_ms.items()), highlight=False)
    stats = result.stats
    split = Table(title=f"{method}: {stats.new_tokens} tokens in {stats.wall_seconds:.2f} s "
                        f"({stats.tokens_per_second:.2f} tok/s, {stats.tokens_per_target_forward:.2f} per target pass)",
                  title_justify="left")
    for column in ("part", "passes", "seconds", "share", "ms each"):
        split.add_column(column, justify="left" if column == "part" else "right")
    for part, count, seconds in time_split(stats):
        share = seconds / stats.wall_seconds if stats.wall_seconds else 0.0
        split.add_row(part, str(count), f"{seconds:.2f}", f"{share:.0%}", f"{1e3 * seconds / count:.1f}" if count else "")
    out.print(split)
    if json_path:
        json_path.write_text(json.dumps(profile_record(passes, stats, method, target_model, drafter_model, kv),
                                        indent=1))
        err.print(f"[dim]wrote {json_path}[/]", highlight=False)


@app.command()
def serve(
    target: str = typer.Option(registry.DEFAULT_TARGET, help="Target model: registry name, HF directory or .gguf."),
    drafter: str = typer.Option(registry.DEFAULT_DRAFTER, help="Drafter model (same vocabulary), 'none', or a "
                                "model-free drafter as generate's (ngram, lookup, suffix, retrieval:DIR), which then "
                                "is the default method."),
    method: str = typer.Option("default", help="Requests' speculation unless they say: any method or preset of "
                               "`specdec methods` but the self-drafting ones (default: the drafter model's chain, "
                               "cost-aware; lookup; suffix, over the request's text and earlier outputs; retrieval, "
                               "--datastore; tree, the mixed tree; lookahead; ar; tree-sides; sd; ...)."),
    gamma_max: int = typer.Option(20, "--gamma-max", help="Longest draft (chains) or deepest tree."),
    tree_nodes: int = typer.Option(64, "--tree-nodes", help="Most nodes in a tree (methods tree, lookahead)."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on (loopback unless told otherwise)."),
    port: int = typer.Option(8000, help="Port to listen on."),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="Require 'Authorization: Bearer KEY' on /v1/* "
                                          "(visible in the process list: prefer --api-key-file or SPECDEC_API_KEY)."),
    api_key_file: Optional[Path] = typer.Option(None, "--api-key-file", help="Read the key from this file's first "
                                                "line."),
    cors_origin: Optional[List[str]] = typer.Option(None, "--cors-origin", help="A web origin whose pages may "
                                                    "call the API (repeatable); requests from other pages: 403."),
    max_batch: int = typer.Option(8, "--max-batch", help="Most sequences decoded at once."),
    kv_memory: Optional[str] = typer.Option(None, "--kv-memory", help="A budget for the running sequences' KV "
                                            "caches (e.g. 2GiB); requests beyond it wait."),
    max_waiting: int = typer.Option(64, "--max-waiting", help="Most requests queued; beyond it, 429."),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Output bound of a chat request that sets none."),
    max_prompt_tokens: Optional[int] = typer.Option(None, "--max-prompt-tokens", help="Longest prompt taken "
                                                    "(default: the model's context)."),
    max_body: str = typer.Option("1MiB", "--max-body", help="Largest request body."),
    request_timeout: float = typer.Option(600.0, "--request-timeout", help="Seconds a request may run (then 504)."),
    grace: float = typer.Option(30.0, "--grace", help="On SIGTERM, seconds in-flight requests get to finish."),
    suffix_cache_tokens: int = typer.Option(100_000, "--suffix-cache-tokens", help="Most tokens of earlier "
                                            "outputs the suffix method drafts from, shared by all requests "
                                            "(0: none)."),
    datastore_dir: Optional[str] = typer.Option(None, "--datastore", help="A datastore (specdec datastore build) "
                                                "the retrieval method drafts from."),
    dtype: str = typer.Option("auto", "--dtype", "--weights", help="Target weights: auto, fp32 or bf16 "
                              "(transformers' weights), or gguf (the GGUF file's own weights on llama.cpp's "
                              "backend, chains only); the batched engine runs either."),
    drafter_dtype: str = typer.Option("auto", help=DRAFTER_DTYPE_HELP),
    device: str = typer.Option("auto", help="auto, cpu or cuda."),
    online: bool = typer.Option(False, "--online", help="The drafter learns from its rejected drafts (OSD): a "
                                "small adapter updated whenever no request is running. Outputs stay exact."),
    prompt_cache: bool = typer.Option(True, "--prompt-cache/--no-prompt-cache", help="A finished request's prompt "
                                      "serves later prompts that start alike (whole 256-token chunks; outputs stay "
                                      "exact): kept in its KV stream on --dtype gguf, copied on transformers' weights."),
    prompt_cache_memory: str = typer.Option("256MiB", "--prompt-cache-memory", help="On transformers' weights: the "
                                            "most memory kept prompts take in the target, and again in a drafter model; "
                                            "the least recently used dropped first."),
):
    """An OpenAI-compatible server (/v1/completions, /v1/chat/completions, /v1/models, /health,
    /metrics) on the batched engine."""
    from .datastore import Datastore
    from .methods import METHODS as REGISTRY, preset
    from .models import GGUF_WEIGHTS
    from .server.schema import METHODS, Speculation
    from .server.service import Limits
    from .spec import from_flags

    try:
        no_drafter = drafter in ("none", "")
        if not no_drafter and from_flags(drafter)["method"] != "chain":  # a drafter that is no model
            named = from_flags(drafter)
            if REGISTRY[named["method"]].self_drafting:
                raise SpecdecError(f"--drafter {drafter}: the target drafting for itself runs one sequence at a "
                                   "time; the server's engine batches sequences (use generate or chat)")
            if method not in ("default", named["method"]):
                raise SpecdecError(f"--drafter {drafter} names the {named['method']} method; --method {method} "
                                   "would draft otherwise (give one of them)")
            method, no_drafter = named["method"], True
            datastore_dir = named.get("datastore", datastore_dir)
        if method not in METHODS:
            raise SpecdecError(f"--method must be one of {', '.join(METHODS)}, got {method!r}")
        kind = preset(method).method if method != "ar" else "ar"
        if dtype in GGUF_WEIGHTS and kind != "ar" and REGISTRY[kind].trees:
            raise SpecdecError(f"--method {method} scores token trees, which need transformers' weights; on --dtype gguf use --method default, "
                               "chain, lookup, suffix or ar")
        for name, value, low in (("--gamma-max", gamma_max, 1), ("--tree-nodes", tree_nodes, 1),
                                 ("--max-batch", max_batch, 1), ("--max-waiting", max_waiting, 1),
                                 ("--max-tokens", max_tokens, 1), ("--port", port, 0)):
            if value < low:
                raise SpecdecError(f"{name} must be >= {low}, got {value}")
        if max_prompt_tokens is not None and max_prompt_tokens < 1:
            raise SpecdecError(f"--max-prompt-tokens must be >= 1, got {max_prompt_tokens}")
        if request_timeout <= 0 or grace < 0:
            raise SpecdecError("--request-timeout must be > 0 and --grace >= 0")
        if no_drafter and kind != "ar" and preset(method).needs_drafter_model():
            raise SpecdecError(f"--method {method} drafts with a drafter model; give --drafter, or use "
                               "--method lookup, suffix or ar")
        if suffix_cache_tokens < 0:
            raise SpecdecError(f"--suffix-cache-tokens must be >= 0, got {suffix_cache_tokens}")
        if online and (no_drafter or _drafter_weights(dtype, drafter, drafter_dtype, False) in GGUF_WEIGHTS):
            raise SpecdecError("--online trains the drafter model's adapter: it needs --drafter MODEL on transformers' "
                               "weights (not --drafter none, not gguf)")
        if kind == "retrieval" and datastore_dir is None:
            raise SpecdecError("--method retrieval drafts from a datastore: give --datastore DIR")
        datastore = Datastore(datastore_dir) if datastore_dir is not None else None  # before minutes of loading
        budget = parse_bytes(kv_memory, "--kv-memory") if kv_memory is not None else None
        if prompt_cache and dtype not in GGUF_WEIGHTS:
            prompt_cache = parse_bytes(prompt_cache_memory, "--prompt-cache-memory")
        limits = Limits(max_tokens=max_tokens, max_prompt_tokens=max_prompt_tokens,
                        max_body=parse_bytes(max_body, "--max-body"), request_timeout=request_timeout,
                        max_waiting=max_waiting)
        from .server.app import api_key_from

        api_key = api_key_from(api_key, api_key_file)
    except SpecdecError as exc:
        _fail(str(exc))
    import uvicorn

    from .server.app import create_app
    from .server.service import Service

    def load() -> Service:
        from .models import load as load_model
        from .drafters.lookahead import OVERHEAD as LOOKAHEAD_OVERHEAD
        from .passcost import flat_rows, pass_costs

        say = lambda m: err.print(f"[dim]{m}[/]", highlight=False)  # noqa: E731
        target_model = load_model(target, dtype=dtype, device=device, role="target", exact_rows=True,
                                  say=say, sequences=max_batch, prompt_cache=prompt_cache)
        drafter_model = None if no_drafter else load_model(
            drafter, dtype=_drafter_weights(dtype, drafter, drafter_dtype, False), device=device, role="drafter",
            exact_rows=True, say=say, sequences=max_batch, prompt_cache=prompt_cache)
        costs = pass_costs(target_model, drafter_model, say) if drafter_model is not None else None
        if online:
            from .adapter import OnlineDistiller

            OnlineDistiller(drafter_model)  # the drafter records its rejections; the worker updates it when idle
        speculation = Speculation(None if method == "ar" else method, gamma_max, tree_nodes)
        service = Service(target_model, drafter_model, default=speculation, limits=limits, costs=costs,
                          lookup_costs=pass_costs(target_model, None, say), suffix_cache_tokens=suffix_cache_tokens,
                          datastore=datastore, lookahead_rows=flat_rows(target_model, LOOKAHEAD_OVERHEAD, say)
                          if getattr(target_model, "tree_masks", True) else None)
        err.print(f"serving {service.name} on http://{host}:{port}/v1 (speculation: {method}, max batch "
                  f"{max_batch})", highlight=False)
        return service

    if host not in ("127.0.0.1", "localhost", "::1"):
        err.print(f"[yellow]listening on {host}: reachable beyond this machine"
                  f"{'' if api_key else ' and without --api-key'}[/]")
    import os
    import signal

    def stop(error: Exception) -> None:  # a model that cannot load: the server stops, the error is the exit line
        os.kill(os.getpid(), signal.SIGINT)

    server = create_app(load, max_batch, budget, api_key, on_load_error=stop, cors_origins=cors_origin, host=host)
    for sig in (signal.SIGINT, signal.SIGTERM):  # uvicorn shuts down gracefully, then raises the signal
        signal.signal(sig, lambda *_: None)    # again for the handler it found: that ends in exit 0
    uvicorn.run(server, host=host, port=port, log_level="warning", timeout_graceful_shutdown=grace)
    error = server.state.specdec["error"]
    if error is not None:
        _fail(str(error) if isinstance(error, SpecdecError) else f"loading failed: {error!r}")


@app.command("bench-serve")
def bench_serve_command(
    url: Optional[List[str]] = typer.Option(None, help="The server's base URL (any OpenAI-compatible server; "
                                            "default http://127.0.0.1:8000). Repeat as NAME=URL to load "
                                            "several servers interleaved: each level of each in turn."),
    fields: Optional[List[str]] = typer.Option(None, help="NAME=JSON: request fields for server NAME alone, e.g. "
                                               "'ours-ar={\"speculative\": false}' (repeatable)."),
    concurrency: str = typer.Option("1,4,8,16", help="Requests in flight at each level, comma-separated."),
    requests: int = typer.Option(32, help="Requests sent at each level (prompts in turn)."),
    dataset: str = typer.Option("humaneval:16,spec-bench:1", help="Prompts: humaneval, spec-bench (chat) or a "
                                "JSONL file, each NAME[:LIMIT], comma-separated."),
    max_tokens: int = typer.Option(64, "--max-tokens", help="Output tokens asked of each request."),
    temperature: float = typer.Option(0.0, help="Sampling temperature sent (0: greedy)."),
    model: Optional[List[str]] = typer.Option(None, help="The model name sent (default: the server's first, "
                                              "/v1/models); NAME=MODEL for server NAME alone (repeatable)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="Sent as 'Authorization: Bearer KEY'."),
    timeout: float = typer.Option(600.0, help="Seconds one request may take before it counts as failed."),
    wait: float = typer.Option(0.0, help="Seconds to wait for each server to be ready (/health 200, as a "
                               "server still loading answers 503) before the run; 0: it must be up now."),
    warmups: int = typer.Option(1, help="Requests sent to each server before the run, not measured."),
    extra: Optional[str] = typer.Option(None, help="A JSON object merged into every request body, e.g. "
                                        '\'{"speculative": false}\'.'),
    variants: Optional[str] = typer.Option(None, help="A JSON object: name -> fields merged into the requests; "
                                           "at each level every variant runs in turn, e.g. "
                                           '\'{"default": {}, "ar": {"speculative": false}}\'.'),
    markdown: Optional[Path] = typer.Option(None, "--markdown", help="Also write the table to this file."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Also write the figures to this JSON file."),
):
    """Load a running server level by level and report what `vllm bench serve` reports: throughput,
    TTFT, TPOT, ITL and end-to-end latency percentiles, and acceptance from its /metrics. Several
    servers (--url NAME=URL ...) run interleaved, level by level."""
    import datetime

    from .bench.concurrency import check_levels
    from .bench.datasets import load_prompts, parse_dataset
    from .bench.run import machine_description
    from .bench.serve import Server, bench_servers, render

    try:
        try:
            levels = [int(c) for c in _csv(concurrency)]
        except ValueError:
            raise SpecdecError(f"--concurrency takes comma-separated integers >= 1, got {concurrency!r}") from None
        check_levels(levels)
        if requests < 1 or max_tokens < 1 or timeout <= 0 or temperature < 0 or wait < 0 or warmups < 0:
            raise SpecdecError("--requests and --max-tokens must be >= 1, --timeout > 0, --temperature, --wait and "
                               "--warmups >= 0")
        more = _json_object(extra, "--extra") if extra else {}
        named = _json_object(variants, "--variants") if variants else None
        if named is not None and (not named or not all(isinstance(v, dict) for v in named.values())):
            raise SpecdecError("--variants must be a JSON object of name -> object of request fields")
        urls = _named_urls(url or ["http://127.0.0.1:8000"])
        own = {}
        for entry in fields or []:
            name, _, text = entry.partition("=")
            if name not in urls:
                raise SpecdecError(f"--fields takes NAME=JSON for a server named with --url NAME=URL, got {entry!r}")
            own[name] = _json_object(text, f"--fields {name}")
        models = {}
        for entry in model or []:
            name, _, rest = entry.partition("=")
            if rest and name in urls:
                models[name] = rest
            else:
                models.update((key, entry) for key in urls if key not in models)
        prompts = []
        for spec in _csv(dataset):
            name, count, _ = parse_dataset(spec, None, [temperature])
            prompts += [(p.text, p.chat) for p in load_prompts(name, count)]
        for base in dict.fromkeys(urls.values()):
            _wait_ready(base, api_key, wait)
        servers = [Server(name, base, {"model": _served_model(base, api_key, models.get(name)),
                                       "max_tokens": max_tokens, "temperature": temperature, **more, **own.get(name, {})})
                   for name, base in urls.items()]
    except SpecdecError as exc:
        _fail(str(exc))
    summaries = bench_servers(servers, prompts, levels, requests, api_key, timeout,
                              say=lambda m: err.print(f"[dim]{m}[/]", highlight=False), variants=named, warmups=warmups)
    table = render(summaries)
    Console().print(table, highlight=False)
    info = {"url": servers[0].url if len(servers) == 1 else {s.name: s.url for s in servers},
            "model": servers[0].settings["model"] if len(servers) == 1 else {s.name: s.settings["model"] for s in servers},
            "levels": levels, "requests": requests, "dataset": dataset, "prompts": len(prompts),
            "settings": servers[0].settings if len(servers) == 1 else {s.name: s.settings for s in servers},
            "variants": named, "warmups": warmups, "machine": machine_description(), "date": datetime.date.today().isoformat(),
            "command": "specdec " + " ".join(sys.argv[1:])}
    if markdown:
        served = ", ".join(f"{s.name + ': ' if s.name else ''}model {s.settings['model']}" for s in servers)
        markdown.write_text(_home_as_tilde(f"# bench-serve\n\n`{info['command']}`\n\n{info['machine']}, "
                                           f"{info['date']}, {served}\n\n{table}\n"))
        err.print(f"[dim]wrote {markdown}[/]", highlight=False)
    if json_path:
        json_path.write_text(_home_as_tilde(json.dumps({"info": info, "levels": summaries}, indent=1)))
        err.print(f"[dim]wrote {json_path}[/]", highlight=False)


def _home_as_tilde(text: str) -> str:
    """Results meant to be shared name the home directory `~` (a model path given as a server's
    model name would otherwise carry this machine's)."""
    home = str(Path.home())
    return text.replace(home + "/", "~/") if len(home) > 1 else text


def _json_object(text: str, option: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise SpecdecError(f"{option} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise SpecdecError(f"{option} must be a JSON object")
    return value


def _named_urls(entries: list[str]) -> dict:
    """--url values -> {name (None for a single unnamed URL): base URL without /v1}."""
    import re

    urls = {}
    for entry in entries:
        match = re.match(r"([A-Za-z0-9_.-]+)=(.+)", entry)
        name, address = (match.group(1), match.group(2)) if match else (None, entry)
        if name is None and len(entries) > 1:
            raise SpecdecError(f"name each of several servers: --url NAME=URL, got {entry!r}")
        if name in urls:
            raise SpecdecError(f"two servers named {name!r}")
        urls[name] = address.rstrip("/").removesuffix("/v1")
    return urls


def _wait_ready(base: str, api_key: str | None, seconds: float) -> None:
    """Return once `base` answers /health with 200 (or has no /health), polling for up to
    `seconds`; SpecdecError when it is still not ready (what it last answered)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline, last = time.monotonic() + seconds, "no answer"
    while True:
        try:
            status = httpx.get(base + "/health", headers=headers, timeout=10).status_code
            if status in (200, 404):
                return
            last = f"HTTP {status}"
        except httpx.HTTPError as exc:
            last = str(exc) or type(exc).__name__
        if time.monotonic() >= deadline:
            if seconds > 0:
                raise SpecdecError(f"{base} was not ready after {seconds:g} s ({last})")
            return  # not waiting: the model listing says what is wrong
        time.sleep(1.0)


def _served_model(base: str, api_key: str | None, wanted: str | None) -> str:
    """`wanted`, or the first model the server lists (/v1/models); SpecdecError where no server
    answers, or it lists none and none is wanted."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        listed = httpx.get(base + "/v1/models", headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        raise SpecdecError(f"no server answers at {base}: {exc}") from None
    if wanted:
        return wanted
    if listed.status_code != 200:  # some servers list models only from a hub cache: --model names it instead
        raise SpecdecError(f"{base}/v1/models answered HTTP {listed.status_code} ({listed.text[:200]}); "
                           "name the model with --model")
    return listed.json()["data"][0]["id"]


def main() -> None:
    app()


if __name__ == "__main__":
    main()
