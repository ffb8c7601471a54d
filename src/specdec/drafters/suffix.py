"""Suffix drafting (SuffixDecoding, Oliaro et al. 2024): draft what most often followed the
context's suffix, in the prompt and output so far and in earlier outputs.

A `SuffixIndex` holds token sequences and where each token occurs. A proposal finds the earlier
occurrences of the context's suffixes (up to `depth` tokens) and, for each match length, follows
from the occurrences matching at least that long the most frequent next token (the count ratio:
its occurrences over all that continue) while the product of the ratios stays at `min_prob` or
more, for at most `factor` × the match length tokens. Each candidate scores the sum of its
prefixes' products (the tokens it expects accepted if the ratios were chances); the best over
match lengths, and over the request's own index and the shared one of earlier outputs
(`SuffixCache`), is proposed. These are the counts and rules of SuffixDecoding's suffix trees,
read from occurrence lists instead: a tree node per string would cost ~24 Python objects per
token (120 MB for 20k tokens), a list entry costs one.

Deterministic (q one-hot at each token), so exact under any sampler, like prompt lookup. The
draft-length rule sees each token's chance (`KeepGoing` with a float): the count ratio, scaled by
what verification accepted in this generation for matches of that length (`RatioScale`; a copy
after a 6-token match is a different bet from one after a single token).
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from typing import Sequence

import torch

from ..errors import SpecdecError
from ..core.samplers import Sampler
from .base import Capabilities, Draft, Drafter, KeepGoing


SEPARATOR = -1  # between the sequences an index holds: no match or continuation crosses it


class SuffixIndex:
    """The token sequences fed to it, with where each token occurs, so that the earlier
    occurrences of a context's suffixes and what followed them are found without a scan.

    Equivalent to SuffixDecoding's suffix tree for drafting (the count of a string's node is its
    number of occurrences), at O(1) per token fed. A lookup reads the `window` latest occurrences
    of the context's last token and extends each match backwards up to `depth` tokens.
    `max_tokens` bounds what is held: the oldest sequences are dropped beyond it.
    """

    def __init__(self, depth: int = 24, window: int = 256, max_tokens: int | None = None):
        if not isinstance(depth, int) or depth < 1:
            raise SpecdecError(f"a suffix index needs depth >= 1, got {depth!r}")
        if not isinstance(window, int) or window < 1:
            raise SpecdecError(f"a suffix index needs window >= 1, got {window!r}")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise SpecdecError(f"a suffix index needs max_tokens >= 1, got {max_tokens!r}")
        self.depth, self.window, self.max_tokens = depth, window, max_tokens
        self.tokens: list[int] = []
        self.where: dict[int, list[int]] = {}  # token -> its positions in `tokens`, rising
        self.floor = 0  # positions below it were dropped
        self.starts: deque[int] = deque()  # where each held sequence starts
        self.open = False  # whether the last sequence takes more tokens

    @property
    def held(self) -> int:
        """Tokens held (separators included)."""
        return len(self.tokens) - self.floor

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the open sequence (a new one if none is open)."""
        if not self.open:
            self.starts.append(len(self.tokens))
            self.open = True
        for token in tokens:
            token = int(token)
            self.where.setdefault(token, []).append(len(self.tokens))
            self.tokens.append(token)

    def close(self) -> None:
        """End the open sequence; drop the oldest ones while more than `max_tokens` are held."""
        if not self.open:
            return
        self.tokens.append(SEPARATOR)
        self.open = False
        while self.max_tokens is not None and self.held > self.max_tokens and len(self.starts) > 1:
            self.starts.popleft()
            self.floor = self.starts[0]
        if self.floor > len(self.tokens) // 2:  # compact once the dropped part outweighs the rest
            self._compact()

    def add(self, tokens: Sequence[int]) -> None:
        """Hold one whole sequence."""
        self.extend(tokens)
        self.close()

    def _compact(self) -> None:
        floor = self.floor
        self.tokens = self.tokens[floor:]
        self.starts = deque(start - floor for start in self.starts)
        self.where = {}
        for position, token in enumerate(self.tokens):
            if token != SEPARATOR:
                self.where.setdefault(token, []).append(position)
        self.floor = 0

    def occurrences(self, context: Sequence[int]) -> list[tuple[int, int]]:
        """(where the continuation starts, match length) for each earlier occurrence of context's
        last token (the `window` latest) that something follows; the match length is how many of
        context's last tokens (at most `depth`) occur there."""
        if not context:
            return []
        tokens, last, floor = self.tokens, len(self.tokens) - 1, self.floor
        positions = self.where.get(int(context[-1]), ())
        found = []
        for position in reversed(positions):
            if position < floor or len(found) >= self.window:
                break
            if position == last or tokens[position + 1] == SEPARATOR:
                continue  # nothing followed it (yet)
            length = 1
            while (length < self.depth and length < len(context) and position - length >= floor
                   and tokens[position - length] == context[-1 - length]):
                length += 1
            found.append((position + 1, length))
        return found

    def counts(self, context: Sequence[int], length: int) -> dict[int, int]:
        """How often each token followed context's last `length` tokens (over the occurrences
        `occurrences` reads)."""
        return dict(Counter(self.tokens[q] for q, matched in self.occurrences(context) if matched >= length))


