"""The parallel drafter (PARD; adapters/pard.py, drafters/parallel.py, training/fit_parallel.py): the training
layout and loss, the mask token, training on a learnable corpus, and that drafting with it is exact."""

import pytest
import torch

from specdec import Sampler, autoregressive_generate, speculative_generate
from specdec.backends.cache import cache_length
from specdec.drafters.parallel import ParallelDrafter
from specdec.engine import generate_many
from specdec.errors import SpecdecError
from specdec.adapters.pard import installed, load_adapter, load_parallel, make_parallel, mask_id, new_adapter
from specdec.core.samplers import GREEDY
from specdec.sizing.schedules import CostAware, Fixed
from specdec.training.fit_parallel import (ParallelConfig, anchors_for, parallel_loss, train_parallel_drafter,
                                       training_layout)

from conftest import tiny_model, tiny_parallel
from test_sampling_exactness import ALPHA, REAL_PROMPT, REAL_RUNS, _real_joint, chi_square_pvalue


def test_a_training_pass_hangs_each_group_of_masks_from_its_anchor():
    parents, label_at, place = training_layout(6, [1, 2], 3)
    assert parents == [-1, 0, 1, 2, 3, 4, 1, 6, 2, 8]  # 6 real tokens, then masks after 1 and after 2
    assert label_at == [1, 2, 3, 4, 5, -1, 3, 4, 4, 5]  # mask j after anchor a learns token a + j + 1
    assert place == [1, 6, 7, 2, 8, 9]  # positions 1..3 of each anchor: its own row, then its masks
    with pytest.raises(SpecdecError, match="no room"):
        training_layout(6, [3], 3)  # its last label would be token 6, past the sequence


def test_anchors_are_distinct_and_leave_room_for_their_labels():
    anchors = anchors_for(20, 8, 4, torch.Generator().manual_seed(0))
    assert anchors == sorted(set(anchors)) and len(anchors) == 8 and max(anchors) < 20 - 4
    assert len(anchors_for(6, 8, 4, torch.Generator().manual_seed(0))) == 2  # fewer where there is less room


def test_the_loss_is_the_masks_cross_entropy_and_skips_unscored_labels():
    logits = torch.randn(2, 3, 7)
    slots = torch.tensor([[1, 2, -1], [3, 4, 5]])
    each = torch.nn.functional.cross_entropy(logits.view(-1, 7), slots.view(-1).clamp(min=0), reduction="none")
    want = each.view(2, 3)[[0, 1, 1], [1, 1, 2]].mean()  # positions 2 and 3 only; -1 left out
    assert torch.allclose(parallel_loss(logits, slots), want)


def test_the_adapter_changes_the_mask_rows_alone():
    """The mask id embeds as the trained vector and the LoRA adds to mask rows only: every real
    token's row and cache entry stays the plain drafter's bit for bit, so a parallel draft's first
    token is the chain's."""
    model = tiny_model(1, vocab=16, layers=2, role="drafter")
    adapter = new_adapter(model, 3, 2).to(model.device)
    with torch.no_grad():
        for b in adapter.lora.b.values():
            b.normal_()
        adapter.mask.normal_()
    ids = [3, 4, 5, 6]
    plain_cache = model.new_cache()
    plain = model.forward(ids, plain_cache, num_logits=4)
    embedding = model._decoder.get_input_embeddings()
    with installed(model, adapter):
        cache = model.new_cache()
        got = model.forward(ids + [mask_id(model)] * 2, cache, num_logits=6)
        embedded = embedding(torch.tensor([[3, mask_id(model)]], device=model.device))
    assert torch.equal(got[:4], plain)
    for mine, theirs in zip(cache.layers, plain_cache.layers):
        assert torch.equal(mine.keys[..., :4, :], theirs.keys)
    assert torch.equal(embedded[0, 1], adapter.mask.to(embedded.dtype).detach())
    plain_mask = new_adapter(model, 3, 2).to(model.device)
    plain_mask.mask.data.copy_(adapter.mask.data)
    with installed(model, plain_mask):  # the same mask, no LoRA: the mask rows differ
        untrained = model.forward(ids + [mask_id(model)] * 2, None, num_logits=2)
    assert not torch.allclose(untrained, got[4:])
    assert model._parallel_hooks == ()  # removed again
    assert mask_id(model) == embedding.num_embeddings  # an id past the table: only the hooks give it meaning
    if model.device.type == "cpu":  # (on CUDA an index past the table is a device-side assert)
        with pytest.raises(IndexError):
            embedding(torch.tensor([[mask_id(model)]]))


