"""Run methods over datasets in one process, interleaved prompt by prompt, and summarise ratios.

Machines here are shared and noisy: absolute times drift, so every number that matters is a
ratio between methods measured on the same prompt within seconds of each other.
"""

from __future__ import annotations

import gc
import json
import platform
import random
import statistics
from collections import Counter

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..backends import Backend
from ..drafters.layerskip import choose_skipped
from ..errors import SpecdecError
from ..decoding.speculation import names, preset
from ..models.loading import load
from ..sizing.pass_costs import pass_costs
from ..core.samplers import Sampler
from ..sizing.schedules import AssumedCosts
from ..decoding.config import MODEL_FREE_DRAFTERS
from ..backends.text import check_pair
from .datasets import Prompt, load_prompts, parse_dataset
from .runners import (BASELINES, BEAM_METHODS, NEEDS_DRAFTER, is_lossy, STREAM, REFERENCE, PeerModels, Record, Settings,
                      check_grammar_methods, check_methods, checkpoint_kind, distilled_adapter, parallel_adapter, is_flat,
                      is_peer, load_own_drafters, merge_samples, online_summary, open_datastore, position_sums, run_method,
                      self_drafting)
from .report import render_markdown, render_paired, render_plot, render_structured, render_table
from .schemas import check_output
from .vllm_peer import VLLM_METHODS, VllmPeers

# Settings fields that hold measurements, reported apart (not JSON as they are), and vLLM's workers
MEASURED_SETTINGS = ("pass_costs", "free_costs", "load_costs", "free_load_costs", "assumed", "vllm")

SAMPLE_SEEDS = 100_003  # sample k of prompt i is drawn with seed + i + k·SAMPLE_SEEDS (a prompt's samples never share one)


