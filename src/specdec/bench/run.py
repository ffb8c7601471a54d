"""Run methods over a dataset in one process, interleaved prompt by prompt, and report ratios.

Machines here are shared and noisy: absolute times drift, so every number that matters is a
ratio between methods measured on the same prompt within seconds of each other.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import dataclass, field

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..errors import SpecdecError
from ..generate import autoregressive_generate, speculative_generate
from ..models import LanguageModel, load
from .datasets import load_prompts

METHODS = ("ar", "sd", "hf", "hf-assisted", "hf-lookup")
NEEDS_DRAFTER = ("sd", "hf-assisted")


@dataclass
class Record:
    prompt_index: int
    method: str
    tokens: list[int]
    new_tokens: int
    wall_seconds: float
    target_forwards: int | None  # None where the method does not report it (transformers' peers)
    drafted: int = 0
    accepted: int = 0
    accepted_per_step: list[int] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_seconds


def hf_generate(method: str, model: LanguageModel, ids: list[int], max_new_tokens: int, gamma: int,
                drafter: LanguageModel | None = None) -> Record:
    """transformers' own greedy `generate` on the very same model objects (same weights, kernels, dtype).

    hf: plain; hf-assisted: with the drafter as `assistant_model`, a constant γ and no confidence
    cut-off (like ours); hf-lookup: prompt lookup with up to γ tokens.
    """
    peers = {"hf": {}, "hf-assisted": {"assistant_model": drafter.hf if drafter else None},
             "hf-lookup": {"prompt_lookup_num_tokens": gamma}}
    if method == "hf-assisted":
        # transformers reads γ from the *assistant's* generation config, and its default "heuristic"
        # schedule carries a grown γ (20 was seen) across calls; pin it to ours on every call
        config = drafter.hf.generation_config
        config.num_assistant_tokens, config.num_assistant_tokens_schedule = gamma, "constant"
        config.assistant_confidence_threshold = 0.0
    eos = model.eos_token_ids
    inputs = torch.tensor([ids], device=model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.hf.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=max_new_tokens,
                                do_sample=False, num_beams=1, repetition_penalty=1.0, temperature=None,
                                top_p=None, top_k=None, eos_token_id=eos, pad_token_id=eos[0] if eos else None,
                                **peers[method])
    wall = time.perf_counter() - start
    tokens = out[0, len(ids):].tolist()
    return Record(-1, method, tokens, len(tokens), wall, len(tokens) if method == "hf" else None)


def run_method(method: str, ids: list[int], target: LanguageModel, drafter: LanguageModel | None, gamma: int,
               max_new_tokens: int) -> Record:
    if method.startswith("hf"):
        return hf_generate(method, target, ids, max_new_tokens, gamma, drafter)
    if method == "ar":
        result = autoregressive_generate(ids, target, max_new_tokens=max_new_tokens)
    elif method == "sd":
        result = speculative_generate(ids, target, drafter, gamma=gamma, max_new_tokens=max_new_tokens)
    else:
        raise SpecdecError(f"unknown method '{method}'; choose from {', '.join(METHODS)}")
    s = result.stats
    return Record(-1, method, result.tokens, s.new_tokens, s.wall_seconds, s.target_forwards, s.drafted,
                  s.accepted, s.accepted_per_step)


def divergence(target: LanguageModel, ids: list[int], reference: list[int], other: list[int]) -> dict:
    """Where `other` first leaves `reference`, and the target's top-2 logit gap there (1-token pass)."""
    k = next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), min(len(reference), len(other)))
    logits = target.forward(ids + reference[:k], None, 1)[-1]
    top2 = logits.topk(2)
    return {"position": k, "reference_token": reference[k] if k < len(reference) else None,
            "other_token": other[k] if k < len(other) else None,
            "top2_logit_gap": float(top2.values[0] - top2.values[1])}


