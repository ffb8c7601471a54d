"""Pass costs, measured once per model pair and machine: whether drafting can pay at all.

A draft of k − 1 tokens, even if every one of them is accepted, yields k tokens for one target
pass over k tokens and k − 1 drafter passes. Where that is not clearly faster than k one-token
target passes for any k (`PassCosts.never_pays`), no acceptance rate makes speculative decoding
pay, and the cost-aware schedule should draft nothing from the first step rather than learn it
from steps that drafted (paying for them and for the drafter's prompt pass). That is the case
on llama.cpp's quantized kernels on a 2-core CPU (docs/methods.md#the-cost-aware-schedule-default).
Elsewhere (bf16 on the same CPU, where a few rows cost what one does) the bound is far above 1 and
the schedule measures as usual.

The profile is cached in specdec's home (`registry.home()`), keyed by both models, their weights
and kernels, this CPU, the thread count and the library versions, so only the first run of a
pair on a machine pays its few seconds.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..models import catalogue as registry
from ..backends import Backend, features
from ..backends.cache import crop_cache

# Target pass widths measured: drafts of up to 7 tokens. Where none of these pays, a longer one
# would need passes that get cheaper per token past 8, which no kernel measured here does.
WIDTHS = (1, 2, 3, 4, 6, 8)
CONTEXT = 32  # cached tokens before the timed passes
REPEATS = 5
WORTH = 1.1  # the least best case worth drafting for (see PassCosts.never_pays)
CLEARLY_PAYS = 1.5  # a best case above this ends the measurement
# Widths measured for lookahead decoding's wide passes (`flat_rows`), up to its published 121 rows.
FLAT_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
# The batched profile (`load_costs`): batch sizes, and rows a sequence (a draft of up to 3 tokens:
# under load longer drafts pay less, and where 2-4 rows do not pay no longer draft does).
LOAD_BATCHES = (1, 2, 4, 8, 16)
LOAD_ROWS = (1, 2, 4)
CATCH_UP = 64  # tokens of the drafter pass timed for its catch-up cost a token
# A batched pass over more sequences or more rows a sequence does more work: where one times
# markedly faster than a pass it contains (`_doubtful`), another process held the cores during
# the smaller one (a server started beside another one timed 16 sequences x 2 rows 23% under x 1,
# and then drafted at 16 in flight where drafting lost). Those sizes are timed again, the faster
# time kept, up to RETIMES rounds; what still disagrees is not cached, and drafting is not
# assumed to pay at those batch sizes (`_cautious`).
SLACK = 0.15
RETIMES = 2


@dataclass(frozen=True)
class PassCosts:
    """target: seconds of a target pass over k tokens, by k (1 always present); drafter: seconds of
    a drafter's 1-token pass (0 for a model-free drafter)."""

    target: dict[int, float]
    drafter: float = 0.0

    def best_speedup(self) -> float:
        """max over measured k ≥ 2 of k·t(1) / (t(k) + (k−1)·t_d): the speedup over plain decoding
        of a (k−1)-token draft if every draft token were accepted, which bounds it at any acceptance."""
        one = self.target[1]
        return max((k * one / (t + (k - 1) * self.drafter) for k, t in self.target.items() if k > 1), default=float("inf"))

    def never_pays(self) -> bool:
        """True when no draft of the measured lengths would beat plain decoding by `WORTH` (10%)
        even if every draft token were accepted. Real acceptance is lower (at α = 0.9 a 1- or
        2-token draft yields 5-10% fewer tokens than at full acceptance), and the timings are noisy
        by a few percent, so below that margin drafting loses in practice."""
        return self.best_speedup() < WORTH

    def to_dict(self) -> dict:
        return {"target_ms": {k: 1e3 * t for k, t in self.target.items()}, "drafter_ms": 1e3 * self.drafter,
                "best_speedup": self.best_speedup(), "never_pays": self.never_pays()}


