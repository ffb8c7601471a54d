"""The step-wise engine: add requests, `step`, read each request's tokens as they are committed.

One step: admit waiting requests up to `max_batch`, feed about a chunk's worth of admitted prompts,
let every running sequence draft (`Decoding.planning`, the drafter model's passes batched across
sequences), score all of their new tokens in one target pass, verify the greedy and seeded chains
in one call over the ragged batch (`verify.verify_ragged`; trees and unseeded sampling each alone),
roll back each sequence (`Decoding.commit`), and free what finished. A sequence's
output does not depend on what shares its passes: its rows are computed bit for bit as its own
pass computes them (`forward_batch`), and everything random comes from its own generators.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..backends import Backend, Segment, features
from ..errors import ModelFault, SpecdecError
from ..decoding import sequence as generate
from ..backends.cache import cache_length, crop_cache
from ..backends.slab import slab_capacity
from ..drafters.base import capabilities_of, is_drafter, is_factory, most_nodes
from ..decoding.sequence import Decoding
from ..decoding.results import GenerationResult
from ..sizing.pass_costs import LoadCosts
from ..core.penalties import LogitRules
from ..core.samplers import GREEDY, Sampler, greedy_rows
from ..sizing.schedules import Schedule
from ..decoding.verifier import decide_batch
from ..sizing.batch_policy import BatchCosts

log = logging.getLogger("specdec.engine")

@dataclass
class Request:
    """What to generate: the prompt's ids, how to sample, when to stop, and who drafts.

    drafter: None (plain decoding), a drafter model (each request drafts with it through its own
    cache), or a factory returning a fresh `Drafter` for this request (`LookupDrafter`,
    `methods.build(...).make_drafter`): a drafter holds one sequence's state.
    schedule: a factory returning this request's draft-length schedule (default: fixed `gamma`).
    """

    prompt_ids: Sequence[int]
    drafter: object = None
    sampler: Sampler = GREEDY
    max_new_tokens: int = 128
    eos_token_ids: Sequence[int] | None = None
    seed: int | None = None
    gamma: int | None = None  # a chain's fixed draft length without a schedule (default 5); a tree's depth bound
    schedule: Callable[[], Schedule] | None = None
    logprobs: int | None = None  # report the target's log-probabilities (`Decoding`'s logprobs)
    seed_rule: str = "coupled"  # what a seed pins (`speculative_generate`'s seed_rule)
    cache_salt: str = ""  # the tenant: prompt caches reuse only prompts kept under the same salt
    rules: LogitRules | None = None  # penalties, logit bias, min_tokens (`speculative_generate`'s rules)
    grammar: object = None  # what the output must match (`speculative_generate`'s grammar)
    id: int = field(default=-1, compare=False)


@dataclass
class StepPlan:
    """What one engine step runs, as the scheduler decided it: the running requests (`ids`, their
    `decodings`), whether they draft (`speculate`: None where the batch policy did not decide),
    and the counters and times the step's cost record compares against."""

    ids: list[int]
    decodings: list[Decoding]
    speculate: bool | None
    passes: int  # drafter passes so far, summed over the sequences
    caught_up: tuple[int, float] | None  # drafter catch-up tokens and seconds so far
    fresh: dict[int, tuple[int, int]] = field(default_factory=dict)  # index -> (context, tokens left): drafters yet to see their prompts
    began: float = 0.0
    drafted: float = 0.0
    rounds: int = 0  # lock-step rounds of drafter passes
    pass_seconds: float = 0.0


