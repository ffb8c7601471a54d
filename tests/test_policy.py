"""Speculation under load (engine/policy.py): the batch's measured costs decide whether to draft
and how high a draft token's chance must be; seeded sampled sequences are never steered."""

import torch

from specdec import Sampler
from specdec.engine.policy import BatchCosts
from specdec.generate import Decoding
from specdec.schedules import CostAware

from conftest import tiny_model


def _simulate(costs: BatchCosts, batch: int, pass_seconds, drafted_tokens: float, steps: int = 120) -> list[bool]:
    """Steps at `batch` sequences: a drafting step scores 4 rows a sequence and commits
    `drafted_tokens` a sequence, a plain one 1 row and 1 token -> the decisions taken."""
    chosen = []
    for _ in range(steps):
        speculate = costs.speculate(batch)
        width = batch * (4 if speculate else 1)
        tokens = round(batch * (drafted_tokens if speculate else 1))
        costs.record(batch, speculate, tokens, 0.01 * batch if speculate else 0.0, 3 * batch if speculate else 0,
                     pass_seconds(width), width)
        chosen.append(speculate)
    return chosen


def test_drafting_stops_where_rows_are_dear_and_goes_on_where_they_are_cheap():
    dear = _simulate(BatchCosts(), 8, lambda width: 0.05 * width, drafted_tokens=2.0)
    cheap = _simulate(BatchCosts(), 8, lambda width: 0.2 + 0.001 * width, drafted_tokens=2.0)
    assert sum(dear[20:]) < 0.2 * len(dear[20:])  # plain steps, but for the probes
    assert sum(cheap[20:]) > 0.8 * len(cheap[20:])


def test_the_bar_for_a_draft_token_rises_with_the_batch():
    """Same pass-cost curve, more sequences: the batch makes more tokens per second, so one more
    row must carry a likelier token to pay (the threshold imposed on each sequence's policy)."""
    costs = BatchCosts()
    curve = lambda width: 0.15 + 0.01 * width  # noqa: E731
    _simulate(costs, 1, curve, drafted_tokens=2.5)
    _simulate(costs, 8, curve, drafted_tokens=2.5)
    alone, loaded = CostAware(), CostAware()
    costs.steer(alone, 1, True)
    costs.steer(loaded, 8, True)
    rate, per_row, slope, _ = costs.costs(8)
    assert abs(slope - 0.01) < 1e-6 and loaded.threshold == min(0.99, rate * (per_row + slope))
    assert loaded.threshold > alone.threshold
    costs.steer(loaded, 8, False)
    assert loaded.budget() == 0 and alone.budget() == alone.gamma


def test_only_sequences_whose_output_cannot_depend_on_draft_lengths_are_steered():
    target = tiny_model(0, exact_rows=True)
    drafter = tiny_model(1, layers=1)
    steer = lambda **kw: Decoding([1, 2, 3], target, drafter, schedule=CostAware(), **kw).steerable  # noqa: E731
    assert isinstance(steer(), CostAware)  # greedy
    assert isinstance(steer(sampler=Sampler(0.8)), CostAware)  # sampled, no seed
    assert steer(sampler=Sampler(0.8), seed=3) is None  # a seed pins the output only without timings
    assert Decoding([1, 2, 3], target, drafter, gamma=3).steerable is None  # a fixed γ is what was asked
    assert Decoding([1, 2, 3], target, None).steerable is None


def test_a_new_batch_size_starts_from_the_nearest_ones_record():
    """Sequences end and join all the time: a batch size seen for the first time takes the nearest
    one's measurements instead of paying drafting steps to warm up again."""
    costs = BatchCosts()
    _simulate(costs, 8, lambda width: 0.05 * width, drafted_tokens=2.0, steps=40)  # plain wins at 8
    assert costs.speculate(7) is False and costs.kinds[7].steps(True) == costs.kinds[8].steps(True)
