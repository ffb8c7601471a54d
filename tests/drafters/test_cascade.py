"""Cascade drafting: a model-free stage guesses the drafter model's tokens, and the drafter keeps
those its own rule draws, so its drafts still follow its q exactly."""

from __future__ import annotations

import pytest
import torch

from specdec import GREEDY, Sampler, SpecdecError, autoregressive_generate, speculative_generate
from specdec.drafters import ModelDrafter
from specdec.drafters import cascade
from specdec.drafters.cascade import CascadeDrafter
from specdec.backends.cache import cache_length

from conftest import tiny_model
from test_sampling_exactness import (ALPHA, DEEP_PROMPT, _cyclic_target, _near_model_drafter, chi_square_pvalue,
                                     exact_joint)


@pytest.mark.parametrize("stage", ["suffix", "lookup"])
@pytest.mark.slow
def test_greedy_cascade_equals_ar_and_saves_drafter_passes(stage):
    target, model = tiny_model(1, vocab=32), tiny_model(1, vocab=32, layers=2, name="same")  # drafter = target
    prompt = [2, 5, 7, 9, 11, 5, 7, 9, 11, 5]
    expected = autoregressive_generate(prompt, target, max_new_tokens=40, eos_token_ids=[]).tokens
    drafter = CascadeDrafter(model, stage)
    result = speculative_generate(prompt, target, drafter, gamma=6, max_new_tokens=40, eos_token_ids=[])
    assert result.tokens == expected
    plain = speculative_generate(prompt, target, ModelDrafter(model), gamma=6, max_new_tokens=40, eos_token_ids=[])
    assert plain.stats.drafted == result.stats.drafted  # the same drafts (the drafter is the target here)
    assert drafter.kept > 0 and result.stats.drafter_passes < plain.stats.drafter_passes


@pytest.mark.slow
def test_sampled_cascade_keeps_the_joint_law_and_a_biased_guess_rule_breaks_it(monkeypatch):
    target, sampler, length = _cyclic_target(), Sampler(1.0), 5
    joint = exact_joint(target, DEEP_PROMPT, length, sampler)

    def run(seeds: range) -> tuple[list, int, int]:
        samples, kept, guessed = [], 0, 0
        for seed in seeds:
            drafter = CascadeDrafter(_near_model_drafter(target), "suffix")
            out = speculative_generate(DEEP_PROMPT, target, drafter, gamma=4, sampler=sampler, max_new_tokens=length,
                                       seed=seed, seed_rule="stream", first_target=False)
            samples.append(tuple(out.tokens))
            kept, guessed = kept + drafter.kept, guessed + drafter.guessed
        return samples, kept, guessed

    samples, kept, guessed = run(range(2_000))
    assert 0.2 * guessed < kept < 0.95 * guessed  # guesses kept and refused, both often
    assert chi_square_pvalue(samples, joint) > ALPHA

    real = cascade._draw

    def keeps_guesses(logits, q, guess, generator, position):  # a guess kept at q's top instead of q(g)
        if q is not None and guess is not None and torch.rand((), generator=generator) < q.max():
            return guess
        return real(logits, q, None, generator, position)

    monkeypatch.setattr(cascade, "_draw", keeps_guesses)
    assert chi_square_pvalue(run(range(2_000))[0], joint) < ALPHA


def test_bad_cascade_settings_are_refused_clearly():
    model = tiny_model(1, vocab=16, layers=1)
    with pytest.raises(SpecdecError, match="unknown cascade stage"):
        CascadeDrafter(model, "ngram")
    with pytest.raises(SpecdecError, match="max_guess >= 1"):
        CascadeDrafter(model, max_guess=0)


def test_the_cost_schedule_stops_a_cascade_draft_inside_a_pass():
    target, model = tiny_model(1, vocab=32), tiny_model(1, vocab=32, layers=2, name="same")
    drafter = CascadeDrafter(model)
    drafter.check_target(target)
    drafter.start([2, 5, 7, 2, 5])
    draft = drafter.propose([2, 5, 7, 2, 5], 6, GREEDY, torch.Generator(), lambda n, logits: n < 2)
    assert len(draft.tokens) == 2  # stopped by the schedule, even where the guess ran further
    assert cache_length(drafter.cache) == 5 + 1  # context and the drafted tokens but the last
