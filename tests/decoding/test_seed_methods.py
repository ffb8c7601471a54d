"""The methods the seeds name (issue 69): early-exit drafting, several drafters merged into one tree
(multi-draft), the horizontal cascade, and Medusa's five heads. Each is exact: greedy token for
token the target's output; sampled, a chi-square of the joint law of the first tokens at 1e-4
(test_sampling_exactness.py's reference)."""

from __future__ import annotations

import pytest
import torch

from specdec import Sampler, SpecdecError, autoregressive_generate, speculative_generate
from specdec.drafters import ModelDrafter
from specdec.drafters.early_exit import EarlyExitModel, choose_exit, early_exit_drafter
from specdec.drafters.horizontal import HorizontalCascadeDrafter
from specdec.drafters.multi import MultiDrafter, merge_chains
from specdec.decoding.speculation import PRESETS, Parts, build, names, resolve
from specdec.decoding.config import METHODS, from_flags
from specdec.core.trees import Draft

from conftest import TableModel, tiny_model
from test_sampling_exactness import (ALPHA, DEEP_PROMPT, _cyclic_target, _near_model_drafter, chi_square_pvalue,
                                     exact_joint)

PROMPT = [2, 5, 7, 9, 11, 5, 7, 9, 11, 5]


def _greedy(prompt, target, drafter, **options):
    return speculative_generate(prompt, target, drafter, max_new_tokens=30, eos_token_ids=[], **options).tokens


def _ar(prompt, target):
    return autoregressive_generate(prompt, target, max_new_tokens=30, eos_token_ids=[]).tokens


# ------------------------------------------------------------------ early exit

def test_early_exit_drafts_with_the_targets_first_layers_and_greedy_equals_ar():
    target = tiny_model(3, vocab=32, layers=4)
    drafter = early_exit_drafter(target, 2)
    assert list(drafter.model.kept) == list(target._decoder.layers[:2])  # the same modules: no second model
    ids = torch.tensor(PROMPT, device=target.device)
    # what a plain forward through the first two layers, the final norm and the LM head gives
    hidden = target._decoder.embed_tokens(ids.view(1, -1))
    positions = torch.arange(len(PROMPT), device=target.device).view(1, -1)
    rotary = target._decoder.rotary_emb(hidden, positions)
    mask = torch.full((len(PROMPT), len(PROMPT)), float("-inf"), device=target.device).triu(1).view(1, 1, len(PROMPT), -1)
    for layer in target._decoder.layers[:2]:
        out = layer(hidden, attention_mask=mask, position_ids=positions, position_embeddings=rotary)
        hidden = out[0] if isinstance(out, tuple) else out
    expected = target.hf.lm_head(target._decoder.norm(hidden))[0].float()
    assert torch.allclose(drafter.model.forward(PROMPT, None, len(PROMPT)).to(expected.device), expected, atol=1e-4)
    assert _greedy(PROMPT, target, drafter, gamma=4) == _ar(PROMPT, target)


def test_early_exit_chooses_its_exit_and_refuses_bad_ones():
    target = tiny_model(3, vocab=32, layers=4)
    exit_layer, search = choose_exit(target)
    assert 1 <= exit_layer < 4 and exit_layer in [t["exit"] for t in search["trials"]]
    assert early_exit_drafter(target).model.exit_layer == exit_layer
    for bad in (0, 4, True):
        with pytest.raises(SpecdecError, match="exit layer must be an integer in 1..3"):
            EarlyExitModel(target, bad)


@pytest.mark.slow
def test_sampled_early_exit_keeps_the_joint_law():
    target = tiny_model(0, vocab=4, layers=3, name="tiny-target")
    prompt, length = [2, 3, 1], 4

    class Reference:  # cache-free conditionals of the target
        def next_probs(self, context, sampler):
            return sampler.probs(target.forward(context, None, 1)[-1])

    joint = exact_joint(Reference(), prompt, length, Sampler(1.0))
    samples, rejections = [], 0
    for seed in range(400):
        out = speculative_generate(prompt, target, early_exit_drafter(target, 1), gamma=3, sampler=Sampler(1.0),
                                   max_new_tokens=length, seed=seed, seed_rule="stream", first_target=False,
                                   eos_token_ids=[])
        samples.append(tuple(out.tokens))
        rejections += sum(step.num_accepted < len(step.draft_tokens) for step in out.steps)
    assert rejections > 100  # the drafter's q differs from p: the rule did work
    assert chi_square_pvalue(samples, joint) > ALPHA


# ------------------------------------------------------------------ horizontal cascade

@pytest.mark.parametrize("stage", ["suffix", "lookup"])
def test_greedy_horizontal_cascade_equals_ar_and_the_stage_drafts_the_later_tokens(stage):
    target, model = tiny_model(1, vocab=32), tiny_model(1, vocab=32, name="same")  # drafter = target
    drafter = HorizontalCascadeDrafter(model, stage, model_tokens=2)
    result = speculative_generate(PROMPT, target, drafter, gamma=6, max_new_tokens=30, eos_token_ids=[])
    assert result.tokens == _ar(PROMPT, target)
    assert drafter.staged > 0  # later positions came from the stage, at no drafter pass
    assert all(passes <= 2 for passes in result.stats.drafter_passes_per_step[1:])