def summarize(records: list[Record], methods: list[str]) -> dict[str, dict]:
    """Per method: median tok/s, aggregate tok/s, median per-prompt speedups, acceptance, identity to AR."""
    by = {m: {r.prompt_index: r for r in records if r.method == m} for m in methods}
    summary = {}
    for m in methods:
        rs = list(by[m].values())
        drafted = sum(r.drafted for r in rs)
        entry = {
            "prompts": len(rs),
            "median_tokens_per_second": statistics.median(r.tokens_per_second for r in rs),
            "aggregate_tokens_per_second": sum(r.new_tokens for r in rs) / sum(r.wall_seconds for r in rs),
            "acceptance_rate": sum(r.accepted for r in rs) / drafted if drafted else None,
            "tokens_per_target_forward": (sum(r.new_tokens for r in rs) / sum(r.target_forwards for r in rs)
                                          if all(r.target_forwards for r in rs) else None),
        }
        for base in ("ar", "hf"):
            if base in by and base != m:
                ratios = [r.tokens_per_second / by[base][i].tokens_per_second for i, r in by[m].items()]
                entry[f"median_speedup_vs_{base}"] = statistics.median(ratios)
        if "ar" in by and m != "ar":
            mismatches = [i for i, r in by[m].items() if r.tokens != by["ar"][i].tokens]
            entry["identical_to_ar"] = len(rs) - len(mismatches)
            entry["mismatched_prompts"] = mismatches
        summary[m] = entry
    return summary


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
            f"CPU capability {torch.backends.cpu.get_cpu_capability()}")


def run_benchmark(dataset: str, limit: int, methods: list[str], target: str, drafter: str, gamma: int,
                  max_new_tokens: int, markdown: str | None = None, json_path: str | None = None,
                  argv: list[str] | None = None, console: Console | None = None, dtype: str = "auto",
                  drafter_dtype: str = "auto") -> dict:
    console = console or Console(stderr=True)
    for m in methods:
        if m not in METHODS:
            raise SpecdecError(f"unknown method '{m}'; choose from {', '.join(METHODS)}")
    prompts = load_prompts(dataset, limit)
    def say(msg: str) -> None:
        console.print(f"[dim]{msg}[/]", highlight=False)

    target_model = load(target, dtype=dtype, role="target", say=say)
    needs_drafter = any(m in NEEDS_DRAFTER for m in methods)
    drafter_model = load(drafter, dtype=drafter_dtype, role="drafter", say=say) if needs_drafter else None
    encoded = [target_model.encode(p) for p in prompts]

    warm = encoded[0][:32]
    for m in methods:  # warm-up: first calls pay for allocations and lazy initialisation
        run_method(m, warm, target_model, drafter_model, gamma, 8)

    records: list[Record] = []
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("benchmark", total=len(prompts) * len(methods))
        for i, ids in enumerate(encoded):
            # rotate the order per prompt so no method always runs first (or right after another)
            order = methods[i % len(methods):] + methods[:i % len(methods)]
            for m in order:
                progress.update(task, description=f"prompt {i + 1}/{len(prompts)}: {m}")
                record = run_method(m, ids, target_model, drafter_model, gamma, max_new_tokens)
                record.prompt_index = i
                records.append(record)
                progress.advance(task)

    summary = summarize(records, methods)
    ar_tokens = {r.prompt_index: r.tokens for r in records if r.method == "ar"}
    for r in records:  # for each output that left AR's: where, and how close the target's call was
        entry = summary[r.method]
        if r.prompt_index in entry.get("mismatched_prompts", []):
            entry.setdefault("divergences", {})[r.prompt_index] = divergence(
                target_model, encoded[r.prompt_index], ar_tokens[r.prompt_index], r.tokens)
    command = "specdec " + " ".join(argv[1:]) if argv else None
    info = {"dataset": dataset, "prompts": len(prompts), "max_new_tokens": max_new_tokens, "gamma": gamma,
            "target": target_model.name, "drafter": drafter_model.name if drafter_model else None,
            "target_dtype": str(target_model.dtype).removeprefix("torch."), "target_kernels": target_model.kernels,
            "drafter_dtype": str(drafter_model.dtype).removeprefix("torch.") if drafter_model else None,
            "drafter_kernels": drafter_model.kernels if drafter_model else None,
            "machine": machine_description(), "command": command}
    console.print(render_table(summary))
    if markdown:
        with open(markdown, "w") as f:
            f.write(render_markdown(summary, records, info))
        console.print(f"wrote {markdown}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"info": info, "summary": summary,
                       "records": [dict(vars(r), tokens_per_second=r.tokens_per_second) for r in records]}, f, indent=1)
        console.print(f"wrote {json_path}")
    return summary


