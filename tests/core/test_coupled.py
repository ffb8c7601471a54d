"""Seeded sampling by Gumbel-max coupling: a seeded output is the seeded AR output, whatever
drafted it, and each token still follows the target's law (verify.verify_coupled, samplers.race)."""

from __future__ import annotations

import pytest
import torch

import specdec.decoding.loop as generate
from specdec import Sampler, autoregressive_generate, generate_many, speculative_generate
from specdec.drafters import (CascadeDrafter, LookaheadDrafter, LookupDrafter, NgramDrafter, OtherTokenizerDrafter,
                              SuffixDrafter, make_tree_drafter)
from specdec.drafters import SidesDrafter
from specdec.drafters.layerskip import LayerSkipModel, self_skip_drafter
from specdec.drafters.medusa import MedusaDrafter
from specdec.core.samplers import SeededNoise, position_noise, race
from specdec.sizing.schedules import CostAware, TreeCost
from specdec.core.trees import depths
from specdec.core.verify import verify_coupled, verify_tree_coupled

from conftest import TableModel, tiny_model, tiny_parallel
from test_retokenize import CharTokenizer
from test_sampling_exactness import ALPHA, chi_square_pvalue, exact_joint
from test_self_drafting import _random_heads

DRAWS = 100_000  # the tensor tests' draws (the issue's bar: >= 10^5)


def _exp_noise(shape, seed: int) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.float64).exponential_(generator=torch.Generator().manual_seed(seed))


def _laws(rows: int, vocab: int, seed: int, sharpness: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g) * sharpness).softmax(-1)


def _pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square of tokens [n] against the law probs [V]."""
    return chi_square_pvalue([(int(t),) for t in tokens], {(x,): float(p) for x, p in enumerate(probs) if p > 0})


# --- the noise and the race ----------------------------------------------------------------------

def test_the_noise_is_a_function_of_seed_and_position_alone():
    a = position_noise(7, 12, 50)
    assert torch.equal(a, position_noise(7, 12, 50))
    assert not torch.equal(a, position_noise(7, 13, 50)) and not torch.equal(a, position_noise(8, 12, 50))
    wide = position_noise(7, 12, 20_000)  # several blocks: a narrower vocabulary races its ids alike
    assert torch.equal(wide[:50], a) and torch.equal(wide[:9000], position_noise(7, 12, 9000))
    assert len(set(wide.tolist())) == 20_000  # no block repeats another
    noise = SeededNoise(7)
    assert torch.equal(noise.rows([12, 13], 50), torch.stack([a, position_noise(7, 13, 50)]).float())
    noise.forget(13)
    assert torch.equal(noise.row(13, 50), position_noise(7, 13, 50).float())
    # Exp(1) races: mean 1 and P(E > 1) = 1/e, over 10^5 draws (5 sigma)
    sample = torch.cat([position_noise(3, s, 1000) for s in range(100)])
    assert abs(float(sample.mean()) - 1) < 5 / len(sample) ** 0.5
    assert abs(float((sample > 1).double().mean()) - 0.36788) < 5 * 0.482 / len(sample) ** 0.5


def test_the_race_draws_from_p_and_never_a_token_of_probability_zero():
    probs = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05, 0.0])
    tokens = race(probs.expand(DRAWS, -1), _exp_noise((DRAWS, 6), 0))
    assert set(tokens.tolist()) <= {0, 2, 3, 4}
    assert _pvalue(tokens, probs) > ALPHA
    skewed = race(probs.expand(DRAWS, -1), _exp_noise((DRAWS, 6), 0) ** 1.1)  # not Exp(1) noise: biased
    assert _pvalue(skewed, probs) < ALPHA


# --- chains --------------------------------------------------------------------------------------

def _chain_trial(noise_of_row, seed: int = 0):
    """DRAWS batched chain verifications, γ = 2, a drafter coupled through the races of positions
    0 and 1; target row i takes `noise_of_row[i]`'s races -> (p, q, emitted tokens, accepted)."""
    vocab = 6
    p, q = _laws(3, vocab, 1), _laws(2, vocab, 2)
    races = _exp_noise((DRAWS, 3, vocab), seed)
    draft = race(q.expand(DRAWS, -1, -1), races[:, :2])
    accepted, next_token = verify_coupled(p.expand(DRAWS, -1, -1), races[:, noise_of_row], draft)
    return p, q, draft, accepted, next_token


