"""`specdec reproduce`: the bigram drafter (exact, registered), Table 3's teacher-forced α, the
top-k coverage and the step view, on tiny models."""

from __future__ import annotations

import math

import pytest
import torch
from typer.testing import CliRunner

from specdec import Sampler, SpecdecError, autoregressive_generate, speculative_generate
from specdec.bench import leviathan as reproduce
from specdec.bench.coverage import coverage, in_top_k
from specdec.bench.leviathan import (Continuations, CountsScorer, ModelScorer, ProposalScorer, generate_continuations,
                                     score, teacher_forced_logits)
from specdec.bench.steps import step_rows, steps_html, steps_markdown
from specdec.drafters import LookupDrafter
from specdec.drafters.bigram import BigramDrafter, BigramTable
from specdec.decoding.results import Step

from conftest import TableModel, tiny_model
from test_sampling_exactness import ALPHA, chi_square_pvalue, exact_joint

CORPUS = [2, 3, 4, 2, 3, 5, 2, 3, 4, 6, 7, 2, 3, 4]


# --- the bigram drafter ---------------------------------------------------------------------------

def test_the_bigram_table_counts_pairs_and_falls_back_to_unigram_counts():
    table = BigramTable([0, 1, 0, 1, 0, 2], vocab_size=4)
    ids, counts = table.row(0)
    assert ids.tolist() == [1, 2] and counts.tolist() == [2.0, 1.0]
    q = table.bigram_probs([0, 2])
    assert torch.allclose(q[0], torch.tensor([0.0, 2 / 3, 1 / 3, 0.0]))
    assert torch.allclose(q[1], torch.tensor([3 / 6, 2 / 6, 1 / 6, 0.0]))  # 2 never followed: the unigram q
    # a document boundary: no pair across it
    split = BigramTable([0, 1, 0, 2], vocab_size=4, boundaries=[2])
    assert split.row(1)[0].tolist() == [0, 1, 2]  # 1 -> 0 crossed the boundary: unigram fallback


def test_the_bigram_drafter_walks_the_most_frequent_chain_under_greedy():
    drafter = BigramDrafter(corpus_tokens=CORPUS)
    drafter.check_target(tiny_model(0, vocab=16))
    draft = drafter.propose([9, 2], 4, Sampler(0.0), torch.Generator(), lambda *_: True)
    assert draft.tokens == [3, 4, 2, 3] and draft.probs is None


def test_the_bigram_drafter_gives_the_greedy_output_token_for_token():
    target = tiny_model(3, vocab=16)
    prompt = [2, 3, 4, 2, 3]
    # a corpus of the target's own greedy text, so that drafts are often accepted (and sometimes not)
    corpus = autoregressive_generate([5, 6, 2], target, Sampler(0.0), 60, eos_token_ids=[]).tokens
    expected = autoregressive_generate(prompt, target, Sampler(0.0), 40, eos_token_ids=[]).tokens
    out = speculative_generate(prompt, target, BigramDrafter(corpus_tokens=corpus), gamma=3, sampler=Sampler(0.0),
                               max_new_tokens=40, eos_token_ids=[])
    assert out.tokens == expected
    assert out.stats.accepted > 0 and out.stats.drafted > out.stats.accepted


def test_the_bigram_drafter_keeps_the_target_distribution_under_sampling():
    target, sampler, length = TableModel(vocab=3, seed=0), Sampler(1.0), 3
    for previous in range(3):
        target.table[:, previous, (previous + 1) % 3] += 2.0
    prompt = [0, 1, 2, 0]
    joint = exact_joint(target, prompt, length, sampler)
    corpus = [0, 1, 2, 0, 1, 2, 0, 2, 1, 0, 1, 1]
    samples, deep = [], 0
    for seed in range(3_000):
        out = speculative_generate(prompt, target, BigramDrafter(corpus_tokens=corpus), gamma=3, sampler=sampler,
                                   max_new_tokens=length, seed=seed, seed_rule="stream", first_target=False)
        samples.append(tuple(out.tokens))
        deep += any(1 <= s.num_accepted < len(s.draft_tokens) for s in out.steps)
    assert deep >= 100  # drafts were accepted in part, not only all or nothing
    assert chi_square_pvalue(samples, joint) > ALPHA


