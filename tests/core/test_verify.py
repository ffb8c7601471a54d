"""verify_draft: exactness checked statistically over 10^6 trials, plus degenerate cases.

The synthetic target here has fixed per-position distributions p_0..p_γ (a target whose
conditionals ignore the prefix), so every emitted position must be distributed as its p_i.
Tolerance: a chi-square test per position at significance 1e-4 (Bonferroni over a few positions),
so a correct rule fails by chance about once in 2000 runs; seeds are fixed, so runs are repeatable.
"""

import pytest
import torch
from scipy.stats import chi2

from specdec import SpecdecError, sample, verify_draft
from specdec.core.verify import verify_greedy, verify_ragged

TRIALS = 1_000_000
ALPHA = 1e-4


def _dirichlet(rows, vocab, seed, concentration=0.7):
    g = torch.Generator().manual_seed(seed)
    x = torch._standard_gamma(torch.full((rows, vocab), concentration), generator=g)
    return x / x.sum(-1, keepdim=True)


def _run_chain(p, q, trials, seed, verify=verify_draft):
    """p [γ+1, V], q [γ, V] fixed per position -> emitted tokens [trials, γ+1] (-1 = not emitted), n."""
    gamma = q.shape[0]
    g = torch.Generator().manual_seed(seed)
    draft = sample(q.expand(trials, -1, -1), g)  # [trials, γ], each position drawn from its q
    n, nxt = verify(p.expand(trials, -1, -1), q.expand(trials, -1, -1), draft, generator=g)
    positions = torch.arange(gamma + 1)
    emitted = torch.where(positions < n[:, None], torch.cat([draft, draft[:, :1]], 1), -1)
    emitted[torch.arange(trials), n] = nxt
    return emitted, n


def _chi_square_pvalue(samples, probs):
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    support = expected > 0
    assert counts[~support].sum() == 0, "emitted a token of target probability 0"
    stat = ((counts[support] - expected[support]) ** 2 / expected[support]).sum().item()
    return chi2.sf(stat, int(support.sum()) - 1)


def _assert_exact(p, q, seed):
    emitted, n = _run_chain(p, q, TRIALS, seed)
    for i in range(p.shape[0]):
        reached = emitted[:, i] >= 0
        if reached.sum() < 1000:
            continue
        pvalue = _chi_square_pvalue(emitted[reached, i], p[i])
        assert pvalue > ALPHA, f"position {i}: output distribution differs from p (chi2 p-value {pvalue:.2e})"
    return emitted, n


@pytest.mark.parametrize("vocab,gamma,seed", [(4, 3, 0), (8, 4, 1), (16, 2, 2)])
def test_output_distribution_equals_target_at_every_position(vocab, gamma, seed):
    p = _dirichlet(gamma + 1, vocab, seed)
    q = _dirichlet(gamma, vocab, seed + 100)
    _, n = _assert_exact(p, q, seed)
    # and the acceptance rate per position is alpha_i = sum(min(p_i, q_i)) (Leviathan et al. §3.1)
    alpha = torch.minimum(p[:gamma], q).sum(-1)
    for i in range(gamma):
        reached = n >= i
        rate = (n[reached] > i).double().mean().item()
        assert abs(rate - alpha[i].item()) < 5 * (alpha[i] * (1 - alpha[i]) / reached.sum()).sqrt() + 1e-3


def test_the_statistic_catches_a_biased_rule():
    """The same check rejects the common bug of resampling from p (not from max(0, p - q))."""

    def biased(p, q, tokens, generator=None):
        n, _ = verify_draft(p, q, tokens, generator)
        stop = p.gather(-2, n[:, None, None].expand(-1, 1, p.shape[-1])).squeeze(-2)
        return n, sample(stop, generator)

    p, q = _dirichlet(3, 6, 5), _dirichlet(2, 6, 6)
    emitted, _ = _run_chain(p, q, 200_000, 7, verify=biased)
    assert _chi_square_pvalue(emitted[:, 0], p[0]) < 1e-10


def test_q_zero_on_the_drafted_token_is_safe():
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.0, 1.0, 0.0]])
    # token 0 has q = 0 (a drafter that lies about q): accepted since p > 0; token 2 (p = 0) never
    n, nxt = verify_draft(p.expand(1000, -1, -1), q.expand(1000, -1, -1), torch.zeros(1000, 1, dtype=torch.long))
    assert (n == 1).all()
    n, nxt = verify_draft(p.expand(1000, -1, -1), torch.tensor([[0.0, 0.0, 1.0]]).expand(1000, -1, -1),
                          torch.full((1000, 1), 2))
    assert (n == 0).all() and (nxt != 2).all()