def test_coupled_chains_emit_the_target_law_and_accept_within_the_coupling_bounds():
    p, q, draft, accepted, next_token = _chain_trial([0, 1, 2])
    first = torch.where(accepted > 0, draft[:, 0], next_token)
    assert _pvalue(first, p[0]) > ALPHA
    # the token after an accepted first one follows p's second row: the races of position 1 are
    # independent of what decided position 0
    kept = accepted > 0
    second = torch.where(accepted[kept] > 1, draft[kept, 1], next_token[kept])
    assert kept.sum() > DRAWS / 10 and _pvalue(second, p[1]) > ALPHA
    tv = 0.5 * float((p[0] - q[0]).abs().sum())
    rate, slack = float(kept.double().mean()), 5 * 0.5 / DRAWS ** 0.5
    assert (1 - tv) / (1 + tv) - slack < rate < 1 - tv + slack  # Daliri et al.'s bound; no coupling beats 1 - TV


def test_the_chain_law_test_catches_a_wrong_noise_index():
    """The bug a position off by one makes: the bonus row reads the races its parent's token used."""
    p, q, draft, accepted, next_token = _chain_trial([0, 0, 1])
    kept = accepted > 0
    second = torch.where(accepted[kept] > 1, draft[kept, 1], next_token[kept])
    assert _pvalue(second, p[1]) < ALPHA


# --- trees ---------------------------------------------------------------------------------------

# root -> a (node 0) -> c (node 2); root -> b (node 1); target rows: root, a, b, c
TREE_TOKENS, TREE_PARENTS, VOCAB = [0, 1, 2], [-1, -1, 0], 4


def _tree_law(p: torch.Tensor) -> dict:
    a, b, c = TREE_TOKENS
    law = {}
    for x in range(VOCAB):
        if x == a:
            for y in range(VOCAB):
                if y == c:
                    for z in range(VOCAB):
                        law[(a, c, z)] = float(p[0, a] * p[1, c] * p[3, z])
                else:
                    law[(a, y)] = float(p[0, a] * p[1, y])
        elif x == b:
            for y in range(VOCAB):
                law[(b, y)] = float(p[0, b] * p[2, y])
        else:
            law[(x,)] = float(p[0, x])
    return law


def _tree_samples(positions_of_rows) -> tuple[list[tuple], dict]:
    p = _laws(4, VOCAB, 5, sharpness=1.0)
    races = _exp_noise((DRAWS, 3, VOCAB), 1)
    last, next_token = verify_tree_coupled(p.expand(DRAWS, -1, -1), races[:, positions_of_rows],
                                           torch.tensor(TREE_TOKENS).expand(DRAWS, -1), TREE_PARENTS)
    paths = {-1: (), 0: (0,), 1: (1,), 2: (0, 2)}
    samples = [paths[int(n)] + (int(t),) for n, t in zip(last, next_token)]
    return samples, _tree_law(p)


def test_coupled_trees_emit_the_target_law():
    samples, law = _tree_samples([0, 1, 1, 2])  # a row at depth d takes the races of position d
    assert sum(len(s) == 3 for s in samples) > DRAWS / 20  # the deep path is taken
    assert chi_square_pvalue(samples, law) > ALPHA


def test_the_tree_law_test_catches_a_wrong_noise_index():
    samples, law = _tree_samples([0, 0, 0, 1])  # each node's row reads the races its own token used
    assert chi_square_pvalue(samples, law) < ALPHA


# --- every method gives the seeded AR output -----------------------------------------------------

SAMPLER = Sampler(temperature=0.8, top_p=0.95)
PROMPTS = [[2, 5, 7, 9, 11, 5, 7], [3, 3, 4, 8, 3, 3, 4], [4, 6, 4, 6, 4, 6], [9, 1, 12, 9, 1], [5, 5, 5, 13]]
SEEDS = [7, 8, 9, 10, 11]
LENGTH = 24


def _wide(nodes: int = 12) -> TreeCost:
    return TreeCost(threshold=0.02, node_threshold=1e-4, max_nodes=nodes, warmup=10**9)


@pytest.fixture(scope="module")
def models():
    target = tiny_model(1, vocab=32, exact_rows=True)
    drafter = tiny_model(2, vocab=32, layers=1, logit_scale=0.3, exact_rows=True, role="drafter")
    return target, drafter


