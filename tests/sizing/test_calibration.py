"""Calibrated node values (schedules.Calibration, TreeCost.record_tree).

- The estimate starts as the drafter's q, moves to the acceptance measured in q's bin, and
  never falls as q grows.
- tried_nodes names exactly the nodes verification tried: the root's children and those of
  the accepted nodes.
- In generation every accepted node is counted as a hit (Medusa, EAGLE and EAGLE-2 trees).
- An under-confident drafter (the target's own argmax at a flat q) drafts deeper trees once its
  acceptance is measured, and greedy output stays the target's.
"""

import random

import pytest
import torch

from specdec import autoregressive_generate, speculative_generate
from specdec.drafters.eagle2 import Eagle2Drafter
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.medusa import MedusaDrafter
from specdec.drafters.sides import SidesDrafter
from specdec.errors import SpecdecError
from specdec.sizing.schedules import Calibration, TreeCost, tried_nodes

from conftest import tiny_model
from test_dynamic_trees import _pair
from test_eagle import _random_eagle
from test_self_drafting import PROMPTS, _random_heads, _wide


def test_the_estimate_starts_at_q_and_moves_to_the_measured_rate():
    calibration = Calibration(strength=8.0)
    for q in (0.0, 0.01, 0.15, 0.5, 0.95, 1.0):
        assert calibration(q) == pytest.approx(q)
    for i in range(1000):  # q = 0.15 accepted 60% of the time
        calibration.record(0.15, i % 5 < 3)
    assert calibration(0.15) == pytest.approx((600 + 8 * 0.15) / 1008)
    assert calibration(0.01) == pytest.approx(0.01)  # another bin, below: untouched
    # above: raised to what the lower bin gives at its upper edge, 0.2
    assert calibration(0.5) == pytest.approx((600 + 8 * 0.2) / 1008)
    assert calibration(0.95) == pytest.approx(0.95)
    rows = calibration.table()
    assert sum(r[2] for r in rows) == 1000 and sum(r[3] for r in rows) == 600
    assert rows[0][0] == 0.0 and rows[-1][1] == 1.0
    with pytest.raises(SpecdecError, match="strength"):
        Calibration(strength=0)


def test_the_estimate_never_falls_as_q_grows():
    rng = random.Random(0)
    calibration = Calibration()
    for _ in range(3000):
        q = rng.random()
        calibration.record(q, rng.random() < 1 - q)  # acceptance falling in q: the worst case
    grid = [i / 1000 for i in range(1001)]
    values = [calibration(q) for q in grid]
    assert all(b >= a for a, b in zip(values, values[1:]))
    assert all(0 <= v <= 1 for v in values)


def test_tried_nodes_are_the_children_of_the_root_and_of_accepted_nodes():
    parents = [-1, 0, 1, 0, -1, 4]
    assert tried_nodes(parents, [0, 3]) == [(0, True), (1, False), (3, True), (4, False)]
    assert tried_nodes(parents, []) == [(0, False), (4, False)]
    assert tried_nodes(parents, [0, 1, 2]) == [(0, True), (1, True), (2, True), (3, False), (4, False)]


def _hits_and_tries(policy: TreeCost) -> tuple[int, int]:
    rows = policy.calibrated.table()
    return sum(r[3] for r in rows), sum(r[2] for r in rows)


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle2", "sides"])
def test_every_accepted_node_is_counted_as_a_hit(kind):
    target = _pair()[0] if kind in ("eagle2", "sides") else tiny_model(1, vocab=32)
    accepted = 0
    for prompt in PROMPTS:
        policy = _wide()
        if kind == "medusa":
            drafter = MedusaDrafter(_random_heads(target), 3, policy=policy)
        elif kind == "eagle":
            drafter = EagleDrafter(_random_eagle(target), 3, policy=policy)
        elif kind == "eagle2":
            drafter = Eagle2Drafter(_pair()[1], 3, policy=policy)  # the target with a noisy head
        else:  # greedy: the chain and its sides are all counted
            drafter = SidesDrafter(_pair()[1], 3, policy=policy)
        result = speculative_generate(prompt, target, drafter, gamma=6, max_new_tokens=30, eos_token_ids=[], seed=0)
        hits, tries = _hits_and_tries(policy)
        assert hits == result.stats.accepted
        trees = [step for step in result.steps if step.draft_tokens]
        assert tries == sum(len(tried_nodes(step.tree_parents, step.path)) for step in trees) > hits
        accepted += hits
    assert accepted > 0


def _flat_pair():
    """The target, and a drafter with the same weights and a head 20 times flatter: the same
    argmax everywhere (every greedy top-1 draft is accepted), at a q of about 0.05."""
    return tiny_model(0, vocab=32), tiny_model(0, vocab=32, logit_scale=0.05)


@pytest.mark.parametrize("calibrate", [True, False])
@pytest.mark.parametrize("kind", ["eagle2", "sides"])
def test_an_under_confident_drafter_drafts_deeper_once_its_acceptance_is_measured(calibrate, kind):
    """Also the sides tree's chain (width 1: a chain alone), whose stopping rule reads the same values."""
    target, drafter = _flat_pair()
    passes = tokens = deepest = 0
    made = Eagle2Drafter if kind == "eagle2" else SidesDrafter
    for prompt in PROMPTS:
        policy = TreeCost(threshold=0.3, node_threshold=0.2, warmup=10**9, calibrate=calibrate)
        result = speculative_generate(prompt, target, made(drafter, 1, policy=policy), gamma=8,
                                      max_new_tokens=120, eos_token_ids=[], seed=0)
        assert result.tokens == autoregressive_generate(prompt, target, max_new_tokens=120, eos_token_ids=[]).tokens
        passes += result.stats.target_passes
        tokens += len(result.tokens)
        deepest = max(deepest, *result.stats.nodes_per_step)
    per_pass = tokens / passes
    if calibrate:  # every try accepted: the estimate climbs from q ~ 0.05 towards 1 (5.0 today)
        assert per_pass > 4.0 and deepest == 8, (per_pass, deepest)  # chains reach gamma
    else:  # q < 0.3: the root's best child only, two tokens a pass at most
        assert per_pass <= 2.0 and deepest == 1, (per_pass, deepest)
