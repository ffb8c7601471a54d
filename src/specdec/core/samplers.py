"""Logits -> probability distributions, and sampling from them.

Every sampler is a distribution (greedy is one-hot at the argmax), as in Leviathan et al. §2.2.
The same `Sampler` shapes both the target's p and the drafter's q, so one verification rule
(`verify.verify_draft`) is exact for all of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ..errors import ModelFault, SpecdecError

NAN_LOGITS = "model produced NaN logits; the weights or the dtype are unusable here"
RULED_OUT = "the model gave every token logit -inf: every token has probability 0, nothing can be sampled"


@dataclass(frozen=True)
class Sampler:
    """How logits become a distribution.

    temperature: 0 means greedy (one-hot at the argmax); otherwise logits are divided by it.
    top_k: keep the k most likely tokens (0 = off).
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p (1.0 = off).
    min_p: drop the tokens less likely than min_p times the most likely one (0.0 = off).
    They compose in that order: top-k first, then top-p on what remains, then min-p.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise SpecdecError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise SpecdecError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise SpecdecError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1):
            raise SpecdecError(f"min_p must be in [0, 1], got {self.min_p!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [..., V] -> probabilities [..., V] in fp32, each row summing to 1."""
        return logits_to_probs(logits, self.temperature, self.top_k, self.top_p, self.min_p)

    def describe(self) -> str:
        if self.is_greedy:
            return "greedy"
        parts = [f"temperature={self.temperature:g}"]
        if self.top_k:
            parts.append(f"top_k={self.top_k}")
        if self.top_p < 1:
            parts.append(f"top_p={self.top_p:g}")
        if self.min_p:
            parts.append(f"min_p={self.min_p:g}")
        return ", ".join(parts)


GREEDY = Sampler(temperature=0.0)


def logits_to_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                    top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] (fp32), every row finite and summing to 1.

    Infinite logits and overflowing temperatures give the limit distribution, never NaN: a row
    with +inf logits is uniform over its +inf entries (at any temperature), and a temperature so
    small that logits / T overflows gives the uniform distribution over the row's largest logits
    (one-hot at the argmax when it is unique, the greedy limit). Temperature 0 is one-hot at the
    first largest logit. Raises SpecdecError on NaN logits and on a row whose logits are all -inf
    (no token is possible) rather than returning a silently wrong distribution.
    """
    logits = logits.float()
    if torch.isnan(logits).any():
        raise ModelFault(NAN_LOGITS)
    row_max = logits.amax(-1, keepdim=True)  # [..., 1]
    _check_some_token_possible(row_max)
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    # +inf logits: the limit of softmax as they grow together is uniform over them, whatever T
    plus_inf = row_max == float("inf")
    if plus_inf.any():
        logits = torch.where(plus_inf, torch.where(logits == float("inf"), 0.0, float("-inf")), logits)
        row_max = logits.amax(-1, keepdim=True)
    # Subtract the row max before dividing by T: (l - max) / T lies in [-inf, 0], so it never
    # overflows to +inf (logits / T can: inf - inf = NaN in softmax). The max entries stay exactly
    # 0 even when T rounds to 0 in fp32 (0 / 0 would be NaN); entries that underflow to -inf give
    # the greedy limit, which is the right answer there.
    shifted = logits - row_max
    logits = torch.where(shifted == 0, 0.0, shifted / temperature)
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p; the top token stays
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if min_p > 0:  # logits are shifted so that each row's largest is 0: p / p_max = exp(logit)
        logits = logits.masked_fill(logits < math.log(min_p), float("-inf"))
    return logits.softmax(-1)


def _check_some_token_possible(row_max: torch.Tensor) -> None:
    """row_max [..., 1]: the largest logit of each row; -inf means every token is ruled out."""
    if (row_max == float("-inf")).any():
        raise ModelFault(RULED_OUT)


def greedy_rows(blocks: Sequence[torch.Tensor]) -> list[list[int] | ModelFault]:
    """`greedy_tokens` of several sequences' logits [n_i, V] at once, with one copy to the host
    (a batched step's argmaxes: on a GPU each sequence's own would wait for the device three
    times) -> per block its rows' tokens, or the ModelFault `greedy_tokens` would raise for it."""
    if not blocks:
        return []
    logits = torch.cat([block.float() for block in blocks])
    tokens = logits.argmax(-1)
    nan = torch.isnan(logits).any(-1)
    ruled_out = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) == float("-inf")
    rows = torch.stack([tokens, nan.long(), ruled_out.long()], -1).tolist()
    out: list[list[int] | ModelFault] = []
    start = 0
    for block in blocks:
        mine = rows[start:start + len(block)]
        start += len(block)
        if any(row[1] for row in mine):
            out.append(ModelFault(NAN_LOGITS))
        elif any(row[2] for row in mine):
            out.append(ModelFault(RULED_OUT))
        else:
            out.append([row[0] for row in mine])
    return out


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> argmax tokens [...] (long): the greedy sampler without building one-hot rows.

    Picks the same token as sampling from `logits_to_probs(logits, temperature=0)` (the first
    largest logit, +inf included), and raises the same SpecdecError on NaN or an all -inf row.
    """
    if torch.isnan(logits).any():
        raise ModelFault(NAN_LOGITS)
    logits = logits.float()
    tokens = logits.argmax(-1)
    _check_some_token_possible(logits.gather(-1, tokens.unsqueeze(-1)))
    return tokens


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one index from each distribution: probs [..., V] -> tokens [...] (long).

    Inverse-CDF sampling, batched over any leading dimensions; it never returns an index of
    probability 0. Rows need not be normalised, but every entry must be finite and >= 0 and each
    row's mass finite and positive: anything else raises SpecdecError (a NaN, inf or all-zero row
    has no distribution to sample; guessing an index would hide the bug upstream).
    """
    probs = probs.float()
    cdf = probs.cumsum(-1)
    total = cdf[..., -1:]
    # a NaN or inf entry makes the total NaN or inf; a negative entry may hide in a positive total
    if not bool(torch.isfinite(total).all()) or bool((probs < 0).any()):
        raise SpecdecError("cannot sample: probabilities must be finite and >= 0 (got NaN, inf or negative "
                           "entries, or a row whose mass overflows)")
    if not bool((total > 0).all()):
        raise SpecdecError("cannot sample: a row of probabilities is all zero (every token has probability 0)")
    u = torch.rand(total.shape, generator=generator, device=probs.device, dtype=torch.float32)
    idx = torch.searchsorted(cdf, u * total, right=True)
    # u * total can round up to total; fall back to the last index with positive mass
    positive = probs > 0
    last_positive = probs.shape[-1] - 1 - positive.flip(-1).int().argmax(-1, keepdim=True)
    return torch.minimum(idx, last_positive).squeeze(-1)


