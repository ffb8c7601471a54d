"""The engine's facade: add requests, `step`, read each step's `StepOutput` (what it emitted, finished
and failed). A step is the scheduler's plan (scheduler.py) and the runner's passes over it (runner.py)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..backends import Backend, features
from ..errors import SpecdecError
from ..drafters.base import capabilities_of, is_drafter, is_factory
from ..decoding.sequence import Decoding
from ..decoding.results import GenerationResult
from ..sizing.pass_costs import LoadCosts
from ..core.penalties import LogitRules
from ..core.samplers import GREEDY, Sampler
from ..sizing.schedules import Schedule
from ..sizing.batch_policy import BatchCosts
from .output import StepFailed, StepOutput
from .runner import Runner
from .scheduler import Scheduler, _kv_need, kv_need, kv_positions  # noqa: F401 (kv_*: server/service.py's import)


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
    """

    def __init__(self, target: Backend, max_batch: int = 8, kv_memory: int | None = None, steer: bool = True,
                 load_costs: LoadCosts | None = None):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise SpecdecError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        self.runner = Runner(target, max_batch)
        self.costs = BatchCosts(prior=load_costs) if steer else None
        self.scheduler = Scheduler(target, max_batch, kv_memory, self.costs, self._decoding)
        self.target, self.max_batch, self.kv_memory, self._batched = target, max_batch, kv_memory, self.runner.batched
        self.waiting = self.scheduler.waiting  # the queue `add` appends to
        self._ids = itertools.count()

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
        return self.scheduler.cancel(request_id)

    @property
    def busy(self) -> bool:
        return self.scheduler.busy

    @property
    def passes(self) -> int:  # target passes made (one per step with running sequences)
        return self.runner.passes

    def step(self) -> StepOutput:
        """Schedule, draft, one target pass, verify and roll back -> what the step emitted, finished
        and failed. Failing outside every request's own guard: `StepFailed`, with what it had."""
        out = StepOutput()
        try:
            plan = self.scheduler.schedule(out)
            segments = self.runner.draft(plan, out) if plan is not None else []
            if segments:  # not every running sequence's drafting failed (each ended alone)
                logits = self.runner.score(plan, segments, out)
                self.runner.verify(plan, logits, out)
                self.scheduler.record(plan, segments, out.emitted)
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
