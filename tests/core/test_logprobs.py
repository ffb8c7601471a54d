"""The target's log-probabilities of emitted tokens (core/logprobs.py): the pure functions alone, then
that every method and every batch reports, bit for bit, what plain decoding alone reports, and
that sampled tokens carry the log-probability a full forward pass gives them."""

from __future__ import annotations

import copy

import pytest
import torch

from specdec import Engine, Request, Sampler, SpecdecError, autoregressive_generate, speculative_generate
from specdec.drafters import LookupDrafter, make_tree_drafter
from specdec.core.logprobs import collect, emitted_rows, token_logprobs

from conftest import tiny_model
from test_rows import _ids, qwen_like


def test_token_logprobs_are_the_log_softmax_and_the_top_ones_sorted():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(5, 50, generator=g) * 3).to(torch.bfloat16)
    tokens = torch.randint(0, 50, (5,), generator=g)
    chosen, ids, values = token_logprobs(logits, tokens, 4)
    reference = torch.log_softmax(logits.float(), -1)
    assert torch.equal(chosen, reference[torch.arange(5), tokens])
    assert torch.equal(values, reference.sort(-1, descending=True).values[:, :4])
    assert torch.equal(reference.gather(-1, ids), values)
    _, none_ids, none_values = token_logprobs(logits, tokens, 0)
    assert none_ids.shape == none_values.shape == (5, 0)


def test_each_emitted_token_is_read_from_the_row_that_scored_it():
    assert emitted_rows(0, None) == [0]
    assert emitted_rows(3, None) == [0, 1, 2, 3]  # three accepted drafts, then the target's token
    # a tree: the root's row scored node 1, node 1's row (2) node 4, node 4's row (5) the next token
    assert emitted_rows(2, [1, 4]) == [0, 2, 5]
    assert emitted_rows(0, []) == [0]
    logits = torch.log_softmax(torch.randn(6, 10, generator=torch.Generator().manual_seed(1)), -1)
    entries = collect(logits, [0, 2, 5], [3, 7], top=2)  # cut short (EOS): two tokens of three rows
    assert [e.token for e in entries] == [3, 7]
    assert [e.logprob for e in entries] == pytest.approx([float(logits[0, 3]), float(logits[2, 7])], abs=1e-6)
    assert entries[1].top[0][0] == int(logits[2].argmax())


@pytest.fixture(scope="module")
def pair():
    target = qwen_like(torch.bfloat16, exact_rows=True, layers=1)
    return target, copy.deepcopy(target), qwen_like(torch.bfloat16, exact_rows=True, layers=1, seed=1)


def _entries(result):
    return [(e.token, e.logprob, e.top) for e in result.logprobs]


def test_every_method_reports_the_log_probabilities_plain_decoding_reports(pair):
    """Greedy: the same tokens, and each one's log-probability and top 3 bit for bit (row-exact
    passes), whether it came from an accepted draft, a tree path or the target's own step."""
    target, same, other = pair
    prompt = (_ids(6, 4096, 3) * 3)[:14]
    reference = autoregressive_generate(prompt, target, max_new_tokens=12, eos_token_ids=[], logprobs=3)
    assert len(reference.logprobs) == 12 and [e.token for e in reference.logprobs] == reference.tokens
    assert all(e.top[0][0] == e.token and e.top[0][1] == e.logprob for e in reference.logprobs)  # greedy
    for drafter in [same, other, LookupDrafter(), make_tree_drafter("sides", other)]:
        result = speculative_generate(prompt, target, drafter, gamma=4, max_new_tokens=12, eos_token_ids=[],
                                      logprobs=3)
        assert _entries(result) == _entries(reference), drafter
    assert speculative_generate(prompt, target, same, max_new_tokens=12, eos_token_ids=[]).logprobs is None


def test_a_batch_reports_what_each_sequence_alone_reports(pair):
    target, same, other = pair
    prompts = [(_ids(6, 4096, i) * 3)[:5 + 3 * i] for i in range(4)]
    alone = [autoregressive_generate(p, target, max_new_tokens=10, eos_token_ids=[], logprobs=2) for p in prompts]
    engine = Engine(target, max_batch=4)
    drafters = [None, same, lambda: make_tree_drafter("mixed", other), LookupDrafter]
    ids = [engine.add(Request(p, d, max_new_tokens=10, eos_token_ids=[], logprobs=2))
           for p, d in zip(prompts, drafters)]
    streamed, results = {i: [] for i in ids}, {}
    while engine.busy:
        out = engine.step()
        for request_id, tokens in out.emitted.items():
            assert len(out.logprobs[request_id]) == len(tokens)  # in step with the tokens
            streamed[request_id] += out.logprobs[request_id]
        results.update(out.finished)
    assert [_entries(results[i]) for i in ids] == [_entries(a) for a in alone]
    assert all(streamed[i] == results[i].logprobs for i in ids)  # the streamed ones are the whole record


def test_sampled_tokens_carry_the_log_probability_of_a_full_pass():
    """T = 1 with a drafter that disagrees: every token (accepted draft, resampled or bonus) has
    the target's log-probability at its position, as one pass over the whole sequence computes it."""
    target, drafter = tiny_model(0, vocab=16, exact_rows=True), tiny_model(1, vocab=16, layers=1, exact_rows=True)
    prompt = [2, 3, 4]
    result = speculative_generate(prompt, target, drafter, gamma=3, sampler=Sampler(temperature=1.0),
                                  max_new_tokens=20, eos_token_ids=[], seed=5, logprobs=16)
    assert result.stats.accepted > 0 and result.stats.drafted > result.stats.accepted
    with torch.no_grad():
        logits = target.hf(torch.tensor([prompt + result.tokens], device=target.device)).logits[0].float().cpu()
    full = torch.log_softmax(logits, -1)[len(prompt) - 1:-1]
    got = torch.tensor([e.logprob for e in result.logprobs])
    assert torch.allclose(got, full[torch.arange(20), torch.tensor(result.tokens)], atol=1e-4)
    for row, entry in zip(full, result.logprobs):  # all 16 tokens: a distribution, sorted
        assert sorted(t for t, _ in entry.top) == list(range(16))
        assert torch.allclose(torch.tensor([v for _, v in entry.top]), row.sort(descending=True).values, atol=1e-4)


def test_logprobs_must_be_a_count():
    target = tiny_model(0, exact_rows=True)
    for bad in (-1, True, 2.5):
        with pytest.raises(SpecdecError, match="logprobs must be"):
            autoregressive_generate([1, 2], target, max_new_tokens=2, logprobs=bad)