def test_a_horizontal_chains_laws_are_the_models_q_then_one_hot():
    target = _cyclic_target()
    drafter = HorizontalCascadeDrafter(_near_model_drafter(target), "lookup", model_tokens=1)
    drafter.check_target(target)
    drafter.start(DEEP_PROMPT)
    generator = torch.Generator().manual_seed(0)
    draft = drafter.propose(DEEP_PROMPT, 4, Sampler(1.0), generator, lambda drafted, estimate: True)
    assert len(draft.tokens) > 1 and draft.probs.shape == (len(draft.tokens), 3)
    assert float(draft.probs[0].max()) < 1  # the model's q
    assert torch.equal(draft.probs[1:], torch.nn.functional.one_hot(torch.tensor(draft.tokens[1:]), 3).float())


@pytest.mark.slow
def test_sampled_horizontal_cascade_keeps_the_joint_law():
    target, sampler, length = _cyclic_target(), Sampler(1.0), 5
    joint = exact_joint(target, DEEP_PROMPT, length, sampler)
    samples, staged = [], 0
    for seed in range(2_000):
        drafter = HorizontalCascadeDrafter(_near_model_drafter(target), "suffix", model_tokens=1)
        out = speculative_generate(DEEP_PROMPT, target, drafter, gamma=4, sampler=sampler, max_new_tokens=length,
                                   seed=seed, seed_rule="stream", first_target=False)
        samples.append(tuple(out.tokens))
        staged += drafter.staged
    assert staged > 1_000
    assert chi_square_pvalue(samples, joint) > ALPHA


def test_bad_horizontal_settings_are_refused_clearly():
    model = tiny_model(1, vocab=32)
    with pytest.raises(SpecdecError, match="unknown cascade stage 'bigram'"):
        HorizontalCascadeDrafter(model, "bigram")
    with pytest.raises(SpecdecError, match="model_tokens >= 1"):
        HorizontalCascadeDrafter(model, "suffix", 0)


# ------------------------------------------------------------------ several drafters

def test_merge_chains_merges_only_when_told():
    a, b = Draft([4, 5, 6]), Draft([4, 5, 9, 1])
    tree, merged = merge_chains([a, b], merge=True)
    assert (tree.tokens, tree.parents, merged) == ([4, 5, 6, 9, 1], [-1, 0, 1, 1, 3], 2)
    q = torch.full((4, 12), 1 / 12)
    tree, merged = merge_chains([Draft([4, 5, 6], q[:3]), Draft([4, 5], q[:2])], merge=False)
    assert (tree.tokens, tree.parents, merged, tree.scheme) == ([4, 5, 6, 4, 5], [-1, 0, 1, -1, 3], 0, "iid")


def _noisy_copy(seed: int, scale: float):
    """The tiny model of `seed` with noise on its embeddings: it agrees with the original at times."""
    model = tiny_model(seed, vocab=32, layers=2, name="noisy")
    with torch.no_grad():
        weight = model.hf.model.embed_tokens.weight
        noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(3)).to(weight.device)
        weight.add_(noise * scale * weight.std())
    return model


def test_greedy_multi_draft_equals_ar_with_two_tiny_drafters():
    target = tiny_model(1, vocab=32, layers=2)
    drafters = [ModelDrafter(tiny_model(1, vocab=32, layers=2, name="same")), ModelDrafter(_noisy_copy(1, 0.5))]
    multi = MultiDrafter(drafters, gamma=4)
    result = speculative_generate(PROMPT, target, multi, max_new_tokens=30, eos_token_ids=[])
    assert result.tokens == _ar(PROMPT, target)
    assert multi.merged > 0 and max(result.stats.nodes_per_step) > 4  # chains merged, and also branched


@pytest.mark.slow
def test_sampled_multi_draft_keeps_the_joint_law_and_merging_under_sampling_breaks_it(monkeypatch):
    """Two drafters with different q's (a far one first, a near one), chains side by side: exact.
    Merging their equal tokens under sampling (one node, the first drafter's law, the second's
    residual update lost) is not, and the test sees it."""
    from specdec.drafters import multi

    target, sampler, length = _cyclic_target(), Sampler(1.0), 2
    joint = exact_joint(target, DEEP_PROMPT, length, sampler)

    def run(seeds: range) -> list[tuple]:
        samples = []
        for seed in seeds:
            drafters = [ModelDrafter(TableModel(vocab=3, seed=5)), ModelDrafter(_near_model_drafter(target))]
            out = speculative_generate(DEEP_PROMPT, target, MultiDrafter(drafters, gamma=2), sampler=sampler,
                                       max_new_tokens=length, seed=seed, seed_rule="stream", first_target=False)
            samples.append(tuple(out.tokens))
        return samples

    assert chi_square_pvalue(run(range(6_000)), joint) > ALPHA
    real = multi.merge_chains
    monkeypatch.setattr(multi, "merge_chains", lambda drafts, merge: real(drafts, True))
    assert chi_square_pvalue(run(range(6_000)), joint) < ALPHA


