"""Prompt lookup decoding: copy what followed the latest earlier occurrence of the current suffix.

Model-free and deterministic (q is one-hot at each proposed token), so it is exact under any
sampler. Strong on inputs that the output repeats (code edits, summaries, extraction).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..errors import SpecdecError
from ..core.samplers import Sampler
from .base import Capabilities, Draft, Drafter, KeepGoing


def find_continuation(context: Sequence[int], max_ngram: int, min_ngram: int, max_tokens: int,
                      earliest: bool = False) -> list[int]:
    """Tokens that followed the latest (or, with `earliest`, the first: transformers' choice)
    earlier occurrence of context's last n tokens, trying n from max_ngram down to min_ngram;
    [] when no suffix recurs."""
    length = len(context)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = list(context[length - n:])
        starts = range(0, length - n) if earliest else range(length - n - 1, -1, -1)  # the suffix itself excluded
        for start in starts:
            if context[start] == suffix[0] and list(context[start:start + n]) == suffix:
                continuation = list(context[start + n:start + n + max_tokens])
                if continuation:
                    return continuation
    return []


def find_continuations(context: Sequence[int], max_ngram: int, min_ngram: int, max_tokens: int,
                       count: int) -> list[list[int]]:
    """Up to `count` distinct continuations of earlier occurrences of context's last n tokens, n
    from max_ngram down to min_ngram; for each n the latest occurrence first, then the earliest
    (transformers' prompt lookup copies the earliest; the prompt's source text often lies
    there), then the others from the latest back. A continuation that is a prefix of one
    already found adds nothing and is skipped."""
    return [continuation for _, continuation in find_matches(context, max_ngram, min_ngram, max_tokens, count)]


def find_matches(context: Sequence[int], max_ngram: int, min_ngram: int, max_tokens: int,
                 count: int) -> list[tuple[int, list[int]]]:
    """`find_continuations`, each with the length n of the suffix it matched."""
    length = len(context)
    found: list[tuple[int, list[int]]] = []
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = list(context[length - n:])
        starts = [s for s in range(length - n - 1, -1, -1)
                  if context[s] == suffix[0] and list(context[s:s + n]) == suffix]
        if len(starts) > 1:
            starts.insert(1, starts.pop())  # the earliest second
        for start in starts:
            continuation = list(context[start + n:start + n + max_tokens])
            if continuation and not any(f[:len(continuation)] == continuation for _, f in found):
                found.append((n, continuation))
                if len(found) >= count:
                    return found
    return found


class LookupDrafter(Drafter):
    """Prompt lookup, trying suffixes of max_ngram down to min_ngram tokens (longest match first),
    copying after the latest earlier occurrence, or the first with `earliest` (transformers'
    prompt lookup: `LookupDrafter(2, 1, earliest=True)`)."""

    capabilities = Capabilities()

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, earliest: bool = False):
        if not (isinstance(max_ngram, int) and isinstance(min_ngram, int) and 1 <= min_ngram <= max_ngram):
            raise SpecdecError(f"lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}..{max_ngram}")
        self.max_ngram, self.min_ngram, self.earliest = max_ngram, min_ngram, earliest
        self.name = f"lookup-{min_ngram}..{max_ngram}" + ("-earliest" if earliest else "")
        self.passes = 0

    def check_target(self, target) -> None:
        pass

    def start(self, prompt: Sequence[int]) -> None:
        pass

    def propose(self, context: Sequence[int], max_tokens: int, sampler: Sampler, generator: torch.Generator,
                keep_going: KeepGoing) -> Draft:
        tokens = find_continuation(context, self.max_ngram, self.min_ngram, max_tokens, self.earliest)
        for i in range(1, len(tokens)):
            if not keep_going(i, None):
                tokens = tokens[:i]
                break
        return Draft(tokens, None)

    def rollback(self, length: int) -> None:
        pass
