"""Drafters (n-gram, prompt lookup) and schedules: their rules, greedy identity, sampling exactness."""

import pytest
import torch

from specdec import GREEDY, Sampler, SpecdecError, autoregressive_generate, speculative_generate
from specdec.drafters import LookupDrafter, NgramDrafter, SuffixDrafter
from specdec.drafters.lookup import find_continuation, find_continuations
from specdec.drafters.ngram import count_ngrams
from specdec.sizing.schedules import EGAG, Confidence, CostAware, Heuristic, make_schedule, normalized_entropy

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
    # transformers' choice: the first occurrence (here the one followed by 9, 1, 2)
    assert find_continuation(context, 3, 1, 3, earliest=True) == [9, 1, 2]


def test_lookup_tries_gather_the_latest_the_earliest_then_the_other_occurrences():
    context = [7, 1, 2, 7, 3, 7, 4, 7, 5, 5, 7]
    # suffix [7] (no longer suffix recurs): occurrences at 0, 3, 5, 7 -> latest 7, earliest 0, then 5, 3
    assert find_continuations(context, 2, 1, 2, 4) == [[5, 5], [1, 2], [4, 7], [3, 7]]
    assert find_continuations(context, 2, 1, 2, 2) == [[5, 5], [1, 2]]
    # a continuation that is a prefix of one already found adds nothing
    assert find_continuations([1, 2, 1, 2, 9, 1], 1, 1, 1, 4) == [[2]]
    assert find_continuations([3, 4, 3, 4, 3], 1, 1, 3, 4) == [[4, 3], [4, 3, 4]]  # the trie merges these


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


@pytest.mark.parametrize("gamma,gamma_min,gamma_max", [(8, 1, 6), (1, 2, 6), (7, 7, 6)])
def test_heuristic_schedule_starts_within_its_bounds(gamma, gamma_min, gamma_max):
    with pytest.raises(SpecdecError, match="gamma"):
        Heuristic(gamma=gamma, gamma_min=gamma_min, gamma_max=gamma_max)
    with pytest.raises(SpecdecError, match="gamma"):
        make_schedule("heuristic", gamma, gamma_min, gamma_max)
    assert Heuristic(gamma=6, gamma_min=6, gamma_max=6).budget() == 6  # the bounds themselves are fine


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


def test_cost_schedule_stops_when_the_draft_is_unlikely_to_pay_for_another_token():
    s = CostAware(gamma_max=12, threshold=0.5, warmup=2)
    sure = torch.tensor([torch.tensor(0.9).logit().item(), 0.0]) + 0.0  # top probability 0.9 (vocabulary 2)
    assert s.budget() == 12
    # prior θ = 0.5: 0.9, 0.81, 0.73, 0.66, 0.59, 0.53 pass; 0.9^7 = 0.48 stops
    assert all(s.keep_going(k, sure) for k in range(1, 7)) and not s.keep_going(7, sure)
    assert s.keep_going(1, sure)  # a new step starts afresh
    # verification takes 0.1 s + 0.02 s per scored token; drafter passes 0.05 s; 8 tokens per 1.0 s
    s.timing(0.25, 5, 0.1 + 0.02 * 6, 6, 4)
    assert s.threshold == 0.5  # still warming up
    s.timing(0.45, 9, 0.1 + 0.02 * 10, 10, 4)
    rate = 8 / (0.25 + 0.22 + 0.45 + 0.3)  # 6.6 tok/s, below plain decoding's 1 / 0.12 s
    assert s.threshold == pytest.approx(1 / 0.12 * (0.05 + 0.02))
    s.timing(0.05, 1, 0.1 + 0.02 * 2, 2, 1)
    s.timing(0.05, 1, 0.1 + 0.02 * 2, 2, 1)
    s.timing(0.75, 15, 0.1 + 0.02 * 16, 16, 16)  # a long accepted run lifts the rate above that
    rate = 26 / (1.22 + 2 * 0.19 + 1.17)
    assert rate > 1 / 0.12 and s.threshold == pytest.approx(rate * (0.05 + 0.02))
    assert s.step_info() == {"threshold": s.threshold}
    s.reset()
    assert s.threshold == 0.5


def test_cost_schedule_counts_a_lookup_token_with_the_observed_acceptance():
    s = CostAware(gamma_max=20, threshold=0.5)
    # nothing observed yet: (0 + 1) / (0 + 2) = 0.5 per token, so 0.5 passes and 0.25 stops
    assert s.keep_going(1, None) and not s.keep_going(2, None)
    for _ in range(10):
        s.update(5, 5)  # lookup drafts that the target kept: (50 + 1) / 52 per token
    assert all(s.keep_going(k, None) for k in range(1, 20))
    s.reset()
    for _ in range(10):
        s.update(5, 0)  # every lookup token rejected: one token a step
    assert not s.keep_going(1, None)


