"""Beam search, and speculative beam search: the same output, fewer target passes."""

import copy

import pytest
import torch

from specdec import (SpecdecError, autoregressive_generate, beam_search_generate, load, make_tree_drafter,
                     speculative_beam_search)
from specdec.decoding.beam import BeamState

from conftest import tiny_model
from specdec.backends.kernels import bf16_rows_exact
from test_rows import _ids, qwen_like


@pytest.fixture(scope="module")
def exact_pair():
    """A row-exact bf16 target with a sharp head (beams that agree for a while), its copy as a
    drafter, and an unrelated drafter."""
    target = qwen_like(torch.bfloat16, exact_rows=True, layers=1, vocab=512)
    with torch.no_grad():
        target.hf.lm_head.weight.mul_(8.0)
    same = copy.deepcopy(target)
    other = qwen_like(torch.bfloat16, exact_rows=True, layers=1, vocab=512, seed=1)
    return target, same, other


def _prompts():
    return [(_ids(5, 512, i) * 2)[: 6 + 3 * i] for i in range(3)]


@pytest.mark.parametrize("num_beams, length_penalty, early_stopping", [(1, 1.0, False), (2, 1.0, False),
                                                                       (3, 0.5, True), (4, 2.0, "never")])
def test_speculative_beam_search_equals_beam_search(exact_pair, num_beams, length_penalty, early_stopping):
    target, same, other = exact_pair
    eos = [7, 11]  # ids the search meets: finished hypotheses are exercised
    replayed = 0
    for prompt in _prompts():
        options = dict(num_beams=num_beams, length_penalty=length_penalty, max_new_tokens=16, eos_token_ids=eos,
                       early_stopping=early_stopping)
        expected = beam_search_generate(prompt, target, **options)
        for drafter in (same, other, lambda: make_tree_drafter("lookup")):
            out = speculative_beam_search(prompt, target, drafter, **options)
            assert out.tokens == expected.tokens, (prompt, drafter)
            assert out.stop_reason == expected.stop_reason
            if drafter is same:
                replayed += expected.stats.target_passes - out.stats.target_passes
    assert replayed > 0  # drafts from the target's copy saved target passes: steps were replayed


def test_row_exact_beam_search_with_one_beam_is_greedy(exact_pair):
    target = exact_pair[0]
    for prompt in _prompts():
        assert beam_search_generate(prompt, target, num_beams=1, max_new_tokens=12, eos_token_ids=[]).tokens == \
            autoregressive_generate(prompt, target, max_new_tokens=12, eos_token_ids=[]).tokens


def test_a_beam_state_step_is_transformers_rule():
    """Two beams over four ids: the top continuations run on, an EOS among the top two finishes."""
    state = BeamState(2, limit=5, eos={3}, length_penalty=1.0, early_stopping=False, device=torch.device("cpu"))
    first = torch.log(torch.tensor([[0.1, 0.5, 0.3, 0.1]])).expand(2, -1)
    assert state.advance(first) == ([0, 0], [1, 2])  # the copies of the one real beam never compete
    second = torch.log(torch.tensor([[0.05, 0.05, 0.1, 0.8], [0.7, 0.1, 0.1, 0.1]]))
    parents, tokens = state.advance(second)
    assert state.finished and state.finished[0][1] == [1, 3]  # 0.5·0.8 ended in EOS
    assert (parents, tokens) == ([1, 0], [0, 2])  # 0.3·0.7 and 0.5·0.1, not the finished one


def test_speculative_beam_search_refuses_what_it_cannot_replay_exactly():
    target = tiny_model(1, vocab=32)  # fp32, not row-exact
    with pytest.raises(SpecdecError, match="needs a row-exact target"):
        speculative_beam_search([1, 2], target, tiny_model(2, vocab=32), num_beams=2)
    with pytest.raises(SpecdecError, match="num_beams must be"):
        speculative_beam_search([1, 2], target, tiny_model(2, vocab=32), num_beams=0)


@pytest.mark.real
def test_speculative_beam_search_equals_beam_search_on_real_smollm2(smollm2):
    target = load("smollm2-135m", dtype="bf16" if bf16_rows_exact() else "fp32", device="cpu", exact_rows=True)
    for prompt, chat in [("def fibonacci(n):", False), ("Say hello.", True)]:
        ids = target.encode(prompt, chat=chat)
        expected = beam_search_generate(ids, target, num_beams=3, max_new_tokens=24)
        out = speculative_beam_search(ids, target, smollm2, num_beams=3, max_new_tokens=24)
        assert out.tokens == expected.tokens
        assert out.stats.target_passes < expected.stats.target_passes
