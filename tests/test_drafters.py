"""Drafters (n-gram, prompt lookup) and schedules: their rules, greedy identity, sampling exactness."""

import pytest
import torch

from specdec import GREEDY, Sampler, SpecdecError, autoregressive_generate, speculative_generate
from specdec.drafters import LookupDrafter, NgramDrafter
from specdec.drafters.lookup import find_continuation
from specdec.drafters.ngram import count_ngrams
from specdec.schedules import EGAG, Confidence, Heuristic, make_schedule, normalized_entropy

from conftest import TableModel, tiny_model
from test_sampling_exactness import ALPHA, chi_square_pvalue, exact_joint


def _never_stop(drafted, logits):
    return True


class _Target:
    vocab_size = 10


def test_lookup_copies_what_followed_the_latest_occurrence_of_the_longest_suffix():
    context = [1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3]
    # suffix [2, 3] last occurred at 5..6 (followed by 4, 5, 7); the earlier one at 1..2 is older
    assert find_continuation(context, 3, 1, 3) == [4, 5, 7]
    assert find_continuation([5, 6, 7], 3, 1, 4) == []  # nothing recurs: no draft, no filler
    assert find_continuation([4, 8, 4], 2, 1, 5) == [8, 4]  # backs off to a 1-token suffix
    assert find_continuation([4, 8, 4], 2, 2, 5) == []


def test_ngram_backs_off_from_the_longest_seen_context_and_gives_counts_as_q():
    drafter = NgramDrafter(n=3)
    drafter.check_target(_Target())
    drafter.start([])
    context = [1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 2]
    draft = drafter.propose(context, 1, Sampler(1.0), torch.Generator().manual_seed(0), _never_stop)
    # after [5, 2] (never seen) it backs off to [2]: followed by 3, 4, 3
    assert draft.probs is not None and draft.probs.shape == (1, 10)
    assert draft.probs[0, 3] == pytest.approx(2 / 3) and draft.probs[0, 4] == pytest.approx(1 / 3)
    assert draft.tokens[0] in (3, 4)
    greedy = drafter.propose(context + [3], 4, GREEDY, torch.Generator(), _never_stop)
    assert greedy.tokens[:3] == [1, 2, 3] and greedy.probs is None  # [2, 3] -> 1 -> [3, 1] -> 2 -> ...
    assert drafter.propose([7, 8], 3, GREEDY, torch.Generator(), _never_stop).tokens == []  # nothing seen


def test_ngram_counts_and_corpus_seeding():
    counts = count_ngrams([1, 2, 1, 2, 3], n=3)
    assert dict(counts[(1,)]) == {2: 2} and dict(counts[(1, 2)]) == {1: 1, 3: 1}
    drafter = NgramDrafter(n=2, corpus_tokens=[6, 7, 6, 7])
    drafter.check_target(_Target())
    drafter.start([])
    assert drafter.propose([6], 3, GREEDY, torch.Generator(), _never_stop).tokens == [7, 6, 7]
    with pytest.raises(SpecdecError, match="n >= 2"):
        NgramDrafter(n=1)


def test_heuristic_schedule_grows_and_shrinks_within_bounds():
    s = Heuristic(gamma=3, gamma_min=2, gamma_max=6)
    s.update(3, 3)
    assert s.budget() == 5
    s.update(5, 5)
    assert s.budget() == 6
    for _ in range(10):
        s.update(6, 0)
    assert s.budget() == 2
    s.reset()
    assert s.budget() == 3


def test_confidence_schedule_stops_below_the_threshold():
    s = Confidence(threshold=0.5, gamma_max=8)
    sure, unsure = torch.tensor([5.0, 0.0, 0.0]), torch.tensor([0.1, 0.0, 0.0])
    assert s.budget() == 8 and s.keep_going(1, sure) and not s.keep_going(1, unsure)