class SuffixCache:
    """The shared index of earlier outputs (SuffixDecoding's global tree): every finished
    generation's output, the oldest dropped once more than `max_tokens` tokens are held."""

    def __init__(self, max_tokens: int = 100_000, depth: int = 24, window: int = 256):
        self.index = SuffixIndex(depth, window, max_tokens)

    def add(self, output: Sequence[int]) -> None:
        """Remember one finished output."""
        if len(output):
            self.index.add(output)


def best_path(tokens: Sequence[int], starts: Sequence[int], max_tokens: int,
              min_prob: float) -> tuple[list[int], list[float]]:
    """From the continuations of a string's occurrences (`starts`: where each continues in
    `tokens`), the most frequent next token at each step while the product of the count ratios
    stays >= min_prob -> (drafted tokens, each one's count over its alternatives' total).
    Ties go to the token of the latest occurrence."""
    drafted, ratios, survival = [], [], 1.0
    end = len(tokens)
    while len(drafted) < max_tokens:
        following = Counter(tokens[q] for q in starts if q < end and tokens[q] != SEPARATOR)
        if not following:
            break
        token, count = following.most_common(1)[0]
        token = int(token)  # a datastore's tokens are numpy scalars
        ratio = count / sum(following.values())
        if survival * ratio < min_prob:
            break
        survival *= ratio
        drafted.append(token)
        ratios.append(ratio)
        starts = [q + 1 for q in starts if q < end and tokens[q] == token]
    return drafted, ratios


def best_tree(tokens: Sequence[int], starts: Sequence[int], max_nodes: int, max_depth: int,
              min_prob: float) -> list[tuple[int, int, float, float]]:
    """SuffixDecoding's tree mode over the continuations of a string's occurrences (`starts`, as
    for `best_path`): nodes added best first by their product of count ratios along the path,
    while it is >= min_prob, at most `max_nodes` of them and `max_depth` deep -> the nodes as
    (parent's place in the list, -1 for the root; token; count ratio; product), parents first.
    Siblings tied in count keep the order of their latest occurrence."""
    nodes: list[tuple[int, int, float, float]] = []
    end, order = len(tokens), 0
    candidates: list = []  # heap of (-product, arrival, parent, token, ratio, starts, depth)

    def offer(parent: int, starts: Sequence[int], survival: float, depth: int) -> None:
        nonlocal order
        following = Counter(int(tokens[q]) for q in starts if q < end and tokens[q] != SEPARATOR)
        total = sum(following.values())
        for token, count in following.most_common():
            product = survival * count / total
            if product < min_prob:
                break
            after = [q + 1 for q in starts if q < end and tokens[q] == token]
            heapq.heappush(candidates, (-product, order, parent, token, count / total, after, depth))
            order += 1

    offer(-1, starts, 1.0, 1)
    while candidates and len(nodes) < max_nodes:
        negative, _, parent, token, ratio, after, depth = heapq.heappop(candidates)
        nodes.append((parent, token, ratio, -negative))
        if depth < max_depth:
            offer(len(nodes) - 1, after, -negative, depth + 1)
    return nodes


def _score(ratios: list[float]) -> float:
    """Expected accepted tokens of a chain whose tokens survive with these conditional chances."""
    total, survival = 0.0, 1.0
    for ratio in ratios:
        survival *= ratio
        total += survival
    return total


LENGTH_BINS = (1, 2, 4, 8)  # match lengths calibrated apart: 1, 2-3, 4-7, 8+


class RatioScale:
    """How far count ratios over- or under-state acceptance: the chance of a token drafted at
    ratio r is min(1, r·s), s = (accepted + k) / (Σ r of the tokens tried + k), k = `strength`
    pseudo-counts at s = 1. (Most ratios are 1, one earlier occurrence or all agreeing, so a
    calibration by bins of r, as for model drafters, would have nothing to tell them apart.)"""

    def __init__(self, strength: float = 4.0):
        self.strength = strength
        self.reset()

    def reset(self) -> None:
        self.tries, self.hits, self.expected = 0, 0, 0.0

    def record(self, ratio: float, accepted: bool) -> None:
        self.tries += 1
        self.hits += int(accepted)
        self.expected += ratio

    def scale(self) -> float:
        return (self.hits + self.strength) / (self.expected + self.strength)

    def __call__(self, ratio: float) -> float:
        return min(1.0, ratio * self.scale())


def length_bin(length: int) -> int:
    return sum(length >= edge for edge in LENGTH_BINS) - 1