def test_the_bigram_drafter_under_sampling_hands_its_q_to_verification():
    drafter = BigramDrafter(corpus_tokens=CORPUS)
    drafter.check_target(tiny_model(0, vocab=16))
    draft = drafter.propose([3], 2, Sampler(1.0), torch.Generator().manual_seed(0), lambda *_: True)
    assert draft.probs is not None and draft.probs.shape == (2, 16)
    assert torch.allclose(draft.probs[0, [4, 5]], torch.tensor([0.75, 0.25]))  # after 3: 4 three times, 5 once


def test_the_bigram_method_is_registered_and_needs_a_tokenizer_or_tokens():
    from specdec.decoding.speculation import Parts, build, resolve

    assert resolve("bigram-fixed").schedule == "fixed"
    with pytest.raises(SpecdecError, match="tokenizer"):
        build(resolve("bigram"), Parts(target=tiny_model(0, vocab=16)))
    with pytest.raises(SpecdecError, match="at least 2 tokens"):
        BigramTable([1], vocab_size=4)
    with pytest.raises(SpecdecError, match="0..3"):
        BigramTable([1, 9], vocab_size=4)


# --- Table 3: teacher-forced α --------------------------------------------------------------------

def test_counts_scorers_compare_argmaxes_at_t0_and_sum_the_minimum_at_t1():
    table = BigramTable([0, 1, 0, 1, 0, 2], vocab_size=4)
    p = torch.tensor([[0.1, 0.6, 0.3, 0.0], [0.7, 0.1, 0.1, 0.1]])
    prompt, generated = [3, 0], [1, 0]  # q at position 0: after 0; at position 1: after 1
    greedy = CountsScorer(table, 2).betas(prompt, generated, Sampler(0.0).probs(p.log()), Sampler(0.0))
    assert greedy.tolist() == [1.0, 1.0]  # after 0 the bigram's argmax is 1, after 1 it is 0
    sampled = CountsScorer(table, 2).betas(prompt, generated, p, Sampler(1.0))
    # after 0: q = (0, 2/3, 1/3, 0), Σ min = 0.6 + 0.3; after 1: q = (1, 0, 0, 0), Σ min = 0.7
    assert torch.allclose(sampled, torch.tensor([0.9, 0.7]), atol=1e-6)
    unigram = CountsScorer(table, 1).betas(prompt, generated, p, Sampler(1.0))
    assert torch.allclose(unigram, torch.minimum(p, table.unigram_probs()).sum(-1))


def test_a_model_free_drafter_is_scored_where_it_proposes():
    p = torch.full((4, 8), 1 / 8)
    p[:, 5] = 0.3
    p = p / p.sum(-1, keepdim=True)
    beta = ProposalScorer(LookupDrafter, tiny_model(0, vocab=8)).betas([1, 5, 1], [5, 2, 3, 1], p, Sampler(1.0))
    # after ...1 lookup copies 5 (what followed 1 before): β = p(5); after 1 5 it copies 1; after 2, 3: nothing
    assert beta[0] == pytest.approx(float(p[0, 5]))
    assert beta[1] == pytest.approx(float(p[1, 1]))
    assert math.isnan(beta[2]) and math.isnan(beta[3])


def test_teacher_forced_chunks_give_the_logits_of_one_pass(monkeypatch):
    model = tiny_model(1, vocab=16)
    prompt, generated = [2, 3, 4], list(range(5, 15))
    whole = teacher_forced_logits(model, prompt, generated, 16)
    monkeypatch.setattr(reproduce, "MAX_LOGITS", 3)
    assert torch.allclose(teacher_forced_logits(model, prompt, generated, 16), whole, atol=1e-4)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_alpha_of_the_target_against_itself_is_one_and_of_another_model_below(temperature):
    target, other, sampler = tiny_model(1, vocab=16, exact_rows=True), tiny_model(2, vocab=16), Sampler(temperature)
    prompts = [[2, 3, 4], [5, 6], [7, 8, 9, 10], [11, 3]]
    made = generate_continuations(target, prompts, sampler, 12, seed=4, batch=3)
    assert made.total > 20 and len(made.tokens) == 4
    # the engine's continuations are the plain decoding ones
    seeds = [None] * 4 if sampler.is_greedy else [4 + i for i in range(4)]
    assert made.tokens == [autoregressive_generate(p, target, sampler, 12, seed=s).tokens
                           for p, s in zip(prompts, seeds)]
    rows = score(made, target, {"self": ModelScorer(target), "other": ModelScorer(other),
                                "lookup": ProposalScorer(LookupDrafter, target)}, sampler)
    assert rows["self"]["alpha"] == pytest.approx(1.0, abs=1e-4)
    assert rows["other"]["alpha"] < 0.9
    assert rows["self"]["positions"] == rows["self"]["proposed"] == made.total
    assert 0 < rows["lookup"]["share_proposed"] <= 1


