"""Cascade drafting, horizontal (Chen et al. 2023, CS Drafting's horizontal cascade): a cheaper
drafter for the later positions of a chain, which are less likely to be accepted anyway.

The drafter model drafts the chain's first `model_tokens` positions; a model-free stage (suffix
drafting or prompt lookup) continues it from there, at no drafter pass. The chain stays exact:
each position's law is that of the stage that drew it, the model's q for the first positions and
one-hot for the stage's deterministic guesses (a function of the context and the tokens drafted
before them), and `verify_draft` takes a law per position. (The vertical cascade, where the
model-free stage drafts for the drafter model, is cascade.py.)
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..backends import Backend
from ..errors import SpecdecError
from ..core.samplers import Sampler
from .base import Capabilities, Draft, KeepGoing, Proposal
from .cascade import STAGES
from .lookup import find_continuation
from .model import ModelDrafter
from .suffix import SuffixDrafter


class HorizontalCascadeDrafter(ModelDrafter):
    """The drafter model for a chain's first `model_tokens` positions, then `stage` ("suffix" or
    "lookup") for the rest. Counts `staged` (tokens the stage drafted). Under a grammar it drafts
    unconstrained (the stage's guesses would need masks of their own): the target's masked
    verification keeps the output exact."""

    capabilities = Capabilities(batched_passes=True, model=True, catches_up=True)

    def __init__(self, model: Backend, stage: str = "suffix", model_tokens: int = 2):
        super().__init__(model)
        if stage not in STAGES:
            raise SpecdecError(f"unknown cascade stage {stage!r}; use one of {', '.join(STAGES)}")
        if isinstance(model_tokens, bool) or not isinstance(model_tokens, int) or model_tokens < 1:
            raise SpecdecError(f"a horizontal cascade needs model_tokens >= 1, got {model_tokens!r}")
        self.stage, self.model_tokens = stage, model_tokens
        self._suffix = SuffixDrafter() if stage == "suffix" else None
        self.name = f"{model.name}+horizontal-{stage}"
        self.staged = 0

    def start(self, prompt: Sequence[int]) -> None:
        super().start(prompt)
        if self._suffix is not None:
            self._suffix.start(prompt)
        self.staged = 0

    def continuation(self, sequence: Sequence[int], count: int) -> list[int]:
        """What the stage expects to follow `sequence` (the context and the model's tokens), at most `count`."""
        if count < 1:
            return []
        if self._suffix is not None:
            return self._suffix.candidates(sequence, count)[0][:count]
        return find_continuation(sequence, 3, 1, count)[:count]

    def proposal(self, context: Sequence[int], max_tokens: int, sampler: Sampler, generator: torch.Generator,
                 keep_going: KeepGoing) -> Proposal:
        if self._suffix is not None:
            self._suffix.observe(context)  # committed tokens only
        stopped = []

        def model_keep_going(drafted: int, estimate) -> bool:
            going = keep_going(drafted, estimate)
            if not going:
                stopped.append(drafted)
            return going

        head = yield from super().proposal(context, min(self.model_tokens, max_tokens), sampler, generator,
                                           model_keep_going)
        tokens = list(head.tokens)
        if stopped or len(tokens) < self.model_tokens:  # the schedule stopped the model: it stops the chain
            return head
        tail = []
        for token in self.continuation(list(context) + tokens, max_tokens - len(tokens)):
            tail.append(token)
            if not keep_going(len(tokens) + len(tail), None):
                break
        self.staged += len(tail)
        if not tail or head.probs is None:  # greedy: verification compares tokens only
            return Draft(tokens + tail, head.probs)
        stage_laws = torch.nn.functional.one_hot(torch.tensor(tail, device=head.probs.device),
                                                 head.probs.shape[-1]).to(head.probs.dtype)
        return Draft(tokens + tail, torch.cat([head.probs, stage_laws]))
