"""Lookahead decoding: the shape from pass costs, the Jacobi window and n-gram pool, exactness."""

import pytest
import torch

from specdec import Sampler, autoregressive_generate, speculative_generate
from specdec.drafters import LookaheadDrafter, lookahead_shape, make_tree_drafter
from specdec.errors import SpecdecError
from specdec.sizing.pass_costs import affordable_rows
from specdec.sizing.schedules import AssumedCosts, TreeCost

from conftest import TableModel, tiny_model
from test_sampling_exactness import ALPHA, chi_square_pvalue, exact_joint


def _always(**kwargs) -> TreeCost:
    return TreeCost(warmup=10**9, **kwargs)  # never measures that plain decoding is faster


def test_the_shape_fills_the_rows_and_meets_the_published_one():
    assert lookahead_shape(60) == (15, 3, 15) and lookahead_shape(16) == (8, 2, 8)  # the probes' best
    assert lookahead_shape(0) == lookahead_shape(1) == (0, 0, 0)
    assert lookahead_shape(2) == (1, 2, 1)
    for rows in range(2, 200):
        window, ngram, guesses = lookahead_shape(rows)
        assert window == guesses >= 1 and ngram >= 2 and (window + guesses) * (ngram - 1) <= rows
    assert [lookahead_shape(r)[1] for r in (8, 30, 60, 120, 240)] == [2, 2, 3, 4, 5]  # more levels as rows get cheap


def test_affordable_rows_stop_at_the_first_width_past_the_overhead():
    costs = {1: 1.0, 2: 0.99, 4: 1.09, 8: 1.33, 16: 1.1}
    assert affordable_rows(costs.__getitem__, [1, 2, 4, 8, 16], 0.2) == 3  # never past a dear width
    assert affordable_rows(costs.__getitem__, [1, 2, 4, 8, 16], 0.4) == 15
    assert affordable_rows(lambda w: 2.0 if w > 1 else 1.0, [1, 2, 4], 0.2) == 0


def test_assumed_costs_size_the_shape_and_dear_rows_draft_nothing():
    target = tiny_model(1, vocab=32)
    flat = LookaheadDrafter(policy=TreeCost(max_nodes=64, assumed=AssumedCosts(0.0, 0.2 / 40)))
    flat.check_target(target)
    assert flat.shape == lookahead_shape(40) and flat.name == "lookahead-w10n3g10"
    capped = LookaheadDrafter(policy=TreeCost(max_nodes=30, assumed=AssumedCosts(0.0, 0.0)))
    capped.check_target(target)
    assert capped.shape == lookahead_shape(30)
    dear = LookaheadDrafter(policy=_always(assumed=AssumedCosts(0.0, 0.5)))
    dear.check_target(target)
    assert dear.shape == (0, 0, 0)
    prompt = [2, 5, 7, 9, 11, 5, 7]
    out = speculative_generate(prompt, target, dear, max_new_tokens=12, gamma=8)
    assert out.tokens == autoregressive_generate(prompt, target, max_new_tokens=12).tokens
    assert out.stats.drafted == 0


@pytest.mark.parametrize("args", [(3, None, 2), (0, 2, 1), (2, 1, 1), (2, 2, -1), (True, 2, 1)])
def test_a_partial_or_impossible_shape_is_refused(args):
    with pytest.raises(SpecdecError, match="lookahead needs window >= 1"):
        LookaheadDrafter(*args)


def _levels_tree(drafter: LookaheadDrafter, context):
    return drafter.propose(context, 32, Sampler(0.0), torch.Generator())


def test_the_window_is_a_tree_with_the_references_mask():
    """Level 0 is a chain; each column's later levels hang from its level-0 token, so (level l,
    column j) sits at depth j + 1 + l and sees level 0 up to column j (llama.cpp's lookahead mask)."""
    drafter = LookaheadDrafter(3, 3, 0, policy=_always())
    drafter.start([0])
    drafter.levels = [[10, 11, 12], [20, 21, 22]]
    tree = _levels_tree(drafter, [0])
    paths = {tuple(tree.tokens[i] for i in tree.path_to(n)) for n in range(len(tree))}
    assert paths == {(10,), (10, 11), (10, 11, 12), (10, 20), (10, 11, 21), (10, 11, 12, 22)}
    assert drafter._columns == [tree.tokens.index(20), tree.tokens.index(21), tree.tokens.index(22)]


def test_each_column_makes_an_ngram_of_the_targets_argmax_and_the_window_moves_on():
    drafter = LookaheadDrafter(3, 3, 2, policy=_always())
    drafter.start([0])
    drafter.levels = [[10, 11, 12], [20, 21, 22]]
    tree = _levels_tree(drafter, [0])
    outputs = [0] * (len(tree) + 1)
    for j, token in enumerate((30, 31, 32)):  # the target's argmax after each column's last level
        outputs[1 + drafter._columns[j]] = token
    drafter.observe_targets(outputs)
    drafter.keep_path(1, [])  # nothing accepted: one token committed, the target's own
    assert drafter.pool == {10: [(20, 30)], 11: [(21, 31)], 12: [(22, 32)]}
    assert drafter.levels == [[20, 21, 22], [30, 31, 32]]  # one Jacobi iteration
    # two more tokens committed: the window moves on by two positions, its tail refilled from the prompt
    tree = _levels_tree(drafter, [0, 5])
    outputs = [0] * (len(tree) + 1)
    for j, token in enumerate((40, 41, 42)):
        outputs[1 + drafter._columns[j]] = token
    drafter.observe_targets(outputs)
    drafter.keep_path(2, [0])
    assert drafter.levels == [[31, 32, 0], [41, 42, 0]]
    assert drafter.pool[20] == [(30, 40)]


