"""Draft-length schedules: how many tokens to draft at the next step.

A schedule gives a budget before each step (`budget`), may cut the draft short as it grows
(`keep_going`, fed the drafter's untempered logits for each drafted token), and learns from
the verification (`update`) and from how long the step took (`timing`). None of them touches
exactness: they only choose γ.
"""

from __future__ import annotations

import bisect
import math
from typing import Sequence

import torch

from ..errors import SpecdecError

SCHEDULES = ("fixed", "heuristic", "confidence", "egag", "cost")


def _check_gamma(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpecdecError(f"{name} must be an integer >= 1, got {value!r}")


class Schedule:
    """Fixed γ; the base of the others."""

    name = "fixed"

    def __init__(self, gamma: int = 5):
        _check_gamma("gamma", gamma)
        self.gamma = gamma

    def reset(self) -> None:
        """Called at the start of each generation."""

    def budget(self) -> int:
        """Most tokens to draft at this step."""
        return self.gamma

    def ceiling(self) -> int:
        """Most tokens it may ever ask to draft in one step (what a KV charge keeps room for)."""
        return self.gamma

    def keep_going(self, drafted: int, logits: torch.Tensor | None) -> bool:
        """After `drafted` tokens, whose last came from `logits` [V] (a float: the drafter's own
        estimate of its chance; None: no estimate)."""
        return True

    def update(self, drafted: int, accepted: int) -> None:
        """What the target kept of the step's draft."""

    def timing(self, draft_seconds: float, drafter_passes: int, verify_seconds: float, width: int,
               emitted: int) -> None:
        """How long the step took: drafting (`drafter_passes` drafter passes), then scoring,
        verifying and rolling back a target pass over `width` tokens; `emitted` tokens came out."""

    def step_info(self) -> dict:
        """Per-step values worth recording (e.g. EGAG's normalised entropy)."""
        return {}

    def describe(self) -> str:
        return f"fixed γ={self.gamma}"


class Fixed(Schedule):
    pass


class Heuristic(Schedule):
    """transformers' and llama.cpp's rule: γ += 2 after a fully accepted draft, else γ -= 1."""

    name = "heuristic"

    def __init__(self, gamma: int = 5, gamma_min: int = 1, gamma_max: int = 32):
        super().__init__(gamma)
        _check_range(gamma_min, gamma_max)
        if not gamma_min <= gamma <= gamma_max:  # else the first steps would draft outside the bounds
            raise SpecdecError(f"the heuristic schedule's starting gamma ({gamma}) must lie in "
                               f"[gamma_min, gamma_max] = [{gamma_min}, {gamma_max}]")
        self.initial, self.gamma_min, self.gamma_max = gamma, gamma_min, gamma_max

    def reset(self) -> None:
        self.gamma = self.initial

    def ceiling(self) -> int:
        return self.gamma_max

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        step = 2 if accepted == drafted else -1
        self.gamma = min(self.gamma_max, max(self.gamma_min, self.gamma + step))

    def describe(self) -> str:
        return f"heuristic γ₀={self.initial} in [{self.gamma_min}, {self.gamma_max}]"


class Confidence(Schedule):
    """Draft until the drafter's top probability falls below τ (that token still goes in), or γ_max."""

    name = "confidence"

    def __init__(self, threshold: float = 0.4, gamma_max: int = 20):
        _check_gamma("gamma_max", gamma_max)
        if not 0 <= threshold < 1:
            raise SpecdecError(f"confidence threshold must be in [0, 1), got {threshold!r}")
        super().__init__(gamma_max)
        self.threshold = threshold

    def keep_going(self, drafted: int, logits: torch.Tensor | None) -> bool:
        return logits is None or top_probability(logits) >= self.threshold

    def describe(self) -> str:
        return f"confidence τ={self.threshold:g}, γ_max={self.gamma}"


def top_probability(logits: torch.Tensor | float) -> float:
    """max softmax(logits): logits [V]; a float is a drafter's own estimate of the chance (`KeepGoing`)."""
    if isinstance(logits, float):
        return logits
    return float(logits.float().softmax(-1).max())


def normalized_entropy(logits: torch.Tensor) -> float:
    """H(softmax(logits)) / log V, in [0, 1]: logits [V]."""
    logp = logits.float().log_softmax(-1)
    entropy = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum()
    return float(entropy) / math.log(logits.shape[-1])


class EGAG(Schedule):
    """Entropy-guided adaptive γ: from the drafter's first distribution of the step,
    γ = clamp(round((1 − H_norm)·γ_max), γ_min, γ_max), with H_norm smoothed across steps by an
    EMA of weight β on the past (β = 0: no smoothing)."""

    name = "egag"

    def __init__(self, gamma_min: int = 1, gamma_max: int = 10, beta: float = 0.0):
        _check_range(gamma_min, gamma_max)
        if not 0 <= beta < 1:
            raise SpecdecError(f"EGAG's EMA weight beta must be in [0, 1), got {beta!r}")
        super().__init__(gamma_max)
        self.gamma_min, self.gamma_max, self.beta = gamma_min, gamma_max, beta
        self.reset()

    def reset(self) -> None:
        self.ema: float | None = None
        self.h_norm: float | None = None
        self.step_gamma = self.gamma_max

    def keep_going(self, drafted: int, logits: torch.Tensor | None) -> bool:
        if drafted == 1:
            h = normalized_entropy(logits) if isinstance(logits, torch.Tensor) else 0.0
            self.ema = h if self.ema is None or self.beta == 0 else self.beta * self.ema + (1 - self.beta) * h
            self.h_norm = self.ema
            self.step_gamma = min(self.gamma_max, max(self.gamma_min, round((1 - self.ema) * self.gamma_max)))
        return drafted < self.step_gamma

    def step_info(self) -> dict:
        return {"h_norm": self.h_norm, "gamma": self.step_gamma}

    def describe(self) -> str:
        return f"egag γ in [{self.gamma_min}, {self.gamma_max}], β={self.beta:g}"


class AssumedCosts:
    """A machine's pass costs taken as given instead of timed: a target pass over w tokens costs
    1 + slope·(w − 1) one-token passes, a drafter pass `drafter` of one (c).

    A cost-aware policy given these (`CostAware(assumed=...)`) sizes its drafts as it would on
    that machine: the timings it learns from are these costs, not the wall clock. That is how a
    run here sizes drafts and trees for a machine where wide passes are nearly free (a GPU; a CPU
    with AMX), to measure their tokens per pass and project their speed there (bench's `-flat`
    methods; `projected_speedup` prices a run's steps there); here they are then slower.
    """

    def __init__(self, drafter: float, slope: float):
        if not (drafter >= 0 and slope >= 0 and math.isfinite(drafter) and math.isfinite(slope)):
            raise SpecdecError(f"assumed costs must be finite and >= 0, got drafter {drafter!r}, slope {slope!r}")
        self.drafter, self.slope = float(drafter), float(slope)

    @classmethod
    def flat(cls, drafter: float, at16: float = 1.2) -> "AssumedCosts":
        """The nearly-free curve of `theory.flat_verification`: scoring 16 drafted tokens (plus the
        pending one) costs `at16` one-token passes (1.2: a GPU at batch 1)."""
        if not at16 >= 1:
            raise SpecdecError(f"a wide pass cannot cost less than a 1-token one, got at16={at16!r}")
        return cls(drafter, (at16 - 1) / 16)

    def seconds(self, drafter_passes: int, width: int) -> tuple[float, float]:
        """(drafting, verification) of a step, in one-token target passes."""
        return self.drafter * drafter_passes, 1.0 + self.slope * (width - 1)

    def to_dict(self) -> dict:
        return {"drafter": self.drafter, "slope": self.slope, "at16": 1.0 + 16 * self.slope}

    def projected_speedup(self, new_tokens: int, widths: Sequence[int], drafter_passes: Sequence[int],
                          one_token_passes: int = 0, generations: int = 1) -> float:
        """The speedup over AR a measured speculative generation would have on this machine: its
        new_tokens over its steps priced by `seconds` (`GenerationStats.widths_per_step`,
        `drafter_passes_per_step`) plus `one_token_passes` target passes outside the steps (the
        first token's, under `first_target`). Prompt passes are left out on both sides: AR makes
        one token per one-token pass, and the drafter's first pass (its prompt) is not counted,
        one per generation where `generations` were joined (the bench's `merge_samples`)."""
        if len(widths) != len(drafter_passes) or new_tokens < 1 or one_token_passes < 0 or \
                not widths and not one_token_passes:
            raise SpecdecError(f"projected_speedup needs one width and drafter pass count per step and tokens >= 1, "
                               f"got {len(widths)} widths, {len(drafter_passes)} pass counts, {new_tokens!r} tokens")
        prompt = generations if any(drafter_passes) else 0
        steps = sum(sum(self.seconds(passes, width)) for width, passes in zip(widths, drafter_passes))
        return new_tokens / (steps - self.drafter * prompt + one_token_passes)


class Prober:
    """Take the option measured faster, probing the other now and then: after a choice, the other
    is tried on the `wait`-th decision, then after twice as many, and so on (up to 64·`probe`),
    back to `wait` whenever the measured choice flips. A probe that loses costs one step, so their
    number grows as the log of a generation's length."""

    def __init__(self, probe: int):
        self.probe = probe
        self.reset()

    def reset(self) -> None:
        self.choice: bool | None = None
        self.since = self.interval = 0

    def decide(self, better: bool, wait: int) -> bool:
        """`better`: what the measurements say; `wait`: the first probe's distance for that choice."""
        if better != self.choice:
            self.choice, self.since, self.interval = better, 0, wait
        self.since += 1
        if self.since < self.interval:
            return better
        self.since, self.interval = 0, min(2 * self.interval, 64 * self.probe)
        return not better


class FasterOf:
    """A choice between two kinds of step, by measurement: the first kind until `warmup` of its
    steps are timed, then one step of the other as a baseline, then whichever has made more
    tokens per second, probing the other (`Prober`; `waits[first]`: the first probe's distance
    while that kind is the choice).

    Both kinds' sums decay by `decay` at every timed step, of either kind. A kind's rate is a
    ratio of its sums, so decay alone leaves it; but a kind left for a while is then judged by
    its next probe more than by its old record (docs/methods.md#the-cost-aware-schedule-default)."""

    def __init__(self, warmup: int, probe: int, decay: float, waits: dict[bool, int]):
        self.warmup, self.decay, self.waits = warmup, decay, waits
        self.prober = Prober(probe)
        self.reset()

    def reset(self) -> None:
        self.sums = {True: [0.0, 0.0, 0], False: [0.0, 0.0, 0]}  # by kind (True: the first): tokens, seconds, steps
        self.prober.reset()

    def record(self, first: bool, tokens: int, seconds: float) -> None:
        for sums in self.sums.values():
            sums[0] *= self.decay
            sums[1] *= self.decay
        sums = self.sums[first]
        sums[0] += tokens
        sums[1] += seconds
        sums[2] += 1

    def steps(self, first: bool) -> int:
        return self.sums[first][2]

    def rate(self, first: bool, charge: float = 0.0) -> float:
        """A kind's tokens per second; `charge`: seconds a token the first kind costs beyond its
        steps' own time (an amortized cost, such as the engine's drafter catch-up on prompts)."""
        tokens, seconds, _ = self.sums[first]
        seconds += tokens * charge if first else 0.0
        return tokens / seconds if seconds > 0 else 0.0

    def choose(self, charge: float = 0.0) -> bool:
        """True: take a step of the first kind (its tokens charged `charge` seconds each, `rate`)."""
        if self.steps(True) < self.warmup:  # also: never timed (sampling under a seed)
            return True
        if self.steps(False) == 0:
            return False  # the baseline
        better = self.rate(True, charge) >= self.rate(False)
        return self.prober.decide(better, self.waits[better])


class WidthFit:
    """Least-squares fit of a pass's seconds over its width (rows), t ≈ base + slope·w, from
    (width, seconds) samples, older ones weighed down by `decay` each sample (1: all alike). The
    one fit of pass costs: a sequence's cost-aware schedule and the engine's batch policy use it."""

    def __init__(self, decay: float = 1.0):
        self.decay = decay
        self._sums = [0.0] * 5  # n, Σw, Σw², Σt, Σw·t

    @property
    def samples(self) -> float:
        """The (decayed) number of samples."""
        return self._sums[0]

    def add(self, width: float, seconds: float) -> None:
        for i, value in enumerate((1.0, width, width * width, seconds, width * seconds)):
            self._sums[i] = self._sums[i] * self.decay + value

    def mean(self) -> float | None:
        """The (decayed) mean seconds of the samples, whatever their widths; None before any."""
        n, _, _, st, _ = self._sums
        return st / n if n > 0 else None

    def fit(self) -> tuple[float, float] | None:
        """(slope, base): seconds per extra row (never below 0) and of a zero-row pass; None until
        the widths have varied enough to fit."""
        n, sw, sww, st, swt = self._sums
        spread = n * sww - sw * sw
        if n <= 0 or spread < 0.25 * n * n:
            return None
        slope = max(0.0, (n * swt - sw * st) / spread)
        return slope, (st - slope * sw) / n


class CostAware(Schedule):
    """Draft while the draft so far is likely enough to survive to pay for one more token.

    After k draft tokens, P_k = Π (drafter's top probability at each) estimates the chance the
    target keeps all k. One more token adds at most P_k expected tokens and costs t_d + t_v
    seconds (t_d: a drafter pass; t_v: the extra verification time per draft token, the slope of
    the target pass's time over its width). It pays while P_k·(1/(t_d + t_v)) beats the rate R
    (tokens per second) this generation already makes, or plain decoding's 1/t(1-token pass) if
    that is higher, so drafting stops once P_k < θ = R·(t_d + t_v).
    All three are measured as the generation runs, so θ follows the hardware: on a CPU where a
    drafter pass is a quarter of a target pass θ comes out around 0.3–0.6; where drafting is cheap it
    falls and drafts grow. Until `warmup` steps with different widths are timed, θ = `threshold`.

    A drafter without a distribution (prompt lookup: logits None) gives no top probability, so
    each of its tokens counts with this generation's acceptance rate so far, (accepted + 1) /
    (drafted + 2): a lookup draft that keeps being rejected shrinks to one token a step instead
    of running to γ_max.

    Drafting nothing, measured rather than modelled: the linear cost model above misprices the
    jump from a 1-token to a 2-token pass (on some kernels far more than 1 + slope:
    docs/kernels.md#row-exact-passes), which is what decides whether a step should draft at all.
    So after `warmup` timed steps that drafted, the policy takes one step without a draft
    (`budget` 0) as a baseline, and from then on compares the measured tokens per second of steps
    that drafted against steps that did not (`FasterOf`: sums decayed by `decay` per step) and
    does what has been faster (`should_draft`). To notice a change in the text it probes the other
    kind `probe` decisions after a choice (4·`probe` when drafting wins, a plain step being the
    dearer probe there), then after twice as many, and so on (up to 64·`probe`), back to the base
    wait whenever the choice flips. Until `warmup` steps are timed
    (and always when sampling under a seed, which gets no timings), the thresholds are the
    priors and every step drafts.
    """

    name = "cost"

    def __init__(self, gamma_max: int = 32, threshold: float = 0.5, warmup: int = 3, probe: int = 8,
                 decay: float = 0.9, pass_costs=None, assumed: AssumedCosts | None = None):
        """pass_costs: a `pass_costs.PassCosts` profile of this target and drafter on this machine, or
        None. For a model-free drafter θ starts at its price of one more row, (t(2) − t(1)) / t(1).
        Where it shows that no draft would beat plain decoding by 10% even if accepted in full
        (`never_pays`), the schedule drafts nothing at all, so neither the drafting steps it would
        learn from nor the drafter's prompt pass are paid. (Keep it None under sampling with a seed: a profile
        is a timing, and a seed pins the output only where no timing steers the draft lengths.)
        assumed: size drafts for these costs instead of the measured ones (`AssumedCosts`)."""
        _check_gamma("gamma_max", gamma_max)
        _check_gamma("probe", probe)
        if not 0 < threshold < 1:
            raise SpecdecError(f"the cost schedule's starting threshold must be in (0, 1), got {threshold!r}")
        if not 0 < decay <= 1:
            raise SpecdecError(f"decay must be in (0, 1], got {decay!r}")
        super().__init__(gamma_max)
        self.prior, self.warmup, self.probe, self.decay = threshold, warmup, probe, decay
        if pass_costs is not None and pass_costs.drafter == 0 and 2 in pass_costs.target and assumed is None:
            # a model-free drafter drafts now and then, so its widths may never vary enough to
            # fit the slope: θ starts at what the profile says one more row costs, R·t_v with R
            # plain decoding's rate, instead of staying at the guess
            one, two = pass_costs.target[1], pass_costs.target[2]
            self.prior = min(0.99, max(0.01, (two - one) / one))
        self.pass_costs, self.assumed = pass_costs, assumed
        self.never_pays = pass_costs is not None and pass_costs.never_pays() and assumed is None
        self.one_pass = 0  # tokens a drafter pass proposes where more than one (a parallel drafter's k; set by the loop)
        self.reset()

    def reset(self) -> None:
        self.threshold = self.prior
        self.survival = 1.0
        self.tokens = self.seconds = self.draft_seconds = 0.0
        self.passes = 0
        self.drafted = self.accepted = 0
        self._widths = WidthFit()  # verify seconds over width
        self.measured: tuple[float, float, float, float] | None = None  # rate, drafter pass, slope, 1-token pass
        # draft or not; a plain probe costs more where drafting wins, so it waits longer
        self.kinds = FasterOf(self.warmup, self.probe, self.decay, {True: 4 * self.probe, False: self.probe})
        self.timed_steps = 0
        self.imposed: bool | None = None  # the engine's decision for this step (`impose`), if any
        self.most: int | None = None  # the engine's longest draft for this step (`impose`), if any

    def budget(self) -> int:
        return self.longest if self.should_draft() else 0

    @property
    def longest(self) -> int:
        """The longest draft this step: `gamma`, or the engine's cap where it imposes one."""
        return min(self.gamma, self.most) if self.most is not None else self.gamma

    def should_draft(self) -> bool:
        """Whether this step should draft at all (see the class docstring)."""
        if self.imposed is not None:
            return not self.never_pays and self.imposed
        return not self.never_pays and self.kinds.choose()

    def impose(self, draft: bool, costs: tuple[float, float, float, float] | None, most: int | None = None) -> None:
        """For this step, the engine's batch-level decision and costs (sizing/batch_policy.py) replace
        what this generation measured alone (its timings are of passes it shared): whether to
        draft, (R, t_d, t_v, t_1) as `measured` holds them, or None for the starting thresholds,
        and the longest draft (None: `gamma`)."""
        self.imposed, self.most = draft, most
        if costs is None:
            self.threshold, self.measured = self.prior, None
        else:
            rate, per_pass, slope, _ = costs
            self.threshold, self.measured = min(0.99, rate * (per_pass + slope)), costs

    def keep_going(self, drafted: int, logits: torch.Tensor | float | None) -> bool:
        if drafted == 0:  # before the first token: it alone must pay for its row
            return logits is None or top_probability(logits) >= self.threshold
        if drafted == 1:
            self.survival = 1.0
        if logits is not None:
            self.survival *= top_probability(logits)
        else:
            self.survival *= (self.accepted + 1) / (self.drafted + 2)
        return self.survival >= self.token_threshold(drafted)

    def token_threshold(self, drafted: int) -> float:
        """θ for token drafted + 1. A drafter that proposes `one_pass` tokens a pass (a parallel
        drafter's k) pays a drafter pass only with the first token of each pass; inside a pass a
        token costs its verification row alone: θ = R·t_v once measured."""
        if not self.one_pass or drafted % self.one_pass == 0 or self.measured is None:
            return self.threshold
        rate, _, slope, _ = self.measured
        return min(0.99, rate * slope)

    def update(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted

    def timing(self, draft_seconds: float, drafter_passes: int, verify_seconds: float, width: int,
               emitted: int) -> None:
        draft_seconds, verify_seconds = self.step_seconds(draft_seconds, drafter_passes, verify_seconds, width)
        self.timed_steps += 1
        if self.timed_steps > 1:  # the first step's time holds the prompt's passes
            self.kinds.record(width > 1, emitted, draft_seconds + verify_seconds)
        self.tokens += emitted
        self.seconds += draft_seconds + verify_seconds
        if self._widths.samples > 0:  # the first step's drafting includes the drafter's prompt pass: not a drafter pass
            self.draft_seconds += draft_seconds
            self.passes += drafter_passes
        self._widths.add(width, verify_seconds)
        if self._widths.samples < self.warmup or self.seconds <= 0:
            return
        if self.assumed is not None:  # known: no fit, so also where the widths never vary
            slope, one_token_pass, per_pass = self.assumed.slope, 1.0, self.assumed.drafter
        else:
            fitted = self._widths.fit()
            if fitted is None:  # widths must vary
                return
            slope, base = fitted  # least-squares seconds per extra scored token
            one_token_pass = base + slope
            per_pass = self.draft_seconds / self.passes if self.passes else 0.0
        # the best rate is at least plain decoding's (drafting nothing): a poor start must not
        # lower the bar and draw out ever longer drafts
        rate = max(self.tokens / self.seconds, 1 / one_token_pass if one_token_pass > 0 else 0.0)
        self.threshold = min(0.99, rate * (per_pass + slope))
        self.measured = (rate, per_pass, slope, one_token_pass)

    def step_seconds(self, draft_seconds: float, drafter_passes: int, verify_seconds: float,
                     width: int) -> tuple[float, float]:
        """A step's (drafting, verification) time as the policy counts it: as measured, or as
        `assumed` prices it."""
        if self.assumed is None:
            return draft_seconds, verify_seconds
        return self.assumed.seconds(drafter_passes, width)

    def step_info(self) -> dict:
        return {"threshold": self.threshold}

    def describe(self) -> str:
        if self.never_pays:
            return (f"cost-aware: drafts nothing, drafting cannot pay on this machine (a draft accepted in "
                    f"full would make {self.pass_costs.best_speedup():.2f}x plain decoding, by measured pass costs)")
        return f"cost-aware (θ {self._costs_said()}, starts at {self.prior:g}), γ_max={self.gamma}"

    def _costs_said(self) -> str:
        if self.assumed is None:
            return "measured"
        return (f"from assumed costs: drafter pass {self.assumed.drafter:.2f}, 16 drafted tokens "
                f"{1 + 16 * self.assumed.slope:.2f} one-token passes")


class Calibration:
    """How often a drafted token is accepted, measured against the drafter's q of it.

    A node of a deterministic tree whose parent was accepted is accepted with the target's
    (sampled) p of its token: q estimates that only when the drafter is calibrated, and a
    drafter trained on little text (the heads and EAGLE layers trained here) is not. (A chain
    token sampled from q, as the sides and mixed trees draw theirs under sampling, is accepted
    with min(1, p/q) instead; those trees count it in the bin of the drafter's top probability at
    its position, which predicts that better than its own q: `SidesDrafter`.) So every such node
    verified is counted in a bin of q (`EDGES`), and the estimate for a q is the bin's acceptance
    rate shrunk towards q itself by `strength` pseudo-counts: (hits + strength·q) / (tries +
    strength), raised where needed to what the lower bins give at their upper edges, so that it
    never falls as q grows (siblings keep their rank order by value). Before any count it is q,
    as without calibration.
    """

    EDGES = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # inner bin edges over q in [0, 1]

    def __init__(self, strength: float = 8.0):
        if not strength > 0:
            raise SpecdecError(f"calibration strength must be > 0, got {strength!r}")
        self.strength = strength
        self.reset()

    def reset(self) -> None:
        bins = len(self.EDGES) + 1
        self.tries, self.hits = [0] * bins, [0] * bins
        self._floor = [0.0] * bins  # the most any lower bin gives

    def record(self, q: float, accepted: bool) -> None:
        b = bisect.bisect_right(self.EDGES, q)
        self.tries[b] += 1
        self.hits[b] += int(accepted)
        top = 0.0
        for lower, high in enumerate(self.EDGES):
            top = max(top, self._estimate(lower, high))
            self._floor[lower + 1] = top

    def _estimate(self, b: int, q: float) -> float:
        return (self.hits[b] + self.strength * q) / (self.tries[b] + self.strength)

    def __call__(self, q: float) -> float:
        """The estimated chance that a node with drafter probability q is accepted, given its parent was."""
        b = bisect.bisect_right(self.EDGES, q)
        return max(self._floor[b], self._estimate(b, q))

    def table(self) -> list[tuple[float, float, int, int]]:
        """(low, high, tries, hits) per bin of q."""
        edges = (0.0, *self.EDGES, 1.0)
        return [(edges[b], edges[b + 1], self.tries[b], self.hits[b]) for b in range(len(self.tries))]


def tried_nodes(parents: Sequence[int], path: Sequence[int]) -> list[tuple[int, bool]]:
    """The nodes verification tried, (index, accepted): the root's children and those of every
    accepted node (a tree's `parents`, the accepted `path` of node indices)."""
    on_path = set(path)
    return [(i, i in on_path) for i, parent in enumerate(parents) if parent < 0 or parent in on_path]


class TreeCost(CostAware):
    """The cost-aware rule for token trees: how deep to draft the chain, which other nodes to add,
    and whether to draft at all.

    A node whose path value v (the drafter's estimate that it lies on the accepted path) is
    added pays for itself when v / t_v > R: v expected tokens for the extra verification width
    t_v (the measured slope of the target pass's time over its width) against the rate R this
    generation makes. So nodes join in falling value while v >= R·t_v (`node_threshold`); a
    chain token, which also costs a drafter pass t_d, while v >= R·(t_d + t_v) (`threshold`,
    as in CostAware). Where wide passes are expensive the tree stays small; where they are
    nearly free (a GPU, AMX) it grows to `max_nodes`.

    Whether to draft at all is measured as in CostAware (`should_draft`); the tree drafters ask it.
    Drafters value their nodes by `acceptance(q)`: the acceptance measured so far at the drafter's
    q in this generation (`calibrated`, fed by `record_tree`): every node of the deterministic
    trees (EAGLE-2, Medusa, EAGLE), and the model chain of the sides and mixed trees, whose
    growth stops on those values too.
    """

    name = "tree-cost"

    def __init__(self, max_depth: int = 5, max_nodes: int = 64, threshold: float = 0.5,
                 node_threshold: float = 0.2, warmup: int = 3, probe: int = 8, decay: float = 0.9,
                 calibrate: bool = True, assumed: AssumedCosts | None = None):
        _check_gamma("max_nodes", max_nodes)
        if not 0 < node_threshold < 1:
            raise SpecdecError(f"the tree's starting node threshold must be in (0, 1), got {node_threshold!r}")
        self.max_nodes, self.node_prior, self.calibrate = max_nodes, node_threshold, calibrate
        self.calibrated = Calibration()
        super().__init__(max_depth, threshold, warmup, probe, decay, assumed=assumed)

    def reset(self) -> None:
        super().reset()
        self.calibrated.reset()

    def budget(self) -> int:
        """The tree's depth bound (`max_depth`, or the engine's longest draft for this step where
        it imposes one: a batch's drafter rounds run in lock step, one a level). Whether to draft
        at all the tree drafter asks (`should_draft`) once a step as it grows, since its decision
        also picks what it grows."""
        return self.longest

    def record_tree(self, q: Sequence[float], parents: Sequence[int], path: Sequence[int]) -> None:
        """After verifying a tree: each node's drafter probability `q` (given its parent; None: a
        node not to count), the tree's `parents` and the accepted `path`; counts the tried nodes."""
        for i, accepted in tried_nodes(parents, path):
            if q[i] is not None:
                self.calibrated.record(q[i], accepted)

    def acceptance(self, q: float) -> float:
        """A node's chance of acceptance given its parent's, from the drafter's q of its token:
        `calibrated` q, or q itself for a policy built with calibrate=False."""
        return self.calibrated(q) if self.calibrate else q

    @property
    def node_threshold(self) -> float:
        if self.measured is None:
            return self.node_prior
        rate, _, slope, _ = self.measured
        return min(0.99, rate * slope)

    def describe(self) -> str:
        values = "calibrated" if self.calibrate else "the drafter's q"
        return f"tree cost-aware (thresholds {self._costs_said()}, node values {values}), depth <= {self.gamma}, " \
               f"nodes <= {self.max_nodes}"


def _check_range(gamma_min, gamma_max) -> None:
    _check_gamma("gamma_min", gamma_min)
    _check_gamma("gamma_max", gamma_max)
    if gamma_min > gamma_max:
        raise SpecdecError(f"gamma_min ({gamma_min}) must not exceed gamma_max ({gamma_max})")


def make_schedule(name: str = "fixed", gamma: int = 5, gamma_min: int = 1, gamma_max: int | None = None,
                  beta: float = 0.0, confidence: float = 0.4, pass_costs=None,
                  assumed: AssumedCosts | None = None) -> Schedule:
    """A schedule by name: fixed (gamma), heuristic (starts at gamma, in [gamma_min, gamma_max]),
    confidence (threshold `confidence`, up to gamma_max), egag (gamma_min, gamma_max, beta),
    cost (measured costs, up to gamma_max; `pass_costs`, `assumed`: see CostAware). gamma_max
    None: 10, but egag's is gamma (the EGAG code's `gamma_max=None` -> γ)."""
    if gamma_max is None:
        gamma_max = gamma if name == "egag" else 10
    if name == "fixed":
        return Fixed(gamma)
    if name == "heuristic":
        return Heuristic(gamma, gamma_min, gamma_max)
    if name == "confidence":
        return Confidence(confidence, gamma_max)
    if name == "egag":
        return EGAG(gamma_min, gamma_max, beta)
    if name == "cost":
        return CostAware(gamma_max, pass_costs=pass_costs, assumed=assumed)
    raise SpecdecError(f"unknown schedule '{name}'; choose from {', '.join(SCHEDULES)}")
