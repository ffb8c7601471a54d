"""The engine's scheduler: which sequences run a step, and whether they draft.

It holds the queue and the admitted sequences: admits waiting requests in order while the batch
(`max_batch`) and the KV budget have room, feeds their prompts' chunks (in one shared pass where
the target shares prompt passes, about `prefill_tokens` a step; else about a chunk's worth),
and asks the batch policy (`BatchCosts`) whether the running sequences draft -> a `StepPlan` for
the runner; where sequences run, the shared prompt chunks ride in their scoring pass
(`StepPlan.feeding`): one pass a step streams the weights, not two. It records each step's costs
for that policy, and lets ended sequences go.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from ..backends import Backend, Segment, features
from ..backends.cache import cache_length, crop_layers
from ..backends.prompts import PREFILL_TOKENS
from ..backends.slab import slab_capacity
from ..decoding import sequence
from ..decoding.sequence import Decoding
from ..drafters.base import capabilities_of, is_drafter, most_nodes
from ..errors import SpecdecError
from ..sizing.batch_policy import BatchCosts
from .output import StepOutput

log = logging.getLogger("specdec.engine")


@dataclass
class StepPlan:
    """What one engine step runs, as the scheduler decided it: the running requests (`ids`, their
    `decodings`), whether they draft (`speculate`: None where the batch policy did not decide),
    and the counters and times the step's cost record compares against (the runner fills in the
    times)."""

    ids: list[int]
    decodings: list[Decoding]
    speculate: bool | None
    passes: int  # drafter passes so far, summed over the sequences
    caught_up: tuple[int, float] | None  # drafter catch-up tokens and seconds so far
    fresh: dict[int, tuple[int, int]] = field(default_factory=dict)  # index -> (context, tokens left): drafters yet to see their prompts
    # prompts whose next chunks ride in the step's pass (`Scheduler.prefill`): (request id, its
    # sequence, its cache's length before), and whether that pass fed them (None: no pass ran)
    feeding: list[tuple[int, Decoding, int]] = field(default_factory=list)
    fed: bool | None = None
    began: float = 0.0
    drafted: float = 0.0
    rounds: int = 0  # lock-step rounds of drafter passes
    pass_seconds: float = 0.0


class Scheduler:
    """The queue (`waiting`), the admitted sequences (`prefilling`, then `running`) and the KV
    bytes each holds (`reserved`), by request id.

    make: a request's `Decoding` (`Engine._decoding`), made when it is admitted.
    costs: the batch policy steering cost-aware drafts (None: each sequence's own schedule).
    prefill_tokens: about how many prompt tokens a step feeds in a shared pass (`prefill`).
    """

    def __init__(self, target: Backend, max_batch: int, kv_memory: int | None, costs: BatchCosts | None,
                 make: Callable[[object], Decoding], prefill_tokens: int = PREFILL_TOKENS):
        if kv_memory is not None:
            if not isinstance(kv_memory, int) or kv_memory < 1:
                raise SpecdecError(f"kv_memory must be a number of bytes >= 1, got {kv_memory!r}")
            if features(target).kv_bytes_per_token is None:
                raise SpecdecError(f"a KV memory budget needs the cache size per token, which {target.name}'s "
                                   "backend does not give; bound the batch with max_batch")
        self.target, self.max_batch, self.kv_memory, self.costs, self.make = target, max_batch, kv_memory, costs, make
        self.waiting: list = []  # requests, first come first served
        self.prefilling: dict[int, Decoding] = {}  # admitted, their prompts fed a chunk a step
        self.running: dict[int, Decoding] = {}
        self.reserved: dict[int, int] = {}  # KV bytes held by each admitted request
        self.prefill_tokens = prefill_tokens

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def schedule(self, out: StepOutput) -> StepPlan | None:
        """Admit waiting requests, feed prompt chunks, and decide for the running ones whether
        this step drafts (`steer`) -> the plan, or None when nothing runs."""
        self.admit(out)
        riding = self.prefill(out)
        lags = self.lags(out)
        if not self.running:  # prompts left to ride wait in `prefilling`, their caches untouched
            return None
        ids = list(self.running)
        decodings = [self.running[i] for i in ids]
        speculate = self.steer(decodings, lags, feeding=bool(riding))
        fresh = {i: (len(d.sequence), d.remaining) for i, d in enumerate(decodings)
                 if speculate and id(d) in lags and lags[id(d)] >= len(d.sequence)}
        return StepPlan(ids, decodings, speculate, sum(d.drafter_passes for d in decodings),
                        _caught_up(decodings) if speculate is not None else None, fresh, riding)

    def admit(self, out: StepOutput) -> None:
        """Waiting requests in order, while the batch and the memory budget have room: each one's
        cache made and its drafter started; its prompt is fed by `prefill`."""
        while self.waiting and len(self.running) + len(self.prefilling) < self.max_batch:
            request, decoding = self.waiting[0], None
            try:
                decoding = self.make(request)
                need = _kv_need(request, decoding) if self.kv_memory is not None else 0
                if self.kv_memory is not None and sum(self.reserved.values()) + need > self.kv_memory:
                    break  # it waits for memory; later requests wait behind it (first come, first served)
                self.waiting.pop(0)
                out.started.append(request.id)
                decoding.begin()
            except Exception as error:  # its drafter's start, its cache: this request alone ends
                if self.waiting and self.waiting[0] is request:
                    self.waiting.pop(0)
                    out.started.append(request.id)
                if decoding is not None:  # what it made so far goes now (a llama.cpp sequence among it)
                    decoding.free()
                out.fail(request.id, error, "starting")
                continue
            self.prefilling[request.id] = decoding
            self.reserved[request.id] = need

    def prefill(self, out: StepOutput) -> list[tuple[int, Decoding, int]]:
        """Prompt chunks (`Decoding.prefill_step`, PREFILL_CHUNK tokens at most of each prompt),
        first come first served: a long prompt delays the running sequences by about one step's
        prompt pass, not by its whole length. Where the target shares prompt passes, the chunks go
        together in one pass (`shared`) that streams the weights once for all of them, about
        `prefill_tokens` of them a step; prompts fed in passes of their own, about a chunk's worth a
        step (each more pass would stream the weights again). Where sequences run, the shared chunks
        ride in their scoring pass (`StepPlan.feeding`, then `fed`): one pass streams the weights for
        both, and a prompt that is in joins the next step's. Otherwise a prompt that is in joins
        this step's pass. -> the prompts left to ride (`StepPlan.feeding`)."""
        fed, alone, shared = 0, 0, []
        for request_id, decoding in list(self.prefilling.items()):
            if fed >= self.prefill_tokens or alone >= sequence.PREFILL_CHUNK:
                break
            before = cache_length(decoding.cache)
            if decoding.shares_prefill:
                shared.append(request_id)
                fed += max(1, len(decoding.prefill_chunk) - 1 - before)
                continue
            self._prefill_alone(out, request_id)
            # a prompt whose feed failed ended alone, its cache freed
            tokens = max(1, cache_length(decoding.cache) - before) if decoding.cache is not None else 1
            fed, alone = fed + tokens, alone + tokens
        if shared and self.running:
            return [(i, self.prefilling[i], cache_length(self.prefilling[i].cache)) for i in shared]
        if len(shared) > 1:
            self._prefill_together(out, shared)
        elif shared:
            self._prefill_alone(out, shared[0])
        return []

    def fed(self, plan: StepPlan, out: StepOutput) -> None:
        """The prompts that rode in the step's pass (`StepPlan.feeding`): each one that is in runs
        from the next step; where the pass failed, each is fed alone, its cache first put back as
        it was; where no pass ran, they wait for the next step's, untouched."""
        if plan.fed is None:
            return
        seconds = plan.pass_seconds / (len(plan.ids) + len(plan.feeding))
        for request_id, decoding, length in plan.feeding:
            if request_id not in self.prefilling:  # cancelled in between
                continue
            try:
                if not plan.fed:  # a pass that failed part way grew some layers only
                    crop_layers(decoding.cache, length)
                    self._prefill_alone(out, request_id)
                elif decoding.prefilled_together(seconds):
                    self.running[request_id] = self.prefilling.pop(request_id)
            except Exception as error:  # its prompt cache's copy, its cache: this request alone ends
                self.fail(out, request_id, error, "feeding its prompt")

    def _prefill_alone(self, out: StepOutput, request_id: int) -> None:
        """Feed one prompt's next chunk in a pass of its own; it runs once it is in."""
        decoding = self.prefilling[request_id]
        try:
            if decoding.prefill_step():
                self.running[request_id] = self.prefilling.pop(request_id)
        except Exception as error:  # this prompt's own trouble (its cache, its drafter's observe)
            self.fail(out, request_id, error, "feeding its prompt")

    def _prefill_together(self, out: StepOutput, request_ids: list[int]) -> None:
        """Prompts' next chunks fed in one shared pass (`prefill_batch`), each cache getting the
        bits its own pass would give it; where the shared pass fails, each is fed alone, its cache
        first put back as it was."""
        decodings = [self.prefilling[i] for i in request_ids]
        before = [cache_length(d.cache) for d in decodings]
        began = time.perf_counter()
        try:
            self.target.prefill_batch([(d.prefill_chunk, d.cache) for d in decodings])
        except Exception:
            log.exception("a shared prompt pass failed; its prompts are fed one by one")
            for request_id, decoding, length in zip(request_ids, decodings, before):
                try:  # a pass that failed part way grew some layers only: each goes back alone
                    crop_layers(decoding.cache, length)
                except Exception as error:
                    self.fail(out, request_id, error, "feeding its prompt")
                    continue
                self._prefill_alone(out, request_id)
            return
        seconds = (time.perf_counter() - began) / len(decodings)
        for request_id, decoding in zip(request_ids, decodings):
            try:
                if decoding.prefilled_together(seconds):
                    self.running[request_id] = self.prefilling.pop(request_id)
            except Exception as error:  # its prompt cache's copy: this request alone ends
                self.fail(out, request_id, error, "feeding its prompt")

    def lags(self, out: StepOutput) -> dict[int, int]:
        """How far each running sequence's drafter model lags its context (`Decoding.lag`), by
        id() of its `Decoding`, for the batch policy (none without one); a sequence whose drafter
        fails to say ends alone."""
        lags = {}
        if self.costs is None:
            return lags
        for request_id, decoding in list(self.running.items()):
            try:
                lag = decoding.lag()
            except Exception as error:
                self.fail(out, request_id, error, "its drafter's lag")
                continue
            if lag is not None:
                lags[id(decoding)] = lag
        return lags

    def steer(self, decodings: list[Decoding], lags: dict[int, int], feeding: bool = False) -> bool | None:
        """The batch-level draft-or-not decision, imposed with the batch's costs on every sequence
        whose output draft lengths cannot change and that may draft this step, but for those whose
        drafter's catch-up would cost more than drafting saves them -> the decision (None: no such
        sequence). lags: `lags`; feeding: prompts' chunks ride in this step's pass."""
        if self.costs is None:
            return None
        # a step of first tokens only would time plain passes as drafting: it decides nothing
        steered = [d for d in decodings if d.steerable is not None and d.drafts_next]
        if not steered:
            return None
        batch = len(decodings)
        # a sequence whose drafter would first catch up on more than drafting saves it (a new
        # one's whole prompt, under load) decodes plainly while the others draft
        sitting_out = {id(d) for d in steered if id(d) in lags and
                       not self.costs.repays_catch_up(batch, lags[id(d)], d.remaining)}
        lagging = [d for d in steered if id(d) in lags and id(d) not in sitting_out]
        # where every one sits out, the step is a plain one (and is timed as one)
        speculate = len(sitting_out) < len(steered) and self.costs.speculate(
            batch, sum(lags[id(d)] for d in lagging), sum(d.remaining for d in lagging), feeding)
        self.costs.steer(batch, [(d.steerable, speculate and id(d) not in sitting_out) for d in steered])
        return speculate

    def record(self, plan: StepPlan, segments: list[Segment], emitted: dict[int, list[int]]) -> None:
        """The step's costs, for the batch policy (`BatchCosts.record`); a failure here is the
        policy's, not the requests': logged, and the step's tokens stand."""
        if self.costs is None or plan.speculate is None:
            return
        try:
            self._record_costs(plan, segments, emitted)
        except Exception:
            log.exception("recording a step's costs failed; the batch policy skips this step")

    def _record_costs(self, plan: StepPlan, segments: list[Segment], emitted: dict[int, list[int]]) -> None:
        fed, catch_up_seconds = (now - then for now, then in zip(_caught_up(plan.decodings), plan.caught_up))
        for i, (context, remaining) in plan.fresh.items():  # drafters that first caught up this step
            if plan.decodings[i].lag() < context:
                self.costs.joined(context, remaining)
        if plan.feeding:  # a pass with prompts' rows in it does not cost what a decode step does
            return
        self.costs.record(len(plan.ids), plan.speculate, sum(map(len, emitted.values())), plan.drafted - plan.began,
                          sum(d.drafter_passes for d in plan.decodings) - plan.passes, plan.pass_seconds,
                          sum(len(s.input_ids) for s in segments), fed, catch_up_seconds, plan.rounds)

    def cancel(self, request_id: int) -> bool:
        """Drop a waiting or admitted request (an admitted one's caches freed at once) -> whether
        it was there."""
        for i, request in enumerate(self.waiting):
            if request.id == request_id:
                del self.waiting[i]
                return True
        return self.drop(request_id)

    def drop(self, request_id: int) -> bool:
        """Free an admitted request's caches and memory at once -> whether it was admitted."""
        decoding = self.running.pop(request_id, None) or self.prefilling.pop(request_id, None)
        self.reserved.pop(request_id, None)
        if decoding is not None:
            decoding.free()
            return True
        return False

    def fail(self, out: StepOutput, request_id: int, error: Exception, where: str) -> None:
        """End one admitted request on an error of its own, its caches freed at once."""
        out.fail(request_id, error, where)
        self.drop(request_id)

    def settle(self, out: StepOutput) -> None:
        """Let the requests that ended this step go (their caches, their KV charge)."""
        for request_id in [*out.finished, *out.failed]:
            self.drop(request_id)


def _caught_up(decodings: list[Decoding]) -> tuple[int, float]:
    """Tokens the drafter models of `decodings` have fed to catch up with their contexts, and the
    seconds it took, so far (`Decoding.caught_up`)."""
    sums = [s for s in (d.caught_up for d in decodings) if s is not None]
    return sum(s[0] for s in sums), sum(s[1] for s in sums)


def _kv_need(request, decoding: Decoding) -> int:
    """Bytes of KV cache a request can reach: its prompt, its output and the widest draft, in the
    target's cache and in its drafter model's (if it has one); a draft wider than the room charged
    for it is refused (`Decoding.charged_positions`)."""
    return kv_need(decoding.charged_positions(), [decoding.target, decoding.drafter_model])


def kv_need(positions: int, models: list) -> int:
    """Bytes of KV cache a sequence reaching `positions` cache positions holds in each of `models`
    (None: none): what its slabs grow to (`slab_capacity`, from a reserve of at most RESERVE_MAX
    positions, doubled), up to twice the positions themselves past RESERVE_MAX."""
    held = slab_capacity(positions, min(positions, sequence.RESERVE_MAX))
    return held * sum(features(m).kv_bytes_per_token or 0 for m in models if m is not None)


def kv_positions(prompt_length: int, max_new_tokens: int, drafts: bool) -> int:
    """The cache positions a request can reach: its prompt, its output and the widest draft
    (`Decoding.positions`, before the context caps them)."""
    return prompt_length + max_new_tokens + (sequence.DRAFT_ROOM if drafts else 0)


def _model_of(drafter):
    """The drafter model `drafter` (what a request's speculation makes) drafts with, or None."""
    if drafter is None:
        return None
    if not is_drafter(drafter):
        return drafter  # a model: the sequence wraps it
    return drafter.model if capabilities_of(drafter).model else None


def _kv_charge(positions: int, target, drafter, speculation) -> int:
    """`_kv_need`'s charge before a sequence exists: `positions` in the target's cache and in the
    drafter model's of `drafter` (what the request's speculation makes), its widest draft checked
    against the room kept for it."""
    if drafter is not None:
        trees = is_drafter(drafter) and capabilities_of(drafter).trees
        if trees:
            width = most_nodes(drafter)
        else:
            schedule = speculation.schedule() or sequence.Fixed(speculation.gamma or sequence.DEFAULT_GAMMA)
            width = schedule.ceiling()
        if width is None:
            raise SpecdecError(f"the tree drafter {drafter.name} does not say how wide its trees grow "
                               "(subclass drafters.Drafter, whose most_nodes reads its policy), so a KV budget cannot "
                               "charge them; run without a budget")
        if width > sequence.DRAFT_ROOM:
            kind = "tree nodes" if trees else "draft tokens"
            raise SpecdecError(f"this request drafts up to {width} {kind} a step, more than the {sequence.DRAFT_ROOM} "
                               "positions a KV budget keeps for a draft; lower the tree's max_nodes (or gamma)")
    return kv_need(positions, [target, _model_of(drafter)])

