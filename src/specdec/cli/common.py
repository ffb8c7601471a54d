"""What the commands share: the app, one-line errors, loading with a spinner, the weights a drafter
follows onto, option help texts, and the parsing of sizes, lists and a command line's speculation
(`spec_config`: the flags -> `SpecConfig`)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from ..models import catalogue as registry
from ..errors import SpecdecError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Lossless speculative decoding for Hugging Face language models.")
err = Console(stderr=True)


def _fail(message: str) -> None:
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(1)


def check_vocab_options(vocab, corpus) -> None:
    from ..models.vocab import check_vocab_options as check

    check(vocab, corpus)


def _drafter_weights(dtype: str, drafter: str | None, drafter_dtype: str, restricted_vocab: bool) -> str:
    """The drafter's dtype with "auto" resolved: a model drafter follows a GGUF target onto its own
    GGUF weights (llama.cpp) unless its vocabulary is restricted (a transformers feature); else
    unchanged. A drafter's weights change acceptance only, never the output."""
    from ..models.loading import GGUF_WEIGHTS

    follows = drafter is not None and (drafter in registry.MODELS or drafter.endswith(".gguf"))
    if dtype in GGUF_WEIGHTS and drafter_dtype == "auto" and follows and not restricted_vocab:
        return "gguf"
    return drafter_dtype


def _check_runs_on(dtype: str, config) -> None:
    """One line, before any loading, where a method cannot run on the target's weights: llama.cpp's
    backend (--dtype gguf) takes chains, not trees or self-drafting."""
    from ..decoding.config import weights_run_trees
    from ..decoding.speculation import METHODS

    method = METHODS[config.method]
    # self-drafting reads hidden states, which llama.cpp's backend (the one without trees) keeps none of
    if not weights_run_trees(dtype) and config.speculative and (method.trees or method.self_drafting):
        raise SpecdecError(f"{config.method} cannot run on --dtype gguf (llama.cpp's backend takes chain drafts "
                           "only); use --dtype auto (transformers' weights)")


def _weights_of(drafter) -> str | None:
    """The weights a drafter model runs (a model, or a drafter holding one); None for model-free ones."""
    from ..drafters.base import capabilities_of, is_drafter
    from ..drafters.eagle import EagleModel

    if drafter is None:
        return None
    model = drafter if not is_drafter(drafter) else drafter.model if capabilities_of(drafter).model else None
    if model is None or isinstance(model, EagleModel):
        return None  # model-free, or an EAGLE layer over the target's features (no weights of its own)
    return model.weights


def _measured_costs(target_model, drafter_model):
    """This machine's pass costs of the pair (sizing/pass_costs.py: measured once, cached), for the cost
    schedule, so that where no draft can pay it drafts nothing from the first step."""
    from ..sizing.pass_costs import pass_costs

    with err.status("measuring pass costs…"):
        costs = pass_costs(target_model, drafter_model, say=lambda m: err.print(f"[dim]{m}[/]", highlight=False))
    if costs.never_pays():
        err.print(f"[dim]drafting cannot pay on this machine (a draft accepted in full would make "
                  f"{costs.best_speedup():.2f}x plain decoding): the cost schedule drafts nothing[/]", highlight=False)
    return costs


def _drafter_rows(config, exact_rows: bool | None) -> bool | None:
    """A drafter model's `exact_rows`. A chain's: on (unless --batched-rows), alone and in a batch
    alike, so that the engine can batch its passes across sequences and a seeded sampled prompt
    drafts the same in both. Its passes are a prompt (fed plainly either way) and then 1-2 tokens,
    where row-exact attention is one one-query call a row, as a decode step makes. A tree's: as
    the target's, so on in a batch, where its passes join the other sequences'; alone it keeps the
    default (its depth passes would pay a call per row)."""
    from ..decoding.speculation import METHODS

    if exact_rows is False:
        return None
    return exact_rows if METHODS[config.method].trees else True


def _load(name: str, dtype: str, device: str, role: str, exact_rows: bool | None = None,
          vocab: int | None = None, vocab_corpus: str | None = None, sequences: int = 1, kernels: str = "auto"):
    from ..models.loading import load

    with err.status(f"loading {name} ({role})…"):
        return load(name, dtype=dtype, device=device, role=role, exact_rows=exact_rows,
                    say=lambda m: err.print(f"[dim]{m}[/]", highlight=False), vocab=vocab, vocab_corpus=vocab_corpus,
                    sequences=sequences, kernels=kernels)


KERNELS_HELP = ("auto (transformers' layers, picked per CPU kind), or captured: on CUDA, a Llama-family model's "
                "passes replayed as CUDA graphs with fused kernels (bf16; chain methods; docs/kernels.md).")


TARGET_DTYPE_HELP = ("Target weights: auto (transformers' weights: bf16 on CUDA and on CPUs with AVX512 or AVX2, "
                     "fp32 where our kernels cannot be built; the same for every method), fp32, bf16, fp16, or gguf: the GGUF file's own "
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
    from ..drafters.lookahead import check_shape

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


def spec_config(method: str, drafter: str | None, tree: str = "off", cascade: str = "off",
                schedule: str | None = None, lenience: float = 1.0, typical: bool = False, **fields):
    """The `SpecConfig` of a command's flags (`speculation.from_options`)."""
    from ..decoding.speculation import from_options

    return from_options(method, drafter, tree, cascade, schedule, lenience, typical, **fields)


def _seed_pins(seed, sampler, config) -> bool:
    from ..decoding.sequence import seed_pins_drafts

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


def _skip_layers(text: str | None) -> list[int] | None:
    """--skip-layers 5,10,15 -> [5, 10, 15]; None: chosen by the self-skip search."""
    if not text:
        return None
    from ..decoding.config import from_flags

    return list(from_flags(f"self-skip:{text}")["skip_layers"])


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


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