def test_a_proposal_keeps_only_the_context_in_the_drafters_cache():
    """The masks' entries are dropped: after a proposal the cache is what feeding the context alone
    makes, so the next proposal continues from real tokens only."""
    model = tiny_parallel(3, vocab=32, k=4)
    drafter = ParallelDrafter(model)
    drafter.check_target(tiny_model(0, vocab=32))
    context = [3, 4, 5, 6, 7]
    drafter.start(context)
    draft = drafter.propose(context, 4, GREEDY, torch.Generator(), lambda n, logits: True)
    assert len(draft.tokens) == 4 and drafter.passes == 1  # four tokens, one pass
    assert cache_length(drafter.cache) == len(context)
    fresh = model.new_cache()
    want = model.forward(context + [mask_id(model)] * 3, fresh, num_logits=4)
    assert [int(t) for t in want.argmax(-1)] == draft.tokens
    alone = model.new_cache()
    model.forward(context, alone, num_logits=1)
    for mine, theirs in zip(drafter.cache.layers, alone.layers):
        assert torch.equal(mine.keys[..., :len(context), :], theirs.keys[..., :len(context), :])


def test_the_schedule_cuts_a_parallel_draft_and_a_budget_below_k_asks_fewer_rows():
    drafter = ParallelDrafter(tiny_parallel(3, vocab=32, k=4))
    drafter.check_target(tiny_model(0, vocab=32))
    drafter.start([3, 4, 5])
    assert len(drafter.propose([3, 4, 5], 4, GREEDY, torch.Generator(), lambda n, logits: n < 2).tokens) == 2
    assert len(drafter.propose([3, 4, 5], 2, GREEDY, torch.Generator(), lambda n, logits: True).tokens) == 2
    assert cache_length(drafter.cache) == 3


def test_a_token_inside_a_pass_is_priced_at_its_row_alone_and_the_first_of_a_pass_at_the_pass_too():
    schedule = CostAware(gamma_max=8)
    schedule.measured, schedule.threshold = (10.0, 0.05, 0.004, 0.1), 0.54  # R, t_d, t_v, t(1)
    assert [schedule.token_threshold(n) for n in (1, 2, 3)] == [0.54] * 3  # a chain: a pass a token
    schedule.one_pass = 3
    assert [schedule.token_threshold(n) for n in (1, 2, 3, 4)] == pytest.approx([0.04, 0.04, 0.54, 0.04])
    schedule.measured = None
    assert schedule.token_threshold(1) == 0.54  # nothing measured yet: the starting threshold


def test_a_draft_longer_than_k_is_a_chain_of_parallel_passes():
    """A budget of 7 with k = 3: three passes (3 + 3 + 1 tokens), each feeding the last one's
    tokens as real ones; the cache then holds the context and the first six tokens, and each
    pass's tokens are what a fresh pass over the same inputs gives."""
    model = tiny_parallel(3, vocab=32, k=3)
    drafter = ParallelDrafter(model)
    drafter.check_target(tiny_model(0, vocab=32))
    context = [3, 4, 5, 6]
    drafter.start(context)
    draft = drafter.propose(context, 7, GREEDY, torch.Generator(), lambda n, logits: True)
    assert len(draft.tokens) == 7 and drafter.passes == 3
    assert cache_length(drafter.cache) == len(context) + 6
    masks = [mask_id(model)] * 2
    second = model.forward(context + draft.tokens[:3] + masks, None, num_logits=3)
    assert [int(t) for t in second.argmax(-1)] == draft.tokens[3:6]
    drafter.rollback(len(context) + 2)  # two accepted: the rest of the first pass's tokens go
    assert cache_length(drafter.cache) == len(context) + 2


