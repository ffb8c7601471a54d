"""What a request is: its prompt's ids, the speculation it carries whole to its sequence, how to
sample and when to stop (`Request`)."""

from __future__ import annotations

from typing import Sequence

from ..core.penalties import LogitRules
from ..core.samplers import GREEDY, Sampler
from ..decoding.sequence import Limits
from ..decoding.speculation import Speculation
from ..errors import SpecdecError

_UNSET = object()  # a keyword of the older Request spelling not given


class Request:
    """What to generate: the prompt's ids, the speculation, how to sample and when to stop.

    speculation: a `Speculation` carried whole to the sequence (`build(config, parts)`, or
        `Speculation.of(drafter, ...)`); None: plain decoding. Its drafter is made per request: a
        drafter model (each request drafts with it through its own cache) or a factory of fresh
        drafters (a drafter object holds one sequence's state).
    limits: `Limits(max_new_tokens, eos_token_ids)`.
    The older spelling `Request(ids, drafter, sampler, ..., gamma=, schedule=, seed_rule=,
    max_new_tokens=, eos_token_ids=)` is taken too: those keywords are folded into `speculation`
    and `limits` here, once (a drafter in the place of the speculation, `schedule` a factory).
    """

    def __init__(self, prompt_ids: Sequence[int], speculation=None, sampler: Sampler = GREEDY,
                 limits: Limits | None = None, *, seed: int | None = None, logprobs: int | None = None,
                 cache_salt: str = "", rules: LogitRules | None = None, grammar=None,
                 drafter=_UNSET, gamma=_UNSET, schedule=_UNSET, seed_rule=_UNSET, max_new_tokens=_UNSET,
                 eos_token_ids=_UNSET):
        older = {name: value for name, value in dict(gamma=gamma, schedule=schedule, seed_rule=seed_rule).items()
                 if value is not _UNSET and value is not None}
        if drafter is not _UNSET:
            if speculation is not None:
                raise SpecdecError("give a request its speculation or its drafter, not both")
            speculation = drafter
        if isinstance(speculation, Speculation):
            if older:
                raise SpecdecError(f"a Speculation carries its own {', '.join(older)}; give them to Speculation.of")
        else:
            speculation = Speculation.of(speculation, **older)
        stops = {name: value for name, value in dict(max_new_tokens=max_new_tokens,
                                                     eos_token_ids=eos_token_ids).items() if value is not _UNSET}
        if stops:
            if limits is not None:
                raise SpecdecError("give a request its limits or max_new_tokens and eos_token_ids, not both")
            limits = Limits(**stops)
        if limits is not None and not isinstance(limits, Limits):
            raise SpecdecError(f"a request's limits are a Limits(max_new_tokens, eos_token_ids), got {limits!r}")
        self.prompt_ids, self.speculation, self.sampler = prompt_ids, speculation, sampler
        self.limits = Limits() if limits is None else limits
        self.seed, self.logprobs, self.cache_salt = seed, logprobs, cache_salt  # cache_salt: the tenant's prompts
        self.rules, self.grammar = rules, grammar  # `speculative_generate`'s
        self.id = -1

    def __eq__(self, other) -> bool:  # the fields, not the id the engine gives
        if not isinstance(other, Request):
            return NotImplemented
        return {**vars(self), "id": None} == {**vars(other), "id": None}

    __hash__ = None

    def __repr__(self) -> str:
        return f"Request(id={self.id}, prompt_ids={list(self.prompt_ids)!r}, speculation={self.speculation!r})"

    @property
    def max_new_tokens(self) -> int:
        return self.limits.max_new_tokens

    @property
    def eos_token_ids(self) -> Sequence[int] | None:
        return self.limits.eos_token_ids