def _fmt(value, spec=".2f"):
    return "–" if value is None else format(value, spec)


def render_table(summary: dict) -> Table:
    table = Table("method", "median tok/s", "aggregate tok/s", "speedup vs ar", "speedup vs hf", "acceptance",
                  "tokens/target fwd", "identical to ar")
    for m, s in summary.items():
        identical = f"{s['identical_to_ar']}/{s['prompts']}" if "identical_to_ar" in s else "–"
        table.add_row(m, _fmt(s["median_tokens_per_second"]), _fmt(s["aggregate_tokens_per_second"]),
                      _fmt(s.get("median_speedup_vs_ar"), ".2f") + ("x" if "median_speedup_vs_ar" in s else ""),
                      _fmt(s.get("median_speedup_vs_hf"), ".2f") + ("x" if "median_speedup_vs_hf" in s else ""),
                      _fmt(s["acceptance_rate"], ".1%"), _fmt(s["tokens_per_target_forward"]), identical)
    return table


def render_markdown(summary: dict, records: list[Record], info: dict) -> str:
    lines = ["| method | median tok/s | aggregate tok/s | median speedup vs ar | median speedup vs hf | acceptance "
             "| tokens / target forward | identical to ar |", "|---|---|---|---|---|---|---|---|"]
    for m, s in summary.items():
        identical = f"{s['identical_to_ar']}/{s['prompts']}" if "identical_to_ar" in s else "–"
        lines.append(f"| {m} | {_fmt(s['median_tokens_per_second'])} | {_fmt(s['aggregate_tokens_per_second'])} "
                     f"| {_fmt(s.get('median_speedup_vs_ar'))} | {_fmt(s.get('median_speedup_vs_hf'))} "
                     f"| {_fmt(s['acceptance_rate'], '.1%')} | {_fmt(s['tokens_per_target_forward'])} | {identical} |")
    head = [f"- dataset: {info['dataset']} (first {info['prompts']} prompts), greedy, {info['max_new_tokens']} new "
            f"tokens max (EOS stops earlier), γ = {info['gamma']}",
            f"- target: {info['target']} ({info['target_dtype']}, {info['target_kernels']} linears); "
            f"drafter: {info['drafter']} ({info['drafter_dtype']}, {info['drafter_kernels']})",
            f"- machine: {info['machine']}",
            f"- command: `{info['command']}`" if info.get("command") else ""]
    mismatched = {m: s["mismatched_prompts"] for m, s in summary.items() if s.get("mismatched_prompts")}
    tail = [f"- outputs differing from ar: {mismatched}" if mismatched else "- every output is token-identical to ar"]
    for m, s in summary.items():
        for i, d in s.get("divergences", {}).items():
            tail.append(f"  - {m}, prompt {i}: first differs at new token {d['position']} (ar {d['reference_token']}, "
                        f"{m} {d['other_token']}); target's top-2 logit gap there: {d['top2_logit_gap']:.4f}")
    per_prompt = ["", "| prompt | " + " | ".join(f"{m} tok/s" for m in summary) + " |",
                  "|---|" + "---|" * len(summary)]
    indices = sorted({r.prompt_index for r in records})
    for i in indices:
        row = {r.method: r for r in records if r.prompt_index == i}
        per_prompt.append(f"| {i} | " + " | ".join(f"{row[m].tokens_per_second:.2f}" for m in summary) + " |")
    return "\n".join([*filter(None, head), "", *lines, "", *tail, *per_prompt, ""])
