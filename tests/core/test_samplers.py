import itertools
import math

import pytest
import torch

from specdec import (GREEDY, Sampler, SpecdecError, autoregressive_generate, logits_to_probs, sample,
                     speculative_generate)
from specdec.drafters import LookupDrafter

from conftest import TableModel
from test_sampling_exactness import ALPHA, chi_square_pvalue


def _logits(seed=0, shape=(4, 50)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_one_hot_at_argmax():
    logits = _logits()
    probs = Sampler(temperature=0).probs(logits)
    assert torch.equal(probs.sum(-1), torch.ones(4))
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))
    assert int((probs > 0).sum()) == 4


def test_temperature_one_is_softmax_and_low_temperature_tends_to_greedy():
    logits = _logits()
    assert torch.allclose(Sampler(1.0).probs(logits), logits.softmax(-1))
    top2 = logits.topk(2, -1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) > 0.01  # the limit below needs a strict argmax
    cold = Sampler(1e-4).probs(logits)
    assert torch.allclose(cold, Sampler(0).probs(logits), atol=1e-4)
    hot = Sampler(1000.0).probs(logits)
    assert torch.allclose(hot, torch.full_like(hot, 1 / 50), atol=1e-3)


@pytest.mark.parametrize("k", [1, 5, 49])
def test_top_k_keeps_exactly_the_k_largest(k):
    logits = _logits()
    probs = Sampler(top_k=k).probs(logits)
    assert ((probs > 0).sum(-1) == k).all()
    kept = probs > 0
    top = torch.zeros_like(kept).scatter(-1, logits.topk(k, -1).indices, True)
    assert torch.equal(kept, top)
    assert torch.allclose(probs.sum(-1), torch.ones(4))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 0.99])
def test_top_p_keeps_the_smallest_prefix_reaching_p(p):
    logits = _logits()
    full = logits.softmax(-1)
    probs = Sampler(top_p=p).probs(logits)
    for row_full, row in zip(full, probs):
        kept = row > 0
        mass = float(row_full[kept].sum())
        assert mass >= p - 1e-6  # enough mass
        smallest_kept = float(row_full[kept].min())
        assert mass - smallest_kept < p  # and minimal: without its smallest member it would fall short
        assert torch.all(row_full[kept].min() >= row_full[~kept].max()) if (~kept).any() else True
        assert torch.allclose(row[kept], row_full[kept] / mass, atol=1e-6)


def _top_k_then_top_p_by_hand(row: list[float], k: int, top_p: float, temperature: float) -> list[float]:
    """The sampler's rule for one row in plain Python (float64): softmax(l / T) over the k
    largest logits, then the smallest most-likely prefix of that whose mass reaches top_p, renormalised."""
    order = sorted(range(len(row)), key=lambda i: -row[i])[:k]
    weights = [math.exp((row[i] - row[order[0]]) / temperature) for i in order]
    mass = [w / sum(weights) for w in weights]
    kept, before = [], 0.0
    for i, m in zip(order, mass):
        if before >= top_p:
            break
        kept.append((i, m))
        before += m
    out = [0.0] * len(row)
    for i, m in kept:
        out[i] = m / before
    return out


@pytest.mark.parametrize("k,top_p,temperature", [(10, 0.8, 1.0), (5, 0.5, 0.7), (3, 0.75, 2.0), (50, 0.3, 1.0)])
def test_top_k_then_top_p(k, top_p, temperature):
    logits = _logits()
    probs = Sampler(temperature, top_k=k, top_p=top_p).probs(logits)
    expected = torch.tensor([_top_k_then_top_p_by_hand(row, k, top_p, temperature) for row in logits.tolist()])
    assert torch.allclose(probs, expected.float(), atol=1e-6)
    assert ((probs > 0) == (expected > 0)).all()  # the same tokens kept, exactly
    assert ((probs > 0).sum(-1) < min(k, 50)).any()  # top-p cuts into what top-k kept somewhere


def test_sample_matches_distribution_and_never_picks_zero_probability():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    n = 200_000
    draws = sample(probs.expand(n, -1), torch.Generator().manual_seed(1))
    counts = torch.bincount(draws, minlength=6).float() / n
    assert counts[[0, 2, 5]].sum() == 0
    assert torch.allclose(counts, probs, atol=0.005)  # ~5 sigma at n=2e5


def test_nan_logits_are_a_clear_error():
    logits = _logits()
    logits[1, 3] = float("nan")
    with pytest.raises(SpecdecError, match="NaN"):
        logits_to_probs(logits)


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(temperature=math.inf), dict(top_k=-2),
                                    dict(top_p=0), dict(top_p=1.5), dict(top_k=2.5)])
def test_bad_sampler_parameters_are_rejected(kwargs):
    with pytest.raises(SpecdecError):
        Sampler(**kwargs)


# --- non-finite logits and overflowing temperatures (issue 11 A) -----------------------------------
# The limit of softmax(l / T) when some logits are +inf, or when T is so small that l / T
# overflows, is the uniform distribution over the largest logits; a row whose logits are all -inf
# rules out every token. None of these may come out as NaN and then as the last token id.

