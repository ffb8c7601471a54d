"""Sampled speculative generation has the target's distribution: joint law of the first tokens.

The reference is exact (enumerated from the target's conditionals, no sampling), and the test is
a chi-square over all token tuples at significance 1e-4: a correct loop fails by chance about
once in 10^4 runs; seeds are fixed, so runs are repeatable.
"""

import itertools

import pytest
import torch
from scipy.stats import chi2

import specdec.decoding.sequence as generate_module  # where a sequence crops its target cache
from specdec import Sampler, TransformersModel, sample, speculative_generate
from specdec.drafters import Draft, Drafter, LookupDrafter, ModelDrafter, NgramDrafter, SuffixDrafter

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
@pytest.mark.slow
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
                                   seed=seed, seed_rule="stream", first_target=first_target)
        samples.append(tuple(out.tokens))
    assert chi_square_pvalue(samples, joint) > ALPHA


@pytest.mark.slow
def test_the_joint_test_catches_a_biased_loop(monkeypatch):
    """Power check: resampling from p after a rejection (a known bug elsewhere) is detected."""
    import specdec.decoding.verifier as verifier_module
    from specdec import sample, verify_draft

    def biased(p, q, tokens, generator=None, lenience=1.0, details=None):
        n, _ = verify_draft(p, q, tokens, generator)
        return n, sample(p[int(n)], generator)

    monkeypatch.setattr(verifier_module, "verify_draft", biased)
    target, drafter, sampler = TableModel(5, 0), TableModel(5, 1), Sampler(1.0)
    joint = exact_joint(target, [2, 3], 2, sampler)
    samples = [tuple(speculative_generate([2, 3], target, drafter, gamma=2, sampler=sampler, max_new_tokens=2,
                                          seed=s, seed_rule="stream", first_target=False).tokens) for s in range(6_000)]
    assert chi_square_pvalue(samples, joint) < 1e-6


# --- deep drafts: rejections at draft position >= 2 and bonus tokens after >= 3 drafted tokens ---
# The loop tests above draft at most 2 tokens; these draft up to 4 (gamma 4, 5 tokens, no
# first-target token) and count, from the returned steps, that the deep events really happened.

DEEP_PROMPT = [0, 1, 2, 0, 1, 0, 1, 2, 0, 1]  # the cycle 0 1 2 with a break: the n-gram q after (0, 1) is 1/3, 2/3


def _cyclic_target() -> TableModel:
    """A TableModel over 3 tokens that favours the cycle 0 -> 1 -> 2 -> 0, so the n-gram and lookup
    drafts of DEEP_PROMPT are often accepted deep (and still often rejected)."""
    target = TableModel(vocab=3, seed=0)
    for previous in range(3):
        target.table[:, previous, (previous + 1) % 3] += 2.0
    return target


def _near_model_drafter(target: TableModel) -> TableModel:
    """The target's table plus noise: close enough for deep acceptances, far enough to reject."""
    drafter = TableModel(vocab=3, seed=1)
    drafter.table = target.table + 0.5 * torch.randn(target.table.shape, generator=torch.Generator().manual_seed(9))
    return drafter


DEEP_DRAFTERS = {"model": _near_model_drafter, "ngram": lambda target: NgramDrafter(3),
                 "lookup": lambda target: LookupDrafter(), "suffix": lambda target: SuffixDrafter(factor=4.0)}


@pytest.mark.parametrize("drafter", DEEP_DRAFTERS)
@pytest.mark.slow
def test_deep_rejections_and_bonus_tokens_keep_the_joint_law(drafter):
    target, sampler, length = _cyclic_target(), Sampler(1.0), 5
    joint = exact_joint(target, DEEP_PROMPT, length, sampler)
    samples, deep_rejections, deep_bonus = [], 0, 0
    for seed in range(2_500):
        out = speculative_generate(DEEP_PROMPT, target, DEEP_DRAFTERS[drafter](target), gamma=4, sampler=sampler,
                                   max_new_tokens=length, seed=seed, seed_rule="stream", first_target=False)
        samples.append(tuple(out.tokens))
        for step in out.steps:
            deep_rejections += 2 <= step.num_accepted < len(step.draft_tokens)
            deep_bonus += 3 <= len(step.draft_tokens) == step.num_accepted
    assert deep_rejections >= 50 and deep_bonus >= 200, (deep_rejections, deep_bonus)
    assert chi_square_pvalue(samples, joint) > ALPHA


class _MisreportingDrafter(Drafter):
    """Draws each draft token from softmax(logits / temperature) of `model` but reports the
    sampler's q = softmax(logits) as the q it drew from; honest only when temperature is 1."""

    name, passes = "misreporting", 0

    def __init__(self, model: TableModel, temperature: float):
        self.model, self.drawn_from = model, Sampler(temperature)

    def check_target(self, target) -> None:
        pass

    def start(self, prompt) -> None:
        pass

    def rollback(self, length: int) -> None:
        pass

    def propose(self, context, max_tokens, sampler, generator, keep_going) -> Draft:
        context, tokens, reported = list(context), [], []
        while len(tokens) < max_tokens:
            logits = self.model.forward(context, None, 1)[-1]
            tokens.append(int(sample(self.drawn_from.probs(logits), generator)))
            reported.append(sampler.probs(logits))
            context.append(tokens[-1])
        return Draft(tokens, torch.stack(reported))


