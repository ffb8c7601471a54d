"""The bench at concurrency levels: every prompt of a run through one engine (`max_batch` = the
level: a new request starts as soon as one ends, as a server under that many clients), method by
method, against transformers' batching on the same model objects.

Per method and level: total output tokens per second (all requests' tokens over the level's wall
time), per-sequence tokens per second, time to first token and time per output token (p50, p99),
tokens per target pass, and how many outputs are identical to the reference: the prompt's AR
output (`ar` at the lowest level run: at level 1 each prompt alone), greedy or sampled with seeds
(a seeded output is the seeded AR output whatever drafted it); transformers' sampled runs against
their own lowest level.
Levels run in turn; within each level the methods run in a counterbalanced order
(`method_orders`), each over the whole prompt set, `repeats` times (each repeat in the next
order): a level's figures are over all its repeats, and the ratio to `ar` is also given per
repeat, so that the machine's drift between runs shows beside the ratio it blurs.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field

import torch

from ..decoding.sequence import Limits
from ..engine import Engine, Request
from ..errors import SpecdecError
from ..decoding.speculation import METHODS as REGISTRY, Parts, build, names, preset, summary
from ..core.samplers import Sampler
from .runners import Settings, bench_config
from .vllm_peer import VLLM_METHODS, VllmPeers

PEERS = {
    "hf-cb": "transformers' continuous batching (generate_batch, paged attention), plain decoding",
    "hf-padded": "transformers' generate on left-padded batches of `level` prompts, plain decoding",
    **VLLM_METHODS,
}
# ours: every registered method the engine runs (the target drafting for itself runs one sequence at a time)
LOAD_METHODS = {**{name: "ours, through the engine: " + summary(name) for name in names()
              if not REGISTRY[preset(name).method].self_drafting}, **PEERS}
# methods with a drafter model (chains and trees): it gets row-exact passes, batched across sequences
MODEL_DRAFTED = {name for name in LOAD_METHODS if name not in PEERS and preset(name).needs_drafter_model()}


@dataclass
class LoadRecord:
    """One request's outcome at one level."""

    method: str
    level: int
    prompt: int  # index into the run's prompts
    tokens: list[int]
    seconds: float | None  # from its admission to its last token (None: not said)
    first_token_seconds: float | None  # from its admission (None: not said)
    target_passes: int | None = None
    drafted: int = 0
    accepted: int = 0
    tpot: float | None = None  # where the method times its tokens itself (transformers' timestamps)

    @property
    def time_per_output_token(self) -> float | None:
        if self.tpot is not None:
            return self.tpot
        if self.seconds is None or self.first_token_seconds is None or len(self.tokens) < 2:
            return None
        return (self.seconds - self.first_token_seconds) / (len(self.tokens) - 1)


@dataclass
class LevelRun:
    method: str
    level: int
    wall_seconds: float
    records: list[LoadRecord] = field(default_factory=list)
    target_passes: int | None = None
    repeat: int = 0  # which of the level's repeats
    drafted: int | None = None  # draft tokens of the whole run where the method counts them so (vLLM)
    accepted: int | None = None


def merge_runs(runs: list[LevelRun]) -> LevelRun:
    """One method's repeats at one level as one run: their records, wall seconds and passes summed."""
    passes = [r.target_passes for r in runs]

    def total(counts):
        return sum(counts) if None not in counts else None
    return LevelRun(runs[0].method, runs[0].level, sum(r.wall_seconds for r in runs),
                    [record for r in runs for record in r.records], total(passes),
                    drafted=total([r.drafted for r in runs]), accepted=total([r.accepted for r in runs]))


def check_load_methods(methods: list[str]) -> None:
    unknown = [m for m in methods if m not in LOAD_METHODS]
    if unknown or not methods:
        raise SpecdecError(f"with --concurrency, methods are {', '.join(LOAD_METHODS)}; "
                           f"got {', '.join(unknown) or 'none'}")