INF, NEG = float("inf"), float("-inf")


@pytest.mark.parametrize("kwargs", [dict(temperature=1.0), dict(temperature=0.3), dict(temperature=2.0, top_k=3),
                                    dict(temperature=1.0, top_p=0.9)])
def test_plus_inf_logits_give_the_uniform_limit_over_the_inf_entries(kwargs):
    logits = torch.tensor([[1.0, INF, 0.5, INF, NEG], [INF, 3.0, 2.0, 1.0, 0.0]])
    expected = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0]])
    assert torch.equal(logits_to_probs(logits, **kwargs), expected)
    # greedy takes the first of the tied maxima, like argmax
    assert torch.equal(logits_to_probs(logits, 0.0), torch.eye(5)[[1, 0]])


@pytest.mark.parametrize("temperature", [1e-40, 1e-45, 1e-300])  # 1e-300 rounds to 0 in fp32
def test_a_temperature_that_overflows_the_scaled_logits_gives_the_greedy_limit(temperature):
    logits = _logits()
    top2 = logits.topk(2, -1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) > 0  # a strict argmax: the limit is one-hot
    greedy = Sampler(0).probs(logits)
    for kwargs in (dict(), dict(top_k=5), dict(top_p=0.9)):
        assert torch.equal(logits_to_probs(logits, temperature, **kwargs), greedy)
    # huge logits overflow even at an ordinary small temperature
    assert torch.equal(logits_to_probs(logits * 1e30, 1e-10), greedy)
    # tied maxima: the limit is uniform over them (first-max greedy is one of its draws)
    assert torch.equal(logits_to_probs(torch.tensor([2.0, 2.0, 1.0]), temperature), torch.tensor([0.5, 0.5, 0.0]))


@pytest.mark.parametrize("temperature", [0.0, 1.0, 1e-40])
def test_a_row_of_minus_inf_logits_is_a_clear_error(temperature):
    logits = _logits()
    logits[2] = NEG
    with pytest.raises(SpecdecError, match="probability 0"):
        logits_to_probs(logits, temperature)


def test_greedy_tokens_reject_a_row_of_minus_inf_logits():
    from specdec.core.samplers import greedy_tokens

    logits = torch.tensor([[NEG, INF, INF], [NEG, 0.0, 1.0]])
    assert greedy_tokens(logits).tolist() == [1, 2]
    with pytest.raises(SpecdecError, match="probability 0"):
        greedy_tokens(torch.full((2, 4), NEG))


def test_greedy_rows_give_each_block_what_greedy_tokens_gives_it():
    from specdec.errors import ModelFault
    from specdec.core.samplers import greedy_rows, greedy_tokens

    generator = torch.Generator().manual_seed(0)
    blocks = [torch.randn(n, 9, generator=generator) for n in (1, 4, 2)]
    blocks[1][2, 3] = INF
    blocks[2][0, :4] = blocks[2][0, 4:8] = 5.0  # ties: the first largest
    assert greedy_rows(blocks) == [greedy_tokens(b).tolist() for b in blocks]
    nan, ruled_out = blocks[0].clone(), torch.full((2, 9), NEG)
    nan[0, 1] = float("nan")
    found = greedy_rows([blocks[1], nan, ruled_out, blocks[2]])
    assert found[0] == greedy_tokens(blocks[1]).tolist() and found[3] == greedy_tokens(blocks[2]).tolist()
    for fault, match in ((found[1], "NaN"), (found[2], "probability 0")):
        assert isinstance(fault, ModelFault) and match in str(fault)
        with pytest.raises(ModelFault, match=match):
            greedy_tokens(nan if match == "NaN" else ruled_out)
    assert greedy_rows([]) == []


@pytest.mark.parametrize("row", [[0.0, 0.0, 0.0], [float("nan")] * 3, [0.2, float("nan"), 0.3], [0.5, INF, 0.1],
                                 [0.5, -0.1, 0.6], [3e38, 3e38, 3e38]])
def test_sample_rejects_rows_without_a_finite_positive_mass(row):
    probs = torch.tensor([[0.2, 0.3, 0.5], row])
    with pytest.raises(SpecdecError, match="probabilit"):
        sample(probs, torch.Generator().manual_seed(0))


class _InfTable(TableModel):
    """A TableModel whose logits are +inf at two tokens of every row: each conditional is the
    uniform distribution over those two (the limit), at any temperature."""

    def __init__(self, vocab: int, seed: int):
        super().__init__(vocab, seed)
        self.table.scatter_(-1, self.table.topk(2, -1).indices, INF)

    def allowed(self, context: list[int]) -> set[int]:
        return set(torch.nonzero(self.table[context[-2], context[-1]] == INF).flatten().tolist())

    def limit_joint(self, prompt: list[int], length: int) -> dict:
        """The joint law of the first `length` tokens, enumerated by hand (not via logits_to_probs)."""
        return {seq: 0.5 ** length for seq in itertools.product(range(self.vocab_size), repeat=length)
                if all(seq[i] in self.allowed(prompt + list(seq[:i])) for i in range(length))}