def test_bad_multi_draft_settings_are_refused_clearly():
    model = ModelDrafter(tiny_model(1, vocab=32))
    with pytest.raises(SpecdecError, match="at least two drafters"):
        MultiDrafter([model])
    with pytest.raises(SpecdecError, match="gamma >= 1"):
        MultiDrafter([model, model], gamma=0)


# ------------------------------------------------------------------ the registry

@pytest.mark.parametrize("method", ["early-exit", "multi-draft", "cascade-horizontal"])
def test_the_new_methods_are_registered_and_build_greedy_exact_drafters(method):
    assert method in METHODS and method in names()
    target = tiny_model(1, vocab=32, layers=4)
    parts = Parts(target, drafter_model=tiny_model(2, vocab=32, layers=1, name="drafter"))
    speculation = build(resolve(method, exit_layer=2), parts)
    drafter = speculation.make_drafter()
    options = {} if METHODS[method].trees else {"schedule": speculation.schedule()}
    assert _greedy(PROMPT, target, drafter, **options) == _ar(PROMPT, target)


def test_the_new_methods_options_and_flags():
    assert from_flags("early-exit") == {"method": "early-exit"}
    assert from_flags("early-exit:3") == {"method": "early-exit", "exit_layer": 3}
    with pytest.raises(SpecdecError, match="early-exit:LAYER takes one layer number"):
        from_flags("early-exit:x")
    with pytest.raises(SpecdecError, match="exit_layer must be an integer >= 1"):
        resolve("early-exit", exit_layer=0)
    with pytest.raises(SpecdecError, match="cascade_split must be an integer >= 1"):
        resolve("cascade-horizontal", cascade_split=0)
    with pytest.raises(SpecdecError, match="exit layer must be an integer in 1..3"):
        build(resolve("early-exit", exit_layer=9), Parts(tiny_model(1, vocab=32, layers=4))).make_drafter()
    assert "cascade-horizontal-lookup" in PRESETS


@pytest.mark.real
def test_early_exit_and_multi_draft_are_greedy_exact_on_smollm2(smollm2):
    prompt = smollm2.encode("def fibonacci(n):")
    expected = autoregressive_generate(prompt, smollm2, max_new_tokens=24).tokens
    early = early_exit_drafter(smollm2)
    assert speculative_generate(prompt, smollm2, early, gamma=4, max_new_tokens=24).tokens == expected
    multi = MultiDrafter([early_exit_drafter(smollm2, early.model.exit_layer),
                          early_exit_drafter(smollm2, max(1, early.model.exit_layer // 2))], gamma=4)
    assert speculative_generate(prompt, smollm2, multi, max_new_tokens=24).tokens == expected


# ------------------------------------------------------------------ Medusa's heads

def test_medusa_trains_five_heads_by_default_and_loads_a_three_head_checkpoint(tmp_path):
    import inspect

    from specdec.cli.training import train_heads
    from specdec.adapters.medusa_heads import MedusaHeads, load_heads, save_heads
    from specdec.training.fit_medusa import TrainConfig
    from test_self_drafting import _random_heads

    assert TrainConfig().num_heads == 5
    assert inspect.signature(train_heads).parameters["heads"].default.default == 5
    target = tiny_model(1, vocab=32)
    save_heads(tmp_path, _random_heads(target, num_heads=3))
    loaded = load_heads(str(tmp_path))
    assert isinstance(loaded.heads, MedusaHeads) and loaded.heads.num_heads == 3


def test_a_seeded_multi_draft_draws_its_later_chains_apart_from_the_first():
    """Under a seed the first chain races the shared noise; a second chain of the same drafter drawn
    from that same noise would repeat it at every step (the review saw 4 of 4), wasting its nodes."""
    target = tiny_model(1, vocab=32, layers=2)
    twin = tiny_model(1, vocab=32, layers=2, name="same")
    multi = MultiDrafter([ModelDrafter(twin), ModelDrafter(twin)], gamma=4)
    same = total = 0

    def on_step(step):
        nonlocal same, total
        if len(multi.chains) == 2 and multi.chains[0]:
            total += 1
            same += multi.chains[0] == multi.chains[1]

    first = speculative_generate(PROMPT, target, multi, sampler=Sampler(1.0), seed=0, max_new_tokens=30,
                                 eos_token_ids=[], on_step=on_step)
    assert total >= 5 and same < total
    again = speculative_generate(PROMPT, target, MultiDrafter([ModelDrafter(twin), ModelDrafter(twin)], gamma=4),
                                 sampler=Sampler(1.0), seed=0, max_new_tokens=30, eos_token_ids=[])
    assert again.tokens == first.tokens  # still pinned by the seed
