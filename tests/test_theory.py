"""Closed forms against worked values from Leviathan et al. (2023) and first principles."""

import math

import pytest
import torch

from specdec import SpecdecError
from specdec.theory import (acceptance_beta, alpha_from_distributions, arithmetic_increase, expected_tokens,
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
