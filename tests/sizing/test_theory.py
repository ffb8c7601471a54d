"""Closed forms against worked values from Leviathan et al. (2023) and first principles."""

import math

import pytest
import torch

from specdec import SpecdecError
from specdec.sizing.theory import (acceptance_beta, alpha_from_distributions, arithmetic_increase, expected_tokens,
                            optimal_gamma, walltime_improvement)


def test_expected_tokens_worked_values():
    assert expected_tokens(0.8, 10) > 4  # the paper's example: α = 0.8, γ = 10
    assert expected_tokens(0.8, 10) == pytest.approx((1 - 0.8**11) / 0.2)
    assert expected_tokens(0.0, 5) == 1.0  # every draft rejected: the target's own token only
    assert expected_tokens(1.0, 5) == 6.0  # every draft accepted plus the bonus


def test_expected_tokens_matches_a_simulation():
    g = torch.Generator().manual_seed(0)
    alpha, gamma, n = 0.7, 4, 200_000
    accepted = (torch.rand(n, gamma, generator=g) < alpha).long().cumprod(-1).sum(-1)
    assert (accepted + 1).double().mean().item() == pytest.approx(expected_tokens(alpha, gamma), abs=0.01)


@pytest.mark.parametrize("alpha,c", [(0.6, 0.05), (0.8, 0.2), (0.9, 0.5), (0.5, 0.4)])
def test_alpha_above_c_gives_at_least_the_theorem_bound(alpha, c):
    # Leviathan et al., Corollary 3.9: if α > c, some γ improves walltime by at least (1 + α)/(1 + c)
    best = walltime_improvement(alpha, optimal_gamma(alpha, c), c)
    assert best >= (1 + alpha) / (1 + c) - 1e-12


def test_optimal_gamma_is_the_argmax_and_grows_with_alpha():
    for alpha, c in [(0.8, 0.1), (0.9, 0.05), (0.6, 0.3)]:
        g = optimal_gamma(alpha, c)
        assert all(walltime_improvement(alpha, g, c) >= walltime_improvement(alpha, k, c) for k in range(1, 65))
    assert optimal_gamma(0.95, 0.05) > optimal_gamma(0.6, 0.05)
    assert optimal_gamma(0.3, 0.9) == 1


def test_arithmetic_increase():
    assert arithmetic_increase(0.0, 3, 0.0) == 4.0  # 4 tokens scored for 1 kept
    assert arithmetic_increase(1.0, 3, 0.0) == 1.0  # all kept: no waste
    assert arithmetic_increase(0.8, 5, 0.1) == pytest.approx((5 * 0.1 + 6) * 0.2 / (1 - 0.8**6))


def test_alpha_from_distributions_and_lenience():
    p = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.25, 0.25, 0.5], [0.0, 1.0, 0.0]])
    assert acceptance_beta(p, q).tolist() == [0.5, 0.0]
    assert alpha_from_distributions(p, q) == 0.25
    assert alpha_from_distributions(p, p) == pytest.approx(1.0)
    # lenience raises α (Leviathan et al. A.5): Σ min(q, p/l), up to 1 once p/l covers q
    p, q = torch.tensor([0.2, 0.8]), torch.tensor([0.6, 0.4])
    assert [alpha_from_distributions(p, q, l) for l in (1.0, 0.5, 0.1)] == pytest.approx([0.6, 0.8, 1.0])


@pytest.mark.parametrize("call", [lambda: expected_tokens(1.5, 3), lambda: expected_tokens(0.5, 0),
                                  lambda: walltime_improvement(0.5, 2, -1), lambda: acceptance_beta(
                                      torch.ones(2), torch.ones(2), lenience=0)])
def test_bad_arguments_are_clear_errors(call):
    with pytest.raises(SpecdecError):
        call()


# --- expected_tree_tokens: Sequoia's positional acceptance model --------------------------------

from specdec.sizing.theory import expected_tree_tokens  # noqa: E402


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 1.0])
@pytest.mark.parametrize("gamma", [1, 4, 9])
def test_expected_tree_tokens_on_a_chain_is_the_chain_closed_form(alpha, gamma):
    """A chain is γ rank-0 nodes: with acceptance[0] = α it gives Leviathan et al.'s
    (1 − α^(γ+1)) / (1 − α), whatever the other ranks' acceptance (no node of another rank)."""
    chain = list(range(-1, gamma - 1))
    for rest in ([], [0.0, 0.0], [0.15, 0.07]):
        assert expected_tree_tokens(chain, [0] * gamma, [alpha, *rest]) == pytest.approx(expected_tokens(alpha, gamma))


