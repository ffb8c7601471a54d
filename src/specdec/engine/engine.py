"""The engine's facade: add requests, `step`, read each step's `StepOutput` (what it emitted, finished
and failed). A step is the scheduler's plan (scheduler.py) and the runner's passes over it (runner.py)."""

from __future__ import annotations

import itertools

from ..backends import Backend, features
from ..backends.prompts import PREFILL_TOKENS
from ..errors import SpecdecError
from ..decoding.sequence import Decoding
from ..decoding.results import GenerationResult
from ..sizing.pass_costs import LoadCosts
from ..sizing.batch_policy import BatchCosts
from .output import StepFailed, StepOutput
from .runner import Runner
from .request import Request
from .scheduler import Scheduler, _kv_charge, _model_of
from ..decoding import sequence


class Engine:
    """Requests in, tokens out, one batched target pass per step.

    target: a model; with `forward_batch` (row-exact passes) the running sequences share each pass,
        otherwise each gets its own in turn; a llama.cpp model must hold `sequences` >= max_batch.
    max_batch: the most sequences running at once; later requests wait, in order.
    kv_memory: a budget in bytes for the running sequences' KV caches (None: none). Each request is
        admitted with room for its whole generation (its prompt, max_new_tokens and the widest draft,
        in the target's and its drafter model's caches); one that could never fit is refused when added.
    steer: size the drafts of cost-aware requests from the batch's measured costs (`BatchCosts`).
    load_costs: the machine's batched pass costs (`pass_costs.load_costs`): batch sizes where drafting
        cannot pay decode plainly from the first step. None: learned from the steps alone.
    prefill_tokens: about how many prompt tokens a step feeds in one pass shared by the waiting
        prompts (each at most one chunk of `PREFILL_CHUNK` a step; a target that cannot share prompt
        passes feeds a chunk's worth a step): more feeds them in fewer passes, each streaming the
        weights once, while the running sequences wait longer for that step's token.
    """

    def __init__(self, target: Backend, max_batch: int = 8, kv_memory: int | None = None, steer: bool = True,
                 load_costs: LoadCosts | None = None, prefill_tokens: int = PREFILL_TOKENS):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise SpecdecError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        if not isinstance(prefill_tokens, int) or prefill_tokens < 1:
            raise SpecdecError(f"prefill_tokens must be an integer >= 1, got {prefill_tokens!r}")
        self.runner = Runner(target, max_batch)
        self.costs = BatchCosts(prior=load_costs) if steer else None
        self.scheduler = Scheduler(target, max_batch, kv_memory, self.costs, self._decoding, prefill_tokens)
        self.target, self.max_batch, self.kv_memory, self._batched = target, max_batch, kv_memory, self.runner.batched
        self.waiting = self.scheduler.waiting  # the queue `add` appends to
        self._ids = itertools.count()

    def add(self, request: Request) -> int:
        """Queue a request; returns its id. What can be checked before its sequence exists is
        checked now (a clear error): its prompt and limits, its drafter, the KV memory it needs.
        Its sequence (`Decoding`) is made once, when it is admitted."""
        speculation = request.speculation
        shared = speculation.one_drafter
        if shared is not None:
            raise SpecdecError(f"a drafter object holds one sequence's state; give requests a factory that makes one "
                               f"each (e.g. {type(shared).__name__} itself, or a lambda), or a drafter model")
        if speculation.one_schedule is not None:
            raise SpecdecError("a schedule object holds one sequence's state; give requests a factory that makes "
                               "one each (e.g. lambda: Heuristic(...))")
        # every refusal its sequence would make, now (the drafter made here is looked at, not kept)
        checked = sequence.check_request(request.prompt_ids, self.target, speculation, request.sampler,
                                         request.limits, logprobs=request.logprobs, rules=request.rules,
                                         grammar=request.grammar)
        self._check_batching(checked.can)
        drafter_model = _model_of(checked.drafter)
        most = features(drafter_model).sequences if drafter_model is not None else None
        if most is not None and self.max_batch > most:
            raise SpecdecError(f"the drafter {drafter_model.name} holds {drafter_model.sequences} sequence(s) at once, "
                               f"fewer than max_batch={self.max_batch}; load it with sequences={self.max_batch}")
        if self.kv_memory is not None:
            drafts = checked.drafter is not None
            positions = len(checked.prompt) + checked.limit + (sequence.DRAFT_ROOM if drafts else 0)
            need = _kv_charge(positions, self.target, checked.drafter, speculation)
            if need > self.kv_memory:
                raise SpecdecError(f"this request needs {need / 2**20:.1f} MiB of KV cache, more "
                                   f"than the whole budget of {self.kv_memory / 2**20:.1f} MiB; raise the budget or "
                                   "lower max_new_tokens")
        request.id = next(self._ids)
        self.waiting.append(request)
        return request.id

    def cancel(self, request_id: int) -> bool:
        """Drop a waiting or running request; a running one's cache is freed at once."""
        return self.scheduler.cancel(request_id)

    @property
    def busy(self) -> bool:
        return self.scheduler.busy

    @property
    def passes(self) -> int:  # target passes made (one per step with running sequences)
        return self.runner.passes

    def step(self) -> StepOutput:
        """Schedule, draft, one target pass (prompt chunks riding in it), verify and roll back -> what
        the step emitted, finished and failed. Failing outside every request's own guard: `StepFailed`, with what it had."""
        out = StepOutput()
        try:
            plan = self.scheduler.schedule(out)
            segments = self.runner.draft(plan, out) if plan is not None else []
            if segments:  # not every running sequence's drafting failed (each ended alone)
                logits = self.runner.score(plan, segments, out)
                self.runner.verify(plan, logits, out)
                self.scheduler.record(plan, segments, out.emitted)
            if plan is not None:
                self.scheduler.fed(plan, out)
        except Exception as error:
            raise StepFailed(error, out) from error
        finally:
            self.scheduler.settle(out)
        return out

    def run(self) -> dict[int, GenerationResult]:
        """Step until every request has ended -> the results of those that finished, by request
        id; a request's own error is raised once the others have ended."""
        total = StepOutput()
        while self.busy:
            try:
                total.merge(self.step())
            except StepFailed as failed:
                raise failed.error from None  # the cause itself: callers (the CLI) catch what they know
        if total.failed:
            raise next(iter(total.failed.values()))
        return total.finished

    def _decoding(self, request: Request) -> Decoding:
        """The request's sequence, made once (at admission), its speculation handed on whole."""
        decoding = Decoding(request.prompt_ids, self.target, request.speculation, request.sampler, request.limits,
                            seed=request.seed, logprobs=request.logprobs, cache_salt=request.cache_salt,
                            rules=request.rules, grammar=request.grammar)
        self._check_batching(decoding.can)
        return decoding

    def _check_batching(self, can) -> None:
        if can.reads_target_hidden and self._batched:
            raise SpecdecError("self-drafting heads (Medusa, EAGLE) read the target's hidden states, which "
                               "batched passes do not keep yet; run them with speculative_generate")

