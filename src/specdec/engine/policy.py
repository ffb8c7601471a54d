"""Speculation under load: what one more draft token is worth when many sequences share a pass.

Alone, the cost-aware rule (`schedules.CostAware`) drafts a token while its chance of surviving,
P_k, pays for its cost at the rate the generation makes: P_k >= R·(t_d + t_v). In a batch every
term is the batch's: R is the committed tokens per second of the whole batch (goodput), t_v the
time one more row adds to the shared target pass at its current width, t_d the time one more
drafted row adds to the drafter's passes (batched across sequences too). As the batch grows, R
grows faster than the pass's cost, so the bar rises and drafts shrink; where no draft pays, the
measured comparison of steps that drafted with steps that did not (`FasterOf`, kept per batch
size) stops drafting altogether. All of it is learned from the engine's own steps.

Only sequences whose output cannot depend on draft lengths are steered (greedy ones, and sampled
ones without a seed): a seeded sampled sequence drafts as it would alone, so that its output is
the same seed's run alone.
"""

from __future__ import annotations

from ..schedules import CostAware, FasterOf


class BatchCosts:
    """The engine's measured step costs, and per batch size whether drafting pays.

    warmup, probe, decay: as `CostAware`'s (the first `warmup` steps at a batch size draft, one
    plain step follows as a baseline, then the faster kind, probed now and then; sums decay by
    `decay` a step so the costs follow the batch's current width).
    """

    def __init__(self, warmup: int = 1, probe: int = 8, decay: float = 0.9):
        self.warmup, self.probe, self.decay = warmup, probe, decay
        self.kinds: dict[int, FasterOf] = {}  # batch size -> drafting steps vs plain steps
        self._fit = [0.0] * 5  # decayed n, Σw, Σw², Σt, Σw·t over (pass width, target seconds)
        self._draft = [0.0, 0.0]  # decayed drafter rows, drafting seconds

    def speculate(self, batch: int) -> bool:
        """Whether this step's steered sequences should draft, at `batch` running sequences."""
        return self._kinds(batch).choose()

    def record(self, batch: int, drafted: bool, tokens: int, draft_seconds: float, drafter_rows: int,
               target_seconds: float, width: int) -> None:
        """One step: `batch` sequences, whether they were let draft, the tokens they committed,
        the drafting time over `drafter_rows` drafter rows, and the target pass over `width` rows."""
        self._kinds(batch).record(drafted, tokens, draft_seconds + target_seconds)
        sums = self._fit
        for i, value in enumerate((1.0, width, width * width, target_seconds, width * target_seconds)):
            sums[i] = sums[i] * self.decay + value
        if drafter_rows:
            self._draft = [self._draft[0] * self.decay + drafter_rows, self._draft[1] * self.decay + draft_seconds]

    def costs(self, batch: int) -> tuple[float, float, float, float] | None:
        """(R, t_d, t_v, t_1) at `batch` sequences: the best rate measured at that size (tokens/s,
        at least plain decoding's), the seconds per drafter row, per target row, and of a pass of
        one row each; None until the target's pass has been timed at widths that differ."""
        n, sw, sww, st, swt = self._fit
        spread = n * sww - sw * sw
        if n < self.warmup or spread < 0.25 * n * n:  # widths must vary
            return None
        slope = max(0.0, (n * swt - sw * st) / spread)
        plain_pass = max(1e-9, (st - slope * sw) / n + slope * batch)  # every sequence scoring one row
        kinds = self._kinds(batch)
        rate = max(kinds.rate(True), kinds.rate(False), batch / plain_pass)
        per_row = self._draft[1] / self._draft[0] if self._draft[0] else 0.0
        return rate, per_row, slope, plain_pass

    def steer(self, policy: CostAware, batch: int, draft: bool) -> None:
        """Impose this step's batch-level decision and costs on one sequence's cost-aware policy."""
        policy.impose(draft, self.costs(batch))

    def _kinds(self, batch: int) -> FasterOf:
        if batch not in self.kinds:
            kinds = FasterOf(self.warmup, self.probe, self.decay, {True: self.probe, False: 2 * self.probe})
            if self.kinds:  # start from the nearest batch size's record: no warm-up of its own to pay
                nearest = self.kinds[min(self.kinds, key=lambda b: (abs(b - batch), b))]
                kinds.sums = {kind: list(sums) for kind, sums in nearest.sums.items()}
            self.kinds[batch] = kinds
        return self.kinds[batch]