def test_expected_tree_tokens_on_a_tree_by_hand():
    #        root
    #     0 (r0)      3 (r1)    4 (r2)
    #   1 (r0) 2 (r1)  5 (r0)
    parents, ranks = [-1, 0, 0, -1, -1, 3], [0, 0, 1, 1, 2, 0]
    a = [0.6, 0.2, 0.1]
    by_hand = 1 + 0.6 + 0.6 * 0.6 + 0.6 * 0.2 + 0.2 + 0.1 + 0.2 * 0.6
    assert expected_tree_tokens(parents, ranks, a) == pytest.approx(by_hand)
    # siblings of rank >= len(acceptance) are never accepted; acceptance (α, 0): the side nodes add nothing
    assert expected_tree_tokens(parents, ranks, [0.6]) == pytest.approx(1 + 0.6 + 0.36)
    assert expected_tree_tokens(parents, ranks, [0.6, 0.0]) == pytest.approx(1 + 0.6 + 0.36)
    assert expected_tree_tokens([], [], a) == 1.0  # no draft: the target's own token


def test_expected_tree_tokens_matches_a_simulation_of_the_model():
    """Walk the tree 200,000 times: at each node the accepted child is rank r with probability
    acceptance[r] (none with the rest); count the accepted nodes, plus the target's token."""
    parents, ranks = [-1, 0, 1, 0, -1, 4], [0, 0, 0, 1, 1, 0]
    a = [0.5, 0.3, 0.1]
    g = torch.Generator().manual_seed(0)
    n = 200_000
    draws = torch.multinomial(torch.tensor(a + [1 - sum(a)]), n * 4, replacement=True, generator=g).view(n, 4)
    tokens = torch.ones(n)
    at = torch.full((n,), -1)  # the walk's current node
    for level in range(3):  # depth 3: each walk takes at most 3 steps
        rank = draws[:, level]
        moved = torch.full((n,), -1)
        for node, (parent, r) in enumerate(zip(parents, ranks)):
            moved = torch.where((at == parent) & (rank == r), node, moved)
        tokens += moved >= 0
        at = torch.where(moved >= 0, moved, -2)  # -2: the walk stopped
    assert tokens.mean().item() == pytest.approx(expected_tree_tokens(parents, ranks, a), abs=0.01)


@pytest.mark.parametrize("call", [lambda: expected_tree_tokens([-1, 0], [0], [0.5]),
                                  lambda: expected_tree_tokens([1, -1], [0, 0], [0.5]),
                                  lambda: expected_tree_tokens([-1], [-1], [0.5]),
                                  lambda: expected_tree_tokens([-1], [0], [1.5])])
def test_expected_tree_tokens_bad_arguments_are_clear_errors(call):
    with pytest.raises(SpecdecError):
        call()


def test_step_speedup_generalises_the_paper_and_flat_verification_is_linear():
    from specdec.sizing.theory import flat_verification, step_speedup

    for alpha, gamma, c in [(0.8, 4, 0.1), (0.5, 1, 0.3), (0.95, 12, 0.05)]:
        assert step_speedup(expected_tokens(alpha, gamma), gamma, c, 1.0) == pytest.approx(
            walltime_improvement(alpha, gamma, c))
    assert step_speedup(3.0, 2, 0.25, 1.5) == pytest.approx(3.0 / 2.0)  # 2 drafter passes of 1/4, a 1.5× pass
    assert flat_verification(0) == 1.0 and flat_verification(16) == pytest.approx(1.2)
    assert flat_verification(32) == pytest.approx(1.4) and flat_verification(8, at16=2.0) == pytest.approx(1.5)
    for bad in [(0.5, 1, 0.1, 1.0), (2.0, -1, 0.1, 1.0), (2.0, 1, 0.1, 0.0)]:
        with pytest.raises(SpecdecError, match="step_speedup"):
            step_speedup(*bad)
    with pytest.raises(SpecdecError, match="flat_verification"):
        flat_verification(4, at16=0.5)


def test_flat_projection_finds_the_chain_when_only_the_top_token_is_ever_accepted():
    from specdec.bench.measure import flat_projection
    from specdec.sizing.theory import flat_verification, step_speedup

    only_top = flat_projection([0.8, 0.0, 0.0], c=0.1, max_nodes=16, max_depth=12)
    assert only_top["tree_speedup"] == pytest.approx(only_top["chain_speedup"])
    gamma = only_top["chain_gamma"]
    assert only_top["chain_speedup"] == pytest.approx(max(
        step_speedup(expected_tokens(0.8, g), g, 0.1, flat_verification(g)) for g in range(1, 13)))
    assert only_top["chain_tokens"] == pytest.approx(expected_tokens(0.8, gamma))
    spread = flat_projection([0.6, 0.2, 0.1], c=0.1, max_nodes=16, max_depth=12)
    assert spread["tree_speedup"] > 1.1 * spread["chain_speedup"]  # siblings pay where passes are nearly free
    assert spread["tree_nodes"] > spread["tree_depth"]  # ... so the best tree is wider than a chain
    assert spread["tree_speedup"] == pytest.approx(
        step_speedup(spread["tree_tokens"], spread["tree_depth"], 0.1, flat_verification(spread["tree_nodes"])))