class Engine:
    """Requests in, tokens out, one batched target pass per step.

    target: a model; with `forward_batch` (transformers' backend with row-exact passes, on the CPU;
        llama.cpp's) the running sequences share each pass; otherwise each sequence gets its own
        pass in turn. A llama.cpp model must hold `sequences` >= max_batch.
    max_batch: the most sequences running at once; later requests wait, in order.
    kv_memory: a budget in bytes for the KV caches of running sequences (None: no budget). Each
        request is admitted with room for its whole generation (prompt + max_new_tokens + the
        widest draft, in the target's cache and its drafter model's); requests beyond the budget
        wait, and one that could never fit is refused when added.
    steer: size the drafts of cost-aware requests from the batch's measured costs (`BatchCosts`);
        False leaves each to its own schedule as alone.
    load_costs: the machine's batched pass costs of the target with the drafter most requests use
        (`passcost.load_costs`): batch sizes where drafting cannot pay then decode plainly without
        first paying drafting steps to learn it. None: learned from the steps alone.
    """

    def __init__(self, target: Backend, max_batch: int = 8, kv_memory: int | None = None, steer: bool = True,
                 load_costs: LoadCosts | None = None):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise SpecdecError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        can = features(target)
        batched = can.batched
        if batched and not can.rows_invariant:
            raise SpecdecError(f"{target.name} runs without row-exact passes (or with int8 layers), so a sequence's "
                               "output would depend on what shares its passes; load it with exact_rows=True")
        if can.sequences is not None and max_batch > can.sequences:  # llama.cpp's: a fixed number of sequences
            raise SpecdecError(f"{target.name} holds {target.sequences} sequence(s) at once, fewer than max_batch="
                               f"{max_batch}; load it with sequences={max_batch}")
        if kv_memory is not None:
            if not isinstance(kv_memory, int) or kv_memory < 1:
                raise SpecdecError(f"kv_memory must be a number of bytes >= 1, got {kv_memory!r}")
            if can.kv_bytes_per_token is None:
                raise SpecdecError(f"a KV memory budget needs the cache size per token, which {target.name}'s "
                                   "backend does not give; bound the batch with max_batch")
        self.target, self.max_batch, self.kv_memory, self._batched = target, max_batch, kv_memory, batched
        self.costs = BatchCosts(prior=load_costs) if steer else None
        self._ids = itertools.count()
        self.waiting: list[Request] = []
        self.prefilling: dict[int, Decoding] = {}  # admitted, their prompts fed a chunk a step
        self.running: dict[int, Decoding] = {}
        self.results: dict[int, GenerationResult] = {}
        self.failed: dict[int, Exception] = {}  # requests that ended on an error of their own
        self.reserved: dict[int, int] = {}  # KV bytes held by each admitted request
        self.passes = 0  # target passes made (one per step with running sequences)

    def add(self, request: Request) -> int:
        """Queue a request; returns its id. Its options are checked now (a clear error), its
        memory is taken when it is admitted."""
        decoding = self._decoding(request)  # validates the options; the real one is built at admission
        drafter_model = decoding.drafter_model
        most = features(drafter_model).sequences if drafter_model is not None else None
        if most is not None and self.max_batch > most:
            raise SpecdecError(f"the drafter {drafter_model.name} holds {drafter_model.sequences} sequence(s) at once, "
                               f"fewer than max_batch={self.max_batch}; load it with sequences={self.max_batch}")
        need = _kv_need(request, decoding) if self.kv_memory is not None else 0
        if need > (self.kv_memory or 0) > 0:
            raise SpecdecError(f"this request needs {need / 2**20:.1f} MiB of KV cache, more "
                               f"than the whole budget of {self.kv_memory / 2**20:.1f} MiB; raise the budget or "
                               "lower max_new_tokens")
        request.id = next(self._ids)
        self.waiting.append(request)
        return request.id

    def cancel(self, request_id: int) -> bool:
        """Drop a waiting or running request; a running one's cache is freed at once."""
        for i, request in enumerate(self.waiting):
            if request.id == request_id:
                del self.waiting[i]
                return True
        return self._drop(request_id)

    def tokens(self, request_id: int) -> list[int] | None:
        """A request's tokens so far (None for one not admitted, or ended and collected): running,
        or ended and not yet collected from `results`."""
        decoding = self.running.get(request_id)
        if decoding is not None:
            return decoding.out.tokens
        result = self.results.get(request_id)
        return None if result is None else result.tokens

    def logprobs(self, request_id: int) -> list | None:
        """The `TokenLogprob`s of a request's tokens so far, where it asked for them (None
        otherwise, or for a request not admitted): running, or ended and not yet collected."""
        decoding = self.running.get(request_id)
        if decoding is not None:
            return decoding.out.logprobs
        result = self.results.get(request_id)
        return None if result is None else result.logprobs

    def _drop(self, request_id: int) -> bool:
        """Free an admitted request's caches and memory at once -> whether it was admitted."""
        decoding = self.running.pop(request_id, None) or self.prefilling.pop(request_id, None)
        if decoding is not None:
            _free(decoding)
            self.reserved.pop(request_id, None)
            return True
        return False

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def step(self) -> dict[int, list[int]]:
        """Schedule, draft, one target pass, verify and roll back -> the tokens each request emitted."""
        plan = self._schedule()
        if plan is None:
            return {}
        segments = self._draft(plan)
        if not plan.ids:  # every running sequence's drafting failed (each ended alone)
            return {}
        logits = self._score(plan, segments)
        emitted = self._verify(plan, logits)
        self._record(plan, segments, emitted)
        return emitted

    def _schedule(self) -> StepPlan | None:
        """Admit waiting requests, feed prompt chunks, and decide for the running ones whether
        this step drafts (`_steer`) -> the plan, or None when nothing runs."""
        self._admit()
        self._prefill()
        lags = self._lags()
        if not self.running:
            return None
        ids = list(self.running)
        decodings = [self.running[i] for i in ids]
        speculate = self._steer(decodings, lags)
        fresh = {i: (len(d.sequence), d.out.remaining) for i, d in enumerate(decodings)
                 if speculate and id(d) in lags and lags[id(d)] >= len(d.sequence)}
        return StepPlan(ids, decodings, speculate, sum(_drafter_passes(d) for d in decodings),
                        _caught_up(decodings) if speculate is not None else None, fresh)

    def _lags(self) -> dict[int, int]:
        """How far each running sequence's drafter model lags its context (`ModelDrafter.lag`), by
        id() of its `Decoding`, for the batch policy (none without one); a sequence whose drafter
        fails to say ends alone."""
        lags = {}
        if self.costs is None:
            return lags
        for request_id, decoding in list(self.running.items()):
            if decoding.can.catches_up:
                try:
                    lags[id(decoding)] = decoding.drafter.lag(decoding.sequence)
                except Exception as error:
                    self._fail(request_id, error, "its drafter's lag")
        return lags

    def _draft(self, plan: StepPlan) -> list[Segment]:
        """Every running sequence's draft, their drafter passes batched (`_plan`) -> what the
        target's pass scores for each."""
        plan.began = time.perf_counter()
        segments, plan.rounds = self._plan(plan.ids, plan.decodings)
        plan.drafted = time.perf_counter()
        if any(segment is None for segment in segments):  # a sequence whose drafting failed ended alone
            kept = [i for i, segment in enumerate(segments) if segment is not None]
            plan.ids, plan.decodings = [plan.ids[i] for i in kept], [plan.decodings[i] for i in kept]
            plan.speculate = None  # this step's costs are not one batch's: not recorded
            segments = [segments[i] for i in kept]
        return segments

    def _score(self, plan: StepPlan, segments: list[Segment]) -> list:
        """The one target pass over every sequence's segment -> each one's logits. Where the pass
        itself fails (not one sequence's own error), each sequence is scored again alone, its
        cache first put back as it was; one that fails again ends alone (`failed`), its logits None."""
        before = [cache_length(s.cache) for s in segments]
        try:
            if self._batched:
                logits = self.target.forward_batch(segments)
            else:
                logits = [self.target.forward(s.input_ids, s.cache, s.num_logits, parents=s.parents) for s in segments]
        except Exception:  # llama.cpp's failed decode (a ModelFault) too: one sequence may be the cause
            log.exception("a batched target pass failed; its sequences are scored again one by one")
            logits = [self._score_alone(request_id, segment, length)
                      for request_id, segment, length in zip(plan.ids, segments, before)]
        plan.pass_seconds = time.perf_counter() - plan.drafted
        self.passes += 1
        return logits

    def _score_alone(self, request_id: int, segment: Segment, length: int):
        """One sequence's segment scored alone after a failed pass (row-exact passes give its rows
        the same bits either way) -> its logits, or None where it fails again (it then ends)."""
        try:
            crop_cache(segment.cache, length)
            return self.target.forward(segment.input_ids, segment.cache, segment.num_logits, parents=segment.parents,
                                       tree_start=segment.tree_start)
        except Exception as error:  # this sequence's own trouble: it alone ends
            self._fail(request_id, error, "scoring alone")
            return None

    def _verify(self, plan: StepPlan, logits: list) -> dict[int, list[int]]:
        """Each sequence's draft verified against its logits, in one call over the ragged batch
        where the target's own tokens decide (`_decide`), and its caches rolled back
        (`Decoding.commit`); a sequence's own error ends it alone; finished ones collected."""
        emitted = {}
        decided = decide_batch(plan.decodings, logits)
        for i, (request_id, decoding, rows) in enumerate(zip(plan.ids, plan.decodings, logits)):
            if rows is None:  # ended when its pass failed
                continue
            try:
                if isinstance(decided.get(i), Exception):
                    raise decided[i]
                emitted[request_id] = decoding.commit(rows, plan.pass_seconds, decided.get(i))
                if decoding.done:
                    self.results[request_id] = decoding.result()  # frees its cache
                    del self.running[request_id]
                    self.reserved.pop(request_id, None)
            except Exception as error:  # this sequence's own (non-finite logits, its drafter's or rules' fault)
                self._fail(request_id, error, "verification")
        return emitted

    def _record(self, plan: StepPlan, segments: list[Segment], emitted: dict[int, list[int]]) -> None:
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
            decoding = plan.decodings[i]
            if decoding.drafter.lag(decoding.sequence) < context:
                self.costs.joined(context, remaining)
        self.costs.record(len(plan.ids), plan.speculate, sum(map(len, emitted.values())), plan.drafted - plan.began,
                          sum(_drafter_passes(d) for d in plan.decodings) - plan.passes, plan.pass_seconds,
                          sum(len(s.input_ids) for s in segments), fed, catch_up_seconds, plan.rounds)

    def run(self) -> dict[int, GenerationResult]:
        """Step until every request has ended -> results by request id; a request's own error
        (`failed`) is raised once the others have ended."""
        while self.busy:
            self.step()
        if self.failed:
            raise next(iter(self.failed.values()))
        return self.results

    def _admit(self) -> None:
        """Waiting requests in order, while the batch and the memory budget have room: each one's
        cache made and its drafter started; its prompt is fed by `_prefill`."""
        while self.waiting and len(self.running) + len(self.prefilling) < self.max_batch:
            request, decoding = self.waiting[0], None
            try:
                decoding = self._decoding(request)
                need = _kv_need(request, decoding) if self.kv_memory is not None else 0
                if self.kv_memory is not None and sum(self.reserved.values()) + need > self.kv_memory:
                    break  # it waits for memory; later requests wait behind it (first come, first served)
                self.waiting.pop(0)
                decoding.begin()
            except Exception as error:  # its drafter's start, its cache: this request alone ends
                if self.waiting and self.waiting[0] is request:
                    self.waiting.pop(0)
                if decoding is not None:  # what it made so far goes now (a llama.cpp sequence among it)
                    _free(decoding)
                self._fail(request.id, error, "starting")
                continue
            self.prefilling[request.id] = decoding
            self.reserved[request.id] = need

    def _prefill(self) -> None:
        """Prompt chunks (`Decoding.prefill_step`), first come first served, until a chunk's worth
        of tokens (PREFILL_CHUNK) is fed this step: a long prompt delays the running sequences by
        about one chunk's pass a step, not by its whole length. A prompt that is in joins this
        step's pass."""
        fed = 0
        for request_id, decoding in list(self.prefilling.items()):
            if fed >= generate.PREFILL_CHUNK:
                break
            before = cache_length(decoding.cache)
            try:
                if decoding.prefill_step():
                    self.running[request_id] = self.prefilling.pop(request_id)
            except Exception as error:  # this prompt's own trouble (its cache, its drafter's observe)
                self._fail(request_id, error, "feeding its prompt")
                continue
            fed += max(1, cache_length(decoding.cache) - before)

    def _steer(self, decodings: list[Decoding], lags: dict[int, int]) -> bool | None:
        """The batch-level draft-or-not decision, imposed with the batch's costs on every sequence
        whose output draft lengths cannot change and that may draft this step, but for those whose
        drafter's catch-up would cost more than drafting saves them -> the decision (None: no such
        sequence). lags: `_lags`."""
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
                       not self.costs.repays_catch_up(batch, lags[id(d)], d.out.remaining)}
        lagging = [d for d in steered if id(d) in lags and id(d) not in sitting_out]
        # where every one sits out, the step is a plain one (and is timed as one)
        speculate = len(sitting_out) < len(steered) and self.costs.speculate(
            batch, sum(lags[id(d)] for d in lagging), sum(d.out.remaining for d in lagging))
        self.costs.steer(batch, [(d.steerable, speculate and id(d) not in sitting_out) for d in steered])
        return speculate

    def _plan(self, ids: list[int], decodings: list[Decoding]) -> tuple[list[Segment | None], int]:
        """Every sequence's `planning` run in lock step: the drafter passes of each round that share
        a drafter model go through it in one batched pass (bit for bit each sequence's own pass,
        where that model has row-exact passes), the others one at a time -> the target segments,
        and the number of rounds.
        A sequence whose drafting raises ends alone (`failed`, its segment None); a batched
        drafter pass that fails is made again one sequence at a time, from the caches as they were."""
        plans = [d.planning() for d in decodings]
        segments: list[Segment | None] = [None] * len(plans)
        asks: dict[int, Segment] = {}

        def advance(i: int, logits) -> None:
            try:
                asks[i] = plans[i].send(logits)
            except StopIteration as stop:
                segments[i] = stop.value
            except Exception as error:  # this sequence's drafter: it alone ends
                self._fail(ids[i], error, "drafting")

        def alone(i: int, model, length: int | None = None) -> None:
            """Sequence i's drafter pass on its own (its cache first cropped to `length`, where a
            batched pass failed)."""
            s = current[i]
            try:
                if length is not None:
                    crop_cache(s.cache, length)
                logits = model.forward(s.input_ids, s.cache, s.num_logits, parents=s.parents, tree_start=s.tree_start)
            except Exception as error:
                self._fail(ids[i], error, "a drafter pass")
                return
            advance(i, logits)

        for i in range(len(plans)):
            advance(i, None)
        rounds = 0
        while asks:
            rounds += 1
            current, groups = dict(asks), {}
            asks.clear()
            for i in current:
                model = decodings[i].drafter.model
                groups.setdefault(id(model), (model, []))[1].append(i)
            for model, members in groups.values():
                shared = [i for i in members if _shares_drafter_passes(model, decodings[i])]
                before = {i: cache_length(current[i].cache) for i in shared} if len(shared) > 1 else {}
                batched = self._drafter_batch(model, [current[i] for i in shared]) if len(shared) > 1 else None
                for i, logits in zip(shared, batched or ()):
                    advance(i, logits)
                for i in members:
                    if batched is None or i not in shared:
                        alone(i, model, before.get(i))
        return segments, rounds

    def _drafter_batch(self, model, segments: list[Segment]) -> list | None:
        """One batched drafter pass -> each segment's logits, or None where the pass failed (each
        sequence then drafts alone, its cache first put back as it was)."""
        try:
            return model.forward_batch(segments)
        except Exception:
            log.exception("a batched drafter pass failed; its sequences draft again one by one")
            return None

    def _fail(self, request_id: int, error: Exception, where: str) -> None:
        """End one request on an error of its own (raised by `run` once the others have ended)."""
        if isinstance(error, ModelFault):
            log.warning("%s failed for request %s; it alone ends: %s", where, request_id, error)
        elif not isinstance(error, SpecdecError):
            log.exception("%s failed for request %s; it alone ends", where, request_id, exc_info=error)
        self.failed[request_id] = error
        self._drop(request_id)

    def _decoding(self, request: Request) -> Decoding:
        drafter = request.drafter
        if is_drafter(drafter):
            raise SpecdecError(f"a drafter object holds one sequence's state; give requests a factory that makes one "
                               f"each (e.g. {type(drafter).__name__} itself, or a lambda), or a drafter model")
        if is_factory(drafter):
            drafter = drafter()  # this request's own drafter
        if is_drafter(drafter) and capabilities_of(drafter).reads_target_hidden and self._batched:
            raise SpecdecError("self-drafting heads (Medusa, EAGLE) read the target's hidden states, which "
                               "batched passes do not keep yet; run them with speculative_generate")
        return Decoding(request.prompt_ids, self.target, drafter, gamma=request.gamma, sampler=request.sampler,
                        max_new_tokens=request.max_new_tokens, eos_token_ids=request.eos_token_ids, seed=request.seed,
                        schedule=request.schedule() if request.schedule else None, logprobs=request.logprobs,
                        seed_rule=request.seed_rule, cache_salt=request.cache_salt, rules=request.rules,
                        grammar=request.grammar)