class SuffixDrafter(Drafter):
    """SuffixDecoding's chain drafter over this request's prompt and output, and over a shared
    `SuffixCache` of earlier outputs (optional; `generate --prompts` and the server share one),
    and over a retrieval datastore (optional: `datastore.Datastore`, REST's corpus; with it
    alone as the extra index the drafter is `retrieval`).

    depth: the longest suffix matched; min_prob: stop once the draft's product of count ratios
    falls below it (SuffixDecoding's 0.1); factor: at most factor × match length tokens (its
    max_spec_factor, 1.0); min_match: the shortest suffix match drafted from.
    """

    capabilities = Capabilities(pins=True, finishes=True)

    def __init__(self, cache: SuffixCache | None = None, depth: int = 24, min_prob: float = 0.1,
                 factor: float = 1.0, min_match: int = 1, datastore=None):
        if not (isinstance(min_prob, (int, float)) and 0 < min_prob <= 1):
            raise SpecdecError(f"suffix drafting needs 0 < min_prob <= 1, got {min_prob!r}")
        if not (isinstance(factor, (int, float)) and factor > 0):
            raise SpecdecError(f"suffix drafting needs factor > 0, got {factor!r}")
        if not isinstance(min_match, int) or min_match < 1:
            raise SpecdecError(f"suffix drafting needs min_match >= 1, got {min_match!r}")
        SuffixIndex(depth)  # checks depth
        self.cache, self.depth, self.min_prob, self.factor, self.min_match = cache, depth, min_prob, factor, min_match
        self.datastore = datastore
        self.name = ("retrieval" if datastore is not None else "suffix") + ("+cache" if cache is not None else "")
        self.passes = 0
        self.calibration = [RatioScale() for _ in LENGTH_BINS]
        self.start([])

    def check_target(self, target) -> None:
        if self.datastore is not None:
            self.datastore.check_tokenizer(target.tokenizer, target.vocab_size)

    def start(self, prompt: Sequence[int]) -> None:
        self.shared = self.cache is not None  # whether this generation drafts from earlier outputs
        self.index = SuffixIndex(self.depth)
        self._fed = 0
        self._prompt = len(prompt)
        self._last: tuple[int, list[float], int] | None = None  # the last proposal: context length, ratios, match
        for calibration in self.calibration:
            calibration.reset()

    def pin(self) -> None:
        """This generation's drafts must not hang on other generations (a seed pins its sampled
        output, and draft lengths decide which random draws it uses): it drafts from its own
        text alone, though its output still joins the cache."""
        self.shared = False

    def finish(self, sequence: Sequence[int]) -> None:
        """The generation ended with `sequence` (prompt + output): its output joins the shared cache."""
        if self.cache is not None:
            self.cache.add(sequence[self._prompt:])

    def chance(self, ratio: float, match: int) -> float:
        """The calibrated chance that a token drafted with this count ratio after a `match`-token
        suffix match is accepted (its parent accepted)."""
        return self.calibration[length_bin(match)](ratio)

    def indexes(self) -> list:
        """What this generation drafts from: its own text, earlier outputs unless pinned, the datastore."""
        return ([self.index] + ([self.cache.index] if self.shared else [])
                + ([self.datastore] if self.datastore is not None else []))

    def observe(self, context: Sequence[int]) -> None:
        """Index the context's tokens not yet indexed (only committed tokens: rejected drafts never enter)."""
        self.index.extend(context[self._fed:])
        self._fed = len(context)

    def candidates(self, context: Sequence[int], max_tokens: int) -> tuple[list[int], list[float], int]:
        """The best-scoring draft over match lengths and indexes -> (tokens, count ratios, match
        length); ([], [], 0) if no suffix of the context occurred before."""
        best, best_score = ([], [], 0), 0.0
        for index in self.indexes():
            found = index.occurrences(context)
            for length in sorted({matched for _, matched in found if matched >= self.min_match}, reverse=True):
                cap = min(max_tokens, max(1, int(self.factor * length)))
                tokens, ratios = best_path(index.tokens, [q for q, matched in found if matched >= length], cap,
                                           self.min_prob)
                score = _score(ratios)
                if score > best_score:
                    best, best_score = (tokens, ratios, length), score
        return best

    def propose(self, context: Sequence[int], max_tokens: int, sampler: Sampler, generator: torch.Generator,
                keep_going: KeepGoing) -> Draft:
        self.observe(context)
        tokens, ratios, match = self.candidates(context, max_tokens)
        if tokens and not keep_going(0, self.chance(ratios[0], match)):
            tokens, ratios = [], []
        for i in range(1, len(tokens)):
            if not keep_going(i, self.chance(ratios[i - 1], match)):
                tokens, ratios = tokens[:i], ratios[:i]
                break
        self._last = (len(context), ratios, match)
        return Draft(tokens, None)

    def rollback(self, length: int) -> None:
        """Count the last draft's tokens that verification tried, by their ratios (`chance`)."""
        if self._last is None:
            return
        start, ratios, match = self._last
        accepted = length - start
        for i, ratio in enumerate(ratios[:accepted + 1]):
            self.calibration[length_bin(match)].record(ratio, i < accepted)
        self._last = None