def test_continuations_round_trip_and_a_bad_file_is_refused(tmp_path):
    made = Continuations("t", "greedy", 0, 4, [[1, 2]], ["qa"], [[3, 4]])
    made.save(tmp_path / "c.json")
    assert Continuations.load(tmp_path / "c.json") == made
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SpecdecError, match="not a continuations file"):
        Continuations.load(tmp_path / "bad.json")


def test_spec_bench_prompts_cover_every_task_round_robin():
    tasks = [task for task, _ in reproduce.spec_bench_prompts(6)]
    assert len(set(tasks)) == 6


def test_continuations_stop_at_the_batch_that_reaches_the_tokens_asked_for():
    target = tiny_model(0, vocab=32, exact_rows=True)
    prompts = [[1 + i % 7, 2] for i in range(10)]
    made = reproduce.generate_continuations(target, prompts, Sampler(temperature=0.0), 5, batch=3, until=7)
    assert made.total >= 7 and len(made.prompts) == 3 and len(made.tokens) == 3  # one batch of 3 gives 15
    whole = reproduce.generate_continuations(target, prompts, Sampler(temperature=0.0), 5, batch=3)
    assert len(whole.tokens) == 10 and whole.tokens[:3] == made.tokens


# --- coverage ---------------------------------------------------------------------------------------

def test_in_top_k_is_cumulative_over_k():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]])
    hits = in_top_k(logits, torch.tensor([2, 0]), k=5)
    assert hits[0].tolist() == [False, False, True, True, True]
    assert hits[1].tolist() == [False] * 5


def test_the_target_covers_its_own_greedy_tokens_at_top_1():
    target = tiny_model(1, vocab=16, exact_rows=True)
    made = generate_continuations(target, [[2, 3, 4], [5, 6]], Sampler(0.0), 10)
    result = coverage(target, made, 16)
    assert result["top_k"][0] == pytest.approx(1.0) and result["positions"] == made.total
    other = coverage(tiny_model(2, vocab=16), made, 16)["top_k"]
    assert other == sorted(other) and other[0] < 1.0


# --- Fig. 1: the step view ------------------------------------------------------------------------

def test_the_step_view_marks_accepted_rejected_and_the_targets_token():
    steps = [Step([5, 6, 7], 2, 9, [5, 6, 9]), Step([1, 2], 2, 3, [1, 2, 3]), Step([], 0, 4, [4])]
    rows = step_rows(steps, lambda ids: f"t{ids[0]}")
    assert rows[0] == {"accepted": ["t5", "t6"], "rejected": "t7", "target": "t9", "kind": "resampled"}
    assert rows[1]["rejected"] is None and rows[1]["kind"] == "bonus"
    text = steps_markdown(rows)
    assert "1. `t5` `t6` ~~`t7`~~ **`t9`**" in text and "3. **`t4`**" in text
    page = steps_html(rows)
    assert "line-through" in page and page.count("<div>") == 3


# --- the command line -----------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["alpha", "--tokens", "0"], "--tokens must be >= 1"),
    (["alpha", "--drafters", "nope"], "unknown drafter nope"),
    (["coverage", "--drafters", "lookup"], "--drafters takes catalogue models or self-skip"),
    (["steps", "--gamma", "0"], "--gamma and --max-new-tokens must be >= 1"),
])
def test_the_command_refuses_bad_options_in_one_line(args, message):
    from specdec.cli import app

    result = CliRunner().invoke(app, ["reproduce", *args])
    assert result.exit_code == 1
    assert message in result.output and "Traceback" not in result.output