METHODS = {  # name -> (drafter factory from (target, drafter), draft-length schedule factory or None)
    "chain": (lambda t, d: d, lambda: CostAware(gamma_max=6)),
    "lookup": (lambda t, d: LookupDrafter, None),
    "suffix": (lambda t, d: SuffixDrafter, None),
    "ngram": (lambda t, d: lambda: NgramDrafter(3), None),
    "cascade": (lambda t, d: lambda: CascadeDrafter(d), None),
    **{f"tree-{kind}": ((lambda kind: lambda t, d: lambda: make_tree_drafter(kind, d, 12))(kind), None)
       for kind in ("sides", "eagle2", "sequoia", "lookup", "mixed", "suffix", "mixed-suffix")},
    "lookahead": (lambda t, d: lambda: LookaheadDrafter(3, 3, 2, policy=_wide()), None),
    "parallel": (lambda t, d: _parallel_drafters(), lambda: CostAware(gamma_max=6)),
}


def _parallel_drafters():
    from specdec.drafters.parallel import ParallelDrafter

    model = tiny_parallel(2, vocab=32, k=4, exact_rows=True, logit_scale=0.3)
    return lambda: ParallelDrafter(model)


def _ar(target) -> list[list[int]]:
    return [autoregressive_generate(p, target, SAMPLER, max_new_tokens=LENGTH, eos_token_ids=[], seed=s).tokens
            for p, s in zip(PROMPTS, SEEDS)]


@pytest.mark.parametrize("method", METHODS)
def test_every_method_gives_the_seeded_ar_output_alone_and_in_batches_of_2_and_5(models, method):
    target, drafter = models
    expected = _ar(target)
    made, schedule = METHODS[method]
    source = made(target, drafter)
    drafted = 0
    for prompt, seed, want in zip(PROMPTS, SEEDS, expected):
        one = source() if callable(source) and not hasattr(source, "forward") else source
        out = speculative_generate(prompt, target, one, sampler=SAMPLER, max_new_tokens=LENGTH, eos_token_ids=[],
                                   seed=seed, gamma=4, schedule=schedule() if schedule else None)
        assert out.tokens == want, method
        drafted += out.stats.drafted
    assert drafted > 0  # not vacuous: something was drafted and verified
    for batch in (2, 5):
        results = generate_many(PROMPTS, target, source, max_batch=batch, seeds=SEEDS, sampler=SAMPLER,
                                max_new_tokens=LENGTH, eos_token_ids=[], gamma=4, schedule=schedule)
        assert [r.tokens for r in results] == expected, (method, batch)


@pytest.mark.slow
def test_self_drafting_gives_the_seeded_ar_output():
    """Medusa heads and skipped layers (one sequence: the engine does not batch them)."""
    target = tiny_model(1, vocab=32, layers=4)
    heads = _random_heads(target)
    drafters = {"medusa": lambda: MedusaDrafter(heads, 3, policy=_wide()),
                "self-skip": lambda: self_skip_drafter(target, [2]),
                "self-skip tree": lambda: SidesDrafter(LayerSkipModel(target, [2]), 3, policy=_wide())}
    for name, made in drafters.items():
        accepted = 0
        for prompt, seed in zip(PROMPTS, SEEDS):
            want = autoregressive_generate(prompt, target, SAMPLER, max_new_tokens=LENGTH, eos_token_ids=[], seed=seed)
            out = speculative_generate(prompt, target, made(), gamma=6, sampler=SAMPLER, max_new_tokens=LENGTH,
                                       eos_token_ids=[], seed=seed)
            assert out.tokens == want.tokens, name
            accepted += out.stats.accepted
        assert accepted > 0, name


def test_a_drafter_of_another_tokenizer_gives_the_seeded_ar_output():
    from test_retokenize import _pair

    target, drafter = _pair()
    for mode in ("text", "intersection"):
        for seed in range(20):
            want = autoregressive_generate([0, 1, 2, 0, 1], target, SAMPLER, max_new_tokens=12, eos_token_ids=[],
                                           seed=seed)
            out = speculative_generate([0, 1, 2, 0, 1], target, OtherTokenizerDrafter(drafter, mode=mode), gamma=4,
                                       sampler=SAMPLER, max_new_tokens=12, eos_token_ids=[], seed=seed)
            assert out.tokens == want.tokens, (mode, seed)


