"""`specdec generate`: one prompt, or a JSONL file of prompts through the engine."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from ..models import catalogue as registry
from ..errors import SpecdecError
from ..models.roles import check_roles
from .common import (app, err, _fail, check_vocab_options, _drafter_weights, _check_runs_on, _weights_of,
                     _measured_costs, _drafter_rows, _load, KERNELS_HELP, TARGET_DTYPE_HELP, DRAFTER_DTYPE_HELP,
                     DRAFTER_VOCAB_HELP, DRAFTER_VOCAB_CORPUS_HELP, EXACT_ROWS_HELP, METHOD_HELP, _lookahead_shape,
                     TREE_HELP, LOOKAHEAD_SHAPE_HELP, TREE_SCHEME_HELP, spec_config, _seed_pins, _first_drafter,
                     parse_bytes)


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
    drafter: str = typer.Option(registry.DEFAULT_DRAFTER, help="Drafter: a model (same vocabulary as the target; "
                                "'distilled:DIR', a distilled one; 'parallel:DIR', one that drafts a chain in one "
                                "pass, from `specdec train-parallel-drafter`), "
                                "or 'ngram' (NASD, built online), 'lookup' (prompt lookup), 'suffix' (suffix "
                                "drafting; with --prompts over earlier outputs too) or 'retrieval:DIR' (a "
                                "datastore, `specdec datastore build`), which need no model; "
                                "or the target drafting for itself: 'medusa:DIR' or 'eagle:DIR' (from `specdec "
                                "train-heads`; token trees) or 'self-skip[:LAYERS]' (layers skipped, chosen at start)."),
    method: str = typer.Option("default", help=METHOD_HELP),
    gamma: Optional[int] = typer.Option(None, help="Draft tokens per step (γ ≥ 1): alone, a fixed γ (the fixed "
                                        "schedule; default 5); with --schedule heuristic its start; with the "
                                        "others (and trees) a bound, as --gamma-max."),
    schedule: Optional[str] = typer.Option(None, help="Draft length: cost (stop when the draft is unlikely to pay "
                                           "for another token, from measured costs), fixed, heuristic (+2 / −1), "
                                           "confidence (stop below τ), egag (entropy-guided). Default: the method's "
                                           "(cost; fixed for sd)."),
    gamma_min: int = typer.Option(1, "--gamma-min", help="Smallest γ (heuristic, egag)."),
    gamma_max: Optional[int] = typer.Option(None, "--gamma-max", help="Largest γ (cost, heuristic, confidence, "
                                            "egag; a tree's depth). Default 20; egag's: γ (the EGAG code's)."),
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
    json_schema: Optional[Path] = typer.Option(None, "--json-schema", help="Constrain the output to JSON valid "
                                               "against this JSON Schema file (exact under speculation: the output "
                                               "is constrained plain decoding's)."),
    json_object: bool = typer.Option(False, "--json-object", help="Constrain the output to any JSON object."),
    regex: Optional[str] = typer.Option(None, "--regex", help="Constrain the whole output to match this regular "
                                        "expression."),
    grammar_file: Optional[Path] = typer.Option(None, "--grammar", help="Constrain the output to this Lark grammar "
                                                "file (llguidance's Lark; it may embed JSON schemas with %json)."),
    dtype: str = typer.Option("auto", "--dtype", "--weights", help=TARGET_DTYPE_HELP),
    drafter_dtype: str = typer.Option("auto", help=DRAFTER_DTYPE_HELP),
    drafter_vocab: Optional[int] = typer.Option(None, "--drafter-vocab", help=DRAFTER_VOCAB_HELP),
    drafter_vocab_corpus: Optional[str] = typer.Option(None, "--drafter-vocab-corpus",
                                                       help=DRAFTER_VOCAB_CORPUS_HELP),
    device: str = typer.Option("auto", help="auto, cpu or cuda."),
    kernels: str = typer.Option("auto", "--kernels", help=KERNELS_HELP),
    exact_rows: Optional[bool] = typer.Option(None, "--exact-rows/--batched-rows", help=EXACT_ROWS_HELP),
    tree: str = typer.Option("off", help=TREE_HELP),
    tree_nodes: int = typer.Option(64, "--tree-nodes", help="Most nodes in a token tree (its size is chosen by "
                                   "measured cost up to this)."),
    tree_scheme: str = typer.Option("without-replacement", "--tree-scheme", help=TREE_SCHEME_HELP),
    lookahead_shape: Optional[str] = typer.Option(None, "--lookahead-shape", help=LOOKAHEAD_SHAPE_HELP +
                                                  " With --tree lookahead."),
    allow_larger_drafter: bool = typer.Option(False, "--allow-larger-drafter", help="Run a drafter model with "
                                              "more parameters than the target (refused by default: the two "
                                              "were likely given the wrong way round)."),
    online: bool = typer.Option(False, "--online", help="With --prompts (--batch-size 1) and a drafter model's "
                                "chains: the drafter learns from its rejected drafts (OSD), its adapter updated "
                                "between prompts. Outputs stay exact."),
):
    """Generate text, showing which tokens the drafter proposed and which the target chose."""
    from ..drafters import SuffixCache
    from ..decoding.speculation import Parts, build
    from ..core.samplers import Sampler

    try:
        check_vocab_options(drafter_vocab, drafter_vocab_corpus)  # before minutes of loading
        sampler = Sampler(temperature=temperature, top_k=top_k, top_p=top_p)
        rows, kv_budget = _prompt_input(prompt, prompts_file, sampler, max_new_tokens, batch_size, debug, kv_memory)
        grammar = cli_grammar(json_schema, json_object, regex, grammar_file)
        if gamma is not None and gamma < 1:
            raise SpecdecError(f"--gamma must be >= 1, got {gamma}")
        config = spec_config(method, drafter, tree, cascade, schedule, lenience, typical, gamma=gamma,
                             gamma_min=gamma_min, gamma_max=gamma_max, egag_beta=egag_beta, confidence=confidence,
                             ngram_n=ngram_n, tree_nodes=tree_nodes, tree_scheme=tree_scheme,
                             typical_epsilon=typical_epsilon, typical_delta=typical_delta,
                             lookahead_shape=_lookahead_shape(lookahead_shape))
        _check_grammar_method(grammar, config, target)
        if _encoder_decoder(target):
            _generate_seq2seq(prompt, target, config, sampler, dtype, device, max_new_tokens, seed, first_target,
                              as_json, rows is not None or chat or dtype == "gguf")
            return
        exact_rows = _check_generate(config, drafter, dtype, rows is not None, batch_size, online, exact_rows)
        vocab = dict(vocab=drafter_vocab, vocab_corpus=drafter_vocab_corpus, kernels=_kernels(kernels))
        target_model, drafter_model = _load_pair(config, target, dtype, drafter_dtype, device, exact_rows, vocab,
                                                 batch_size if rows is not None else 1)
        check_roles(target_model, drafter_model, allow_larger_drafter, cli=True)  # None (no model): passes
        # measured costs size drafts, but not where a seed's output hangs on them (the stream rule, lossy rules)
        pinned = rows is None and _seed_pins(seed, sampler, config)
        speculation = build(config, Parts(target_model, drafter_model, costs=None if pinned else
                                          lambda model: _measured_costs(target_model, model),
                                          suffix_cache=SuffixCache() if rows is not None else None))
        if rows is not None:
            _generate_batch(target_model, speculation, rows, batch_size, as_json, chat, kv_budget,
                            online=_online(drafter_model) if online else None, drafter_model=drafter_model,
                            grammar=grammar)
            return
        _generate_one(target_model, speculation, prompt, sampler, max_new_tokens, seed, first_target, chat, debug,
                      as_json, grammar)
    except SpecdecError as exc:
        _fail(str(exc))


def cli_grammar(json_schema: Path | None, json_object: bool, regex: str | None, grammar_file: Path | None):
    """The `grammar.Grammar` of generate's --json-schema, --json-object, --regex or --grammar (None
    without one), read and compiled before any model loads: a one-line error for a missing file, a
    schema that is not JSON or not valid, a bad regex or Lark grammar, or two of them at once."""

    from ..core.grammar import Grammar

    given = [name for name, value in (("--json-schema", json_schema), ("--json-object", json_object),
                                      ("--regex", regex), ("--grammar", grammar_file)) if value]
    if len(given) > 1:
        raise SpecdecError(f"{' and '.join(given)} each constrain the whole output: give one of them")
    if not given:
        return None

    def read(path: Path, option: str) -> str:
        try:
            return path.read_text()
        except OSError as exc:
            raise SpecdecError(f"cannot read {option} {path}: {exc.strerror or exc}") from None

    if json_schema is not None:
        text = read(json_schema, "--json-schema")
        try:  # Grammar.json_schema says which is wrong: not JSON, or JSON but no object
            grammar = Grammar.json_schema(text)
        except SpecdecError as error:
            raise SpecdecError(f"--json-schema {json_schema}: {error}") from None
    elif json_object:
        grammar = Grammar.json()
    elif regex is not None:
        grammar = Grammar.regex(regex)
    else:
        grammar = Grammar.lark(read(grammar_file, "--grammar"))
    try:
        grammar.check()  # the model's tokenizer is checked at generation
    except SpecdecError as error:
        raise SpecdecError(f"{given[0]}: {error}") from None
    return grammar


def _check_grammar_method(grammar, config, target: str) -> None:
    """A grammar constrains a decoder-only target's chain drafts: a tree method or an
    encoder-decoder target is refused before any model loads."""
    from ..decoding.speculation import METHODS

    if grammar is not None and _encoder_decoder(target):
        raise SpecdecError("a grammar constrains decoder-only targets; drop --json-schema, --json-object, "
                           "--regex and --grammar with an encoder-decoder target")
    if grammar is not None and config.speculative and METHODS[config.method].trees:
        raise SpecdecError(f"a grammar constrains chain drafts only; the {config.method} method drafts token trees "
                           "(use a chain method, e.g. the default, lookup or forced)")


def _prompt_input(prompt, prompts_file, sampler, max_new_tokens: int, batch_size: int, debug: bool,
                  kv_memory: str | None) -> tuple[list[dict] | None, int | None]:
    """The --prompts file's rows and the --kv-memory budget (None, None for one prompt), checked
    before any model loads."""
    if prompts_file is None:
        if kv_memory is not None:
            raise SpecdecError("--kv-memory bounds a batch: use it with --prompts")
        if prompt is None or not prompt.strip():
            raise SpecdecError("empty prompt")
        return None, None
    if prompt is not None:
        raise SpecdecError("give a prompt or --prompts FILE, not both")
    rows = read_prompt_rows(prompts_file, sampler, max_new_tokens)
    if batch_size < 1:
        raise SpecdecError(f"--batch-size must be >= 1, got {batch_size}")
    if debug:
        raise SpecdecError("--debug shows one generation's steps; drop it with --prompts")
    return rows, parse_bytes(kv_memory, "--kv-memory") if kv_memory is not None else None


def _check_generate(config, drafter: str, dtype: str, batch: bool, batch_size: int, online: bool,
                    exact_rows: bool | None) -> bool | None:
    """What the config cannot run here, refused before any model loads -> the target's
    exact_rows (on for a batch: a sequence's output must not depend on what shares its passes)."""
    from ..decoding.speculation import METHODS, open_files

    open_files(config)
    _check_runs_on(dtype, config)
    if online and (not batch or batch_size != 1 or config.method != "chain" or dtype == "gguf"):
        raise SpecdecError("--online updates a drafter model between prompts: use it with --prompts FILE, "
                           "--batch-size 1, --drafter MODEL, chains (no --tree, --cascade) and --dtype auto")
    if not batch:
        return exact_rows
    if config.acceptance != "exact":
        raise SpecdecError("--lenience and --typical apply to one generation; drop them with --prompts")
    if METHODS[config.method].self_drafting:
        raise SpecdecError(f"--drafter {drafter} drafts from the target's hidden states, which batched "
                           "passes do not keep yet; generate its prompts one at a time")
    return True if batch_size > 1 and exact_rows is None else exact_rows


def _kernels(kernels: str) -> str:
    if kernels not in ("auto", "captured"):
        raise SpecdecError(f"--kernels is auto or captured, not {kernels!r}")
    return kernels


def _load_pair(config, target: str, dtype: str, drafter_dtype: str, device: str, exact_rows: bool | None,
               vocab: dict, sequences: int):
    """The target, and the drafter model where the config drafts with one (on the weights it
    follows the target onto) -> (target model, drafter model or None). vocab: the drafter's
    vocabulary options and both models' kernels."""
    target_model = _load(target, dtype, device, "target", exact_rows, sequences=sequences, kernels=vocab["kernels"])
    if not (config.speculative and config.needs_drafter_model()):
        return target_model, None
    weights = _drafter_weights(dtype, config.drafter, drafter_dtype, bool(vocab["vocab"] or vocab["vocab_corpus"]))
    return target_model, _load(config.drafter, weights, device, "drafter", _drafter_rows(config, exact_rows),
                               sequences=sequences, **vocab)


def _online(drafter_model):
    """The drafter model's online learner (OSD), attached now."""
    from ..adapters.lora import OnlineDistiller

    return OnlineDistiller(drafter_model)


def _generate_one(target_model, speculation, prompt: str, sampler, max_new_tokens: int, seed, first_target: bool,
                  chat: bool, debug: bool, as_json: bool, grammar=None) -> None:
    """One prompt's generation, its steps drawn as they come (or one JSON object). grammar: what
    the output must match (`grammar.Grammar`), or None."""
    from ..ui.display import LEGEND, DebugPrinter, StepPrinter, summary_line
    from ..decoding.loop import autoregressive_generate, speculative_generate

    config = speculation.config
    drafter_used = _first_drafter(speculation)
    plan = speculation.schedule() if config.speculative else None  # None for a tree: its drafter's policy sizes it
    out = Console()
    printer = None if as_json else (DebugPrinter if debug and config.speculative else StepPrinter)(target_model, out)
    if printer is not None and config.speculative:
        err.print(LEGEND)
    ids = target_model.encode(prompt, chat=chat)
    if config.speculative:
        # the drafter and schedule shown are the ones that run
        result = speculative_generate(ids, target_model, speculation.made_once(drafter_used, plan), sampler=sampler,
                                      max_new_tokens=max_new_tokens, seed=seed, first_target=first_target,
                                      on_step=printer, debug=debug, grammar=grammar,
                                      allow_larger_drafter=True)  # the command checked the pair
    else:
        result = autoregressive_generate(ids, target_model, sampler=sampler, max_new_tokens=max_new_tokens,
                                         seed=seed, on_step=printer, grammar=grammar)
    if as_json:
        print(json.dumps(_result_json(result, config, target_model, drafter_used, sampler, plan), ensure_ascii=False))
        return
    out.print()
    if debug and config.speculative:
        out.print(target_model.decode(result.tokens), highlight=False)
    err.print(f"[dim]{summary_line(result.stats, 'sd' if config.speculative else 'ar')} · stop: "
              f"{result.stop_reason} · weights: {target_model.weights}[/]", highlight=False)


def _result_json(result, config, target_model, drafter_used, sampler, plan) -> dict:
    """`generate --json`'s object: the text, tokens, stats, what ran, and every step."""
    sizing = plan if plan is not None or not config.speculative else drafter_used.policy  # a tree's own TreeCost
    return {"text": target_model.decode(result.tokens), "tokens": result.tokens, "stats": result.stats.to_dict(),
            "stop_reason": result.stop_reason, "method": config.method, "spec": config.to_dict(),
            "target": target_model.name, "drafter": drafter_used.name if drafter_used is not None else None,
            "weights": {"target": target_model.weights, "drafter": _weights_of(drafter_used)},
            "sampler": sampler.describe(), "schedule": sizing.describe() if sizing is not None else None,
            "steps": [{"drafted": s.draft_tokens, "accepted": s.num_accepted, "next": s.next_token, **s.info,
                       **({"parents": s.tree_parents, "path": s.path} if s.tree_parents is not None else {})}
                      for s in result.steps]}


def _encoder_decoder(target: str) -> bool:
    """Whether --target names a local encoder-decoder model directory (T5, BART)."""
    from ..models.loading import _is_encoder_decoder

    path = Path(target).expanduser()
    return path.is_dir() and (path / "config.json").exists() and _is_encoder_decoder(path)


def _generate_seq2seq(prompt: str, target: str, config, sampler, dtype: str, device: str, max_new_tokens: int,
                      seed: int | None, first_target: bool, as_json: bool, refused: bool) -> None:
    """`generate` on an encoder-decoder target: the source encoded once per model, chain drafts from
    a smaller encoder-decoder of the same vocabulary, or prompt lookup / n-gram over the output.
    refused: options given that it does not take (--prompts, --chat, --dtype gguf)."""
    from ..ui.display import LEGEND, StepPrinter, summary_line
    from ..decoding.loop import speculative_generate_encoder_decoder
    from ..decoding.speculation import Parts, build
    from ..models.loading import load_seq2seq

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
        target_model.encode(prompt), target_model, speculation.made_once(drafter_used, speculation.schedule()),
        sampler=sampler, max_new_tokens=max_new_tokens, seed=seed, first_target=first_target, on_step=printer)
    method = "sd" if drafter_used is not None else "ar"
    if as_json:
        print(json.dumps({"text": target_model.decode(result.tokens), "tokens": result.tokens,
                          "stats": result.stats.to_dict(), "stop_reason": result.stop_reason, "method": method,
                          "target": target_model.name, "drafter": drafter_used.name if drafter_used is not None else None,
                          "sampler": sampler.describe()}, ensure_ascii=False))
    else:
        out.print()
        err.print(f"[dim]{summary_line(result.stats, method)} · stop: {result.stop_reason}[/]", highlight=False)