def test_p_equal_q_accepts_everything():
    p = _dirichlet(4, 10, 3)
    draft = sample(p[:3].expand(10_000, -1, -1), torch.Generator().manual_seed(0))
    n, _ = verify_draft(p.expand(10_000, -1, -1), p[:3].expand(10_000, -1, -1), draft)
    assert (n == 3).all()


def test_disjoint_supports_reject_at_once_and_sample_from_p():
    p = torch.tensor([[0.6, 0.4, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.0, 0.0, 0.5, 0.5]])
    draft = sample(q.expand(100_000, -1, -1), torch.Generator().manual_seed(0))
    n, nxt = verify_draft(p.expand(100_000, -1, -1), q.expand(100_000, -1, -1), draft,
                          torch.Generator().manual_seed(1))
    assert (n == 0).all()
    assert _chi_square_pvalue(nxt, p[0]) > ALPHA


def test_one_hot_p_and_q_is_greedy():
    vocab, gamma = 7, 3
    target_argmax = torch.tensor([2, 5, 1, 4])
    p = torch.nn.functional.one_hot(target_argmax, vocab).float()
    for draft, expect_n, expect_next in [([2, 5, 1], 3, 4), ([2, 5, 0], 2, 1), ([3, 5, 1], 0, 2)]:
        tokens = torch.tensor(draft)
        q = torch.nn.functional.one_hot(tokens, vocab).float()
        n, nxt = verify_draft(p, q, tokens)
        assert (int(n), int(nxt)) == (expect_n, expect_next)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_are_computed_in_fp32_without_nan(dtype):
    p = _dirichlet(4, 32, 8).to(dtype)
    q = _dirichlet(3, 32, 9).to(dtype)
    trials = 50_000
    draft = sample(q.float().expand(trials, -1, -1), torch.Generator().manual_seed(0))
    n, nxt = verify_draft(p.expand(trials, -1, -1), q.expand(trials, -1, -1), draft, torch.Generator().manual_seed(1))
    assert n.dtype == torch.long and nxt.dtype == torch.long
    # the same draws on the same values upcast first give the same decisions, trial by trial
    n32, nxt32 = verify_draft(p.float().expand(trials, -1, -1), q.float().expand(trials, -1, -1), draft,
                              torch.Generator().manual_seed(1))
    assert torch.equal(n, n32) and torch.equal(nxt, nxt32)
    # and the output follows p (the low-precision values, renormalised) at every position
    emitted = torch.where(torch.arange(4) < n[:, None], torch.cat([draft, draft[:, :1]], 1), -1)
    emitted[torch.arange(trials), n] = nxt
    for i in range(4):
        reached = emitted[:, i] >= 0
        target = p[i].float() / p[i].float().sum()
        assert _chi_square_pvalue(emitted[reached, i], target) > ALPHA / 4


def _reference_verify(p, q, tokens, u, v):
    """Algorithm 1 for one draft in plain Python (float64): p [γ+1][V], q [γ][V], tokens [γ],
    u [γ] the acceptance draws, v the draw that picks the next token by inverse CDF."""
    gamma = len(tokens)
    n = 0
    while n < gamma and u[n] * q[n][tokens[n]] < p[n][tokens[n]]:
        n += 1
    weights = p[n] if n == gamma else [max(0.0, a - b) for a, b in zip(p[n], q[n])]
    if sum(weights) <= 0:
        weights = p[n]
    point, cumulative = v * sum(weights), 0.0
    for token, w in enumerate(weights):
        cumulative += w
        if point < cumulative and w > 0:
            return n, token
    return n, max(t for t, w in enumerate(weights) if w > 0)


def test_batched_over_several_leading_dimensions():
    """Each element of a [3, 5] batch gets what Algorithm 1 gives for that draft alone."""
    p = _dirichlet(3 * 5 * 4, 6, 10).view(3, 5, 4, 6)
    q = _dirichlet(3 * 5 * 3, 6, 11).view(3, 5, 3, 6)
    draft = sample(q, torch.Generator().manual_seed(0))
    n, nxt = verify_draft(p, q, draft, torch.Generator().manual_seed(1))
    assert n.shape == (3, 5) and nxt.shape == (3, 5)
    # verify_draft's draws, in its order: the acceptance uniforms [3, 5, γ], then sample's [3, 5, 1]
    g = torch.Generator().manual_seed(1)
    u, v = torch.rand(3, 5, 3, generator=g), torch.rand(3, 5, 1, generator=g)
    for i in range(3):
        for j in range(5):
            expected = _reference_verify(p[i, j].double().tolist(), q[i, j].double().tolist(), draft[i, j].tolist(),
                                         u[i, j].double().tolist(), float(v[i, j, 0]))
            assert (int(n[i, j]), int(nxt[i, j])) == expected, (i, j)
    assert len(set(n.flatten().tolist())) >= 3  # rejections at several positions and bonus tokens


