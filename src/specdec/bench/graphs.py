"""Captured passes against the memory floor (`python -m specdec.bench.rowprobe --captured ...`).

On random weights of a config's shape (no weights reach a lent GPU), it reports, each section
as soon as it is measured (a line of text and a JSON record):

- floor: the bytes a pass reads (every weight but the embedding table, of which a pass reads
  only its rows) over the GPU's measured copy bandwidth;
- exactness: the row and batch gaps of captured row-exact passes (`backends.captured`), and of
  captured plain ones (GEMMs and norms on each pass's own rows, graphs per exact width: the
  power check, which should break them);
- cost: ms per pass by width and by sequences x rows, captured row-exact, captured plain and
  transformers' eager passes (passcost's medians), each over the floor;
- drafter and theory: the drafter config's captured 1-token pass, c, and the speculative speedup
  the iid model predicts from an acceptance measured elsewhere (`--alpha`) and these costs;
- engine: batched AR throughput (tokens/s) at 1..64 sequences through `Engine`, and our AR at
  batch 1 against transformers' `generate`, eager and with its static cache compiled.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Callable

import torch

from ..backends.captured import CapturedModel
from ..sizing.pass_costs import batch_pass_seconds, pass_seconds, sync
from ..sizing.theory import expected_tokens, step_speedup
from .rowgap import batch_gap, row_gap

WIDTHS = (1, 2, 4, 6, 8, 16, 32)
BATCHES = ((1, 1), (4, 1), (8, 1), (16, 1), (32, 1), (64, 1), (8, 6), (16, 6))
CONTEXT = 200


class Report:
    """Prints each section's line and appends its record to a JSON-lines file (if any)."""

    def __init__(self, path: str | None):
        self.path = path

    def __call__(self, section: str, line: str, **record) -> None:
        print(f"{section}: {line}", flush=True)
        if self.path:
            with open(self.path, "a") as out:
                out.write(json.dumps({"section": section, **record}) + "\n")


def copy_bandwidth(device: torch.device, megabytes: int = 1024) -> float:
    """Bytes per second a device-to-device copy moves, counting what it reads and writes (median of 10)."""
    source = torch.empty(megabytes << 20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    times = []
    for _ in range(12):
        sync(device)
        start = time.perf_counter()
        target.copy_(source)
        sync(device)
        times.append(time.perf_counter() - start)
    return 2 * source.numel() / statistics.median(times[2:])


def pass_bytes(hf_model) -> int:
    """Bytes of weights a pass reads: every parameter but the input embedding (unless tied to the head)."""
    embedding = hf_model.get_input_embeddings().weight
    head = hf_model.get_output_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in hf_model.parameters())
    return total - (0 if embedding.data_ptr() == head.data_ptr() else embedding.numel() * embedding.element_size())


def gaps(model, prompt: list[int], more: list[int]) -> dict:
    """Row gaps (a w-token pass against w 1-token passes) and batch gaps (sequences scored
    together against alone): max |logit difference| and how many argmaxes differ."""
    rows = {w: row_gap(model, prompt, more, w) for w in (2, 4, 6, 8, 16)}
    batch = {f"{n}x{w}": batch_gap(model, prompt, more, n, w) for n, w in ((8, 1), (8, 6), (16, 4))}
    return {"row": rows, "batch": batch}


def costs(model, widths=WIDTHS, batches=BATCHES) -> dict:
    """ms per pass by width (one sequence) and by sequences x rows (`passcost`, medians of 15)."""
    by_width = {w: 1e3 * pass_seconds(model, w, context=CONTEXT, repeats=15) for w in widths}
    by_batch = {f"{n}x{w}": 1e3 * batch_pass_seconds(model, n, w, context=CONTEXT, repeats=15)
                for n, w in batches} if batches else {}
    return {"width": by_width, "batch": by_batch}


def throughput(target, sequences: int, new_tokens: int = 128, prompt_length: int = 100) -> float:
    """Tokens/s of batched greedy AR through the engine: `sequences` random prompts at once,
    each generating exactly `new_tokens` (no end token)."""
    from ..engine import generate_many

    generator = torch.Generator().manual_seed(sequences)
    prompts = [torch.randint(0, target.vocab_size, (prompt_length,), generator=generator).tolist()
               for _ in range(sequences)]
    generate_many(prompts[:1], target, max_batch=1, max_new_tokens=4, eos_token_ids=[])  # warm-up
    sync(target.device)
    start = time.perf_counter()
    results = generate_many(prompts, target, max_batch=sequences, max_new_tokens=new_tokens, eos_token_ids=[])
    sync(target.device)
    return sum(len(r.tokens) for r in results) / (time.perf_counter() - start)


def ours_batch1(target, new_tokens: int = 128) -> float:
    """Tokens/s of our greedy AR loop at batch 1 (`autoregressive_generate`), 100-token prompt."""
    from .. import autoregressive_generate

    prompt = torch.randint(0, target.vocab_size, (100,), generator=torch.Generator().manual_seed(7)).tolist()
    autoregressive_generate(prompt, target, max_new_tokens=8, eos_token_ids=[])
    sync(target.device)
    start = time.perf_counter()
    tokens = autoregressive_generate(prompt, target, max_new_tokens=new_tokens, eos_token_ids=[]).tokens
    sync(target.device)
    return len(tokens) / (time.perf_counter() - start)