def check_levels(levels: list[int]) -> None:
    if not levels or any(not isinstance(c, int) or c < 1 for c in levels):
        raise SpecdecError(f"--concurrency takes comma-separated integers >= 1, got {levels!r}")


def check_repeats(repeats: int) -> None:
    if not isinstance(repeats, int) or repeats < 1:
        raise SpecdecError(f"--repeats takes an integer >= 1, got {repeats!r}")


def request(method: str, ids: list[int], target, drafter, settings: Settings, sampler: Sampler,
            seed: int | None) -> Request:
    """Our method's request for a prompt (`drafter`: the drafter model, or None). Cost schedules
    of model-free drafters time their passes as they go (under load their rows stop being free
    too, so they can back off)."""
    config = bench_config(method, settings)
    model = drafter if method in MODEL_DRAFTED else None
    speculation = build(config, Parts(target, model,
                                      costs=lambda m: settings.pass_costs if m is not None else None))
    return Request(ids, speculation, sampler, Limits(settings.max_new_tokens), seed=seed)


def run_ours(method: str, level: int, prompts: list[list[int]], target, drafter, settings: Settings,
             sampler: Sampler, seeds: list[int | None]) -> LevelRun:
    engine = Engine(target, max_batch=level,
                    load_costs=settings.load_costs if method in MODEL_DRAFTED else settings.free_load_costs)
    ids = [engine.add(request(method, p, target, drafter, settings, sampler, s)) for p, s in zip(prompts, seeds)]
    began = time.perf_counter()
    results = engine.run()
    run = LevelRun(method, level, time.perf_counter() - began, target_passes=engine.passes)
    for index, request_id in enumerate(ids):
        r = results[request_id]
        run.records.append(LoadRecord(method, level, index, r.tokens, r.stats.wall_seconds, r.stats.first_token_seconds,
                                      r.stats.target_passes, r.stats.drafted, r.stats.accepted))
    return run


def _sampling(sampler: Sampler) -> dict:
    if sampler.is_greedy:
        return dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    return dict(do_sample=True, temperature=sampler.temperature, top_k=sampler.top_k or None, top_p=sampler.top_p)


class _StockAttention:
    """transformers' continuous batching takes its own attention implementations only: ours (the
    row-exact one, which outside our passes is transformers' sdpa) is named back while it runs."""

    def __init__(self, model):
        self.config = model.hf.config

    def __enter__(self):
        self.saved = self.config._attn_implementation
        self.config._attn_implementation = "sdpa"

    def __exit__(self, *exc):
        self.config._attn_implementation = self.saved


