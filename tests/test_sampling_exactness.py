"""Sampled speculative generation has the target's distribution: joint law of the first tokens.

The reference is exact (enumerated from the target's conditionals, no sampling), and the test is
a chi-square over all token tuples at significance 1e-4: a correct loop fails by chance about
once in 10^4 runs; seeds are fixed, so runs are repeatable.
"""

import itertools

import pytest
import torch
from scipy.stats import chi2

from specdec import Sampler, speculative_generate

from conftest import TableModel, tiny_model

ALPHA = 1e-4


def exact_joint(target, prompt, length, sampler):
    """{tuple of the first `length` tokens: probability} under autoregressive sampling."""
    joint = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for prefix, mass in joint.items():
            probs = target.next_probs(list(prompt) + list(prefix), sampler)
            for token, p in enumerate(probs.tolist()):
                if p > 0:
                    nxt[prefix + (token,)] = mass * p
        joint = nxt
    return joint


def chi_square_pvalue(samples, joint):
    counts = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    assert set(counts) <= set(joint), "produced a sequence the target gives probability 0"
    n = len(samples)
    # pool cells with tiny expectation so the chi-square approximation holds
    big = [k for k, p in joint.items() if p * n >= 5]
    small_expected = n - sum(joint[k] * n for k in big)
    small_count = n - sum(counts.get(k, 0) for k in big)
    stat = sum((counts.get(k, 0) - joint[k] * n) ** 2 / (joint[k] * n) for k in big)
    dof = len(big) - 1
    if small_expected >= 1:
        stat += (small_count - small_expected) ** 2 / small_expected
        dof += 1
    return chi2.sf(stat, dof)


CASES = [(Sampler(1.0), 2, False), (Sampler(0.7, top_k=3), 1, True), (Sampler(1.3, top_p=0.8), 4, True)]


@pytest.mark.parametrize("sampler,gamma,first_target", CASES, ids=lambda c: getattr(c, "describe", lambda: c)())
def test_speculative_sampling_matches_the_target_joint_distribution(sampler, gamma, first_target):
    target = TableModel(vocab=5, seed=0)
    drafter = TableModel(vocab=5, seed=1)  # a different model: many rejections
    prompt, length, runs = [2, 3], 3, 8_000
    joint = exact_joint(target, prompt, length, sampler)
    g = torch.Generator().manual_seed(1234)
    samples = []
    for _ in range(runs):
        seed = int(torch.randint(0, 2**62, (1,), generator=g))
        out = speculative_generate(prompt, target, drafter, gamma=gamma, sampler=sampler, max_new_tokens=length,
                                   seed=seed, first_target=first_target)
        samples.append(tuple(out.tokens))
    assert chi_square_pvalue(samples, joint) > ALPHA


def test_the_joint_test_catches_a_biased_loop(monkeypatch):
    """Power check: resampling from p after a rejection (a known bug elsewhere) is detected."""
    import specdec.generate as generate
    from specdec import sample, verify_draft

    def biased(p, q, tokens, generator=None, lenience=1.0, details=None):
        n, _ = verify_draft(p, q, tokens, generator)
        return n, sample(p[int(n)], generator)

    monkeypatch.setattr(generate, "verify_draft", biased)
    target, drafter, sampler = TableModel(5, 0), TableModel(5, 1), Sampler(1.0)
    joint = exact_joint(target, [2, 3], 2, sampler)
    samples = [tuple(speculative_generate([2, 3], target, drafter, gamma=2, sampler=sampler, max_new_tokens=2,
                                          seed=s, first_target=False).tokens) for s in range(6_000)]
    assert chi_square_pvalue(samples, joint) < 1e-6


def test_on_a_tiny_transformer_with_real_kv_caches():
    target = tiny_model(0, vocab=4, logit_scale=0.05, name="tiny-target")
    drafter = tiny_model(1, vocab=4, layers=1, logit_scale=0.05, name="tiny-drafter")
    sampler = Sampler(1.0)

    class Reference:  # cache-free conditionals of the HF target
        def next_probs(self, context, sampler):
            return sampler.probs(target.forward(context, None, 1)[-1])

    prompt = [2, 3, 1]
    joint = exact_joint(Reference(), prompt, 2, sampler)
    assert max(joint.values()) < 0.5  # spread out enough for the test to mean something
    samples = [tuple(speculative_generate(prompt, target, drafter, gamma=2, sampler=sampler, max_new_tokens=2,
                                          seed=s, first_target=False, eos_token_ids=[]).tokens)
               for s in range(1500)]
    assert chi_square_pvalue(samples, joint) > ALPHA
