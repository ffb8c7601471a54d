"""The engine's runner: a step's passes over the batch the scheduler planned.

Every running sequence drafts (`Decoding.drafting`), the drafter model's passes batched across the
sequences that share it (lock step); one target pass scores every sequence's new tokens; the greedy
and seeded chains are verified in one call over the ragged batch (`decoding.verifier.decide_batch`), the others each
alone, and each sequence rolls back and emits (`Decoding.apply`). A sequence's output does not
depend on what shares its passes: its rows are computed bit for bit as its own pass computes them
(`forward_batch`), and everything random comes from its own generators. A sequence's own error ends
it alone (`StepOutput.failed`); a batched pass that fails is made again one sequence at a time.
"""

from __future__ import annotations

import logging
import time

from ..backends import Backend, Segment, features
from ..backends.cache import cache_length, crop_cache, crop_layers
from ..decoding.verifier import decide_batch
from ..decoding.sequence import Decoding
from ..errors import SpecdecError
from .output import StepOutput
from .scheduler import StepPlan

log = logging.getLogger("specdec.engine")


class Runner:
    """Makes a step's passes on `target` (and on the drafter models of its sequences).

    target: with `forward_batch` (row-exact passes) the running sequences share each pass;
        otherwise each sequence gets its own pass in turn.
    """

    def __init__(self, target: Backend, max_batch: int):
        can = features(target)
        if can.batched and not can.rows_invariant:
            raise SpecdecError(f"{target.name} runs without row-exact passes (or with int8 layers), so a sequence's "
                               "output would depend on what shares its passes; load it with exact_rows=True")
        if can.sequences is not None and max_batch > can.sequences:  # llama.cpp's: a fixed number of sequences
            raise SpecdecError(f"{target.name} holds {target.sequences} sequence(s) at once, fewer than max_batch="
                               f"{max_batch}; load it with sequences={max_batch}")
        self.target, self.batched = target, can.batched
        self.passes = 0  # target passes made (one per step with running sequences)

    def draft(self, plan: StepPlan, out: StepOutput) -> list[Segment]:
        """Every planned sequence's draft, their drafter passes batched (`_lock_step`) -> what the
        target's pass scores for each. A sequence whose drafting failed leaves the plan."""
        plan.began = time.perf_counter()
        segments, plan.rounds = self._lock_step(plan.ids, plan.decodings, out)
        plan.drafted = time.perf_counter()
        if any(segment is None for segment in segments):  # a sequence whose drafting failed ended alone
            kept = [i for i, segment in enumerate(segments) if segment is not None]
            plan.ids, plan.decodings = [plan.ids[i] for i in kept], [plan.decodings[i] for i in kept]
            plan.speculate = None  # this step's costs are not one batch's: not recorded
            segments = [segments[i] for i in kept]
        return segments

    def score(self, plan: StepPlan, segments: list[Segment], out: StepOutput) -> list:
        """The one target pass over every sequence's segment, and the prompt chunks riding in it
        (`StepPlan.feeding`) -> each sequence's logits. Where the pass itself fails (not one
        sequence's own error), each sequence is scored again alone, its cache first put back as it
        was; one that fails again ends alone, its logits None."""
        before = [cache_length(s.cache) for s in segments]
        try:
            if plan.feeding:  # prompts' next chunks ride in the same pass (`Scheduler.prefill`)
                logits = self.target.prefill_batch([(d.prefill_chunk, d.cache) for _, d, _ in plan.feeding], segments)
            elif self.batched:
                logits = self.target.forward_batch(segments)
            else:
                logits = [self.target.forward(s.input_ids, s.cache, s.num_logits, parents=s.parents) for s in segments]
            plan.fed = True
        except Exception:  # llama.cpp's failed decode (a ModelFault) too: one sequence may be the cause
            log.exception("a batched target pass failed; its sequences are scored again one by one")
            plan.fed = False  # the prompts that rode in it are fed alone (`Scheduler.fed`)
            logits = [self._score_alone(request_id, decoding, segment, length, out)
                      for request_id, decoding, segment, length in zip(plan.ids, plan.decodings, segments, before)]
        plan.pass_seconds = time.perf_counter() - plan.drafted
        self.passes += 1
        return logits

    def _score_alone(self, request_id: int, decoding: Decoding, segment: Segment, length: int, out: StepOutput):
        """One sequence's segment scored alone after a failed pass (row-exact passes give its rows
        the same bits either way) -> its logits, or None where it fails again (it then ends)."""
        try:
            # a batched pass that failed part way grew some layers only: each goes back on its own
            (crop_layers if self.batched else crop_cache)(segment.cache, length)
            return self.target.forward(segment.input_ids, segment.cache, segment.num_logits, parents=segment.parents,
                                       tree_start=segment.tree_start)
        except Exception as error:  # this sequence's own trouble: it alone ends
            _fail(out, request_id, decoding, error, "scoring alone")
            return None

    def verify(self, plan: StepPlan, logits: list, out: StepOutput) -> None:
        """Each sequence's draft verified against its logits, in one call over the ragged batch
        where the target's own tokens decide (`decoding.verifier.decide_batch`), and its caches rolled back
        (`Decoding.apply`) -> its tokens, their logprobs, and its result where it finished, in
        `out`; a sequence's own error ends it alone."""
        decided = decide_batch(plan.decodings, logits)
        for i, (request_id, decoding, rows) in enumerate(zip(plan.ids, plan.decodings, logits)):
            if rows is None:  # ended when its pass failed
                continue
            try:
                if isinstance(decided.get(i), Exception):
                    raise decided[i]
                # a pass with prompts' rows in it is no step's cost for the sequence's schedule
                emitted = decoding.apply(rows, plan.pass_seconds, decided.get(i), timed=not plan.feeding)
                out.emitted[request_id] = emitted
                logprobs = decoding.emitted_logprobs(len(emitted))
                if logprobs is not None:
                    out.logprobs[request_id] = logprobs
                if decoding.done:
                    out.finished[request_id] = decoding.result()  # frees its cache
            except Exception as error:  # this sequence's own (non-finite logits, its drafter's or rules' fault)
                out.emitted.pop(request_id, None)
                out.logprobs.pop(request_id, None)
                _fail(out, request_id, decoding, error, "verification")

    def _lock_step(self, ids: list[int], decodings: list[Decoding], out: StepOutput) -> tuple[list[Segment | None], int]:
        """Every sequence's `planning` run in lock step: the drafter passes of each round that share
        a drafter model go through it in one batched pass (bit for bit each sequence's own pass,
        where that model has row-exact passes), the others one at a time -> the target segments,
        and the number of rounds.
        A sequence whose drafting raises ends alone (its segment None); a batched drafter pass that
        fails is made again one sequence at a time, from the caches as they were."""
        plans = [d.drafting() for d in decodings]
        segments: list[Segment | None] = [None] * len(plans)
        asks: dict[int, Segment] = {}

        def advance(i: int, logits) -> None:
            try:
                asks[i] = plans[i].send(logits)
            except StopIteration as stop:
                segments[i] = stop.value
            except Exception as error:  # this sequence's drafter: it alone ends
                _fail(out, ids[i], decodings[i], error, "drafting")

        def alone(i: int, model, length: int | None = None) -> None:
            """Sequence i's drafter pass on its own (its cache first cropped to `length`, where a
            batched pass failed)."""
            s = current[i]
            try:
                if length is not None:  # after a batched pass that failed, perhaps part way
                    crop_layers(s.cache, length)
                logits = model.forward(s.input_ids, s.cache, s.num_logits, parents=s.parents, tree_start=s.tree_start)
            except Exception as error:
                _fail(out, ids[i], decodings[i], error, "a drafter pass")
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
                model = decodings[i].drafter_model
                groups.setdefault(id(model), (model, []))[1].append(i)
            for model, members in groups.values():
                shared = [i for i in members if _shares_drafter_passes(model, decodings[i])]
                before = {i: cache_length(current[i].cache) for i in shared} if len(shared) > 1 else {}
                batched = _drafter_batch(model, [current[i] for i in shared]) if len(shared) > 1 else None
                for i, logits in zip(shared, batched or ()):
                    advance(i, logits)
                for i in members:
                    if batched is None or i not in shared:
                        alone(i, model, before.get(i))
        return segments, rounds


def _fail(out: StepOutput, request_id: int, decoding: Decoding, error: Exception, where: str) -> None:
    """End one sequence on an error of its own: recorded, its caches let go at once (the
    scheduler lets the request go when the step settles)."""
    out.fail(request_id, error, where)
    decoding.free()


def _drafter_batch(model, segments: list[Segment]) -> list | None:
    """One batched drafter pass -> each segment's logits, or None where the pass failed (each
    sequence then drafts alone, its cache first put back as it was)."""
    try:
        return model.forward_batch(segments)
    except Exception:
        log.exception("a batched drafter pass failed; its sequences draft again one by one")
        return None


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