def test_a_plain_drafter_model_is_refused():
    with pytest.raises(SpecdecError, match="no parallel drafter"):
        ParallelDrafter(tiny_model(1, vocab=16, role="drafter"))


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_greedy_output_is_the_targets_alone_and_in_batches(gamma):
    target, model = tiny_model(0, vocab=32, exact_rows=True), tiny_parallel(1, vocab=32, k=4, exact_rows=True)
    prompts = [[3, 4, 5], [9, 8, 7, 6, 5], [2, 2, 2, 2], [5, 1, 7], [11, 3]]
    want = [autoregressive_generate(p, target, max_new_tokens=20, eos_token_ids=[]).tokens for p in prompts]
    drafted = 0
    for prompt, tokens in zip(prompts, want):
        out = speculative_generate(prompt, target, ParallelDrafter(model), gamma=gamma, max_new_tokens=20,
                                   eos_token_ids=[])
        assert out.tokens == tokens
        drafted += out.stats.drafted
        # a pass per k = 4 draft tokens, not per token
        assert out.stats.drafter_passes == sum(-(-len(s.draft_tokens) // 4) for s in out.steps)
    assert drafted > 0
    for batch in (2, 5):
        results = generate_many(prompts, target, lambda: ParallelDrafter(model), max_batch=batch, max_new_tokens=20,
                                eos_token_ids=[], schedule=lambda: Fixed(gamma))
        assert [r.tokens for r in results] == want, batch


def test_a_seeded_sample_is_the_seeded_ar_sample():
    target, model = tiny_model(0, vocab=32, exact_rows=True), tiny_parallel(1, vocab=32, k=4, exact_rows=True)
    sampler = Sampler(temperature=0.8, top_p=0.95)
    for prompt, seed in (([3, 4, 5], 7), ([9, 8, 7, 6], 8)):
        want = autoregressive_generate(prompt, target, sampler, max_new_tokens=20, eos_token_ids=[], seed=seed).tokens
        got = speculative_generate(prompt, target, ParallelDrafter(model), sampler=sampler, gamma=4, max_new_tokens=20,
                                   eos_token_ids=[], seed=seed)
        assert got.tokens == want


@pytest.mark.slow
def test_sampled_output_follows_the_target_law():
    """The joint law of 4 tokens on test_sampling_exactness's tiny target (its power checks use as
    many runs), drafted 3 at a time by a parallel drafter under the standard rule."""
    target = tiny_model(0, vocab=4, name="tiny-target")
    drafter = ParallelDrafter(tiny_parallel(1, vocab=4, k=3, scale=1.0))
    samples, rejections = [], 0
    for seed in range(REAL_RUNS):
        out = speculative_generate(REAL_PROMPT, target, drafter, gamma=3, sampler=Sampler(1.0), max_new_tokens=4,
                                   seed=seed, seed_rule="stream", first_target=False, eos_token_ids=[])
        samples.append(tuple(out.tokens))
        rejections += sum(step.num_accepted < len(step.draft_tokens) for step in out.steps)
    assert rejections > REAL_RUNS / 2  # drafts were rejected part way: the residual law was drawn from
    assert chi_square_pvalue(samples, _real_joint(target, Sampler(1.0))) > ALPHA


def _counting_corpus(vocab: int, length: int) -> list[int]:
    """Runs that count up by one from random starts: token t + j is token t + j (mod vocab), so a
    mask that knows its distance from the anchor can be right."""
    generator = torch.Generator().manual_seed(0)
    ids: list[int] = []
    while len(ids) < length:
        start = int(torch.randint(0, vocab, (1,), generator=generator))
        ids += [(start + i) % vocab for i in range(16)]
    return ids[:length]


@pytest.mark.slow
def test_training_teaches_the_masks_what_comes_next_and_saves_a_loadable_drafter(tmp_path):
    model = tiny_model(1, vocab=32, layers=2, role="drafter")
    config = ParallelConfig(k=3, tokens=32 * 48, seq_len=32, groups=8, rank=8, epochs=20, batch=4, lr=1e-2)
    made = train_parallel_drafter(model, _counting_corpus(32, 32 * 60), tmp_path / "pard", config, say=lambda m: None)
    before, after = made.info["heldout_before"]["top1_by_position"], made.info["heldout_after"]["top1_by_position"]
    assert after[1] > before[1] + 0.3 and after[2] > before[2] + 0.3, (before, after)
    assert model.adapter is None and not getattr(model, "parallel_k", None)  # the drafter it was given is untouched
    assert after[0] == before[0]  # the drafter's own row: nothing adapts it
    assert load_adapter(tmp_path / "pard").adapter.k == 3
    loaded = load_parallel(tmp_path / "pard", lambda name: tiny_model(1, vocab=32, layers=2, role="drafter"))
    assert loaded.parallel_k == 3 and loaded.name.endswith("+parallel")
    with pytest.raises(SpecdecError, match="trained on"):
        load_parallel(tmp_path / "pard", lambda name: tiny_model(5, vocab=32, layers=2, role="drafter"))


def test_training_refuses_bad_settings_and_an_adapted_drafter(tmp_path):
    model = tiny_model(1, vocab=32, role="drafter")
    with pytest.raises(SpecdecError, match="k must be >= 2"):
        train_parallel_drafter(model, list(range(32)) * 8, tmp_path, ParallelConfig(k=1))
    with pytest.raises(SpecdecError, match="fewer than two chunks"):
        train_parallel_drafter(model, list(range(32)), tmp_path, ParallelConfig(seq_len=32))
    make_parallel(model, new_adapter(model, 3, 2))
    with pytest.raises(SpecdecError, match="already has an adapter"):
        train_parallel_drafter(model, list(range(32)) * 8, tmp_path, ParallelConfig(seq_len=32))


def test_a_missing_checkpoint_names_the_command_that_makes_one(tmp_path):
    with pytest.raises(SpecdecError, match="specdec train-parallel-drafter"):
        load_adapter(tmp_path)


def test_the_bench_runs_sd_parallel_on_its_own_drafter_and_counts_acceptance_by_position(tmp_path):
    from specdec.bench.runners import OWN_DRAFTERS, Settings, load_own_drafters, run_method
    from specdec.bench.run import summarize

    target = tiny_model(0, vocab=32)
    train_parallel_drafter(tiny_model(1, vocab=32, role="drafter"), _counting_corpus(32, 32 * 12), tmp_path,
                           ParallelConfig(k=3, tokens=32 * 10, seq_len=32, groups=4), say=lambda m: None)
    settings = Settings(max_new_tokens=12, parallel=str(tmp_path), spec={"gamma": 3})
    run_drafter = tiny_model(1, vocab=32, role="drafter")
    load_own_drafters(["sd-parallel"], settings,
                      lambda name: load_parallel(tmp_path, lambda _: tiny_model(1, vocab=32, role="drafter")))
    prompt = [3, 4, 5, 6]
    record = run_method("sd-parallel", prompt, target, run_drafter, settings, Sampler(0.0))
    assert record.tokens == autoregressive_generate(prompt, target, max_new_tokens=12).tokens
    assert record.drafted > 0 and sum(record.drafter_passes_per_step) < record.drafted  # k = 3 tokens a pass
    assert record.drafted_at and record.drafted_at[0] >= record.accepted_at[0]
    record.prompt_id = "p@t0"
    shares = summarize([record], ["sd-parallel"])["sd-parallel"]["acceptance_by_position"]
    assert shares[0] == round(record.accepted_at[0] / record.drafted_at[0], 4)
    assert not getattr(run_drafter, "parallel_k", None)  # the run's own drafter is untouched
    OWN_DRAFTERS.clear()


def test_the_commands_defaults_are_the_librarys():
    import inspect

    from specdec.cli.training import train_parallel_drafter_command

    parameters = inspect.signature(train_parallel_drafter_command).parameters
    for name in ("k", "tokens", "seq_len", "groups", "rank", "epochs", "batch", "lr", "seed"):
        assert parameters[name].default.default == getattr(ParallelConfig(), name), name


def test_the_command_refuses_the_bench_prompts_as_training_text(tmp_path):
    from typer.testing import CliRunner

    from specdec.cli import app

    result = CliRunner().invoke(app, ["train-parallel-drafter", "--out", str(tmp_path), "--corpus", "humaneval"])
    assert result.exit_code != 0 and "the bench's prompts" in result.output


@pytest.mark.slow
def test_a_stopped_training_resumes_part_way_through_its_one_epoch_to_the_same_adapter(tmp_path, monkeypatch):
    from specdec.training import distill

    corpus = _counting_corpus(32, 32 * 24)
    config = ParallelConfig(k=3, tokens=32 * 20, seq_len=32, groups=4, batch=2, lr=1e-2)  # 10 steps, one epoch
    whole = train_parallel_drafter(tiny_model(1, vocab=32, role="drafter"), corpus, tmp_path / "whole", config,
                                   say=lambda m: None)
    monkeypatch.setattr(distill, "SAVE_EVERY", 3)
    calls = {"n": 0}
    real_step = torch.optim.AdamW.step

    def stop_midway(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 8:  # after the state saved at step 6
            raise KeyboardInterrupt
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", stop_midway)
    with pytest.raises(KeyboardInterrupt):
        train_parallel_drafter(tiny_model(1, vocab=32, role="drafter"), corpus, tmp_path / "resumed", config,
                               say=lambda m: None)
    monkeypatch.setattr(torch.optim.AdamW, "step", real_step)
    said = []
    resumed = train_parallel_drafter(tiny_model(1, vocab=32, role="drafter"), corpus, tmp_path / "resumed", config,
                                     say=said.append)
    assert any("resuming at step 6" in m for m in said)
    for a, b in zip(whole.adapter.parameters(), resumed.adapter.parameters()):
        assert torch.equal(a, b)
    assert {p.name for p in (tmp_path / "resumed").iterdir()} == {"parallel.safetensors", "parallel.json"}


def test_a_mask_whose_tokens_are_rarely_accepted_stops_being_fed():
    drafter = ParallelDrafter(tiny_parallel(3, vocab=32, k=4))
    drafter.check_target(tiny_model(0, vocab=32))
    drafter.start([3, 4, 5])
    drafter.propose([3, 4, 5], 5, GREEDY, torch.Generator(), lambda n, logits: True)
    assert drafter._origins == [0, 1, 2, 3, 0]  # a pass of 1 + 3 masks, then the next pass's own row
    drafter.rollback(3 + 2)  # two accepted: mask 1's token kept, mask 2's reached and rejected, mask 3's not reached
    assert drafter.reached == [1, 1, 0] and drafter.kept == [1, 0, 0]
    assert drafter.masks() == 3  # (kept + 1) / (reached + 2): 2/3, 1/3, 1/2
    drafter.reached, drafter.kept = [10, 10, 10], [5, 1, 0]
    assert drafter.masks() == 2  # mask 2 at 2/12 still pays its row (>= ROW_SHARE), mask 3 at 1/12 does not
    drafter.kept = [0, 5, 5]
    assert drafter.masks() == 0  # the leading mask does not pay: a chain
    draft = drafter.propose([3, 4, 5], 3, GREEDY, torch.Generator(), lambda n, logits: True)
    assert drafter.passes == 2 + 3 and drafter._origins == [0, 0, 0] and len(draft.tokens) == 3
