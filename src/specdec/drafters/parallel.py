"""A parallel drafter (PARD): the drafter model proposes up to k tokens in one pass (adapters/pard.py)."""

from __future__ import annotations

from typing import Sequence

import torch

from ..backends import Segment, features
from ..backends.cache import cache_length, crop_cache
from ..errors import SpecdecError
from ..core.samplers import Sampler
from .base import Capabilities, Draft, KeepGoing, Proposal
from .model import ModelDrafter


ROW_SHARE = 0.15  # an extra row of the drafter's pass over its one-row pass (docs/methods.md#parallel-drafters)


class ParallelDrafter(ModelDrafter):
    """Drafts with a parallel drafter model (`parallel.load_parallel`): one pass feeds the tokens
    its cache lacks and up to k − 1 mask tokens, and its last rows give the draft, token i + 1
    drawn from row i's q (greedy: its argmax). Row i does not see draft tokens 1 … i, so q_i is a
    law given what the pass fed alone; verification is exact for any such q.

    The masks' cache entries are dropped after each pass. Where the schedule wants more tokens,
    the next pass feeds this pass's tokens as real ones, then its own masks (a chain of parallel
    passes: a draft of 2k tokens costs 2 passes, not 2k); the loop's rollback then keeps the
    accepted ones, as for a chain. The draft's length is the schedule's (`keep_going` after each
    row): a token inside a pass costs its row, the first of a pass a drafter pass too
    (`Capabilities.one_pass`, `k`).

    Mask j is fed only while its tokens pay for its row: while the share of them accepted (when
    the draft reached them; counted from 1 of 2) is at least ROW_SHARE, the price of a row against
    the drafter pass an accepted token saves. With no mask paying it drafts as the chain does.
    """

    capabilities = Capabilities(batched_passes=True, model=True, catches_up=True, one_pass=True)

    def __init__(self, model):
        k = features(model).parallel_k  # declared by the backend once an adapter is installed (`make_parallel`)
        if not k:
            raise SpecdecError(f"{model.name} is no parallel drafter: load one with --drafter parallel:DIR "
                               "(`specdec train-parallel-drafter`)")
        super().__init__(model)
        self.k = int(k)
        from ..adapters.pard import mask_id

        self.mask = mask_id(model)
        self.reached = [0] * (self.k - 1)  # per mask j (1 … k-1): its tokens the accepted prefix reached
        self.kept = [0] * (self.k - 1)  # ... and those accepted
        self._origins: list[int] = []  # the last draft's tokens: 0 from a real row, j from mask j
        self._start = 0

    def masks(self) -> int:
        """Masks the next pass feeds: the leading ones whose tokens pay for their rows."""
        count = 0
        while count < self.k - 1 and (self.kept[count] + 1) / (self.reached[count] + 2) >= ROW_SHARE:
            count += 1
        return count

    def proposal(self, context: Sequence[int], max_tokens: int, sampler: Sampler, generator: torch.Generator,
                 keep_going: KeepGoing) -> Proposal:
        tokens: list[int] = []
        probs = []
        self._origins, self._start = [], len(context)
        if max_tokens < 1:
            return Draft(tokens)
        self._catch_up(context)
        fed = cache_length(self.cache)
        if fed >= len(context):  # the last token's row reads the next one: it must be fed again
            fed = len(context) - 1
            crop_cache(self.cache, fed)
        pending = self._inputs(context[fed:])
        masks = self.masks()
        while True:
            width = min(max_tokens - len(tokens), masks + 1)
            rows = yield Segment(pending + [self.mask] * (width - 1), self.cache, width)
            self.passes += 1
            crop_cache(self.cache, cache_length(self.cache) - (width - 1))  # the masks' entries
            going = True
            for origin, logits in enumerate(rows):
                logits = logits[:self.vocab_size]  # ids past the target's (head padding) are never proposed
                token, q = self._choose(logits, sampler, generator, len(context) + len(tokens))
                if q is not None:
                    probs.append(q)
                tokens.append(token)
                self._origins.append(origin)
                going = keep_going(len(tokens), logits)
                if not going:
                    break
            if not going or len(tokens) >= max_tokens:
                return Draft(tokens, torch.stack(probs) if probs else None)
            pending = self._inputs(tokens[-width:])  # this pass's tokens, fed as real ones before the next masks

    def rollback(self, length: int) -> None:
        accepted = length - self._start
        for i, origin in enumerate(self._origins[:accepted + 1]):  # the tokens the accepted prefix reached
            if origin:
                self.reached[origin - 1] += 1
                self.kept[origin - 1] += i < accepted
        self._origins = []
        super().rollback(length)