@pytest.mark.parametrize("shapes,message", [
    (((3, 5), (2, 5), (3,)), "draft_probs"),
    (((4, 5), (3, 6), (3,)), "target_probs"),
    (((1, 5), (0, 5), (0,)), "γ >= 1"),
])
def test_shape_errors_are_clear(shapes, message):
    p_shape, q_shape, t_shape = shapes
    with pytest.raises(SpecdecError, match=message):
        verify_draft(torch.rand(p_shape), torch.rand(q_shape), torch.zeros(t_shape, dtype=torch.long))


def test_nan_probabilities_are_a_clear_error():
    p = torch.rand(3, 5)
    p[1, 1] = float("nan")
    with pytest.raises(SpecdecError, match="NaN"):
        verify_draft(p, torch.rand(2, 5), torch.zeros(2, dtype=torch.long))


def test_verify_greedy_equals_verify_draft_with_one_hot_p():
    g = torch.Generator().manual_seed(0)
    vocab, gamma = 6, 4
    target_tokens = torch.randint(0, vocab, (500, gamma + 1), generator=g)
    # drafts that often match the target's prefix, so every accepted length occurs
    draft_tokens = torch.where(torch.rand(500, gamma, generator=g) < 0.7, target_tokens[:, :gamma],
                               torch.randint(0, vocab, (500, gamma), generator=g))
    p = torch.nn.functional.one_hot(target_tokens, vocab).float()
    q = torch.rand(500, gamma, vocab, generator=g).softmax(-1)
    n_ref, next_ref = verify_draft(p, q, draft_tokens, g)
    n, nxt = verify_greedy(target_tokens, draft_tokens)
    assert torch.equal(n, n_ref) and torch.equal(nxt, next_ref)
    assert set(n.tolist()) == set(range(gamma + 1))
    with pytest.raises(SpecdecError, match="target_tokens"):
        verify_greedy(target_tokens[:, :gamma], draft_tokens)


def test_verify_ragged_equals_each_chain_verified_alone():
    """One call over chains of lengths 0..5 gives each one's `verify_greedy` result; a vocabulary
    of 3 makes a padding position that matched (pads of one value) show at once."""
    g = torch.Generator().manual_seed(1)
    targets, drafts = [], []
    for _ in range(300):
        gamma = int(torch.randint(0, 6, (1,), generator=g))
        target = torch.randint(0, 3, (gamma + 1,), generator=g)
        draft = torch.where(torch.rand(gamma, generator=g) < 0.8, target[:gamma], torch.randint(0, 3, (gamma,), generator=g))
        targets.append(target.tolist())
        drafts.append(draft.tolist())
    num, nxt = verify_ragged(targets, drafts)
    alone = [verify_greedy(torch.tensor(t), torch.tensor(d)) for t, d in zip(targets, drafts)]
    assert num == [int(n) for n, _ in alone] and nxt == [int(x) for _, x in alone]
    assert {n for n, d in zip(num, drafts) if n == len(d)} and {n for n, d in zip(num, drafts) if n < len(d)}
    assert verify_ragged([], []) == ([], [])
    with pytest.raises(SpecdecError, match="sequence 1: 2 target tokens for a draft of 2"):
        verify_ragged([[1], [1, 2]], [[], [1, 2]])


def _first_emitted(p, q, lenience, trials, seed):
    """The token each of `trials` one-draft verifications emits first, and the acceptance rate."""
    g = torch.Generator().manual_seed(seed)
    draft_tokens = sample(q.expand(trials, -1), g).unsqueeze(-1)  # [trials, 1]
    n, nxt = verify_draft(p.expand(trials, 2, -1), q.expand(trials, 1, -1), draft_tokens, g, lenience=lenience)
    return torch.where(n == 1, draft_tokens[:, 0], nxt), n.float().mean().item()