# ---------------------------------------------------------------------------------------------
# Seeded sampling by Gumbel-max coupling (Daliri, Musco and Suresh 2024). The token at sequence
# position s is argmax_x p(x) / E_s(x), E_s ~ Exp(1) i.i.d. per id, drawn from (seed, s) alone:
# that is argmax log p + Gumbel, an exact draw from p. Since the noise does not depend on what
# was drafted, a seeded output is the seeded AR output under every drafter, draft length, tree
# shape and batch; a drafter that proposes argmax q / E_s with the same noise is accepted with
# probability >= (1 - TV(p, q)) / (1 + TV(p, q)).

_MIX = 0x9E3779B97F4A7C15  # splitmix64's increment: (seed, position) -> one well-spread 64-bit seed
_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + _MIX) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


NOISE_BLOCK = 8192  # ids drawn from one generator: the race of id x depends on (seed, position, x) alone


def position_noise(seed: int, position: int, vocab: int) -> torch.Tensor:
    """The exponential races of sequence position `position` under `seed`: [V] fp64, i.i.d.
    Exp(1), on the CPU. The race of id x is a function of (seed, position, x) alone: the same on
    every device and for every vocabulary width (a drafter whose head is narrower than the
    target's races its ids as the target does)."""
    base = _splitmix64(_splitmix64(int(seed) & _MASK) ^ int(position))
    generator = torch.Generator()
    blocks = []
    for block in range(-(-vocab // NOISE_BLOCK)):
        generator.manual_seed(_splitmix64(base ^ block))
        blocks.append(torch.rand(min(NOISE_BLOCK, vocab - block * NOISE_BLOCK), generator=generator,
                                 dtype=torch.float64))
    uniform = torch.cat(blocks) if len(blocks) > 1 else blocks[0]
    return uniform.log_().neg_()  # U = 0 gives +inf: that id never wins a race


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The coupled draw: probs [..., V], noise [..., V] (`position_noise` rows) -> tokens [...]
    (long), argmax p / E. An exact sample from p when E is Exp(1) noise unseen by p; never an id
    of probability 0 (unless a row is all zero, which `sample` refuses too).

    Scored in fp32, the precision of p itself (fp64 scoring costs 10× here: ~1 ms a row of
    151,936 ids on a 2-core CPU): two scores within rounding of each other decide ties by id, a
    bias of order 1e-7 in each probability, as p's own rounding is."""
    probs = probs.float()
    if not bool((probs.sum(-1) > 0).all()):
        raise SpecdecError("cannot sample: a row of probabilities is all zero (every token has probability 0)")
    tokens = (probs / noise.to(probs.device, torch.float32)).argmax(-1)
    if bool((probs.gather(-1, tokens.unsqueeze(-1)) > 0).all()):
        return tokens
    # every id of positive p lost its race to 0 (E = +inf, odds ~2^-53 per id): keep to p's support
    scores = torch.where(probs > 0, probs / noise.to(probs.device, torch.float32), -1.0)
    return scores.argmax(-1)


class SeededNoise:
    """One sequence's shared noise: `rows(positions, V)` -> [n, V] fp32, kept while positions
    may be asked for again (the drafter and the target read the same rows in a step; a rejected
    draft's rows serve the next step). `forget(below)` drops the rows of committed positions."""

    def __init__(self, seed: int):
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise SpecdecError(f"seed must be an integer, got {seed!r}")
        self.seed = seed
        self._rows: dict[tuple[int, int], torch.Tensor] = {}

    def row(self, position: int, vocab: int) -> torch.Tensor:
        key = (position, vocab)
        if key not in self._rows:  # kept in fp32, as `race` scores
            self._rows[key] = position_noise(self.seed, position, vocab).float()
        return self._rows[key]

    def rows(self, positions, vocab: int) -> torch.Tensor:
        return torch.stack([self.row(int(s), vocab) for s in positions])

    def forget(self, below: int) -> None:
        for key in [k for k in self._rows if k[0] < below]:
            del self._rows[key]

    def draw(self, probs: torch.Tensor, position: int) -> int:
        """The coupled draw from probs [V] at sequence position `position`."""
        return int(race(probs, self.row(position, probs.shape[-1])))


class CoupledGenerator(torch.Generator):
    """A drafter's random source under a seed: an ordinary generator (for draws that no coupled
    token stands for, such as a tree's extra siblings) that also carries the sequence's shared
    noise, so that `draw` proposes each token as the target will choose its own."""

    def __new__(cls, noise: SeededNoise, seed: int, device: torch.device | str = "cpu"):
        generator = super().__new__(cls, device=device)
        generator.manual_seed(seed)
        generator.noise = noise
        return generator

    def __init__(self, *args, **kwargs):  # all done in __new__ (torch.Generator is a C type)
        pass


def draw(probs: torch.Tensor, generator: torch.Generator | None, position: int) -> int:
    """A drafter's draw from q = probs [V] for sequence position `position`: coupled with the
    target's own draw (`race` with the shared noise) under a seed, else `sample`."""
    if isinstance(generator, CoupledGenerator):
        return generator.noise.draw(probs, position)
    return int(sample(probs, generator))
