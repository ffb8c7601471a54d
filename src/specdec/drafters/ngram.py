"""NASD: an n-gram drafter built online from the prompt and the generated text.

Counts of next tokens after every context of 1..n-1 tokens are kept as generation goes on
(optionally on top of counts from a corpus). A proposal backs off from the longest context
that has been seen to shorter ones; its q is the normalised counts, and under sampling the
draft token is drawn from that q, so rejection sampling stays exact. When no context of
length >= 1 has been seen, the draft stops: no filler tokens.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import torch

from ..errors import SpecdecError
from ..core.samplers import Sampler, draw
from .base import Capabilities, Draft, Drafter, KeepGoing

Counts = dict[tuple[int, ...], dict[int, int]]


def count_ngrams(tokens: Sequence[int], n: int, counts: Counts | None = None, start: int = 0) -> Counts:
    """Add, for each position t >= start, the next-token count of tokens[t] after each of its
    1..n-1 preceding tokens. Returns `counts` (a new table when None)."""
    counts = counts if counts is not None else defaultdict(lambda: defaultdict(int))
    for t in range(max(start, 1), len(tokens)):
        for k in range(1, min(n - 1, t) + 1):
            counts[tuple(tokens[t - k:t])][tokens[t]] += 1
    return counts


class NgramDrafter(Drafter):
    """n-gram assisted drafting. n: the longest n-gram (context of n-1 tokens), >= 2.
    corpus_tokens: token ids whose counts seed every generation (e.g. a tokenized corpus file)."""

    capabilities = Capabilities()

    def __init__(self, n: int = 4, corpus_tokens: Sequence[int] | None = None, name: str | None = None):
        if not isinstance(n, int) or n < 2:
            raise SpecdecError(f"the n-gram drafter needs n >= 2, got {n!r}")
        self.n = n
        self.name = name or f"ngram-{n}"
        self.passes = 0
        self.vocab_size: int | None = None
        self.corpus: Counts = count_ngrams(list(corpus_tokens or []), n)
        self.online: Counts = {}
        self._counted = 0

    def check_target(self, target) -> None:
        self.vocab_size = target.vocab_size

    def start(self, prompt: Sequence[int]) -> None:
        self.online = defaultdict(lambda: defaultdict(int))
        self._counted = 0

    def next_counts(self, context: Sequence[int]) -> dict[int, int] | None:
        """Next-token counts after the longest seen suffix of `context` (None if none is seen)."""
        for k in range(min(self.n - 1, len(context)), 0, -1):
            key = tuple(context[-k:])
            online, corpus = self.online.get(key), self.corpus.get(key)
            if online or corpus:
                if not corpus:
                    return online
                merged = dict(corpus)
                for token, c in (online or {}).items():
                    merged[token] = merged.get(token, 0) + c
                return merged
        return None

    def propose(self, context: Sequence[int], max_tokens: int, sampler: Sampler, generator: torch.Generator,
                keep_going: KeepGoing) -> Draft:
        if self.vocab_size is None:
            raise SpecdecError("NgramDrafter.check_target(target) must run before propose (it learns V)")
        # only committed tokens are counted: rejected drafts never enter the table
        count_ngrams(context, self.n, self.online, start=self._counted)
        self._counted = len(context)
        extended = list(context[-(self.n - 1):])  # all the back-off ever looks at
        tokens, probs = [], []
        while len(tokens) < max_tokens:
            counts = self.next_counts(extended)
            if counts is None:
                break
            ids = torch.tensor(list(counts), device=generator.device)
            weights = torch.tensor(list(counts.values()), dtype=torch.float32, device=generator.device)
            q = torch.zeros(self.vocab_size, device=generator.device).index_put_((ids,), weights / weights.sum())
            if sampler.is_greedy:
                token = max(counts, key=counts.get)  # the most frequent; ties go to the first seen
            else:
                token = draw(q, generator, len(context) + len(tokens))
                probs.append(q)
            tokens.append(token)
            extended.append(token)
            if not keep_going(len(tokens), q.log()):
                break
        return Draft(tokens, torch.stack(probs) if probs else None)

    def rollback(self, length: int) -> None:
        pass  # the table holds committed tokens only
