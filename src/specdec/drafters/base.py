"""The drafter protocol and the proposal it returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generator, Protocol, Sequence

import torch

from ..samplers import Sampler

# Called after each drafted token with how many are drafted so far and the drafter's own
# (untempered) logits [V] for the last one, or a float (a model-free drafter's estimate of the
# chance that the token is accepted, its parent accepted), or None (no estimate at all);
# False stops the draft there. A drafter that knows its first token's chance before drafting
# it may ask first with 0 drafted: False drafts nothing. Draft-length schedules (schedules.py)
# provide it.
KeepGoing = Callable[[int, "torch.Tensor | float | None"], bool]


@dataclass
class Draft:
    """A proposal: `tokens` [n], and `probs` [n, V] the q each token was sampled from.

    probs is None when the drafter proposes deterministically (q one-hot at each token) or
    when the sampler is greedy (verification then only compares tokens).
    """

    tokens: list[int]
    probs: torch.Tensor | None = None


class Drafter(Protocol):
    """What `speculative_generate` needs from a drafter."""

    name: str
    forwards: int  # drafter forward passes since `start` (0 for model-free drafters)

    def check_target(self, target) -> None:
        """Raise SpecdecError if this drafter cannot serve `target` (e.g. another vocabulary)."""

    def start(self, prompt: Sequence[int]) -> None:
        """Forget the previous generation; `prompt` is the new context."""

    def propose(self, context: Sequence[int], max_tokens: int, sampler: Sampler, generator: torch.Generator,
                keep_going: KeepGoing) -> Draft:
        """Up to `max_tokens` (>= 1) tokens to follow `context` (every token emitted so far, prompt
        included). An empty draft is allowed: the target then emits one token on its own."""

    def rollback(self, length: int) -> None:
        """Only `context[:length]` of the last proposal's context + draft was kept."""


# A proposal that leaves its model passes to the caller: it yields each pass it needs (a
# backends.Segment on the drafter model) and is sent that pass's logits; it returns its Draft.
# The engine runs many sequences' proposals in lock step, one batched drafter pass per round.
Proposal = Generator["Segment", torch.Tensor, "Draft"]


def drive(proposal: Generator, forward: Callable) -> object:
    """Run a generator of passes (`Proposal`, `Decoding.planning`) to its end, each pass made by
    `forward(input_ids, cache, num_logits, parents=, tree_start=)` -> what it returns."""
    try:
        segment = next(proposal)
        while True:
            segment = proposal.send(forward(segment.input_ids, segment.cache, segment.num_logits,
                                            parents=segment.parents, tree_start=segment.tree_start))
    except StopIteration as stop:
        return stop.value


def one_hot(tokens: Sequence[int], vocab_size: int, device: torch.device | None = None) -> torch.Tensor:
    """tokens [n] -> [n, V] fp32: the q of a deterministic proposal."""
    return torch.nn.functional.one_hot(torch.tensor(list(tokens), device=device), vocab_size).float()
