"""Two meanings of α kept apart (acceptance rate = accepted / drafted; α = E[Σ min(p, q)]), the
closed forms of sizing/theory.py against simulation, the oracle-γ bound and the tutorials' rule of thumb."""

import pytest
import torch

from conftest import tiny_model
from specdec import SpecdecError, TransformersModel
from specdec.bench.measure import measure_alpha
from specdec.decoding.results import GenerationStats
from specdec.decoding.verifier import chain_beta
from specdec.decoding.loop import speculative_generate
from specdec.core.samplers import GREEDY, Sampler
from specdec.sizing.theory import (alpha_from_tokens, arithmetic_increase, expected_tokens, optimal_gamma,
                            oracle_walltime_improvement, rule_of_thumb_gamma, rule_of_thumb_speedup, trace_speedup,
                            walltime_improvement)
from specdec.core.trees import Draft

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


# ---- where stats are reported: the summary line, bench, /metrics, measure, `specdec theory` ----


def _generation(sampler=GREEDY):
    target, drafter = _pair()
    return speculative_generate([0, 5, 7, 9], target, drafter, gamma=4, sampler=sampler, max_new_tokens=40, seed=1)


def test_summary_line_names_the_acceptance_rate_and_alpha_apart():
    from specdec.ui.display import summary_line

    stats = _generation().stats
    line = summary_line(stats, "sd")
    assert f"acceptance rate {stats.acceptance_rate:.1%}" in line and f"α {stats.alpha:.3f} (Σ min(p, q))" in line
    implied = GenerationStats(new_tokens=10, drafted=10, accepted=7, accepted_per_step=[4, 3], fixed_gamma=5)
    assert f"α {implied.alpha:.3f} (implied by tokens per drafting step at γ = 5)" in summary_line(implied, "sd")
    assert "α" not in summary_line(GenerationStats(new_tokens=3, target_passes=3), "ar")


def test_bench_summary_and_table_report_alpha_beside_the_acceptance_rate():
    from specdec.bench.runners import Record, merge_samples
    from specdec.bench.report import render_table
    from specdec.bench.run import summarize

    stats = _generation().stats
    ours = Record("p/0@t0", "sd", [], stats.new_tokens, 1.0, stats.target_passes, stats.drafted, stats.accepted,
                  stats.accepted_per_step, beta_sum=stats.beta_sum, beta_positions=stats.beta_positions,
                  fixed_gamma=4)
    merged = merge_samples([ours, ours])
    assert merged.beta_positions == 2 * stats.beta_positions and merged.fixed_gamma == 4
    # a peer's records: no β, a fixed γ of 5 -> α implied by its tokens per step (4.37 -> 0.871)
    steps = [4] * 37 + [3] * 63  # 3.37 accepted, 4.37 tokens per step
    peer = [Record(f"p/{i}@t0", "peer", [], 10, 1.0, None, 50, 10, steps[i::10], fixed_gamma=5) for i in range(10)]
    summary = summarize([ours, *peer], ["sd", "peer"])
    assert summary["sd"]["alpha"] == pytest.approx(stats.alpha) and summary["sd"]["alpha_source"] == "beta"
    assert summary["peer"]["alpha"] == pytest.approx(0.871, abs=0.001)
    assert summary["peer"]["alpha_source"] == "tokens per step"
    table = render_table(summary)
    headers = [c.header for c in table.columns]
    assert "acceptance rate" in headers and "α" in headers
    assert f"{stats.alpha:.3f}" in list(table.columns[headers.index("α")].cells)


def test_metrics_export_alpha_numerator_and_count():
    from specdec.server.metrics import Metrics

    result = _generation(Sampler(temperature=1.0))
    metrics = Metrics()
    metrics.finished(result, 4, 0.0, 0.1, 0.5)
    metrics.finished(result, 0, 0.0, 0.1, 0.5)
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.text().decode().splitlines()
              if line and not line.startswith("#")}
    assert values["specdec:alpha_beta_sum_total"] == pytest.approx(2 * result.stats.beta_sum)
    assert values["specdec:alpha_positions_total"] == 2 * result.stats.beta_positions
    assert values["specdec:spec_decode_num_accepted_tokens_total"] == 2 * result.stats.accepted  # kept


