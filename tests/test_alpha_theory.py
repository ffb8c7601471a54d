"""Two meanings of α kept apart (acceptance rate = accepted / drafted; α = E[Σ min(p, q)]), the
closed forms of theory.py against simulation, the oracle-γ bound and the tutorials' rule of thumb."""

import pytest
import torch

from conftest import tiny_model
from specdec import SpecdecError, TransformersModel
from specdec.bench.measure import measure_alpha
from specdec.generate import GenerationStats, chain_beta, speculative_generate
from specdec.samplers import GREEDY, Sampler
from specdec.theory import (alpha_from_tokens, arithmetic_increase, expected_tokens, optimal_gamma,
                            oracle_walltime_improvement, rule_of_thumb_gamma, rule_of_thumb_speedup, trace_speedup,
                            walltime_improvement)
from specdec.trees import Draft

# ---- simulation of iid acceptance (Leviathan et al. §3's model) ----


def _simulate(alpha: float, gamma: int, steps: int = 200_000, seed: int = 0) -> torch.Tensor:
    """Accepted drafts per step: the run of passes before the first rejection, cut at γ -> [steps]."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(steps, gamma, generator=g) < alpha).long().cumprod(-1).sum(-1)


@pytest.mark.parametrize("alpha,gamma", [(0.5, 3), (0.8, 5), (0.9, 8)])
def test_expected_tokens_and_walltime_match_a_simulation(alpha, gamma):
    c, accepted = 0.1, _simulate(alpha, gamma)
    tokens = (accepted + 1).double()
    # 200k steps: the mean's standard error is below 0.01 tokens; 1% is several of them
    assert tokens.mean().item() == pytest.approx(expected_tokens(alpha, gamma), rel=0.01)
    # time in target passes: γ drafter passes (c each) and one verification per step; AR: one per token
    speedup = tokens.sum().item() / (len(tokens) * (gamma * c + 1))
    assert speedup == pytest.approx(walltime_improvement(alpha, gamma, c), rel=0.01)


@pytest.mark.parametrize("alpha,gamma,c_hat", [(0.6, 2, 0.05), (0.85, 6, 0.1)])
def test_arithmetic_increase_matches_a_simulation(alpha, gamma, c_hat):
    tokens = (_simulate(alpha, gamma) + 1).double()
    # each step does γ drafter tokens' work (ĉ each) and γ + 1 target tokens'; AR does one per token
    ratio = len(tokens) * (gamma * c_hat + gamma + 1) / tokens.sum().item()
    assert ratio == pytest.approx(arithmetic_increase(alpha, gamma, c_hat), rel=0.01)


@pytest.mark.parametrize("alpha,c", [(0.8, 0.1), (0.6, 0.05), (0.9, 0.3)])
def test_optimal_gamma_is_the_simulated_best(alpha, c):
    simulated = {g: (_simulate(alpha, g, 100_000, seed=g) + 1).double().mean().item() / (g * c + 1)
                 for g in range(1, 13)}
    best = optimal_gamma(alpha, c)
    # the simulated best may be a neighbour whose closed form is within the simulation's noise
    close = [g for g in simulated if walltime_improvement(alpha, g, c) >= walltime_improvement(alpha, best, c) * 0.99]
    assert max(simulated, key=simulated.get) in close
    assert simulated[best] == pytest.approx(walltime_improvement(alpha, best, c), rel=0.01)


# ---- α implied by tokens per step ----


def test_alpha_from_tokens_inverts_expected_tokens():
    for alpha in (0.0, 0.3, 0.71, 0.87, 0.99):
        for gamma in (1, 3, 5, 10):
            assert alpha_from_tokens(expected_tokens(alpha, gamma), gamma) == pytest.approx(alpha, abs=1e-9)
    # the run: γ = 5 at 4.37 tokens per pass is α ≈ 0.87, not its 71% acceptance rate
    assert alpha_from_tokens(4.37, 5) == pytest.approx(0.871, abs=0.001)
    assert alpha_from_tokens(0.9, 5) == 0.0 and alpha_from_tokens(7.0, 5) == 1.0
    with pytest.raises(SpecdecError, match="gamma"):
        alpha_from_tokens(2.0, 0)


def test_acceptance_rate_underestimates_alpha_at_fixed_gamma():
    # iid acceptance α = 0.87 at γ = 5: accepted / drafted is E[accepted] / γ, far below α
    accepted = _simulate(0.87, 5)
    rate = accepted.sum().item() / (5 * len(accepted))
    assert rate == pytest.approx((expected_tokens(0.87, 5) - 1) / 5, abs=0.005)
    assert rate < 0.75
    stats = GenerationStats(accepted_per_step=accepted[:20_000].tolist(), fixed_gamma=5)
    assert stats.alpha_source == "tokens per step" and stats.alpha == pytest.approx(0.87, abs=0.01)
    assert GenerationStats(accepted_per_step=[1, 2]).alpha is None  # a varied γ or a tree: no implied α


# ---- α measured in the loop: Σ min(p, q) at the judged positions ----


def test_chain_beta_is_the_overlap_and_greedy_agreement():
    p_logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 0.0], [1.0, 1.5, 0.5]])
    q = torch.softmax(torch.tensor([[1.0, 2.0, 0.0], [0.0, 1.0, 1.0]]), -1)
    draft = Draft([1, 2], q)
    sampler = Sampler(temperature=1.0)
    p = sampler.probs(p_logits)
    assert chain_beta(p_logits, draft, sampler, [0, 1]).tolist() == pytest.approx(
        torch.minimum(p[:2], q).sum(-1).tolist())
    assert chain_beta(p_logits, Draft([1, 2]), sampler, [0, 1]).tolist() == pytest.approx([p[0, 1].item(), p[1, 2].item()])
    # greedy: p and q one-hot at their argmaxes, β = 1 where they agree
    assert chain_beta(p_logits, Draft([0, 2]), GREEDY, [0, 1]).tolist() == [1.0, 0.0]
    assert chain_beta(p_logits, draft, GREEDY, []).numel() == 0


def _pair():
    # the target's weights with noise on the drafter's output head: it agrees often, not always
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)  # tiny_model(0)'s weights
    hf = LlamaForCausalLM(config)
    with torch.no_grad():
        head = hf.lm_head.weight
        head.mul_(40.0 * 0.6).add_(torch.randn(head.shape, generator=torch.Generator().manual_seed(5)) * head.std())
    return tiny_model(0, vocab=32), TransformersModel(hf, None, "tiny-0-noisy", role="drafter")


@pytest.mark.parametrize("sampler", [GREEDY, Sampler(temperature=1.0)], ids=["greedy", "sampled"])
def test_alpha_sums_beta_over_the_positions_the_target_judged(sampler):
    target, drafter = _pair()
    prompt = [0, 5, 7, 9]
    result = speculative_generate(prompt, target, drafter, gamma=4, sampler=sampler, max_new_tokens=80, seed=3)
    beta, _, _ = measure_alpha(target, drafter, prompt, result.tokens, sampler)  # cache-free, per output position
    at = expected = judged = 0
    for step in result.steps:
        if step.draft_tokens:  # up to and including the first rejection; every position when all passed
            k = min(step.num_accepted + 1, len(step.draft_tokens))
            expected, judged = expected + sum(beta[at:at + k]), judged + k
        at += len(step.emitted)
    stats = result.stats
    assert stats.beta_positions == judged and judged > stats.accepted  # the rejected positions count too
    assert stats.beta_sum == pytest.approx(expected, abs=1e-4)
    assert stats.alpha == pytest.approx(expected / judged, abs=1e-6) and stats.alpha_source == "beta"
    assert stats.acceptance_rate == stats.accepted / stats.drafted
    assert stats.to_dict()["alpha"] == stats.alpha and stats.fixed_gamma == 4
    if sampler.is_greedy:  # β is 1 exactly where a draft passed
        assert stats.beta_sum == stats.accepted


# ---- oracle γ and the rule of thumb ----


def test_oracle_bound_matches_a_simulated_trace_and_beats_every_fixed_gamma():
    g = torch.Generator().manual_seed(1)
    for alpha, c in [(0.8, 0.1), (0.6, 0.3)]:
        trace = (torch.rand(300_000, generator=g) < alpha).tolist()
        tokens, speedup = trace_speedup(trace, c)
        assert tokens == pytest.approx(1 / (1 - alpha), rel=0.01)
        assert speedup == pytest.approx(oracle_walltime_improvement(alpha, c), rel=0.01)
        for gamma in (1, 2, 4, 8):
            fixed_tokens, fixed = trace_speedup(trace, c, gamma)
            assert fixed_tokens == pytest.approx(expected_tokens(alpha, gamma), rel=0.01)
            assert fixed == pytest.approx(walltime_improvement(alpha, gamma, c), rel=0.01)
        assert oracle_walltime_improvement(alpha, c) > walltime_improvement(alpha, optimal_gamma(alpha, c), c)


def test_trace_speedup_counts_steps_by_hand():
    trace = [True, True, False, True, False, False]
    # oracle: runs 2 (3 tokens, cost 2c + 1), 1 (2 tokens, c + 1), 0 (1 token, 1)
    assert trace_speedup(trace, 0.5) == pytest.approx((6 / 3, 6 / (2 + 1.5 + 1)))
    # γ = 1: runs cut at 1: [T,T] -> 2 tokens, [F] -> 1, [T,F] -> 2, [F] -> 1; each step c + 1
    assert trace_speedup(trace, 0.5, 1) == pytest.approx((6 / 4, 6 / (4 * 1.5)))
    assert trace_speedup([], 0.1) == (0.0, 0.0)


def test_rule_of_thumb_promises_more_than_theorem_3_8():
    # the tutorials' numbers at c = 0.1, γ = 2: 2.17× is α = 0.8; the rule rises with γ while α > c
    assert [round(rule_of_thumb_speedup(0.8, g, 0.1), 2) for g in (2, 4, 6, 8)] == [2.17, 3.0, 3.63, 4.11]
    assert [round(walltime_improvement(0.8, g, 0.1), 2) for g in (2, 4, 6, 8)] == [2.03, 2.4, 2.47, 2.4]
    assert rule_of_thumb_gamma(0.1) == pytest.approx(3.0)
    for alpha in (0.5, 0.8, 0.95):
        for gamma in range(1, 10):
            assert rule_of_thumb_speedup(alpha, gamma, 0.1) >= walltime_improvement(alpha, gamma, 0.1) - 1e-12
    with pytest.raises(SpecdecError, match="c in"):
        rule_of_thumb_gamma(0.0)