def method_orders(methods: list[str], seed: int = 0):
    """Yield the order to run `methods` in, prompt (or sample of a prompt) after prompt: rows of a
    Williams design.

    Within every block of k rows (2k when k is odd) each method runs in each position equally often
    and right after each other method equally often. A machine that drifts (these speed up or slow
    down by 10-20% over minutes) then favours no method: with a seeded shuffle instead, the 10-prompt
    ar-vs-hf run put ar first on 6 prompts and hf on 4, and the ratio read the drift. The methods
    are relabelled and the rows reordered by `seed`, afresh for each block.
    """
    rng = random.Random(seed)
    k = len(methods)
    first = [0] + [(j + 1) // 2 if j % 2 else k - j // 2 for j in range(1, k)]  # 0, 1, k-1, 2, k-2, ...
    rows = [[(x + r) % k for x in first] for r in range(k)]
    if k % 2:  # odd k: the reversed rows complete the carry-over balance
        rows += [row[::-1] for row in rows]
    while True:
        labels = rng.sample(methods, k)
        for row in rng.sample(rows, len(rows)):
            yield [labels[x] for x in row]


def bootstrap_median_interval(values: list[float], seed: int = 0, resamples: int = 2000,
                              level: float = 0.95) -> list[float] | None:
    """A percentile bootstrap interval for the median of `values` (None below 3 values): how far
    the median speedup over a handful of prompts can be trusted on a noisy machine."""
    if len(values) < 3:
        return None
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    tail = (1 - level) / 2
    return [medians[int(tail * resamples)], medians[min(resamples - 1, int((1 - tail) * resamples))]]


def _mean(values: list) -> float | None:
    return sum(values) / len(values) if values else None


def _time_split(rs: list) -> dict:
    """Where our methods' wall-clock time went, over all their prompts: the shares inside target
    passes, inside the drafter, and in the loop itself, and the loop's ms per target pass (step).
    Empty for the peers, which do not report it."""
    if not rs or any(r.target_seconds is None for r in rs):
        return {}
    wall = sum(r.wall_seconds for r in rs)
    target, drafter = sum(r.target_seconds for r in rs), sum(r.drafter_seconds for r in rs)
    loop = max(0.0, wall - target - drafter)
    steps = sum(r.target_passes or 0 for r in rs)
    return {"time_in_target": target / wall, "time_in_drafter": drafter / wall, "time_in_loop": loop / wall,
            "loop_ms_per_step": 1e3 * loop / steps if steps else None} if wall > 0 else {}


def _projected(method: str, rs: list, assumed: AssumedCosts | None) -> dict:
    """The median per-prompt speedup over AR each of our methods would have on the assumed machine
    (`AssumedCosts.projected_speedup`: its tokens per step, its passes' widths on that machine's cost
    curve, its drafter passes at the pair's c). AR is 1 by definition; none for the peers and for
    self-drafting, whose drafter passes are not the pair's drafter's."""
    if assumed is None or checkpoint_kind(method) or method in ("self-skip", "early-exit", "multi-draft") or not rs:
        return {}
    if method == "ar":
        return {"projected_speedup": 1.0}
    if any(not r.widths_per_step for r in rs):
        return {}
    return {"projected_speedup": statistics.median(
        assumed.projected_speedup(r.new_tokens, r.widths_per_step, r.drafter_passes_per_step,
                                  r.target_passes - len(r.widths_per_step), r.samples)  # the first tokens' passes
        for r in rs)}


def _by_position(rs: list, positions: int = 8) -> list[float] | None:
    drafted, accepted = position_sums([r.drafted_at for r in rs]), position_sums([r.accepted_at for r in rs])
    shares = [round(a / d, 4) for a, d in zip(accepted[:positions], drafted[:positions]) if d]
    return shares or None


def _median_or_none(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _alpha(records: list[Record]) -> dict:
    """Leviathan et al.'s α over a method's records, apart from its acceptance rate: the mean of
    Σ min(p, q) over every judged position (`GenerationStats.alpha`), else implied by the tokens per
    drafting step where every record drafted at one fixed γ (`theory.alpha_from_tokens`), else None."""
    positions = sum(r.beta_positions for r in records)
    if positions:
        return {"alpha": sum(r.beta_sum for r in records) / positions, "alpha_source": "beta"}
    steps = [n for r in records for n in r.accepted_per_step]
    gammas = {r.fixed_gamma for r in records}
    if steps and len(gammas) == 1 and None not in gammas:
        from ..sizing.theory import alpha_from_tokens

        return {"alpha": alpha_from_tokens(1 + sum(steps) / len(steps), gammas.pop()), "alpha_source": "tokens per step"}
    return {"alpha": None, "alpha_source": None}


def summarize(records: list[Record], methods: list[str], assumed: AssumedCosts | None = None) -> dict[str, dict]:
    """Per method: median and aggregate tok/s, median time to first token and decoding rate after it,
    median per-prompt speedups vs ar, hf and hf-assisted (with a bootstrap interval, on how many
    prompts it was faster, and decoding alone), acceptance, tokens per target pass, histogram of
    accepted counts, (greedy prompts) identity to ar, and with `assumed` costs the speedup
    projected for that machine (`_projected`)."""
    by = {m: {r.prompt_id: r for r in records if r.method == m} for m in methods}
    summary = {}
    for m in methods:
        rs = list(by[m].values())
        if not rs:
            continue
        drafted = sum(r.drafted for r in rs)
        entry = {
            "prompts": len(rs),
            "median_tokens_per_second": statistics.median(r.tokens_per_second for r in rs),
            "aggregate_tokens_per_second": sum(r.new_tokens for r in rs) / sum(r.wall_seconds for r in rs),
            "acceptance_rate": sum(r.accepted for r in rs) / drafted if drafted else None,
            **_alpha(rs),
            "tokens_per_target_pass": (sum(r.new_tokens for r in rs) / sum(r.target_passes for r in rs)
                                          if all(r.target_passes for r in rs) else None),
            "accepted_histogram": dict(sorted(Counter(n for r in rs for n in r.accepted_per_step).items())),
            # per drafting step: accepted draft tokens (for trees, the accepted path's length) and tree nodes
            "mean_accepted_per_step": _mean([n for r in rs for n in r.accepted_per_step]),
            "mean_nodes_per_step": _mean([n for r in rs for n in r.nodes_per_step]),
            # the drafter model's passes per emitted token (cascades save some; None: no drafter model ran)
            "drafter_passes_per_token": (sum(sum(r.drafter_passes_per_step) for r in rs) / sum(r.new_tokens for r in rs)
                                         if any(r.drafter_passes_per_step for r in rs) else None),
            # of the drafts that reached position i + 1, the share accepted that far (the first 8 positions)
            "acceptance_by_position": _by_position(rs),
            # sd-typical under sampling: its first-token law's distance from the target's (`typical_divergence`)
            "typical_total_variation": _mean([r.typical_tv for r in rs if r.typical_tv is not None]),
            "median_first_token_seconds": _median_or_none([r.first_token_seconds for r in rs]),
            "median_decode_tokens_per_second": _median_or_none([r.decode_tokens_per_second for r in rs]),
            **_time_split(rs),
            **_projected(m, rs, assumed),
            **_structured(rs),
        }
        for base in BASELINES:
            if by.get(base) and base != m:
                ratios = [r.tokens_per_second / by[base][i].tokens_per_second for i, r in by[m].items() if i in by[base]]
                entry[f"median_speedup_vs_{base}"] = statistics.median(ratios) if ratios else None
                entry[f"faster_than_{base}"] = [sum(x > 1 for x in ratios), len(ratios)]
                entry[f"speedup_vs_{base}_interval95"] = bootstrap_median_interval(ratios)
                # the same ratio with the prompt pass left out: tells a slower prefill from slower decoding
                entry[f"median_decode_speedup_vs_{base}"] = _median_or_none([
                    r.decode_tokens_per_second / by[base][i].decode_tokens_per_second for i, r in by[m].items()
                    if i in by[base] and r.decode_tokens_per_second and by[base][i].decode_tokens_per_second])
        reference = REFERENCE.get(m, "ar")
        greedy = [i for i, r in by[m].items() if r.temperature == 0 and i in by.get(reference, {})]
        if m != reference and greedy:
            mismatches = [i for i in greedy if by[m][i].tokens != by[reference][i].tokens]
            entry[f"identical_to_{reference}"] = len(greedy) - len(mismatches)
            entry["greedy_prompts"] = len(greedy)
            entry["mismatched_prompts"] = mismatches
        # seeded sampled outputs of our exact methods are the seeded AR output (Gumbel-max coupling)
        sampled = [i for i, r in by[m].items() if r.temperature > 0 and i in by.get("ar", {})]
        if m != "ar" and sampled and not is_peer(m) and not is_lossy(m) and m not in STREAM + BEAM_METHODS:
            mismatches = [i for i in sampled if by[m][i].tokens != by["ar"][i].tokens]
            entry["identical_sampled_to_ar"] = len(sampled) - len(mismatches)
            entry["sampled_prompts"] = len(sampled)
            entry["mismatched_sampled_prompts"] = mismatches
        summary[m] = entry
    return summary


def _structured(rs: list[Record]) -> dict:
    """Where the prompts had a schema (json-tasks): how many outputs were valid (and why the others
    were not), how many ran out of tokens, the tokens the grammar forced, and the masks' cost per
    emitted token."""
    checked = [r for r in rs if r.valid is not None]
    if not checked:
        return {}
    tokens = sum(r.new_tokens for r in checked)
    return {"valid_outputs": sum(r.valid for r in checked), "checked_outputs": len(checked),
            "invalid_outputs": {r.prompt_id: r.problem for r in checked if not r.valid},
            "truncated_outputs": sum(bool(r.problem and r.problem.startswith("truncated")) for r in checked),
            "forced_tokens": sum(r.forced for r in checked),
            "forced_per_token": sum(r.forced for r in checked) / tokens if tokens else None,
            "masks_per_token": sum(r.mask_calls for r in checked) / tokens if tokens else None,
            "mask_ms_per_token": 1000 * sum(r.mask_seconds for r in checked) / tokens if tokens else None}


def check_schema_output(record: Record, schema: dict, target: Backend) -> None:
    """Set `record.valid` and `record.problem`: its output decoded and checked against `schema`
    (an output that did not end with an end token was cut off, and is invalid)."""
    ends = set(target.eos_token_ids or ())
    truncated = not record.tokens or record.tokens[-1] not in ends
    record.problem = check_output(target.decode(record.tokens), schema, truncated)
    record.valid = record.problem is None


def group_summaries(records: list[Record], methods: list[str], assumed: AssumedCosts | None = None) -> list[dict]:
    """One summary per (dataset, task, temperature), in the order they ran."""
    keys = list(dict.fromkeys((r.dataset, r.task, r.temperature) for r in records))
    return [{"dataset": d, "task": t, "temperature": temp,
             "summary": summarize([r for r in records if (r.dataset, r.task, r.temperature) == (d, t, temp)], methods,
                                  assumed)}
            for d, t, temp in keys]


def load_peers(methods: list[str], target: str, drafter: str, target_model, drafter_model, device: str,
               say) -> PeerModels:
    """The models the peers need beyond ours: transformers models where ours run on llama.cpp, and
    llama.cpp's own for the llama-cpp methods."""
    peers = PeerModels()
    hf_methods = [m for m in methods if m.startswith("hf")]
    from ..backends.llamacpp import LlamaCppModel

    if hf_methods and isinstance(target_model, LlamaCppModel):  # transformers' peers need a transformers model
        say("transformers' peers run on transformers' own models (dtype auto)")
        peers.hf_target = load(target, device=device, role="target", say=say)
        if NEEDS_DRAFTER & set(hf_methods):
            peers.hf_drafter = load(drafter, device=device, role="drafter", say=say, vocab=0)
    if any(m.startswith("llama-cpp") for m in methods):
        from .llama_peers import LlamaPeers

        say("llama.cpp's peers: loading the GGUF files into llama-cpp-python")
        peers.llama = LlamaPeers(target, drafter if "llama-cpp-spec" in methods else None,
                                 lookup="llama-cpp-lookup" in methods)
    return peers


def llama_cpp_version() -> str | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    return getattr(llama_cpp, "__version__", "unknown")


def divergence(target: Backend, ids: list[int], reference: list[int], other: list[int]) -> dict:
    """Where `other` first leaves `reference`, and the target's top-2 logit gap there, scored as the
    AR baseline scores it (prefill, then a one-token pass)."""
    k = next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), min(len(reference), len(other)))
    cache = target.new_cache()
    logits = target.forward(target.prefill(ids + reference[:k], cache), cache, 1)[-1]
    top2 = logits.topk(2)
    return {"position": k, "reference_token": reference[k] if k < len(reference) else None,
            "other_token": other[k] if k < len(other) else None,
            "top2_logit_gap": float(top2.values[0] - top2.values[1])}


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (host: {cpu}), torch {torch.__version__}"
    return (f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
            f"CPU capability {torch.backends.cpu.get_cpu_capability()}")