def test_egag_sets_gamma_from_the_normalised_entropy_with_an_ema():
    uniform, peaked = torch.zeros(8), torch.tensor([20.0] + [0.0] * 7)
    assert normalized_entropy(uniform) == pytest.approx(1.0)
    assert normalized_entropy(peaked) == pytest.approx(0.0, abs=1e-6)
    s = EGAG(gamma_min=2, gamma_max=10)
    s.keep_going(1, peaked)
    assert s.step_info()["gamma"] == 10
    s.keep_going(1, uniform)
    assert s.step_info()["gamma"] == 2  # (1 - 1) * 10 = 0, clamped to gamma_min
    half = EGAG(gamma_min=1, gamma_max=10, beta=0.5)
    half.keep_going(1, peaked)
    half.keep_going(1, uniform)
    assert half.step_info()["h_norm"] == pytest.approx(0.5, abs=1e-6) and half.step_info()["gamma"] == 5
    assert half.keep_going(4, None) and not half.keep_going(5, None)


@pytest.mark.parametrize("bad", [dict(name="nope"), dict(name="fixed", gamma=0), dict(name="egag", gamma_min=5, gamma_max=2),
                                 dict(name="confidence", confidence=1.5), dict(name="egag", beta=1.0)])
def test_schedule_errors_are_clear(bad):
    with pytest.raises(SpecdecError):
        make_schedule(**bad)


@pytest.fixture(scope="module")
def tiny_pair():
    return tiny_model(0, vocab=64, layers=2, name="tiny-target"), tiny_model(1, vocab=64, layers=1, name="tiny-drafter")


VARIANTS = {
    "ngram": lambda d: dict(drafter=NgramDrafter(3)),
    "lookup": lambda d: dict(drafter=LookupDrafter()),
    "heuristic": lambda d: dict(drafter=d, schedule=make_schedule("heuristic", 2, 1, 6)),
    "confidence": lambda d: dict(drafter=d, schedule=make_schedule("confidence", confidence=0.5, gamma_max=6)),
    "egag": lambda d: dict(drafter=d, schedule=make_schedule("egag", gamma_min=1, gamma_max=6, beta=0.3)),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_drafter_and_schedule_is_greedy_identical_on_tiny_models(tiny_pair, variant):
    target, drafter = tiny_pair
    for prompt in ([3, 7, 9, 3, 7], [5], list(range(10, 30))):
        ar = autoregressive_generate(prompt, target, max_new_tokens=40, eos_token_ids=[])
        sd = speculative_generate(prompt, target, max_new_tokens=40, eos_token_ids=[], **VARIANTS[variant](drafter))
        assert sd.tokens == ar.tokens


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_drafter_and_schedule_is_greedy_identical_on_real_smollm2(smollm2, smollm2_drafters, variant):
    prompt = smollm2.encode("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):")
    ar = autoregressive_generate(prompt, smollm2, max_new_tokens=40)
    sd = speculative_generate(prompt, smollm2, max_new_tokens=40, **VARIANTS[variant](smollm2_drafters[1]))
    assert sd.tokens == ar.tokens
    assert sd.stats.drafted > 0 and sd.stats.target_forwards < ar.stats.target_forwards


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_drafter_and_schedule_is_exact_under_sampling(variant):
    """Joint law of the first 3 tokens (chi-square at 1e-4), vocabulary 5: n-grams and lookups recur."""
    target, drafter = TableModel(vocab=5, seed=0), TableModel(vocab=5, seed=1)
    sampler, prompt, length = Sampler(1.0), [2, 3, 4, 2, 3, 4, 2], 3
    joint = exact_joint(target, prompt, length, sampler)
    samples, drafted = [], 0
    for seed in range(5_000):
        out = speculative_generate(prompt, target, sampler=sampler, max_new_tokens=length, seed=seed,
                                   first_target=False, **VARIANTS[variant](drafter))
        samples.append(tuple(out.tokens))
        drafted += out.stats.drafted
    assert drafted >= 5_000  # the drafter really proposed (a token per run on average)
    assert chi_square_pvalue(samples, joint) > ALPHA
