"""Speculation under load: what one more draft token is worth when many sequences share a pass.

Alone, the cost-aware rule (`schedules.CostAware`) drafts a token while its chance of surviving,
P_k, pays for its cost at the rate the generation makes: P_k >= R·(t_d + t_v). In a batch every
term is the batch's: R is the committed tokens per second of the whole batch (goodput), t_v the
time one more row adds to the shared target pass at its current width, t_d a drafted row's share
of a lock-step drafter round over a row of each sequence (the drafter's passes are batched too).
As the batch grows, R grows faster than the pass's cost, so the bar rises and drafts shrink;
where no draft pays, the measured comparison of steps that drafted with steps that did not
(`FasterOf`, kept per batch size) stops drafting altogether. All of it is learned from the
engine's own steps.

A drafter model that sat out plain steps must first catch up on their tokens (and on its
sequence's prompt, the first time), a pass over all of them: under load, where plain steps win,
a probe of drafting pays that for every sequence in the batch, seconds on a CPU. So catch-up is
timed apart (steps that drafted are rated without it) and charged to the switch: drafting that
has been faster resumes when its catch-up, at the measured seconds per token, costs less than it
would save over the batch's remaining tokens; a probe of drafting that has been losing waits
until its catch-up costs at most `probe_share` of the plain steps' time since drafting last ran,
and (given the machine's profile, below) at most what the best draft could save in the tokens left.

But a new sequence's first catch-up, on its whole prompt, is not a switch: drafting demands it of
every request. So the choice between the kinds charges drafting its share, amortized: the
seconds new sequences' drafters took to catch up with their contexts over the tokens those
sequences then had left to make (`prompt_charge`, decayed over joins); without it drafting won
its steps and lost the run (docs/engine.md#speculation-under-load).

Only sequences whose output cannot depend on draft lengths are steered: greedy ones, and sampled
ones, seeded or not (a seed couples each token to noise of its position: `samplers.SeededNoise`).
A sequence seeded under `seed_rule="stream"` drafts as it would alone, so that its output is the
same seed's run alone.

Smaller batches gain more from drafting (a pass over a few rows costs about what one row does),
so a batch size met for the first time, as sequences end and the batch shrinks, is not left to
the record of a larger one where drafting lost: the costs measured so far predict the drafting
rate at that size (`predict`: the target pass's fit over width, the drafter's per round, the
tokens a drafting step commits per sequence), and where the prediction beats plain decoding the
size drafts until its own steps have measured it. The prediction also values the catch-up of a
switch to drafting there.

Learning that drafting loses costs drafting steps; at a batch size where no draft can pay that
is all loss (docs/engine.md#speculation-under-load). So given the machine's batched pass costs
(`pass_costs.LoadCosts`, measured once per pair), a batch size drafts only where they say that
drafting could beat plain steps by 10% at the acceptance seen so far (before any,
`ACCEPTANCE_PRIOR`; by 30% in a step whose pass also feeds prompts, which is never timed:
`FEEDING_WORTH`), or where its own steps have shown drafting faster: elsewhere it takes plain
steps from the first, with no warm-up and no probes. The profile is a best case (the best draft
length, no overheads), so where it says no, measuring would only confirm it; where it says yes,
the steps decide as above; the catch-up the sequences would pay first is spread over the tokens
they have left and counted in that best case. (The
acceptance measured fades back toward the prior while no step
drafts, so a size ruled out at a low acceptance is tried again after a long run of plain steps.) The
profile also prices a catch-up before the drafter's own is measured (its pass over 64 tokens),
and where drafting is not yet compared with plain steps at a size, a warm-up, or a sequence
joining it, whose catch-up costs more than the profile's best case would save over the tokens
left, waits (a warm-up at the tail of a run would catch drafters up on whole prompts to draft a
few tokens each).
"""

from __future__ import annotations

from collections.abc import Sequence

from .pass_costs import WORTH, LoadCosts
from .schedules import CostAware, FasterOf, WidthFit