def _free(decoding: Decoding) -> None:
    """Let go of a sequence's caches (the target's and its drafter model's) at once."""
    decoding.cache = None
    if decoding.can.model:
        decoding.drafter.cache = None


def _kv_need(request: Request, decoding: Decoding) -> int:
    """Bytes of KV cache a request can reach: its prompt, its output and the widest draft, in the
    target's cache and in its drafter model's (if it has one). A draft wider than the room charged
    for it (DRAFT_ROOM) would write past the charge: refused."""
    width = _draft_width(decoding)
    if width is None:
        raise SpecdecError(f"the tree drafter {decoding.drafter.name} does not say how wide its trees grow "
                           "(subclass drafters.Drafter, whose most_nodes reads its policy), so a KV budget cannot "
                           "charge them; run without a budget")
    if width > generate.DRAFT_ROOM:
        kind = "tree nodes" if decoding.trees else "draft tokens"
        raise SpecdecError(f"this request drafts up to {width} {kind} a step, more than the {generate.DRAFT_ROOM} "
                           "positions a KV budget keeps for a draft; lower the tree's max_nodes (or gamma)")
    return kv_need(decoding.positions, [decoding.target, decoding.drafter_model])


def _draft_width(decoding: Decoding) -> int | None:
    """The most positions one step's draft can take: a tree's node cap, a chain's longest draft
    (None: unknown)."""
    if decoding.drafter is None:
        return 0
    return most_nodes(decoding.drafter) if decoding.trees else decoding.schedule.ceiling()