def test_oracle_rows_on_traces():
    from specdec.bench.measure import oracle_rows

    # greedy traces: β is 0 or 1; two prompts whose steps are counted by hand
    rows = oracle_rows([[1.0, 1.0, 0.0], [0.0, 1.0]], 0.5, [1, 2], greedy=True)
    # oracle: [T,T,F] -> 1 step of 3 tokens, cost 2; [F,T] -> steps of 1 (cost 1) and 1 (the run of 1 cut at the end)
    assert rows["tokens"] == pytest.approx(5 / 3)
    assert rows["speedup"] == pytest.approx(5 / (2.0 + 1.0 + 1.5))
    assert rows["fixed"][2] == pytest.approx(5 / (3 * 2.0))  # steps: [T,T,F], [F], [T]; each 2c + 1 = 2
    assert rows["best_gamma"] in (1, 2) and rows["speedup"] >= rows["best_fixed"]
    # sampled: draws with the β chances; long iid traces approach the closed form
    sampled = oracle_rows([[0.8] * 2000], 0.1, [3, 6], greedy=False, draws=32, seed=2)
    assert sampled["speedup"] == pytest.approx(oracle_walltime_improvement(0.8, 0.1), rel=0.02)
    assert sampled["fixed"][6] == pytest.approx(walltime_improvement(0.8, 6, 0.1), rel=0.02)
    assert sampled["iid"] == pytest.approx(oracle_walltime_improvement(0.8, 0.1))


def test_measure_markdown_shows_rule_of_thumb_theorem_and_oracle():
    from specdec.bench.measure import measure_markdown

    row = {"gamma": 4, "expected_tokens": 3.36, "measured_tokens": 3.3, "acceptance_rate": 0.58, "alpha_in_runs": 0.8,
           "verification_cost": 1.1, "rule_of_thumb": 3.0, "predicted_iid": 2.4, "predicted_measured_cost": 2.2,
           "measured": 2.1, "predicted_flat": 2.3}
    m = {"target": "t", "drafter": "d", "prompts": 1, "max_new_tokens": 8, "sampler": "greedy", "alpha": 0.8,
         "positions": 8, "c": 0.1, "drafter_ms": 1, "target_ms": 10, "rows": [row],
         "oracle": {"tokens": 5.0, "speedup": 3.5, "best_gamma": 4, "best_fixed": 2.4, "iid": 3.57}}
    text = measure_markdown(m)
    assert "rule of thumb (1 + γα)/(1 + γc)" in text and "Theorem 3.8" in text
    assert "| 4 | 3.36 | 3.30 | 58.0% | 0.800 | 1.10 | 3.00× | 2.40× | 2.20× | 2.10× | 2.30× |" in text
    assert "3.50× at cost kc + 1 against 2.40× for the best fixed γ (4)" in text


def test_theory_command_prints_both_columns():
    from typer.testing import CliRunner

    from specdec.cli import app

    result = CliRunner().invoke(app, ["theory", "--alpha", "0.8", "--c", "0.1", "--gamma-max", "8"])
    assert result.exit_code == 0, result.output
    assert "rule of thumb" in result.output and "Theorem 3.8" in result.output
    rows = {line.split("│")[1].strip(): line for line in result.output.splitlines() if line.count("│") > 4}
    assert "2.17×" in rows["2"] and "2.03×" in rows["2"] and "4.11×" in rows["8"] and "2.40×" in rows["8"]
    assert "oracle γ 3.57×" in " ".join(result.output.split())


def test_the_oracle_bound_is_unbounded_where_every_draft_passes_for_free():
    import math

    from specdec.sizing.theory import oracle_walltime_improvement

    assert oracle_walltime_improvement(1.0, 0.0) == math.inf
    assert oracle_walltime_improvement(1.0, 0.25) == 4.0