def run_benchmark(datasets: list[str], limit: int | None, methods: list[str], target: str, drafter: str,
                  settings: Settings, temperatures: list[float] = (0.0,), tasks: list[str] | None = None,
                  seed: int = 0, markdown: str | None = None, json_path: str | None = None,
                  plot: str | None = None, argv: list[str] | None = None, console: Console | None = None,
                  dtype: str = "auto", drafter_dtype: str = "auto", device: str = "auto",
                  exact_rows: bool | None = None, drafter_vocab: int | None = None,
                  drafter_vocab_corpus: str | None = None, samples: int = 1) -> dict:
    """Run every method on every prompt of `datasets` (names, or NAME:LIMIT:T+T specs, see
    `parse_dataset`) at every temperature; report and return
    {"info", "summary" (by method, all prompts), "groups" (by dataset, task, temperature), "records"}.

    samples: generations per method of each prompt at a temperature > 0 (greedy ones run once),
    each sample's methods in a counterbalanced order of their own, summed into one record
    (`merge_samples`): one sampled generation's length, and so its speed, is a draw."""
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 1:
        raise SpecdecError(f"samples must be an integer >= 1, got {samples!r}")
    if len(set(VLLM_METHODS) & set(methods)) > 1:  # they would swap workers (minutes each) at every prompt
        raise SpecdecError("one vLLM method a bench run without --concurrency: each loads a worker of ~8 GB, one "
                           "at a time, and methods alternate prompt by prompt")
    console = console or Console(stderr=True)
    if not console.is_terminal:  # a log file: the summary table would wrap at 80 columns
        console.width = max(console.width, 160)
    check_methods(methods)
    prompts: list[Prompt] = []
    temperatures_of: list[list[float]] = []  # per prompt
    for spec in datasets:
        name, count, temps = parse_dataset(spec, limit, list(temperatures))
        loaded = load_prompts(name, count, tasks if name != "humaneval" else None)
        prompts += loaded
        temperatures_of += [temps] * len(loaded)
    if any(p.schema is not None for p in prompts):
        check_grammar_methods(methods)
    temperatures = sorted({t for temps in temperatures_of for t in temps})
    beams = [m for m in methods if m in BEAM_METHODS]
    if beams and any(t > 0 for t in temperatures):
        raise SpecdecError(f"{', '.join(beams)} decode deterministically: run them at temperature 0 only")
    samplers = [Sampler(temperature=t) for t in temperatures]

    def say(msg: str) -> None:
        console.print(f"[dim]{msg}[/]", highlight=False)

    if "retrieval" in methods:
        open_datastore(settings)  # a missing or damaged datastore fails before minutes of loading
    if "sd-distilled" in methods:
        distilled_adapter(settings)  # as with a datastore
    if "sd-parallel" in methods:
        parallel_adapter(settings)
    kinds = {checkpoint_kind(m) for m in methods} - {None}
    for kind in sorted(kinds):  # a missing or damaged checkpoint fails before minutes of loading
        self_drafting(settings, kind)
    target_model = load(target, dtype=dtype, device=device, role="target", exact_rows=exact_rows, say=say)
    self_skip_search = None
    if "self-skip" in methods and not settings.skip_layers:  # searched once, used on every prompt
        settings.skip_layers, self_skip_search = choose_skipped(target_model)
        say(f"self-skip: skipping layers {settings.skip_layers}")
    if {"early-exit", "multi-draft"} & set(methods) and not settings.exit_layer:  # searched once too
        from ..drafters.early_exit import choose_exit

        settings.exit_layer = choose_exit(target_model)[0]
        say(f"early-exit: exiting after layer {settings.exit_layer}")
    drafter_model = (load(drafter, dtype=drafter_dtype, device=device, role="drafter", say=say, vocab=drafter_vocab,
                          vocab_corpus=drafter_vocab_corpus)
                     if NEEDS_DRAFTER & set(methods) else None)
    if drafter_model is not None:
        check_pair(target_model, drafter_model)
        load_own_drafters(methods, settings, lambda name: load(
            name or drafter, dtype=drafter_dtype, device=device, role="drafter", say=say, vocab=drafter_vocab,
            vocab_corpus=drafter_vocab_corpus))
    peers = load_peers(methods, target, drafter, target_model, drafter_model, device, say)
    if set(VLLM_METHODS) & set(methods):  # vLLM's workers, one request at a time
        settings.vllm = VllmPeers.for_run(methods, target, drafter, settings.vllm_threads, 1, say,
                                           datastore=settings.datastore, eager=settings.vllm_eager,
                                           dtype=settings.vllm_dtype)
    if "sd-cost" in methods or drafter_model is not None:
        # as the CLI does: where no draft can pay, sd-cost drafts nothing; and the pair's c prices
        # the drafter's passes in the projection for a machine with nearly free wide passes
        settings.pass_costs = pass_costs(target_model, drafter_model, say)
        say(f"pass costs: best case of a draft here {settings.pass_costs.best_speedup():.2f}x plain decoding"
            + (": sd-cost will draft nothing" if settings.pass_costs.never_pays() else ""))
        costs = settings.pass_costs
        settings.assumed = AssumedCosts.flat(costs.drafter / costs.target[1], settings.flat_at16)
    if any(m in names() and preset(m).method in MODEL_FREE_DRAFTERS for m in methods):  # their cost schedules
        settings.free_costs = pass_costs(target_model, None, say)
    if settings.assumed is None and any(is_flat(m) for m in methods):  # model-free -flat methods: no drafter passes
        settings.assumed = AssumedCosts.flat(0.0, settings.flat_at16)
    encoded = [target_model.encode(p.text, chat=p.chat) for p in prompts]
    too_long = [p.index for p, ids in zip(prompts, encoded) if len(ids) + settings.max_new_tokens > target_model.max_context]
    if too_long:
        raise SpecdecError(f"prompts {too_long[:5]} leave no room for {settings.max_new_tokens} new tokens")

    warm = encoded[0][:32]
    warm_settings = Settings(**{**vars(settings), "max_new_tokens": 8})
    for m in methods:  # warm-up: first calls pay for allocations and lazy initialisation (a grammar's tokenizer view)
        for sampler in samplers:
            run_method(m, warm, target_model, drafter_model, warm_settings, sampler, seed, peers, prompts[0].schema)

    records: list[Record] = []
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=console) as progress:
        runs = sum(samples if t > 0 else 1 for temps in temperatures_of for t in temps)
        bar = progress.add_task("benchmark", total=runs * len(methods))
        orders = method_orders(methods, seed)
        for sampler in samplers:
            for p, ids, temps in zip(prompts, encoded, temperatures_of):
                if sampler.temperature not in temps:
                    continue
                count = 1 if sampler.is_greedy else samples
                drawn: dict[str, list[Record]] = {m: [] for m in methods}
                for k in range(count):
                    for m in next(orders):  # counterbalanced: see method_orders
                        progress.update(bar, description=f"{p.dataset}/{p.task} #{p.index} T={sampler.temperature:g}"
                                        + (f" sample {k + 1}/{count}" if count > 1 else "") + f": {m}")
                        gc.collect()  # the garbage of the previous method is not collected on this one's clock
                        r = run_method(m, ids, target_model, drafter_model, settings, sampler,
                                       seed + p.index + SAMPLE_SEEDS * k, peers, p.schema)
                        if p.schema is not None:
                            check_schema_output(r, p.schema, target_model)
                        r.prompt_id = f"{p.dataset}/{p.index}@t{sampler.temperature:g}"
                        r.dataset, r.task, r.temperature = p.dataset, p.task, sampler.temperature
                        drawn[m].append(r)
                        progress.advance(bar)
                        if not console.is_terminal:  # a log file gets no live bar: one line per generation
                            console.print(f"{r.prompt_id} {m}: {r.new_tokens} tokens, {r.tokens_per_second:.2f} tok/s",
                                          highlight=False)
                records += [merge_samples(rs) if len(rs) > 1 else rs[0] for rs in drawn.values()]

    summary = summarize(records, methods, settings.assumed)
    ids_by_prompt = {f"{p.dataset}/{p.index}": ids for p, ids in zip(prompts, encoded)}
    outputs = {(r.method, r.prompt_id): r.tokens for r in records}
    for r in records:  # for each greedy output that left its reference's: where, and how close the target's call was
        entry = summary[r.method]
        if r.prompt_id in entry.get("mismatched_prompts", []):
            entry.setdefault("divergences", {})[r.prompt_id] = divergence(
                target_model, ids_by_prompt[r.prompt_id.split("@")[0]],
                outputs[(REFERENCE.get(r.method, "ar"), r.prompt_id)], r.tokens)
    own_limits = any(":" in d for d in datasets)  # then the specs say the limits
    info = {"datasets": datasets, "tasks": tasks, "limit": None if own_limits else limit, "prompts": len(prompts),
            "temperatures": list(temperatures), "seed": seed, "samples": samples,
            "settings": {k: v for k, v in vars(settings).items() if k not in MEASURED_SETTINGS},
            "pass_costs": settings.pass_costs.to_dict() if settings.pass_costs else None,
            "assumed_costs": settings.assumed.to_dict() if settings.assumed else None,
            "target": target_model.name, "drafter": drafter_model.name if drafter_model else None,
            "target_dtype": target_model.weights, "target_kernels": target_model.kernels,
            "target_exact_rows": target_model.exact_rows,
            "drafter_dtype": drafter_model.weights if drafter_model else None,
            "drafter_kernels": drafter_model.kernels if drafter_model else None,
            "drafter_vocab": drafter_model.draft_vocabulary if drafter_model else None,
            "hf_peers_dtype": (str(peers.hf_target.dtype).removeprefix("torch.") if peers.hf_target else None),
            "llama_cpp": llama_cpp_version() if peers.llama else None,
            "vllm": settings.vllm.describe() if settings.vllm else None,
            "medusa_heads": self_drafting(settings, "medusa").info if "medusa" in kinds else None,
            "eagle_drafter": self_drafting(settings, "eagle").info if "eagle" in kinds else None,
            "distilled_adapter": {k: v for k, v in distilled_adapter(settings).info.items() if k != "shapes"}
                                 if "sd-distilled" in methods else None,
            "parallel_drafter": {k: v for k, v in parallel_adapter(settings).info.items() if k != "shapes"}
                                if "sd-parallel" in methods else None,
            "online": online_summary(),
            "self_skip_search": self_skip_search,
            "machine": machine_description(), "command": "specdec " + " ".join(argv[1:]) if argv else None}
    result = {"info": info, "summary": summary, "groups": group_summaries(records, methods, settings.assumed),
              "records": [dict(vars(r), tokens_per_second=r.tokens_per_second,
                               decode_tokens_per_second=r.decode_tokens_per_second) for r in records]}
    console.print(render_table(summary, title="all prompts"))
    console.print(render_paired(summary))
    if any("valid_outputs" in s for s in summary.values()):
        console.print(render_structured(summary))
    if markdown:
        with open(markdown, "w") as f:
            f.write(render_markdown(result))
        console.print(f"wrote {markdown}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
        console.print(f"wrote {json_path}")
    if plot:
        render_plot(result, plot)
        console.print(f"wrote {plot}")
    return result
