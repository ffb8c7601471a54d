"""`specdec profile`: what a pass costs on this machine by its width, and where one generation's
time goes (the target's passes, the drafter's, the decoding loop around them).

A wider verification pass pays only while one more row costs less than the tokens it is expected
to add; this prints that cost as this machine measures it, with no benchmark run needed.
"""

from __future__ import annotations

import datetime
import sys
from dataclasses import asdict, dataclass, field

import torch

from ..backends import Backend
from ..decoding.results import GenerationStats
from ..sizing.pass_costs import batch_pass_seconds, machine
from .forward_cost import forward_ms


@dataclass
class PassProfile:
    """Median ms of one pass after a cached context, by the number of new tokens it scores."""

    target_ms: dict[int, float]  # chain passes: the last committed token plus width - 1 drafts
    target_tree_ms: dict[int, float]  # the same widths under a tree mask (what a tree step pays)
    drafter_ms: dict[int, float]  # the drafter model's passes (empty for a model-free drafter)
    batch_ms: dict[str, float] = field(default_factory=dict)  # "BxR": B sequences' batched pass, R rows each


def pass_profile(target: Backend, drafter: Backend | None, widths: list[int], drafter_tokens: list[int],
                 repeats: int = 5, batches: list[int] = (), batch_rows: tuple[int, ...] = (1, 4)) -> PassProfile:
    """Time the target over each width (chain, and tree where the backend takes tree masks), the
    drafter over each token count, and the target's batched pass over each of `batches` sequences
    with each of `batch_rows` rows a sequence (what the engine's steps pay), each after a 128-token
    cache per sequence."""
    from ..decoding.config import runs_trees

    trees = runs_trees(target)
    return PassProfile(
        target_ms={w: forward_ms(target, w, repeats=repeats) for w in widths},
        target_tree_ms={w: forward_ms(target, w, repeats=repeats, tree=True) for w in widths} if trees else {},
        drafter_ms={t: forward_ms(drafter, t, repeats=repeats) for t in drafter_tokens} if drafter else {},
        batch_ms={f"{b}x{r}": 1e3 * batch_pass_seconds(target, b, r, repeats=repeats)
                  for b in batches for r in batch_rows},
    )


# What each op of a CPU pass is, by the names torch's profiler gives them (self times: no op twice)
OP_KINDS = (("linears", ("linear_pointwise", "mkldnn_linear", "aten::mm", "aten::addmm", "aten::bmm",
                         "_weight_int8pack_mm", "specdec::linear")),
            ("attention", ("scaled_dot_product", "flash_attention", "specdec::one_query")))


def op_split(model: Backend, tokens: int = 1, context: int = 128, repeats: int = 5) -> dict[str, float]:
    """Where a pass over `tokens` new tokens after `context` cached ones spends its time, ms per
    pass under torch's profiler: "linears" (GEMMs, the head's too), "attention", "other ops" (norms,
    rotary, activations, copies, ...), and "host" (the rest of the wall time: Python, dispatch,
    waiting); "pass" is the wall time. The profiler adds its own cost to every op."""
    import time

    from torch.profiler import ProfilerActivity, profile

    from ..backends.cache import crop_cache
    from ..sizing.pass_costs import cached_context

    new, cache = cached_context(model, tokens, context)
    model.forward(new, cache, tokens)  # warm-up
    crop_cache(cache, context + 1)
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        began = time.perf_counter()
        for _ in range(repeats):
            model.forward(new, cache, tokens)
            crop_cache(cache, context + 1)
        wall = time.perf_counter() - began
    split = {kind: 0.0 for kind, _ in OP_KINDS} | {"other ops": 0.0}
    for event in trace.key_averages():
        kind = next((k for k, names in OP_KINDS if any(n in event.key for n in names)), "other ops")
        split[kind] += event.self_cpu_time_total / 1e3 / repeats
    split["pass"] = 1e3 * wall / repeats
    split["host"] = max(0.0, split["pass"] - sum(v for k, v in split.items() if k != "pass"))
    return split


def time_split(stats: GenerationStats) -> list[tuple[str, int, float]]:
    """(part, passes or steps, seconds) of a generation's wall time: the target's passes (its prompt
    pass included), the drafter's, and the loop (drafting bookkeeping, verification, rollback)."""
    return [("target passes", stats.target_passes, stats.target_seconds),
            ("drafter passes", stats.drafter_passes, stats.drafter_seconds),
            ("decoding loop", stats.target_passes, stats.loop_seconds)]


def profile_record(passes: PassProfile, stats: GenerationStats, method: str, target: Backend,
                   drafter: Backend | None, kv_storage: dict | None = None, ops: dict | None = None) -> dict:
    """Everything `specdec profile` printed, for --json, with the machine and date it was measured on."""
    return {"machine": machine(target), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "date": datetime.date.today().isoformat(), "command": " ".join(["specdec", *sys.argv[1:]]),
            "method": method, "target": target.name, "target_weights": target.weights,
            "target_kernels": target.kernels, "drafter": drafter.name if drafter else None,
            "drafter_weights": drafter.weights if drafter else None, "passes": asdict(passes),
            "generation": stats.to_dict(), **({"kv_storage": kv_storage} if kv_storage else {}),
            **({"ops": ops} if ops else {})}