# The acceptance assumed before any drafting step is measured: about the best a drafter model of
# the target's family reaches (the 0.5B drafter of the 1.5B target: 0.83-0.88 in docs/engine.md),
# so that only sizes where even a good drafter could not pay are ruled out unseen. It weighs as
# PRIOR_TOKENS drafted tokens: one short first draft does not rule a size out.
ACCEPTANCE_PRIOR = 0.8
PRIOR_TOKENS = 16
JOIN_DECAY = 0.95  # per join: the prompt charge follows about the last 20 requests that joined drafting
# The least best case, by the profile, for drafting in a step whose pass also feeds prompts, where
# drafting has not been the faster kind at that size: such steps are never timed, so no measurement
# corrects a wrong start there. Set from one machine's profile (a 2-core AMX Xeon: best cases 1.25x
# at 8 sequences, where drafting started in those steps lost, and ~1.4x at 4, where it paid;
# docs/engine.md#speculation-under-load).
FEEDING_WORTH = 1.3


class BatchCosts:
    """The engine's measured step costs, and per batch size whether drafting pays.

    warmup, probe, decay: as `CostAware`'s (the first `warmup` steps at a batch size draft, one
    plain step follows as a baseline, then the faster kind, probed now and then; sums decay by
    `decay` a step so the costs follow the batch's current width).
    probe_share: the most a losing probe's drafter catch-up may cost, as a share of the plain
    steps' time since the last drafting step.
    prior: the machine's batched pass costs with the requests' drafter (`pass_costs.load_costs`):
    batch sizes where they say drafting cannot pay take plain steps unmeasured; None: every size
    is learned from its own steps.
    """

    def __init__(self, warmup: int = 3, probe: int = 8, decay: float = 0.9, probe_share: float = 0.1,
                 prior: LoadCosts | None = None):
        self.warmup, self.probe, self.decay, self.probe_share = warmup, probe, decay, probe_share
        self.prior = prior
        self.ruled_out = 0  # steps the prior kept plain
        self.kinds: dict[int, FasterOf] = {}  # batch size -> drafting steps vs plain steps
        self._fit = WidthFit(decay)  # target seconds over pass width, older steps decayed
        self._draft = [0.0, 0.0]  # decayed drafter rows, drafting seconds
        self._rounds = WidthFit(decay)  # drafter seconds per lock-step round over its rows
        self._drafting = [0.0] * 5  # decayed over drafting steps: steps, sequences, tokens, rows, rounds
        # drafting steps' sequences, tokens and rows, decayed at every step (of either kind): the
        # acceptance they show fades back to the prior while no step drafts, so no size is ruled out for good
        self._accepting = [0.0] * 3
        self._measured: set[int] = set()  # batch sizes with drafting steps of their own
        self._catch_up = [0, 0.0]  # tokens drafters caught up on, seconds
        self.plain_seconds = 0.0  # spent in plain steps since the last drafting step
        self.deferred = 0  # steps that would have drafted but for their catch-up's cost
        self._put_off: set[int] = set()  # batch sizes whose switch to drafting waits for its catch-up
        self._joins = [0.0, 0.0]  # decayed over joins: context tokens new drafters caught up on, tokens then left

    def speculate(self, batch: int, lag: int = 0, remaining: int = 0, feeding: bool = False) -> bool:
        """Whether this step's steered sequences should draft, at `batch` running sequences whose
        drafters lack `lag` tokens of their contexts in all, with `remaining` tokens left to make;
        `feeding`: prompts' chunks ride in the step's pass."""
        # the profile's best case, its drafters' catch-up spread over the tokens they have left;
        # a step that feeds prompts is never timed (`record`), so drafting there needs a wider margin
        ahead = self.catch_up_seconds(lag) / remaining if remaining > 0 else 0.0
        margin = FEEDING_WORTH if feeding else WORTH
        if self.prior is not None and not self.prior.may_pay(batch, self.acceptance(), ahead, margin) and \
                not self._won(batch):
            self.ruled_out += 1
            return False
        kinds = self._kinds(batch)
        cost, charge = self.catch_up_seconds(lag), self.prompt_charge()
        predicted = self.predict(batch) if batch not in self._measured else None
        if predicted is not None and _charged(predicted[0], charge) > predicted[1]:  # a size not tried, where drafting should win
            drafting, plain = predicted
            if cost > _saved(remaining, drafting, plain):
                self.deferred += 1
                return False
            self.kinds[batch] = self._fresh()  # measured by its own steps from here
            return True
        # a switch to drafting put off for its catch-up is due as soon as it is cheap enough
        draft = batch in self._put_off or kinds.choose(charge)
        if draft and cost > 0 and kinds.steps(False) == 0 and cost > self._prior_saved(batch, remaining):
            self.deferred += 1  # a warm-up not worth its catch-up, by the profile
            return False
        if not draft or cost == 0 or kinds.steps(False) == 0:
            self._put_off.discard(batch)
            return draft
        # the catch-up paid now is weighed against the steps' own rates (the prompts' share is in the choice)
        drafting, plain = kinds.rate(True), kinds.rate(False)
        if kinds.rate(True, charge) < plain:  # a probe: never worth more than drafting could save in the tokens left
            worth = min(self.probe_share * self.plain_seconds, self._prior_saved(batch, remaining))
        else:
            worth = _saved(remaining, drafting, plain) if plain > 0 else float("inf")
        if cost > worth:
            self._put_off.add(batch)
            self.deferred += 1
            return False
        self._put_off.discard(batch)
        return True

    def _won(self, batch: int) -> bool:
        """Whether drafting steps at `batch` have been faster than plain ones there."""
        kinds = self.kinds.get(batch)
        return batch in self._measured and kinds is not None and kinds.steps(False) > 0 and \
            kinds.rate(True, self.prompt_charge()) >= kinds.rate(False)

    def acceptance(self) -> float:
        """The chance a draft token is kept, as drafting steps show it (decayed at every step):
        the larger of accepted / drafted rows (a chain's rate) and 1 − 1/(tokens a sequence per
        step), which a chain of any length with that acceptance reaches at most (a tree's rows
        include rejected siblings; this bound does not), averaged with `ACCEPTANCE_PRIOR` weighing
        as `PRIOR_TOKENS` drafted tokens."""
        sequences, tokens, rows = self._accepting
        drafted = rows - sequences
        if drafted <= 0:
            return ACCEPTANCE_PRIOR
        chain = (tokens - sequences) / drafted
        measured = min(0.99, max(chain, 1 - sequences / tokens if tokens > 0 else 0.0))
        return (measured * drafted + ACCEPTANCE_PRIOR * PRIOR_TOKENS) / (drafted + PRIOR_TOKENS)

    def repays_catch_up(self, batch: int, lag: int, remaining: int) -> bool:
        """Whether one sequence, in a step where the batch drafts, should draft too: where drafting
        has been the faster kind at `batch`, only if catching its drafter up on the `lag` tokens it
        lacks (a new sequence: its whole prompt) costs less than drafting saves over its
        `remaining` tokens; where the kinds are not compared at `batch` yet, only if it costs less
        than the profile's best case would save (`prior`; none: it drafts). Otherwise (a probe, or
        nothing to catch up) it drafts with the batch."""
        cost = self.catch_up_seconds(lag)
        kinds = self._kinds(batch)
        drafting, plain = kinds.rate(True), kinds.rate(False)
        if cost > 0 and (kinds.steps(False) == 0 or plain <= 0):  # not measured here: the profile's word
            return cost <= self._prior_saved(batch, remaining)
        if cost == 0 or drafting <= plain:
            return True
        return cost <= self._joining_saves(remaining, drafting)

    def _joining_saves(self, remaining: int, drafting: float) -> float:
        """Seconds one sequence saves the batch by drafting with it over its `remaining` tokens,
        where the batch drafts at `drafting` tokens a second: sitting out, it makes one token a
        drafting step; drafting, E (the tokens a sequence a drafting step), so its slot is free
        remaining·(1 − 1/E) steps sooner, each worth E / `drafting` seconds of the batch's time.
        (Not the batch's plain rate against its drafting one: a drafting step is as long with the
        sequence sitting out, whose alternative is one token of such a step, not a plain step.)"""
        sequences, tokens = self._drafting[1], self._drafting[2]
        per_sequence = tokens / sequences if sequences > 0 else 1.0
        return remaining * max(0.0, per_sequence - 1) / drafting

    def _prior_saved(self, batch: int, remaining: int) -> float:
        """Seconds drafting could save over `remaining` tokens at `batch` sequences, by the profile
        at its best draft length and the acceptance seen (inf without a profile: then nothing is
        known against which to weigh a catch-up). Plain steps make `batch` tokens a pass."""
        if self.prior is None:
            return float("inf")
        speedup = self.prior.best_speedup(batch, self.acceptance())
        plain = remaining / batch * self.prior.target_seconds(batch, 1)
        return plain * max(0.0, 1 - 1 / speedup) if speedup > 0 else 0.0

    def joined(self, context: int, remaining: int) -> None:
        """A sequence's drafter first caught up with its `context` (tokens: its prompt, and any it
        made sitting out), with `remaining` tokens then left to make (`prompt_charge`)."""
        self._joins = [self._joins[0] * JOIN_DECAY + context, self._joins[1] * JOIN_DECAY + remaining]

    def prompt_charge(self) -> float:
        """Seconds a drafting step's token costs in new sequences' first catch-ups, amortized over
        the tokens they had left when they joined (0 before any joined)."""
        context, remaining = self._joins
        return self.catch_up_seconds(context) / remaining if remaining > 0 else 0.0

    def catch_up_seconds(self, lag: int) -> float:
        """What feeding `lag` tokens to the drafters costs, at the measured seconds per token (until
        measured, the profile's; without a profile 0: the first probes run)."""
        tokens, seconds = self._catch_up
        if tokens:
            return lag * seconds / tokens
        return lag * self.prior.catch_up if self.prior is not None else 0.0

    def record(self, batch: int, drafted: bool, tokens: int, draft_seconds: float, drafter_rows: int,
               target_seconds: float, width: int, caught_up: int = 0, catch_up_seconds: float = 0.0,
               rounds: int = 0) -> None:
        """One step: `batch` sequences, whether they were let draft, the tokens they committed,
        the drafting time over `drafter_rows` drafter rows in `rounds` lock-step drafter passes (of
        it, `catch_up_seconds` spent feeding drafters `caught_up` tokens they lacked), and the
        target pass over `width` rows."""
        self._kinds(batch).record(drafted, tokens, draft_seconds - catch_up_seconds + target_seconds)
        self._accepting = [old * self.decay + (new if drafted else 0)
                           for old, new in zip(self._accepting, (batch, tokens, width))]
        if drafted:
            self._measured.add(batch)
            decay = self.decay
            self._drafting = [old * decay + new for old, new in zip(self._drafting, (1, batch, tokens, width, rounds))]
            if rounds:
                per_round = (draft_seconds - catch_up_seconds) / rounds
                self._rounds.add(drafter_rows / rounds, per_round)
        self.plain_seconds = 0.0 if drafted else self.plain_seconds + draft_seconds + target_seconds
        if caught_up:
            self._catch_up = [self._catch_up[0] + caught_up, self._catch_up[1] + catch_up_seconds]
        self._fit.add(width, target_seconds)
        if drafter_rows:  # the catch-up is the switch's cost, not a drafted row's
            self._draft = [self._draft[0] * self.decay + drafter_rows,
                           self._draft[1] * self.decay + draft_seconds - catch_up_seconds]

    def costs(self, batch: int) -> tuple[float, float, float, float] | None:
        """(R, t_d, t_v, t_1) at `batch` sequences: the best rate measured at that size (tokens/s,
        at least plain decoding's), the seconds per drafter row (`_row_seconds`), per target row,
        and of a pass of one row each; None until the target's pass has been timed at widths that
        differ."""
        fitted = self._fit.fit() if self._fit.samples >= self.warmup else None
        if fitted is None:  # widths must vary
            return None
        slope, base = fitted
        plain_pass = max(1e-9, base + slope * batch)  # every sequence scoring one row
        kinds = self._kinds(batch)
        rate = max(kinds.rate(True), kinds.rate(False), batch / plain_pass)
        return rate, self._row_seconds(batch), slope, plain_pass

    def _row_seconds(self, batch: int) -> float:
        """What one drafted row costs at `batch` sequences: a lock-step round over a row each,
        shared by them (from the fit of rounds over their rows, once rows per round have varied),
        else the mean drafting seconds per row measured. Not a round alone: with the same bar, the
        other sequences draft about as long, so a round's cost is shared; charging each row a whole
        round kept drafts at 2 in flight to 1-2 tokens where alone they ran to 5-7."""
        fitted = self._rounds.fit()
        if fitted is not None:
            slope, base = fitted
            return max(0.0, base + slope * batch) / batch
        return self._draft[1] / self._draft[0] if self._draft[0] else 0.0

    def predict(self, batch: int) -> tuple[float, float] | None:
        """(drafting, plain) tokens per second predicted at `batch` sequences from the costs
        measured at any size: a plain step is a target pass over `batch` rows; a drafting step
        commits the tokens per sequence that drafting steps have committed, for a target pass over
        their rows per sequence and their rounds of drafter passes, each over `batch` rows. None
        until both kinds' costs are measured."""
        fitted = self._fit.fit()
        steps, sequences, tokens, rows, rounds = self._drafting
        mean_round = self._rounds.mean()
        if fitted is None or sequences <= 0 or mean_round is None:
            return None
        slope, base = fitted
        drafter = self._rounds.fit()  # where rows per round never varied: their mean
        per_round = drafter[1] + drafter[0] * batch if drafter is not None else mean_round
        plain = batch / max(1e-9, base + slope * batch)
        seconds = base + slope * batch * rows / sequences + max(0.0, per_round) * rounds / steps
        return batch * tokens / sequences / max(1e-9, seconds), plain

    def steer(self, batch: int, choices: Sequence[tuple[CostAware, bool]]) -> None:
        """Impose this step's batch-level decision, costs and longest draft on each steered
        sequence's cost-aware policy: `choices` pairs a policy with whether its sequence drafts
        this step. The costs and the draft rates are the batch's, computed once a step; each
        policy's cap is the best length within its own `gamma`."""
        costs = self.costs(batch)
        gammas = [policy.gamma for policy, draft in choices if draft]
        rates = self._draft_rates(batch, max(gammas)) if gammas else None
        for policy, draft in choices:
            most = _best(rates, policy.gamma) if draft and rates is not None else None
            policy.impose(draft, costs, most)

    def longest_draft(self, batch: int, most: int) -> int | None:
        """The draft length k <= `most` that makes the most tokens a second for the whole batch, at
        the acceptance α seen (`acceptance`): E_k / (t(batch, k + 1 rows each) + k·d(batch)),
        E_k = (1 − α^(k+1)) / (1 − α), with the profile's pass costs (else the measured ones).
        None alone (no cap), or before any cost is known.

        Drafter passes run in lock step: a round lasts while any sequence drafts, so one draft
        longer than the rest costs whole rounds for a row each (uncapped drafts lost to plain steps:
        docs/engine.md#speculation-under-load); the cost-aware bar still ends each draft sooner where
        its own tokens grow unlikely. A tree's depth is capped alike (its drafter rounds)."""
        rates = self._draft_rates(batch, most)
        return _best(rates, most) if rates is not None else None

    def _draft_rates(self, batch: int, most: int) -> list[float] | None:
        """The batch's tokens a second at each draft length 1..`most` (see `longest_draft`), or None."""
        if batch < 2:
            return None
        target, round_ = self._pass_costs(batch)
        if target is None:
            return None
        alpha = min(self.acceptance(), 0.99)
        return [(1 - alpha ** (k + 1)) / (1 - alpha) / max(1e-9, target(k + 1) + k * round_)
                for k in range(1, most + 1)]

    def _pass_costs(self, batch: int):
        """(rows a sequence -> seconds of a target pass over `batch` sequences, seconds of a
        drafter round over them), from the profile where there is one, else from the steps'
        fits; (None, 0) where neither is known yet."""
        if self.prior is not None:
            return (lambda rows: self.prior.pass_seconds(batch, rows)), self.prior.drafter_seconds(batch)
        fitted, rounds = self._fit.fit(), self._rounds.fit()
        if fitted is None:
            return None, 0.0
        slope, base = fitted
        round_ = rounds[1] + rounds[0] * batch if rounds is not None else (self._rounds.mean() or 0.0)
        return (lambda rows: base + slope * batch * rows), max(0.0, round_)

    def _fresh(self) -> FasterOf:
        return FasterOf(self.warmup, self.probe, self.decay, {True: self.probe, False: 2 * self.probe})

    def _kinds(self, batch: int) -> FasterOf:
        if batch not in self.kinds:
            kinds = self._fresh()
            if self.kinds:  # start from the nearest batch size's record: no warm-up of its own to pay
                nearest = self.kinds[min(self.kinds, key=lambda b: (abs(b - batch), b))]
                kinds.sums = {kind: list(sums) for kind, sums in nearest.sums.items()}
            self.kinds[batch] = kinds
        return self.kinds[batch]


def _best(rates: list[float], most: int) -> int:
    """The draft length in 1..`most` with the highest of `rates` (rates[k − 1]: length k's)."""
    return max(range(1, min(most, len(rates)) + 1), key=lambda k: rates[k - 1])


def _charged(rate: float, charge: float) -> float:
    """A rate (tokens/s) with `charge` seconds more a token."""
    return 1 / (1 / rate + charge) if rate > 0 else 0.0


def _saved(tokens: int, drafting: float, plain: float) -> float:
    """Seconds that making `tokens` at the `drafting` rate saves against the `plain` rate (tokens/s)."""
    return tokens * (1 / plain - 1 / drafting)