def test_the_pool_proposes_the_newest_ngrams_of_the_last_token_and_keeps_g():
    drafter = LookaheadDrafter(1, 3, 2, policy=_always())
    drafter.start([0])
    for gram in [(7, 1, 2), (7, 3, 4), (7, 5, 6), (8, 1, 1), (7, 3, 4)]:
        drafter._remember(gram)
    assert drafter.pool[7] == [(3, 4), (5, 6)]
    tree = _levels_tree(drafter, [9, 7])
    paths = {tuple(tree.tokens[i] for i in tree.path_to(n)) for n in range(len(tree))}
    assert {(3, 4), (5, 6)} <= paths and (1, 2) not in paths


@pytest.mark.parametrize("shape", [(3, 3, 3), (5, 2, 5), (4, 4, 2), (1, 2, 0)])
def test_greedy_lookahead_equals_greedy_ar_and_its_pool_is_accepted(shape):
    target = tiny_model(1, vocab=32)
    hits = {"window": 0, "pool": 0}
    for prompt in ([2, 5, 7, 9, 11, 5, 7], [3, 3, 4, 8, 3, 3, 4]):
        expected = autoregressive_generate(prompt, target, max_new_tokens=60).tokens
        drafter = LookaheadDrafter(*shape, policy=_always())
        out = speculative_generate(prompt, target, drafter, max_new_tokens=60, gamma=16)
        assert out.tokens == expected
        for source in hits:
            hits[source] += drafter.tries[source][1]
    assert hits["pool"] > 0 or shape[2] == 0  # n-grams from the window were verified and accepted
    assert hits["window"] > 0


def test_greedy_lookahead_equals_ar_when_trees_are_cut_by_the_output_limit():
    target = tiny_model(3, vocab=24)
    prompt = [1, 2, 3, 1, 2, 3, 1]
    for limit in (1, 2, 3, 7):
        expected = autoregressive_generate(prompt, target, max_new_tokens=limit).tokens
        out = speculative_generate(prompt, target, LookaheadDrafter(6, 4, 4, policy=_always()), max_new_tokens=limit,
                                   gamma=16, first_target=False)
        assert out.tokens == expected


class _Misreported(LookaheadDrafter):
    """A plausible bug: the deterministic nodes sent to verification with a uniform drafter law
    (as if sampled iid), so each is accepted with min(1, p/q) instead of p."""

    def propose(self, *args):
        tree = super().propose(*args)
        if tree.tokens:
            tree.scheme = "iid"
            tree.probs = torch.full((len(tree), 5), 0.2)
        return tree


@pytest.mark.parametrize("made, shape", [(LookaheadDrafter, (2, 3, 2)), (LookaheadDrafter, (3, 2, 3)),
                                         (_Misreported, (2, 3, 2))])
@pytest.mark.slow
def test_sampled_lookahead_follows_the_target_law(made, shape):
    """The joint law of the first 3 tokens against the enumerated target law (chi-square, 1e-4);
    the misreported law fails the same test (its power)."""
    target = TableModel(vocab=5, seed=0, sharpness=2.5)
    sampler, prompt, length, runs = Sampler(1.0), [2, 3, 2, 3, 2], 3, 3_000
    joint = exact_joint(target, prompt, length, sampler)
    samples, accepted = [], 0
    for seed in range(runs):
        out = speculative_generate(prompt, target, made(*shape, policy=_always()), gamma=4, sampler=sampler,
                                   max_new_tokens=length, seed=seed, seed_rule="stream", first_target=False)
        samples.append(tuple(out.tokens))
        accepted += sum(s.num_accepted for s in out.steps)
    pvalue = chi_square_pvalue(samples, joint)
    if made is LookaheadDrafter:
        assert pvalue > ALPHA
        assert accepted > runs // 5  # the window's and pool's nodes were accepted: verification ran
    else:
        assert pvalue < ALPHA


def test_make_tree_drafter_sizes_lookahead_from_the_targets_measured_passes(tmp_path, monkeypatch):
    """Widths are measured up to the first past the overhead, once (then cached), never extrapolated."""
    import specdec.sizing.pass_costs as passcost

    measured = []

    def seconds(model, tokens, *args, **kwargs):  # a machine where each row adds 1% of a one-token pass
        measured.append(tokens)
        return 0.1 * (1 + 0.01 * (tokens - 1))

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    monkeypatch.setattr(passcost, "pass_seconds", seconds)
    target = tiny_model(1, vocab=32)
    drafter = make_tree_drafter("lookahead", max_nodes=64)
    drafter.check_target(target)
    assert measured == [1, 2, 3, 4, 6, 8, 12, 16, 24]  # 24 rows cost 1.23 one-token passes: the last measured
    assert drafter.shape == lookahead_shape(15)
    again = make_tree_drafter("lookahead", max_nodes=10)
    again.check_target(target)
    assert len(measured) == 9 and again.shape == lookahead_shape(10)  # from the cache, capped by the node budget
    prompt = [2, 5, 7, 9, 11, 5, 7]
    out = speculative_generate(prompt, target, drafter, max_new_tokens=30, gamma=16)
    assert out.tokens == autoregressive_generate(prompt, target, max_new_tokens=30).tokens
