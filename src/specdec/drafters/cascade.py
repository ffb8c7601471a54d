"""Cascade drafting, vertical (Chen et al. 2023, CS Drafting; Spector & Ré 2023, staged
speculative decoding): the drafter model is itself drafted for by a model-free stage.

At each of its passes the drafter model also scores what suffix drafting (or prompt lookup)
guesses it will draft next, and keeps the guessed tokens its own rule would have drawn: under
greedy those equal to its argmax; under sampling a guess g is kept with probability q(g), else a
token is drawn from q with g taken out (speculative sampling against a one-hot guess), so every
drafted token still follows the drafter's q exactly and the target's verification is unchanged.
Each kept guess saves a drafter pass at the price of a row in a pass that was running anyway.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..backends import Backend, Segment
from ..backends.cache import cache_length, crop_cache
from ..errors import SpecdecError
from ..core.samplers import CoupledGenerator, Sampler, draw, greedy_tokens, sample
from .base import Capabilities, Draft, KeepGoing, Proposal
from .lookup import find_continuation
from .model import ModelDrafter
from .suffix import SuffixDrafter

STAGES = ("suffix", "lookup")


class CascadeDrafter(ModelDrafter):
    """The drafter model, with `stage` ("suffix" or "lookup") guessing up to `max_guess` of its
    tokens per pass. Counts `guessed` (guess tokens the model scored) and `kept` (those it drew).
    Under a grammar it drafts unconstrained (its stage's guesses would need masks of their own):
    the target's masked verification keeps the output exact."""

    capabilities = Capabilities(batched_passes=True, model=True, catches_up=True)

    def __init__(self, model: Backend, stage: str = "suffix", max_guess: int = 3):
        super().__init__(model)
        if stage not in STAGES:
            raise SpecdecError(f"unknown cascade stage {stage!r}; use one of {', '.join(STAGES)}")
        if isinstance(max_guess, bool) or not isinstance(max_guess, int) or max_guess < 1:
            raise SpecdecError(f"a cascade needs max_guess >= 1, got {max_guess!r}")
        self.stage, self.max_guess = stage, max_guess
        self._suffix = SuffixDrafter() if stage == "suffix" else None
        self.name = f"{model.name}+cascade-{stage}"
        self.guessed = self.kept = 0

    def start(self, prompt: Sequence[int]) -> None:
        super().start(prompt)
        if self._suffix is not None:
            self._suffix.start(prompt)
        self.guessed = self.kept = 0

    def guess(self, sequence: Sequence[int], count: int) -> list[int]:
        """What the stage expects to follow `sequence` (the context and the tokens drafted so far)."""
        if count < 1:
            return []
        if self._suffix is not None:
            return self._suffix.candidates(sequence, count)[0]
        return find_continuation(sequence, 3, 1, count)

    def proposal(self, context: Sequence[int], max_tokens: int, sampler: Sampler, generator: torch.Generator,
                 keep_going: KeepGoing) -> Proposal:
        tokens: list[int] = []
        probs = []
        self._catch_up(context)
        if self._suffix is not None:
            self._suffix.observe(context)  # committed tokens only
        pending = self._inputs(context[cache_length(self.cache):])
        done = False
        while not done and len(tokens) < max_tokens:
            guess = self.guess(list(context) + tokens, min(self.max_guess, max_tokens - len(tokens) - 1))
            rows = yield Segment(pending + self._inputs(guess), self.cache, len(guess) + 1)
            self.passes += 1
            self.guessed += len(guess)
            for i, row in enumerate(rows):
                logits = row[:self.vocab_size]  # ids past the target's (head padding) are never proposed
                q = None if sampler.is_greedy else sampler.probs(self._over_target_vocabulary(logits))
                token = _draw(logits, q, guess[i] if i < len(guess) else None, generator,
                              len(context) + len(tokens))
                tokens.append(token)
                if q is not None:
                    probs.append(q)
                kept = i < len(guess) and token == guess[i]
                self.kept += kept
                if not keep_going(len(tokens), logits) or len(tokens) >= max_tokens:
                    done = True
                if done or not kept:
                    break
            # the pass fed pending + guess; the cache keeps context + tokens but the last (as a plain pass would)
            crop_cache(self.cache, len(context) + len(tokens) - 1)
            pending = self._inputs([tokens[-1]])
        return Draft(tokens, torch.stack(probs) if probs else None)


def _draw(logits: torch.Tensor, q: torch.Tensor | None, guess: int | None, generator: torch.Generator,
          position: int) -> int:
    """The drafter's token at sequence position `position`: its argmax under greedy (q None);
    under a seed the coupled draw from q [V] (`samplers.draw`); else a draw from q that keeps
    `guess` with probability q(guess) and otherwise draws from q with the guess taken out, which
    is a draw from q all the same."""
    if q is None:
        return int(greedy_tokens(logits))
    if guess is None or isinstance(generator, CoupledGenerator):
        return draw(q, generator, position)
    u = torch.rand((), generator=generator, device=q.device)
    if u < q[guess]:
        return guess
    rest = q.clone()
    rest[guess] = 0.0
    if float(rest.sum()) <= 0:  # q(guess) = 1 up to rounding: the guess is the only token
        return guess
    return int(sample(rest / rest.sum(), generator))