def test_lenience_never_emits_a_token_above_p_over_l_and_raises_acceptance():
    p = torch.tensor([0.50, 0.30, 0.10, 0.05, 0.05, 0.00])
    q = torch.tensor([0.05, 0.10, 0.30, 0.25, 0.20, 0.10])
    trials = 400_000
    rates = []
    for lenience in (1.0, 0.7, 0.4):
        emitted, rate = _first_emitted(p, q, lenience, trials, seed=int(lenience * 10))
        freq = torch.bincount(emitted, minlength=6).float() / trials
        sigma = (freq * (1 - freq) / trials).sqrt()
        assert torch.all(freq <= p / lenience + 5 * sigma + 1e-9), (lenience, freq)
        assert freq[5] == 0  # a token the target rules out is never emitted, however lenient
        expected_rate = torch.minimum(q, p / lenience).sum().item()  # theory.acceptance_beta
        assert abs(rate - expected_rate) < 5 * (expected_rate * (1 - expected_rate) / trials) ** 0.5
        if lenience == 1.0:
            assert torch.all((freq - p).abs() <= 5 * sigma + 1e-9)  # exact
        else:
            assert (freq - p).abs().max() > 20 * sigma.max()  # and l < 1 really is lossy
        rates.append(rate)
    assert rates[0] < rates[1] < rates[2]
    with pytest.raises(SpecdecError, match="lenience"):
        verify_draft(p.expand(2, -1), q.expand(1, -1), torch.tensor([0]), lenience=0.0)


# Typical acceptance (Medusa): LOSSY by design; its tests check that it does what it says, and
# that the divergence from p which `theory.typical_first_token_law` predicts is what it makes.

def test_typical_acceptance_keeps_the_prefix_above_each_positions_threshold():
    from specdec.core.verify import Typical, typical_threshold, verify_typical

    typical = Typical(epsilon=0.09, delta=0.3)
    flat, peaked = torch.full((4,), 0.25), torch.tensor([0.97, 0.01, 0.01, 0.01])
    # flat: H = log 4, 0.3/4 = 0.075 < ε; peaked: H ≈ 0.17, 0.3·e^-0.17 ≈ 0.25, capped at ε = 0.09
    assert typical_threshold(torch.stack([flat, peaked]), typical).tolist() == pytest.approx([0.075, 0.09], abs=1e-6)
    p = torch.stack([flat, peaked, flat])  # [γ+1 = 3, V]
    accepted, _ = verify_typical(p, torch.tensor([2, 0]), typical)
    assert int(accepted) == 2  # 0.25 > 0.075, 0.97 > 0.09
    accepted, _ = verify_typical(p, torch.tensor([2, 1]), typical)
    assert int(accepted) == 1  # 0.01 < 0.09
    batch, _ = verify_typical(p.expand(2, -1, -1), torch.tensor([[1, 0], [3, 3]]), typical)
    assert batch.tolist() == [2, 1]
    with pytest.raises(SpecdecError, match="must be"):
        verify_typical(p, torch.tensor([2, 0, 1]), typical)
    for bad in (dict(epsilon=0), dict(delta=1.5), dict(epsilon=True)):
        with pytest.raises(SpecdecError, match="typical acceptance needs"):
            Typical(**bad)


def test_typical_acceptance_makes_the_law_theory_predicts_and_not_p():
    """Drafts from q, one position: the first emitted token follows typical_first_token_law
    (chi-square), which differs from p here; the same test against p fails (power)."""
    from specdec.sizing.theory import total_variation, typical_first_token_law
    from specdec.core.verify import Typical, verify_typical

    p, q = _dirichlet(2, 8, seed=3)[:1], _dirichlet(1, 8, seed=4)  # p: [1, V], q: [1, V]
    p = torch.cat([p, p])  # [γ+1 = 2, V]
    trials, g = 400_000, torch.Generator().manual_seed(0)
    x = sample(q.expand(trials, -1), g)  # [trials]
    accepted, nxt = verify_typical(p.expand(trials, -1, -1), x.unsqueeze(-1), Typical(), g)
    first = torch.where(accepted > 0, x, nxt)
    counts = torch.bincount(first, minlength=8).double()
    predicted = typical_first_token_law(p[0], q[0]).double()
    assert float(total_variation(predicted, p[0])) > 0.05  # typical acceptance does move the law here
    for law, should_pass in ((predicted, True), (p[0].double(), False)):
        expected = law * trials
        stat = float(((counts - expected) ** 2 / expected.clamp_min(1e-12))[expected > 0].sum())
        assert (chi2.sf(stat, int((expected > 0).sum()) - 1) > ALPHA) == should_pass
    # exact verification makes p itself: r = p when the rule is min(1, p/q) (theory's baseline)
    assert float(total_variation(typical_first_token_law(p[0], p[0], epsilon=1e-9, delta=1e-9), p[0])) < 1e-6