def read_prompt_rows(path: Path, sampler, max_new_tokens: int) -> list[dict]:
    """The rows of a --prompts JSONL file, each with its sampler and limits resolved; a clear error
    naming the line for anything else."""
    from ..core.samplers import Sampler

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
                    kv_memory: int | None = None, online=None, drafter_model=None, grammar=None) -> None:
    """Every row of a --prompts file through the engine, `batch_size` at a time; output in the
    file's order (a JSON line per prompt with --json), then one summary line. speculation: the
    built `speculation.Speculation`, a drafter and a schedule per row; a row's output is that of its
    prompt alone (greedy, or seeded: the seeded AR output), whatever its batch. online: an
    `lora.OnlineDistiller` on the drafter, updated after each row (the rows then run one by one).
    drafter_model: the loaded drafter model, if any (with the target: the batched pass costs the
    engine's batch policy starts from, `pass_costs.load_costs`). grammar: what every row's output
    must match (`grammar.Grammar`), or None."""
    import time

    from ..decoding.sequence import Limits
    from ..engine import Engine, Request

    profile = None
    if batch_size > 1 and speculation.config.method != "ar":  # where drafting cannot pay under load
        from ..sizing.pass_costs import load_costs

        profile = load_costs(target_model, drafter_model if speculation.config.needs_drafter_model() else None,
                             lambda m: err.print(f"[dim]{m}[/]", highlight=False))
    engine = Engine(target_model, batch_size, kv_memory, load_costs=profile)
    requests = [Request(target_model.encode(row["prompt"], chat=bool(row.get("chat", chat))), speculation,
                        row["sampler"], Limits(row["max_new_tokens"]), seed=row.get("seed"), grammar=grammar)
                for row in rows]
    began = time.perf_counter()
    if online is None:
        ids = [engine.add(request) for request in requests]
        with err.status(f"generating {len(rows)} prompts, {batch_size} at a time…"):
            results = engine.run()
    else:
        ids, results = _one_by_one(engine, requests, online)
    seconds = time.perf_counter() - began
    out = Console()
    for number, (row, request_id) in enumerate(zip(rows, ids), 1):
        result = results[request_id]
        text = target_model.decode(result.tokens)
        if as_json:
            print(json.dumps({"text": text, "tokens": result.tokens, "stats": result.stats.to_dict(),
                              "stop_reason": result.stop_reason, "method": speculation.config.method,
                              "target": target_model.name, "weights": {"target": target_model.weights},
                              "sampler": row["sampler"].describe(), "batch_size": batch_size}, ensure_ascii=False))
        else:
            out.rule(f"prompt {number}", style="dim")
            out.print(text, highlight=False)
    tokens = sum(len(r.tokens) for r in results.values())
    learnt = "" if online is None else f" · {online.updates} drafter updates ({online.seconds:.1f} s)"
    err.print(f"[dim]{len(rows)} prompts · {tokens} tokens in {seconds:.2f} s · {tokens / seconds:.2f} tok/s "
              f"in all · {engine.passes} target passes · batch {batch_size} · weights: {target_model.weights}{learnt}[/]",
              highlight=False)


def _one_by_one(engine, requests: list, online) -> tuple[list[int], dict]:
    """The requests one at a time, the drafter's online learner updated between them -> their ids
    and results."""
    ids, results = [], {}
    with err.status(f"generating {len(requests)} prompts, the drafter learning between them…") as status:
        for number, request in enumerate(requests, 1):
            ids.append(engine.add(request))
            results.update(engine.run())
            update = online.update()
            if update is not None:
                status.update(f"prompt {number} of {len(requests)} done; the drafter learnt from "
                              f"{update['records']} rejected positions")
    return ids, results