def run_hf_cb(level: int, prompts: list[list[int]], target, settings: Settings, sampler: Sampler,
              seed: int | None) -> LevelRun:
    """transformers' `generate_batch`: at most `level` requests per batch, a paged cache sized for them."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    eos = target.eos_token_ids
    config = GenerationConfig(max_new_tokens=settings.max_new_tokens, eos_token_id=eos,
                              pad_token_id=eos[0] if eos else 0, **_sampling(sampler))
    page = 64
    longest = max(len(p) for p in prompts) + settings.max_new_tokens
    batching = ContinuousBatchingConfig(max_requests_per_batch=level, page_size=page,
                                        num_blocks=level * (-(-longest // page) + 1) + 2)
    if seed is not None:
        torch.manual_seed(seed)
    began = time.perf_counter()
    with _StockAttention(target), torch.inference_mode():
        outputs = target.hf.generate_batch(prompts, generation_config=config, continuous_batching_config=batching,
                                           record_timestamps=True, progress_bar=False, warmup=False)
    run = LevelRun("hf-cb", level, time.perf_counter() - began)
    by_prompt = sorted(outputs.values(), key=lambda o: int(o.request_id.rsplit("_", 1)[-1]))
    for index, out in enumerate(by_prompt):
        stamps = out.timestamps or []
        # transformers does not say when a queued request was admitted: its first token is timed
        # from the run's start, which holds the queue's wait; its time per token is its own
        tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
        run.records.append(LoadRecord("hf-cb", level, index, list(out.generated_tokens), None, None, tpot=tpot))
    return run


def run_hf_padded(level: int, prompts: list[list[int]], target, settings: Settings, sampler: Sampler,
                  seed: int | None) -> LevelRun:
    """transformers' `generate` on left-padded batches of `level` prompts, in order: a batch ends
    when its longest generation does."""
    eos = target.eos_token_ids
    pad = eos[0] if eos else 0
    run = LevelRun("hf-padded", level, 0.0)
    began = time.perf_counter()
    for start in range(0, len(prompts), level):
        group = prompts[start:start + level]
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group], device=target.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=target.device)
        if seed is not None:
            torch.manual_seed(seed + start)
        batch_began = time.perf_counter()
        with torch.inference_mode():
            out = target.hf.generate(ids, attention_mask=mask, max_new_tokens=settings.max_new_tokens, num_beams=1,
                                     eos_token_id=eos, pad_token_id=pad, **_sampling(sampler))
        seconds = time.perf_counter() - batch_began
        for k, row in enumerate(out[:, width:].tolist()):
            tokens = []
            for token in row:
                tokens.append(token)
                if token in eos:
                    break
            run.records.append(LoadRecord("hf-padded", level, start + k, tokens, seconds, None))
    run.wall_seconds = time.perf_counter() - began
    return run


def run_vllm(method: str, level: int, prompts: list[list[int]], target, settings: Settings, sampler: Sampler,
             seeds: list[int | None]) -> LevelRun:
    """One of vLLM's methods in its worker (`settings.vllm`), at most `level` requests in flight,
    stopping where ours stop (the target's end ids, `max_new_tokens`)."""
    if settings.vllm is None:
        raise SpecdecError(f"{method} needs vLLM's workers (bench/vllm_peer.py)")
    answer = settings.vllm.run(method, prompts, level, settings.max_new_tokens, sampler, seeds, target.eos_token_ids)
    # vLLM counts its iterations (batched passes) and drafts per engine, not per request
    run = LevelRun(method, level, answer["wall_seconds"], target_passes=answer["iterations"] or None,
                   drafted=answer["drafted"], accepted=answer["accepted"])
    for index, record in enumerate(answer["records"]):
        run.records.append(LoadRecord(method, level, index, record["tokens"], record["seconds"],
                                      record["first_token_seconds"]))
    return run


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between order statistics; None for no values."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    position = (len(values) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (position - low)


def summarize_level(run: LevelRun, reference: dict[int, list[int]] | None) -> dict:
    """A level run's figures; `reference`: the outputs to compare with, by prompt (None: none)."""
    records = run.records
    tokens = sum(len(r.tokens) for r in records)
    ttft = [r.first_token_seconds for r in records]
    tpot = [r.time_per_output_token for r in records]
    per_sequence = [len(r.tokens) / r.seconds for r in records if r.seconds]
    passes = [r.target_passes for r in records if r.target_passes]
    drafted = run.drafted if run.drafted is not None else sum(r.drafted for r in records)
    accepted = run.accepted if run.accepted is not None else sum(r.accepted for r in records)
    acceptance = accepted / drafted if drafted else None
    out = {"method": run.method, "concurrency": run.level, "requests": len(records), "output_tokens": tokens,
           "wall_seconds": run.wall_seconds, "output_tokens_per_second": tokens / run.wall_seconds,
           "per_sequence_tokens_per_second": statistics.median(per_sequence) if per_sequence else None,
           "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
           "tpot_p50": percentile(tpot, 50), "tpot_p99": percentile(tpot, 99),
           "target_passes": run.target_passes,
           "tokens_per_target_pass": tokens / sum(passes) if passes and len(passes) == len(records) else
           tokens / run.target_passes if run.target_passes and run.level == 1 else None,  # vLLM's iterations alone
           "acceptance_rate": acceptance}
    if reference is not None:
        out["identical"] = sum(reference.get(r.prompt) == r.tokens for r in records)
    return out


def run_method_at(method: str, level: int, prompts: list[list[int]], target, drafter, settings: Settings,
                  sampler: Sampler, seeds: list[int | None]) -> LevelRun:
    """One method at one level over `prompts` (`seeds`: one a prompt, or Nones for greedy)."""
    if method == "hf-cb":
        return run_hf_cb(level, prompts, target, settings, sampler, seeds[0])
    if method == "hf-padded":
        return run_hf_padded(level, prompts, target, settings, sampler, seeds[0])
    if method in VLLM_METHODS:
        return run_vllm(method, level, prompts, target, settings, sampler, seeds)
    return run_ours(method, level, prompts, target, drafter, settings, sampler, seeds)


def warm_up_level(level: int, prompts: list[list[int]], methods: list[str], target, drafter, settings: Settings,
                  sampler: Sampler, seeds: list[int | None], tokens: int = 8, prompt_tokens: int = 32) -> list[LevelRun]:
    """Every method once at `level`, untimed, over `level` prompts cut to `prompt_tokens` ids and
    `tokens` new tokens -> their runs (to be thrown away). A batch of a width not run before pays
    for its first kernels and allocations at that shape; without this the method that ran first
    at a level paid it on its clock (the first of identical runs was the slowest at 4 and 8 in
    flight, XEON-BF16)."""
    short = Settings(**{**vars(settings), "max_new_tokens": tokens})
    cut = [p[:prompt_tokens] for p in (prompts * level)[:level]]
    return [run_method_at(method, level, cut, target, drafter, short, sampler, (seeds * level)[:level])
            for method in methods]


def run_levels(prompts: list[list[int]], levels: list[int], methods: list[str], target, drafter,
               settings: Settings, sampler: Sampler, seed: int, orders, say=lambda message: None,
               progress=None, repeats: int = 1, warmup: bool = False) -> tuple[list[dict], list[LevelRun]]:
    """Every method at every level over all `prompts`, `repeats` times a level (each repeat in
    the next of `orders`) -> (summaries, a method and level's repeats merged; runs). Our outputs
    are compared with `ar`'s first repeat at the lowest level run (sampled ones seeded: seed +
    prompt index, so each is the seeded AR output): at level 1 each prompt alone, at a higher one
    `ar`'s batched output, which is each prompt's alone bit for bit (the engine's row-exact
    passes); transformers' sampled ones with their own run at the lowest level. `warmup`: each
    method's first run at a level comes right after its untimed `warm_up_level` there. Where vLLM's
    methods run, theirs run back to back in each order (`VllmPeers.grouped`): one worker is alive
    at a time."""
    seeds = [None if sampler.is_greedy else seed + i for i in range(len(prompts))]
    runs: list[LevelRun] = []
    alone: dict[str, dict[int, list[int]]] = {}
    levels = sorted(set(levels))
    for level in levels:
        warmed: set[str] = set()
        for repeat in range(repeats):
            order = next(orders)
            if settings.vllm is not None:  # one vLLM worker at a time: theirs run back to back
                order = settings.vllm.grouped(order)
            for method in order:
                if warmup and method not in warmed:
                    warm_up_level(level, prompts, [method], target, drafter, settings, sampler, seeds)
                    warmed.add(method)
                gc.collect()  # the previous method's garbage is not collected on this one's clock
                run = run_method_at(method, level, prompts, target, drafter, settings, sampler, seeds)
                run.repeat = repeat
                runs.append(run)
                if level == levels[0] and repeat == 0:  # the reference: at level 1 each prompt alone
                    alone[method] = {r.prompt: r.tokens for r in run.records}
                tokens = sum(len(r.tokens) for r in run.records)
                again = f" (repeat {repeat + 1}/{repeats})" if repeats > 1 else ""
                say(f"concurrency {level} {method}{again}: {tokens} tokens in {run.wall_seconds:.1f} s, "
                    f"{tokens / run.wall_seconds:.2f} tok/s in all")
                if progress is not None:
                    progress()
    grouped: dict[tuple[str, int], list[LevelRun]] = {}
    for run in runs:
        grouped.setdefault((run.method, run.level), []).append(run)
    summaries = []
    for (method, level), repeated in grouped.items():
        reference = alone.get("ar") if sampler.is_greedy or not method.startswith("hf") else alone.get(method)
        summary = summarize_level(merge_runs(repeated), reference)
        if sampler.is_greedy and method in VLLM_METHODS and "vllm" in alone and (method, level) != ("vllm", levels[0]):
            # vLLM's greedy outputs against its own plain ones at the lowest level: where drafts
            # change them, whether another batch size alone does too (its numerics, not the drafts);
            # sampled, its rejection sampler draws other numbers than plain decoding, seeded or not
            summary["identical_vllm"] = summarize_level(merge_runs(repeated), alone["vllm"])["identical"]
        summary["repeat_tokens_per_second"] = [sum(len(r.tokens) for r in run.records) / run.wall_seconds
                                               for run in repeated]
        summaries.append(summary)
    return summaries, runs


def render_levels(summaries: list[dict]) -> str:
    """The markdown table: a row per method and level, with its ratio to `ar` at that level (and,
    where a level ran more than once, the lowest and highest of the repeats' own ratios)."""
    ar = {s["concurrency"]: s["output_tokens_per_second"] for s in summaries if s["method"] == "ar"}
    ar_repeats = {s["concurrency"]: s.get("repeat_tokens_per_second") for s in summaries if s["method"] == "ar"}
    repeated = any(len(s.get("repeat_tokens_per_second") or ()) > 1 for s in summaries)
    lines = ["| concurrency | method | output tok/s | × ar | " + ("× ar by repeat | " if repeated else "") +
             "per-sequence tok/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | tokens / target pass | identical |",
             "|---|---|---|---|" + ("---|" if repeated else "") + "---|---|---|---|---|"]

    def number(value, scale=1.0, digits=2):
        return "–" if value is None else f"{value * scale:.{digits}f}"

    for s in sorted(summaries, key=lambda s: (s["concurrency"], s["method"])):
        ratio = s["output_tokens_per_second"] / ar[s["concurrency"]] if s["concurrency"] in ar else None
        identical = f'{s["identical"]}/{s["requests"]}' if "identical" in s else "–"
        if "identical_vllm" in s:
            identical += f' (vLLM plain: {s["identical_vllm"]}/{s["requests"]})'
        by_repeat = ""
        if repeated:
            ratios = [mine / theirs for mine, theirs in zip(s.get("repeat_tokens_per_second") or (),
                                                           ar_repeats.get(s["concurrency"]) or ())]
            by_repeat = (f"{min(ratios):.2f}–{max(ratios):.2f}" if ratios else "–") + " | "
        lines.append(f'| {s["concurrency"]} | {s["method"]} | {s["output_tokens_per_second"]:.2f} | {number(ratio)} | '
                     f'{by_repeat}'
                     f'{number(s["per_sequence_tokens_per_second"])} | {number(s["ttft_p50"])} / {number(s["ttft_p99"])} | '
                     f'{number(s["tpot_p50"], 1e3, 0)} / {number(s["tpot_p99"], 1e3, 0)} | '
                     f'{number(s["tokens_per_target_pass"])} | {identical} |')
    return "\n".join(lines) + "\n"


def run_load_benchmark(datasets: list[str], limit: int | None, methods: list[str], levels: list[int], target: str,
                       drafter: str, settings: Settings, temperature: float = 0.0, seed: int = 0,
                       markdown: str | None = None, json_path: str | None = None, argv: list[str] | None = None,
                       console=None, device: str = "auto", drafter_dtype: str = "auto",
                       tasks: list[str] | None = None, repeats: int = 1) -> dict:
    """`specdec bench --concurrency`: every method at every level over the prompts of `datasets`
    (one temperature), on one target and drafter, `repeats` times a level; report and return
    {"info", "levels"}."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..models.loading import load
    from ..sizing.pass_costs import load_costs, pass_costs
    from ..backends.text import check_pair
    from .datasets import load_prompts, parse_dataset
    from .run import machine_description, method_orders

    check_load_methods(methods)
    check_levels(levels)
    check_repeats(repeats)
    console = console or Console(stderr=True)

    def say(message: str) -> None:
        console.print(f"[dim]{message}[/]", highlight=False)

    prompts = []
    for spec in datasets:
        name, count, _ = parse_dataset(spec, limit, [temperature])
        prompts += load_prompts(name, count, tasks if name != "humaneval" else None)
    if any(p.schema is not None for p in prompts):  # their outputs would go unconstrained and unchecked
        raise SpecdecError("prompts with a schema (json-tasks) run without --concurrency, one at a time")
    # batched passes must be row-exact on the CPU (the engine refuses the target otherwise)
    target_model = load(target, device=device, role="target", exact_rows=True, say=say)
    drafter_model = None
    if MODEL_DRAFTED & set(methods):  # row-exact attention: the engine batches its passes across sequences
        drafter_model = load(drafter, dtype=drafter_dtype, device=device, role="drafter", exact_rows=True, say=say)
        check_pair(target_model, drafter_model)
        settings.pass_costs = pass_costs(target_model, drafter_model, say)
        settings.load_costs = load_costs(target_model, drafter_model, say)
    settings.free_load_costs = load_costs(target_model, None, say)
    if set(VLLM_METHODS) & set(methods):
        settings.vllm = VllmPeers.for_run(methods, target, drafter, settings.vllm_threads, max(levels), say,
                                           datastore=settings.datastore, eager=settings.vllm_eager,
                                           dtype=settings.vllm_dtype)
    encoded = [target_model.encode(p.text, chat=p.chat) for p in prompts]
    sampler = Sampler(temperature=temperature)
    say(f"{len(encoded)} prompts of {min(map(len, encoded))}-{max(map(len, encoded))} tokens; levels {levels}")

    orders = method_orders(methods, seed)
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    try:
        with Progress(*columns, console=console) as progress:
            bar = progress.add_task("concurrency levels", total=len(set(levels)) * len(methods) * repeats)
            summaries, _ = run_levels(encoded, levels, methods, target_model, drafter_model, settings, sampler, seed,
                                      orders, say, lambda: progress.advance(bar), repeats, warmup=True)
    finally:
        if settings.vllm is not None:
            vllm_setup = settings.vllm.describe()
            settings.vllm.close()
    info = {"datasets": datasets, "tasks": tasks, "limit": limit, "prompts": len(encoded), "prompt_tokens": [len(e) for e in encoded],
            "levels": sorted(set(levels)), "repeats": repeats, "methods": methods, "temperature": temperature, "seed": seed,
            "max_new_tokens": settings.max_new_tokens, "target": target_model.name,
            "target_dtype": target_model.weights, "drafter": drafter if drafter_model else None,
            "drafter_dtype": drafter_model.weights if drafter_model else None,
            "machine": machine_description(), "command": "specdec " + " ".join(argv[1:]) if argv else None,
            "method_descriptions": {m: LOAD_METHODS[m] for m in methods},
            **({"vllm": vllm_setup} if settings.vllm is not None else {})}
    result = {"info": info, "levels": summaries}
    table = render_levels(summaries)
    console.print(table, highlight=False)
    if markdown:
        with open(markdown, "w") as f:
            f.write(f"# Concurrency levels\n\n`{info['command']}`\n\n{info['machine']}\n\n{table}")
        console.print(f"wrote {markdown}")
    if json_path:
        import json

        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
        console.print(f"wrote {json_path}")
    return result