def kv_need(positions: int, models: list) -> int:
    """Bytes of KV cache a sequence reaching `positions` cache positions holds in each of `models`
    (None: none): what its slabs grow to (`slab_capacity`, from a reserve of at most RESERVE_MAX
    positions, doubled), up to twice the positions themselves past RESERVE_MAX."""
    held = slab_capacity(positions, min(positions, generate.RESERVE_MAX))
    return held * sum(features(m).kv_bytes_per_token or 0 for m in models if m is not None)


def kv_positions(prompt_length: int, max_new_tokens: int, drafts: bool) -> int:
    """The cache positions a request can reach: its prompt, its output and the widest draft
    (`Decoding.positions`, before the context caps them)."""
    return prompt_length + max_new_tokens + (generate.DRAFT_ROOM if drafts else 0)


def _shares_drafter_passes(model, decoding: Decoding) -> bool:
    """Whether this sequence's drafter passes may join other sequences' on `model`: the model must
    batch with each sequence's own attention (`forward_batch`, row-exact), and where its rows round
    otherwise in a wider pass (an int8 drafter) the sequence's output must not hang on its drafts'
    exact values: a greedy output never does, an unseeded sampled one keeps the target's law (its
    q is what its token was drawn from), a seeded one would change."""
    can = features(model)
    if not can.batched or not can.exact_rows:
        return False
    return can.rows_invariant or not decoding.pinned