def test_the_drafter_is_coupled_a_target_drafting_for_itself_is_always_accepted(models):
    """Each drafter draws with the races of the position its token takes: with q = p every draft
    token is the target's own (a drafter sampling on its own draws would be accepted by chance)."""
    target, _ = models
    for drafter in (target, CascadeDrafter(target), make_tree_drafter("sides", target, 8)):
        out = speculative_generate(PROMPTS[0], target, drafter, gamma=4, sampler=SAMPLER, max_new_tokens=LENGTH,
                                   eos_token_ids=[], seed=3)
        assert out.stats.drafted > LENGTH / 2, type(drafter).__name__
        for step in out.steps:  # every chain token kept (a tree: its path as deep as the tree)
            if step.tree_parents is None:
                assert step.num_accepted == len(step.draft_tokens)
            elif step.tree_parents:
                assert len(step.path) == max(depths(step.tree_parents)), type(drafter).__name__


def test_coupling_raises_acceptance_over_the_uncoupled_draws(models):
    target, drafter = models
    rates = {}
    for rule in ("coupled", "stream"):
        accepted = drafted = 0
        for prompt, seed in zip(PROMPTS, SEEDS):
            out = speculative_generate(prompt, target, drafter, gamma=3, sampler=Sampler(1.0), max_new_tokens=LENGTH,
                                       eos_token_ids=[], seed=seed, seed_rule=rule)
            accepted, drafted = accepted + out.stats.accepted, drafted + out.stats.drafted
        rates[rule] = accepted / drafted
    assert rates["coupled"] > 0.5 * rates["stream"]  # same order: (1 - TV) / (1 + TV) against 1 - TV


# --- the loop's own bookkeeping: positions, with power --------------------------------------------

def _loop_pvalue(runs: int = 3_000) -> float:
    target = TableModel(vocab=3, seed=0, sharpness=1.0)
    drafter = TableModel(vocab=3, seed=1, sharpness=1.0)
    sampler, prompt, length = Sampler(1.0), [0, 1], 3
    joint = exact_joint(target, prompt, length, sampler)
    samples = [tuple(speculative_generate(prompt, target, drafter, gamma=3, sampler=sampler, max_new_tokens=length,
                                          eos_token_ids=[], seed=s, first_target=False).tokens) for s in range(runs)]
    return chi_square_pvalue(samples, joint)


@pytest.mark.slow
def test_coupled_generation_follows_the_target_joint_law():
    assert _loop_pvalue() > ALPHA


@pytest.mark.slow
def test_the_joint_law_test_catches_the_loop_reading_the_races_a_position_early(monkeypatch):
    from specdec.decoding.verifier import Verifier

    real = Verifier._races
    monkeypatch.setattr(Verifier, "_races",
                        lambda self, start, offsets, vocab: real(self, start, [max(0, o - 1) for o in offsets], vocab))
    assert _loop_pvalue() < ALPHA


def test_a_seed_rule_outside_the_two_is_refused():
    target = TableModel(vocab=3, seed=0)
    with pytest.raises(Exception, match="seed_rule"):
        speculative_generate([0, 1], target, target, sampler=Sampler(1.0), seed=1, seed_rule="coupld")


def test_the_coupled_acceptance_formula_matches_the_races_and_sits_within_the_bounds():
    from specdec.sizing.theory import acceptance_beta, coupled_acceptance

    p, q = _laws(3, 12, 7, sharpness=1.2), _laws(3, 12, 8, sharpness=1.2)
    exact = coupled_acceptance(p, q)
    races = _exp_noise((DRAWS, 3, 12), 4)
    empirical = (race(p.expand(DRAWS, -1, -1), races) == race(q.expand(DRAWS, -1, -1), races)).double().mean(0)
    assert torch.allclose(exact.double(), empirical, atol=5 * 0.5 / DRAWS ** 0.5)
    beta = acceptance_beta(p, q)
    assert bool((beta / (2 - beta) <= exact + 1e-6).all() and (exact <= beta + 1e-6).all())
    same = coupled_acceptance(p, p)
    assert torch.allclose(same, torch.ones(3), atol=1e-5)  # a drafter that is the target always agrees