def hf_generate(hf_model, compiled: bool, new_tokens: int = 128) -> tuple[float, float]:
    """Tokens/s of transformers' greedy `generate` at batch 1 (100-token prompt) and the seconds
    its warm-up took: eager, or with its static cache and `torch.compile` (mode reduce-overhead,
    transformers' documented fastest path: `cache_implementation="static"`, which its `generate`
    compiles with mode reduce-overhead on CUDA)."""
    ids = torch.randint(0, hf_model.config.vocab_size, (1, 100), generator=torch.Generator().manual_seed(7))
    ids = ids.to(hf_model.device)
    options = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    if compiled:  # on CUDA, generate compiles the forward itself for a static cache (its CompileConfig:
        options["cache_implementation"] = "static"  # mode reduce-overhead, i.e. CUDA graphs)
    began = time.perf_counter()
    for _ in range(2 if compiled else 1):  # compiles, then records its graphs
        hf_model.generate(ids, **options)
    warm = time.perf_counter() - began
    sync(ids.device)
    start = time.perf_counter()
    out = hf_model.generate(ids, **options)
    sync(ids.device)
    return (out.shape[1] - ids.shape[1]) / (time.perf_counter() - start), warm


def run(hf_model, drafter_hf, report: Report, alpha: float, eager: Callable[[], tuple] | None,
        sections: set[str]) -> None:
    """The sections above on `hf_model` (bf16, CUDA) and, for theory, `drafter_hf` (or None).
    eager: builds transformers' (plain, row-exact) wrappers for the eager rows, or None."""
    device = hf_model.device
    exact = CapturedModel(hf_model, None, "captured", sequences=64, capacity=1024)
    plain = CapturedModel(hf_model, None, "captured-plain", sequences=64, capacity=1024, rows=None,
                          buckets=tuple(range(1, 65)) + (96, 128, 256, 512))
    unfused = CapturedModel(hf_model, None, "captured, torch ops", sequences=64, capacity=1024, fused=False) \
        if exact.decoder.fused else None
    bandwidth = copy_bandwidth(device)
    floor = 1e3 * pass_bytes(hf_model) / bandwidth
    report("kernels", f"captured passes run {exact.kernels}", kernels=exact.kernels)
    report("floor", f"{pass_bytes(hf_model) / 1e9:.2f} GB a pass over {bandwidth / 1e12:.2f} TB/s = {floor:.3f} ms",
           bytes=pass_bytes(hf_model), bandwidth=bandwidth, floor_ms=floor)
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, exact.vocab_size, (CONTEXT,), generator=generator).tolist()
    more = torch.randint(0, exact.vocab_size, (64,), generator=generator).tolist()
    if "exactness" in sections:
        for model in (exact, plain):
            found = gaps(model, prompt, more)
            report("exactness", f"{model.name}: {found}", model=model.name, **found)
    if "cost" in sections:
        for model in (exact, plain) + ((unfused,) if unfused is not None else ()):
            found = costs(model)
            report("cost", f"{model.name}: " + _over(found, floor), model=model.name, floor_ms=floor, **found)
        if eager is not None:
            for model in eager():
                found = costs(model, widths=(1, 8), batches=((16, 1),) if model.exact_rows else ())
                report("cost", f"eager {model.name}: " + _over(found, floor), model="eager " + model.name,
                       floor_ms=floor, **found)
                del model
    target_ms = {w: 1e3 * pass_seconds(exact, w, context=CONTEXT, repeats=15) for w in range(1, 10)}
    if drafter_hf is not None and "theory" in sections:
        drafter = CapturedModel(drafter_hf, None, "drafter", role="drafter", sequences=4, capacity=1024)
        drafter_ms = 1e3 * pass_seconds(drafter, 1, context=CONTEXT, repeats=15)
        c = drafter_ms / target_ms[1]
        predicted = {g: step_speedup(expected_tokens(alpha, g), g, c, target_ms[g + 1] / target_ms[1])
                     for g in range(1, 9)}
        best = max(predicted, key=predicted.get)
        report("theory", f"drafter pass {drafter_ms:.3f} ms, c = {c:.3f}; with alpha = {alpha}: predicted speedup "
               + ", ".join(f"γ={g}: {s:.2f}x" for g, s in predicted.items()) + f"; best γ={best}",
               drafter_ms=drafter_ms, target_ms=target_ms, c=c, alpha=alpha, predicted=predicted, best=best)
        del drafter
    if "engine" in sections:
        rates = {n: throughput(exact, n) for n in (1, 2, 4, 8, 16, 32, 64)}
        report("engine", f"{exact.kernels}: batched AR tokens/s by sequences: " +
               ", ".join(f"{n}: {r:.0f} ({r / rates[1]:.1f}x)" for n, r in rates.items()), tokens_per_s=rates)
    if "peers" in sections:
        ours = ours_batch1(exact)
        report("peers", f"ours (captured, AR, batch 1): {ours:.1f} tokens/s", name="ours", tokens_per_s=ours)
        for compiled in (False, True):
            name = "transformers generate, static cache + torch.compile" if compiled else "transformers generate, eager"
            try:
                rate, warm = hf_generate(hf_model, compiled)
                report("peers", f"{name}: {rate:.1f} tokens/s (warm-up {warm:.0f} s)", name=name,
                       tokens_per_s=rate, warmup_s=warm)
            except Exception as exc:  # a peer's failure is reported, not fatal to the run
                report("peers", f"{name}: failed: {type(exc).__name__}: {exc}"[:400], name=name, error=str(exc)[:400])


def _over(found: dict, floor: float) -> str:
    widths = ", ".join(f"{w}: {ms:.2f} ({ms / floor:.1f}x)" for w, ms in found["width"].items())
    batches = ", ".join(f"{k}: {ms:.2f} ({ms / floor:.1f}x)" for k, ms in found["batch"].items())
    return f"ms (x floor) by width {widths}" + (f"; by sequences x rows {batches}" if batches else "")