def test_cost_schedule_threshold_falls_when_drafting_is_cheap():
    cheap, dear = CostAware(warmup=1), CostAware(warmup=1)
    for width in (3, 7, 5):
        cheap.timing(0.01 * (width - 1), width - 1, 0.3 + 0.01 * width, width, 4)
        dear.timing(0.1 * (width - 1), width - 1, 0.3 + 0.01 * width, width, 4)
    assert cheap.threshold < dear.threshold


def _policy_decisions(kind: str, draft_step: tuple[float, int], plain_step: tuple[float, int],
                      steps: int = 80) -> list[bool]:
    """A cost policy fed simulated steps: (seconds, tokens) of a step that drafted (width 4) or not
    (width 1). The tree drafters ask a TreeCost `should_draft`; the chain loop asks a CostAware
    for its `budget` (0: no draft)."""
    from specdec.sizing.schedules import TreeCost

    policy, decisions = (TreeCost if kind == "tree" else CostAware)(warmup=2, probe=4), []
    policy.timing(3.0, 1, 1.0, 4, 3)  # the prompt step: left out of the rates
    for _ in range(steps):
        drafts = policy.should_draft() if kind == "tree" else policy.budget() > 0
        decisions.append(drafts)
        seconds, tokens = draft_step if drafts else plain_step
        policy.timing(seconds * 0.3, 1 if drafts else 0, seconds * 0.7, 4 if drafts else 1, tokens)
    return decisions


@pytest.mark.parametrize("kind", ["tree", "chain"])
def test_cost_policy_drafts_nothing_where_drafting_is_measured_slower(kind):
    """The draft-nothing rule compares measured tokens per second of both kinds of step: a linear
    cost model misprices the 1 -> 2 row jump, which is exactly what this decision turns on."""
    slow = _policy_decisions(kind, draft_step=(0.7, 1), plain_step=(0.35, 1))  # drafting: 1.4 tok/s, plain 2.9
    assert slow[:3] == [True, True, False]  # drafts until 2 drafting steps are timed, then one plain baseline
    probes = [i for i, drafts in enumerate(slow) if drafts and i > 2]
    assert probes == [6, 14, 30, 62]  # then plain, probing as the 4th, 8th, 16th, 32nd decision (probe=4)
    fast = _policy_decisions(kind, draft_step=(0.5, 3), plain_step=(0.35, 1))  # drafting: 6 tok/s
    assert fast[:3] == [True, True, False]
    assert [i for i, drafts in enumerate(fast) if not drafts and i > 2] == [18, 50]  # the 16th, then 32nd decision


def test_tree_policy_drafts_while_unmeasured():
    from specdec.sizing.schedules import TreeCost

    policy = TreeCost()
    assert all(policy.should_draft() for _ in range(20))  # no timings (a seed under sampling): the priors
    with pytest.raises(SpecdecError, match="decay"):
        TreeCost(decay=0.0)


def test_cost_schedule_leaves_the_drafters_prompt_pass_out_of_its_pass_time():
    """The first step's drafting holds the drafter's prompt pass (seconds on a long prompt): counted
    as a drafter pass, it made one pass look dearer than a target pass and trees stop drafting."""
    with_prompt, without = CostAware(warmup=1), CostAware(warmup=1)
    with_prompt.timing(5.0, 1, 0.3, 2, 2)
    without.timing(0.1, 1, 0.3, 2, 2)
    for schedule in (with_prompt, without):
        for width in (3, 7, 5):
            schedule.timing(0.1 * (width - 1), width - 1, 0.3 + 0.01 * width, width, 4)
    assert with_prompt.measured[1] == pytest.approx(without.measured[1]) == pytest.approx(0.1)


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
    "cost": lambda d: dict(drafter=d, schedule=make_schedule("cost", gamma_max=6)),
    "lookup-cost": lambda d: dict(drafter=LookupDrafter(), schedule=make_schedule("cost", gamma_max=6)),
    "suffix-cost": lambda d: dict(drafter=SuffixDrafter(), schedule=make_schedule("cost", gamma_max=6)),
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
    assert sd.stats.drafted > 0 and sd.stats.target_passes < ar.stats.target_passes


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.slow
def test_every_drafter_and_schedule_is_exact_under_sampling(variant):
    """Joint law of the first 3 tokens (chi-square at 1e-4), vocabulary 5: n-grams and lookups recur."""
    target, drafter = TableModel(vocab=5, seed=0), TableModel(vocab=5, seed=1)
    sampler, prompt, length = Sampler(1.0), [2, 3, 4, 2, 3, 4, 2], 3
    joint = exact_joint(target, prompt, length, sampler)
    samples, drafted = [], 0
    for seed in range(5_000):
        out = speculative_generate(prompt, target, sampler=sampler, max_new_tokens=length, seed=seed,
                                   seed_rule="stream",
                                   first_target=False, **VARIANTS[variant](drafter))
        samples.append(tuple(out.tokens))
        drafted += out.stats.drafted
    assert drafted >= 5_000  # the drafter really proposed (a token per run on average)
    assert chi_square_pvalue(samples, joint) > ALPHA