@dataclass(frozen=True)
class LoadCosts:
    """Seconds of batched passes on this machine, for the engine's batch policy
    (`engine.policy.BatchCosts`): target[(sequences, rows)] is a target pass over `sequences`
    sequences scoring `rows` rows each; drafter[sequences] a drafter pass of one row each (empty:
    a model-free drafter, which costs nothing a round); catch_up: seconds a token of a
    drafter pass over CATCH_UP tokens, what feeding a drafter the context it missed costs."""

    target: dict[tuple[int, int], float]
    drafter: dict[int, float] = field(default_factory=dict)
    catch_up: float = 0.0

    def target_seconds(self, batch: int, rows: int) -> float:
        """A target pass over `batch` sequences of `rows` rows each, interpolated (and past the
        largest batch measured, extrapolated) linearly over the batch size."""
        return _interpolate({b: t for (b, r), t in self.target.items() if r == rows}, batch)

    def pass_seconds(self, batch: int, rows: int) -> float:
        """`target_seconds` for any number of rows a sequence: interpolated over the rows measured
        (past the most, extrapolated linearly)."""
        return _interpolate({r: self.target_seconds(batch, r) for r in sorted({r for _, r in self.target})}, rows)

    def drafter_seconds(self, batch: int) -> float:
        """One drafter round over `batch` sequences (0 for a model-free drafter)."""
        return _interpolate(self.drafter, batch) if self.drafter else 0.0

    def best_speedup(self, batch: int, acceptance: float) -> float:
        """max over the measured draft lengths k − 1 of E_k·t(b, 1) / (t(b, k) + (k − 1)·d(b)): the
        speedup over plain steps of `batch` sequences each drafting k − 1 tokens accepted with
        probability `acceptance` each (E_k = (1 − α^k) / (1 − α) tokens a step)."""
        alpha = min(max(acceptance, 0.0), 0.999)
        plain = self.target_seconds(batch, 1)
        rows = sorted({r for _, r in self.target if r > 1})
        return max(((1 - alpha ** k) / (1 - alpha) * plain /
                    (self.target_seconds(batch, k) + (k - 1) * self.drafter_seconds(batch)) for k in rows),
                   default=0.0)

    def may_pay(self, batch: int, acceptance: float, charge: float = 0.0, worth: float = WORTH) -> bool:
        """Whether drafting at `batch` sequences could beat plain steps by `worth` (by default
        `WORTH`; see `PassCosts.never_pays`: below that margin it loses in practice) at that
        acceptance, each drafted token also costing `charge` seconds outside the passes (the
        drafters' catch-up on what they have not read, over the tokens left to make)."""
        speedup = self.best_speedup(batch, acceptance)
        plain_rate = batch / max(1e-9, self.target_seconds(batch, 1))
        return speedup / (1 + charge * speedup * plain_rate) >= worth


def _interpolate(points: dict[int, float], x: int) -> float:
    """The piecewise-linear curve through `points` (x -> seconds) at `x`; past either end the
    nearest two points' line, never below the nearest point's value past the right end."""
    xs = sorted(points)
    if len(xs) == 1:
        return points[xs[0]]
    if x in points:
        return points[x]
    right = next((i for i, v in enumerate(xs) if v > x), len(xs) - 1)
    left = max(0, right - 1)
    x0, x1 = xs[left], xs[max(right, 1)]
    y0, y1 = points[x0], points[x1]
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return max(y, points[xs[-1]]) if x > xs[-1] else max(y, 1e-9)