@pytest.mark.slow
def test_the_joint_test_catches_a_drafter_that_reports_another_q():
    """Power check: a drafter that samples from a tempered q but reports the untempered q (the
    rule then corrects for the wrong q) is detected; the same drafter reporting honestly passes."""
    target, sampler = _cyclic_target(), Sampler(1.0)
    drafter = _near_model_drafter(target)
    joint = exact_joint(target, DEEP_PROMPT, 2, sampler)

    def pvalue(temperature):
        samples = [tuple(speculative_generate(DEEP_PROMPT, target, _MisreportingDrafter(drafter, temperature), gamma=2,
                                              sampler=sampler, max_new_tokens=2, seed=s,
                                              seed_rule="stream", first_target=False).tokens)
                   for s in range(1_500)]
        return chi_square_pvalue(samples, joint)

    assert pvalue(1.0) > ALPHA  # honest: the wrapper itself is right
    assert pvalue(0.5) < 1e-6


# --- real KV caches ------------------------------------------------------------------------------
# Tiny random Llamas with sharp conditionals, so that the context matters (yet no 4-token tuple
# is likelier than 0.4), 4 tokens drafted 3 at a time: most runs crop the target's cache. A crop that removes the wrong positions is caught (the power test below); one that keeps
# rejected positions makes the next pass return fewer rows of logits than the loop asks for, and
# the loop stops with an error.

REAL_PROMPT, REAL_LENGTH, REAL_GAMMA, REAL_RUNS = [2, 3, 1], 4, 3, 300


def _real_pair() -> tuple[TransformersModel, TransformersModel]:
    return tiny_model(0, vocab=4, name="tiny-target"), tiny_model(1, vocab=4, layers=1, name="tiny-drafter")


def _real_joint(target: TransformersModel, sampler: Sampler) -> dict:
    class Reference:  # cache-free conditionals of the HF target
        def next_probs(self, context, sampler):
            return sampler.probs(target.forward(context, None, 1)[-1])

    return exact_joint(Reference(), REAL_PROMPT, REAL_LENGTH, sampler)


def _real_samples(target: TransformersModel, drafter: ModelDrafter, runs: int) -> tuple[list[tuple], int]:
    """Token tuples of `runs` seeded generations, and how many steps rejected part of a draft."""
    samples, rejections = [], 0
    for seed in range(runs):
        out = speculative_generate(REAL_PROMPT, target, drafter, gamma=REAL_GAMMA, sampler=Sampler(1.0),
                                   max_new_tokens=REAL_LENGTH, seed=seed,
                                   seed_rule="stream", first_target=False, eos_token_ids=[])
        samples.append(tuple(out.tokens))
        rejections += sum(step.num_accepted < len(step.draft_tokens) for step in out.steps)
    return samples, rejections


@pytest.mark.slow
def test_on_a_tiny_transformer_with_real_kv_caches():
    target, drafter = _real_pair()
    joint = _real_joint(target, Sampler(1.0))
    assert max(joint.values()) < 0.4  # spread out enough for the test to mean something
    samples, rejections = _real_samples(target, ModelDrafter(drafter), REAL_RUNS)
    assert rejections > REAL_RUNS  # the target's cache was cropped in most runs
    assert chi_square_pvalue(samples, joint) > ALPHA


@pytest.mark.slow
def test_the_real_cache_test_catches_a_crop_that_removes_the_wrong_positions(monkeypatch):
    """Power check: a crop that keeps the right number of positions but drops the oldest ones
    (a slicing slip in a cache backend) leaves a cache of the right length and silently wrong
    contents; the joint test above rejects it."""

    @torch.inference_mode()
    def drop_oldest(cache, length):
        remove = cache.get_seq_length() - length
        if remove > 0:
            for layer in cache.layers:  # in place: a slab layer writes its next pass after `length`
                kept = layer.keys[..., remove:, :].clone(), layer.values[..., remove:, :].clone()
                layer.crop(-remove)
                layer.keys.copy_(kept[0])
                layer.values.copy_(kept[1])

    target, drafter = _real_pair()
    drafter = ModelDrafter(drafter)
    monkeypatch.setattr(generate_module, "crop_cache", drop_oldest)  # the loop's crop of the target's cache
    samples, _ = _real_samples(target, drafter, REAL_RUNS)  # as many runs as the test above
    assert chi_square_pvalue(samples, _real_joint(target, Sampler(1.0))) < 1e-6


@pytest.mark.parametrize("keep", [1, None], ids=["one-position-too-few", "no-crop"])
def test_a_crop_that_keeps_rejected_positions_stops_the_loop(monkeypatch, keep):
    """A target cache left longer than the sequence cannot go unnoticed: the next pass feeds only
    the draft (or nothing) and returns fewer rows of logits than the loop needs, so the loop stops
    with an error (today a SpecdecError about target_probs' shape, or a TypeError from the model
    on an empty input) instead of producing samples."""
    right = generate_module.crop_cache
    broken_crops = []

    def keep_too_much(cache, length):
        broken_crops.append(length)
        if keep is not None:
            right(cache, length + keep)

    target, drafter = _real_pair()
    drafter = ModelDrafter(drafter)
    monkeypatch.setattr(generate_module, "crop_cache", keep_too_much)
    with pytest.raises(Exception):
        _real_samples(target, drafter, 30)
    assert broken_crops  # the error came after a broken crop, not from the set-up