class _DeadTable(TableModel):
    """A model that gives every token logit -inf: no distribution exists."""

    def __init__(self, vocab: int):
        super().__init__(vocab, 0)
        self.table.fill_(NEG)


PROMPT = [0, 1, 2]  # no token repeats: prompt lookup finds nothing to copy

# Every way the loops draw a target token: (generate(target, drafter, sampler, seed) -> result,
# number of tokens, check that the path really ran).
PATHS = {
    "autoregressive": (lambda t, d, s, seed: autoregressive_generate(PROMPT, t, s, max_new_tokens=3, seed=seed,
                                                                     seed_rule="stream",
                                                                     eos_token_ids=[]), 3,
                       lambda out: len(out.steps) == 3),
    "first token of the prompt pass": (
        lambda t, d, s, seed: speculative_generate(PROMPT, t, d, gamma=3, sampler=s, max_new_tokens=1, seed=seed,
                                                   seed_rule="stream",
                                                   eos_token_ids=[], first_target=True), 1,
        lambda out: len(out.steps) == 1 and out.stats.drafter_passes == 0),
    "empty draft": (  # lookup on a context without repeats proposes nothing: the target draws alone
        lambda t, d, s, seed: speculative_generate(PROMPT, t, LookupDrafter(), gamma=3, sampler=s, max_new_tokens=2,
                                                   seed=seed,
                                                   seed_rule="stream", eos_token_ids=[], first_target=False), 2,
        lambda out: all(step.draft_tokens == [] for step in out.steps)),
    "verify_draft": (
        lambda t, d, s, seed: speculative_generate(PROMPT, t, d, gamma=3, sampler=s, max_new_tokens=3, seed=seed,
                                                   seed_rule="stream",
                                                   eos_token_ids=[], first_target=False), 3,
        lambda out: len(out.steps[0].draft_tokens) == 2),
    "verify_coupled (a seed's draws)": (
        lambda t, d, s, seed: speculative_generate(PROMPT, t, d, gamma=3, sampler=s, max_new_tokens=3, seed=seed,
                                                   eos_token_ids=[], first_target=False), 3,
        lambda out: len(out.steps[0].draft_tokens) == 2),
}


@pytest.mark.parametrize("path", PATHS)
def test_inf_logits_sample_the_limit_on_every_path(path):
    """+inf logits in the target (and the drafter): the output follows the limit law, the uniform
    distribution over the +inf tokens of each context (chi-square at ALPHA over the joint)."""
    generate, length, ran = PATHS[path]
    target, drafter = _InfTable(5, 0), _InfTable(5, 1)  # different +inf sets: rejections and residuals
    joint = target.limit_joint(PROMPT, length)
    samples = []
    for seed in range(400):
        out = generate(target, drafter, Sampler(1.0), seed)
        assert ran(out)
        samples.append(tuple(out.tokens))
    assert chi_square_pvalue(samples, joint) > ALPHA  # also asserts that no ruled-out sequence came out


@pytest.mark.parametrize("path", PATHS)
def test_an_overflowing_temperature_gives_the_greedy_output_on_every_path(path):
    generate, length, ran = PATHS[path]
    target, drafter = TableModel(5, 0), TableModel(5, 1)
    greedy = autoregressive_generate(PROMPT, target, GREEDY, max_new_tokens=length, eos_token_ids=[]).tokens
    assert greedy != [4] * length  # the old failure mode (NaN -> the last id) would not pass unnoticed
    for seed in range(3):
        out = generate(target, drafter, Sampler(1e-40), seed)  # logits / 1e-40 overflow fp32
        assert ran(out) and out.tokens == greedy


@pytest.mark.parametrize("sampler", [Sampler(1.0), GREEDY], ids=["sampled", "greedy"])
@pytest.mark.parametrize("path", PATHS)
def test_a_target_that_rules_out_every_token_is_a_clear_error_on_every_path(path, sampler):
    generate, _, _ = PATHS[path]
    with pytest.raises(SpecdecError, match="every token has probability 0"):
        generate(_DeadTable(5), TableModel(5, 1), sampler, 0)


def test_min_p_keeps_the_tokens_at_least_that_likely_against_the_top_one():
    probs = torch.tensor([[0.5, 0.3, 0.04, 0.16]])
    kept = Sampler(1.0, min_p=0.2).probs(probs.log())  # keeps p >= 0.1
    torch.testing.assert_close(kept, torch.tensor([[0.5, 0.3, 0.0, 0.16]]) / 0.96)
    assert torch.equal(Sampler(1.0, min_p=1.0).probs(probs.log()), torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    assert Sampler(0.7, min_p=0.05).describe() == "temperature=0.7, min_p=0.05"
    with pytest.raises(SpecdecError, match="min_p"):
        Sampler(1.0, min_p=1.5)