def sync(device: torch.device) -> None:
    """Wait for `device`'s queued work (CUDA runs asynchronously; a timer must wait for it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cached_context(model, tokens: int, context: int = CONTEXT) -> tuple[list[int], object]:
    """A cache holding `context` + 1 positions of any ids the model embeds, and `tokens` more ids
    to pass after them (what a timed pass scores; crop back to `context` + 1 after each)."""
    ids = [(100 + 7 * i) % model.vocab_size for i in range(context + 1 + tokens)]
    cache = model.new_cache()
    model.forward(model.prefill(ids[:context + 1], cache), cache, 1)
    return ids[context + 1:], cache


def pass_seconds(model, tokens: int, context: int = CONTEXT, repeats: int = REPEATS, parents=None) -> float:
    """Median seconds of one pass over `tokens` new tokens after `context` cached ones (the cache
    cropped back after each; the first pass warms up and is not counted). parents: a tree over
    the new tokens (`Backend.forward`), or None for a chain."""
    new, cache = cached_context(model, tokens, context)
    times = []
    for _ in range(repeats + 1):
        sync(model.device)
        start = time.perf_counter()
        model.forward(new, cache, tokens, parents=parents)
        sync(model.device)
        times.append(time.perf_counter() - start)
        crop_cache(cache, context + 1)  # static: takes either backend's cache
    return statistics.median(times[1:])


def batch_pass_seconds(model, batch: int, rows: int, context: int = CONTEXT, repeats: int = REPEATS) -> float:
    """Median seconds of one batched pass (`forward_batch`) over `batch` sequences, `rows` new
    tokens each, after `context` cached ones each (the caches cropped back after each pass)."""
    from ..backends import Segment

    sequences = [[(100 + 7 * i + 13 * b) % model.vocab_size for i in range(context + 1 + rows)] for b in range(batch)]
    caches = []
    for ids in sequences:
        caches.append(model.new_cache())
        model.forward(model.prefill(ids[:context + 1], caches[-1]), caches[-1], 1)
    segments = [Segment(ids[context + 1:], cache, rows) for ids, cache in zip(sequences, caches)]
    times = []
    for _ in range(repeats + 1):
        sync(model.device)
        start = time.perf_counter()
        model.forward_batch(segments)
        sync(model.device)
        times.append(time.perf_counter() - start)
        for cache in caches:
            crop_cache(cache, context + 1)
    return statistics.median(times[1:])


def _key(model) -> str:
    from ..backends.transformers import TransformersModel

    # only transformers' backend restricts a head's vocabulary (restrict_vocabulary); the others score all
    vocabulary = model.draft_vocabulary if isinstance(model, TransformersModel) else None
    versions = [torch.__version__]
    if isinstance(model, TransformersModel) and model.int8:  # where its int8 short path hands over to the long one
        from ..backends.kernels import int8_short_rows

        versions.append(f"int8 rows={int8_short_rows()}")
    if isinstance(model, TransformersModel) and model.merged_groups:  # fewer, wider GEMMs: other costs
        versions.append(f"merged={model.merged_groups}")
    if model.kernels.startswith("llama.cpp"):
        import llama_cpp

        # a patched build feeds more rows a call: other costs for the same version
        versions.append(f"{llama_cpp.__version__} rows/call={model.rows_per_call}")
    if isinstance(model, TransformersModel) and model.device.type == "cpu":  # another build of our kernels: other costs
        from ..backends import native

        versions.append(f"native={native.build_stamp()}")
    return "|".join([model.name, model.weights, model.kernels, f"exact_rows={model.exact_rows}",
                     f"vocab={vocabulary or 'all'}", str(model.device), machine(model),
                     f"threads={torch.get_num_threads()}", *versions])


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        name = ""
    return f"{name or platform.processor() or platform.machine()} x{os.cpu_count()}"


def machine(model) -> str:
    """What the timings depend on besides the model: the CPU (and the GPU a model runs on)."""
    if model.device.type == "cuda":
        return f"{torch.cuda.get_device_name(model.device)} | {_cpu()}"
    return _cpu()


def cache_path():
    """Where the measured profiles are kept (specdec's home: $SPECDEC_HOME or the user's cache)."""
    return registry.home() / "pass-costs.json"


def _read_cache() -> dict:
    try:
        data = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(entries: dict) -> None:
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(entries, indent=1, sort_keys=True))
        partial.replace(path)  # atomic: a concurrent reader sees the old file or the new one
    except OSError:
        pass  # a read-only home: measure again next time


def pass_costs(target, drafter=None, say=lambda message: None) -> PassCosts:
    """The profile of a target and its drafter (a Backend, or None for a model-free one) on
    this machine, from the cache or measured now (3-8 s) and cached. The target's widths are
    measured in order until one shows that drafting clearly pays (`CLEARLY_PAYS`): past that,
    more widths cannot change what the schedule does with the profile."""
    key = _key(target) + " <- " + (_key(drafter) if drafter is not None else "model-free")

    def measure() -> dict:
        seconds, drafter_pass = {1: pass_seconds(target, 1)}, 0.0 if drafter is None else pass_seconds(drafter, 1)
        _said(say, "1 token", seconds[1])
        for width in WIDTHS[1:]:
            seconds[width] = pass_seconds(target, width)
            _said(say, f"{width} tokens", seconds[width])
            if PassCosts(seconds, drafter_pass).best_speedup() > CLEARLY_PAYS:
                break
        return {"target": {str(k): v for k, v in seconds.items()}, "drafter": drafter_pass}

    entry = _remembered(key, _valid, measure, "pass costs", say)
    return PassCosts({int(k): float(v) for k, v in entry["target"].items()}, float(entry["drafter"]))


class Interrupted(Exception):
    """A measurement stopped early because work arrived (`should_stop`); what it measured so far
    is kept, and the next call goes on from there."""


_PARTIAL: dict[str, dict[str, float]] = {}  # sizes measured so far of an interrupted batched profile, by key


def load_costs(target, drafter=None, say=lambda message: None, should_stop=None) -> LoadCosts | None:
    """The batched profile (`LoadCosts`) of a target and its drafter (None: a model-free one) on
    this machine: target passes over LOAD_BATCHES sequences of LOAD_ROWS rows each and drafter
    rounds over LOAD_BATCHES sequences, each model's from the cache or measured now (10-30 s for
    a 1.5B target on a CPU) and cached. None for a target that scores one sequence a pass (no
    `forward_batch`). should_stop: asked between sizes; where it says so, `Interrupted` is raised
    (a server measuring between requests yields to one that arrives)."""
    if not features(target).batched:
        return None
    target_seconds = _batched(target, LOAD_ROWS, say, should_stop)
    if drafter is None:
        return LoadCosts(target_seconds)
    rounds = {b: t for (b, _), t in _batched(drafter, (1,), say, should_stop).items()}
    return LoadCosts(target_seconds, rounds, _catch_up(drafter, say))


def _catch_up(drafter, say) -> float:
    """Seconds a token of one `drafter` pass over CATCH_UP tokens, cached."""
    return float(_remembered(_key(drafter) + f" catch-up {CATCH_UP}", lambda v: isinstance(v, (int, float)) and v > 0,
                             lambda: pass_seconds(drafter, CATCH_UP, repeats=3) / CATCH_UP,
                             f"{drafter.name}'s catch-up passes", say))


def _batched(model, rows: Sequence[int], say, should_stop=None) -> dict[tuple[int, int], float]:
    """Seconds of `model`'s passes over LOAD_BATCHES sequences (those it can hold: llama.cpp's
    holds a fixed number) of `rows` rows each (one sequence after another where it does not
    batch), cached; `Interrupted` between sizes where `should_stop()` says so."""
    can = features(model)
    batches = [b for b in LOAD_BATCHES if can.sequences is None or b <= can.sequences]
    wanted = {f"{b},{r}" for b in batches for r in rows}
    key = _key(model) + " batched rows " + ",".join(map(str, rows)) + " sequences " + ",".join(map(str, batches))

    def measure() -> dict[str, float]:
        if can.batched:
            seconds = _PARTIAL.setdefault(key, {})
            for b in batches:
                for r in rows:
                    if f"{b},{r}" in seconds:
                        continue
                    if should_stop is not None and should_stop():
                        raise Interrupted(f"{len(seconds)} of {len(wanted)} sizes measured")
                    seconds[f"{b},{r}"] = batch_pass_seconds(model, b, r, repeats=3)
                    _said(say, f"{b} sequences x {r} rows ({len(seconds)} of {len(wanted)})", seconds[f"{b},{r}"])
            for _ in range(RETIMES):
                for size in sorted(_doubtful(seconds)):
                    if should_stop is not None and should_stop():
                        raise Interrupted(f"{len(wanted)} sizes measured, some to time again")
                    b, r = map(int, size.split(","))
                    seconds[size] = min(seconds[size], batch_pass_seconds(model, b, r, repeats=3))
                    _said(say, f"{b} sequences x {r} rows (timed again: it disagreed with another size)",
                          seconds[size])
            seconds = _PARTIAL.pop(key)
            if _doubtful(seconds):
                settled[0] = False
                say("  some sizes still disagree (is another process busy?): not cached, and drafting is not "
                    "assumed to pay at those batch sizes; timed again at the next start")
                return _cautious(seconds)
            return seconds
        alone = {}
        for r in rows:
            alone[r] = pass_seconds(model, r, repeats=3)
            _said(say, f"{r} rows", alone[r])
        return {f"{b},{r}": b * alone[r] for b in batches for r in rows}

    settled = [True]  # whether what `measure` returns may be cached
    seconds = _remembered(
        key,
        lambda v: isinstance(v, dict) and set(v) == wanted and all(isinstance(t, (int, float)) and t > 0
                                                                   for t in v.values()) and not _doubtful(v),
        measure, f"{model.name}'s batched passes", say, keep=lambda: settled[0])
    return {tuple(map(int, k.split(","))): float(v) for k, v in _monotone(seconds).items()}


def _contains(size: str, other: str) -> bool:
    """Whether a pass of `size` ("sequences,rows") does all the work of one of `other` and more."""
    (b, r), (ob, orows) = map(int, size.split(",")), map(int, other.split(","))
    return size != other and b >= ob and r >= orows


def _doubtful(seconds: dict[str, float]) -> set[str]:
    """The sizes of a batched profile that disagree: both of every pair where a pass doing more
    work timed more than SLACK faster than one it contains."""
    return {size for big in seconds for small in seconds
            if _contains(big, small) and seconds[big] < (1 - SLACK) * seconds[small] for size in (big, small)}


def _monotone(seconds: dict[str, float]) -> dict[str, float]:
    """The profile with each size at least as slow as every size it contains (noise within SLACK,
    read as more work costing less)."""
    return {size: max([t] + [seconds[o] for o in seconds if _contains(size, o)]) for size, t in seconds.items()}


def _cautious(seconds: dict[str, float]) -> dict[str, float]:
    """A profile whose sizes still disagree, made safe to draft by: at a batch size where a size
    disagreed, each row a sequence costs a one-row pass (no draft pays there)."""
    batches = {size.split(",")[0] for size in _doubtful(seconds)}
    safe = dict(seconds)
    for size, t in seconds.items():
        batch, rows = size.split(",")
        if batch in batches and f"{batch},1" in seconds:
            safe[size] = max(t, int(rows) * seconds[f"{batch},1"])
    return safe


def _said(say, size: str, seconds: float) -> None:
    """One measured size, as it comes: a first start measures for minutes on a large model."""
    say(f"  {size}: {1e3 * seconds:.1f} ms a pass")


def _remembered(key: str, valid, measure, what: str, say, keep=lambda: True):
    """The cached seconds under `key` where `valid` takes them, else `measure()`d now and cached
    (unless `keep()` then says otherwise)."""
    entry = _read_cache().get(key)
    if isinstance(entry, dict) and valid(entry.get("seconds")):
        return entry["seconds"]
    say(f"measuring {what} once for this machine (cached in {cache_path()})")
    seconds = measure()
    if not keep():
        return seconds
    entries = _read_cache()  # re-read: another process may have written meanwhile
    entries[key] = {"seconds": seconds}
    _write_cache(entries)
    return seconds


def flat_rows(target, overhead: float, say=lambda message: None) -> int:
    """How many rows besides the pending token's a pass of `target` takes at a cost of at most
    1 + `overhead` one-token passes, on this machine (lookahead decoding's budget): widths of
    FLAT_WIDTHS measured in order up to the first that costs more, never extrapolated; cached
    with the pass-cost profiles."""
    def measure() -> dict:
        seconds = {1: pass_seconds(target, 1)}
        _said(say, "1 token", seconds[1])
        for width in FLAT_WIDTHS[1:]:
            seconds[width] = pass_seconds(target, width, repeats=3)
            _said(say, f"{width} tokens", seconds[width])
            if seconds[width] > (1 + overhead) * seconds[1]:
                break
        return {"target": {str(k): v for k, v in seconds.items()}, "drafter": 0.0, "overhead": overhead}

    # widths were measured up to the first over the overhead then asked for: a larger one needs more
    entry = _remembered(_key(target) + " <- lookahead widths",
                        lambda v: _valid(v) and v.get("overhead", -1) >= overhead, measure, "wide passes", say)
    seconds = {int(k): float(v) for k, v in entry["target"].items()}
    return affordable_rows(lambda width: seconds[width] / seconds[1], sorted(seconds), overhead)


def affordable_rows(cost_of, widths: Sequence[int], overhead: float) -> int:
    """The widest of `widths` (in order, from 1) whose pass costs at most 1 + `overhead` of a
    one-token pass, less the pending token's row; `cost_of(width)` in one-token passes."""
    rows = 0
    for width in widths:
        if cost_of(width) > 1 + overhead:
            break
        rows = width - 1
    return rows


def _valid(entry) -> bool:
    if not isinstance(entry, dict) or not isinstance(entry.get("target"), dict):
        return False
    target, drafter = entry["target"], entry.get("drafter")
    return "1" in target and len(target) > 1 and isinstance(drafter, (int, float)) and drafter >= 0 and all(
        isinstance(k, str) and k.isdigit() and isinstance(v, (int, float)) and v > 0 for k, v in target.items())
