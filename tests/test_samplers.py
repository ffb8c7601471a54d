import math

import pytest
import torch

from specdec import Sampler, SpecdecError, logits_to_probs, sample


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


def test_top_k_then_top_p():
    logits = _logits()
    probs = Sampler(top_k=10, top_p=0.8).probs(logits)
    assert ((probs > 0).sum(-1) <= 10).all()
    assert torch.allclose(probs.sum(-1), torch.ones(4))


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