def _drafter_passes(decoding: Decoding) -> int:
    return decoding.drafter.passes if decoding.drafter is not None else 0


def _caught_up(decodings: list[Decoding]) -> tuple[int, float]:
    """Tokens the drafter models of `decodings` have fed to catch up with their contexts, and the
    seconds it took, so far (`ModelDrafter.caught_up`)."""
    sums = [d.drafter.caught_up for d in decodings if d.can.catches_up]
    return sum(s[0] for s in sums), sum(s[1] for s in sums)


def generate_many(prompts: Sequence[Sequence[int]], target: Backend, drafter=None, max_batch: int = 8,
                  samples: int = 1, seeds: Sequence[int | None] | None = None, kv_memory: int | None = None,
                  load_costs: LoadCosts | None = None, allow_larger_drafter: bool = False,
                  **options) -> list[GenerationResult]:
    """Generate for every prompt (`samples` each, in order), up to `max_batch` sequences at once.

    drafter: as `Request.drafter` (a model, a factory of drafters, or None).
    seeds: one per generated sequence (len(prompts) * samples), or None.
    kv_memory: the engine's KV budget in bytes (`Engine`), or None.
    load_costs: the machine's batched pass costs with the drafter's model
    (`passcost.load_costs(target, drafter)`), so that batch sizes where no draft can pay decode
    plainly from the first step (`Engine`); None: every size is learned from its own steps.
    allow_larger_drafter: as `speculative_generate`'s (a drafter model larger than the target, or
    the two loaded the other way round, is refused: `roles.check_roles`).
    options: the rest of `Request`'s fields (sampler, max_new_tokens, eos_token_ids, gamma, schedule).
    Returns the results in the order of the prompts (each prompt's samples together).
    """
    if not isinstance(samples, int) or samples < 1:
        raise SpecdecError(f"samples must be an integer >= 1, got {samples!r}")
    count = len(prompts) * samples
    if seeds is not None and len(seeds) != count:
        raise SpecdecError(f"seeds: one per generated sequence ({count}), got {len(seeds)}")
    from ..models.roles import check_roles

    check_roles(target, drafter, allow_larger_drafter)
    engine = Engine(target, max_batch, kv_memory, load_costs=load_costs)
    ids = [engine.add(Request(prompt, drafter, seed=None if seeds is None else seeds[i * samples + k], **options))
           for i, prompt in enumerate(prompts) for k in range(samples)]
    results = engine.run()
    return [results[i] for i in ids]
