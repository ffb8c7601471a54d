"""Batched passes: several sequences' new tokens in one target pass, each row bit for bit what that
sequence's own pass computes, whatever shares the pass (chains and trees mixed, ragged rollback).

Both CPU dtype paths are forced (fp32 with packed kernels, bf16), whatever CPU runs the tests.
"""

import copy

import pytest
import torch

from specdec import SpecdecError, autoregressive_generate
from specdec.backends import BatchedBackend, Segment
from specdec.backends.cache import cache_length, crop_cache
from specdec.core.trees import input_parents

from test_layout import protocol_gaps
from test_rows import _ids, qwen_like

VOCAB = 4096
TREE = [-1, 0, 0, 1, 2, 2]  # a tree of six nodes under the pending token (input_parents adds it)


def _prefilled(model, prompts):
    """A cache per prompt after `prefill`, and what each leaves to score."""
    caches, pending = [], []
    for prompt in prompts:
        cache = model.new_cache()
        pending.append(model.prefill(prompt, cache))
        caches.append(cache)
    return caches, pending


def _segments(pending, drafts):
    """Per sequence: its pending ids plus a chain draft (a list) or the tree TREE (a tuple of ids)."""
    segments = []
    for ids, draft in zip(pending, drafts):
        if isinstance(draft, tuple):
            parents = input_parents(len(ids), TREE)
            segments.append(Segment(ids + list(draft), None, len(draft) + 1, parents))
        else:
            segments.append(Segment(ids + draft, None, len(draft) + 1))
    return segments


def _alone(model, segment):
    return model.forward(segment.input_ids, segment.cache, segment.num_logits, segment.parents, segment.tree_start)


def _each_alone(model, segments, caches):
    """Each segment's logits from its own pass over a copy of its cache; then the segments hold
    `caches` again, as they were, for the batched pass."""
    alone = []
    for segment, cache in zip(segments, caches):
        segment.cache = copy.deepcopy(cache)
        alone.append(_alone(model, segment))
        segment.cache = cache
    return alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.slow
def test_batched_rows_equal_each_sequence_alone_bit_for_bit(dtype):
    model = qwen_like(dtype, exact_rows=True)
    prompts = [_ids(23, VOCAB, 1), _ids(5, VOCAB, 2), _ids(40, VOCAB, 3), _ids(11, VOCAB, 4)]
    drafts = [_ids(4, VOCAB, 5), [], tuple(_ids(len(TREE), VOCAB, 6)), _ids(1, VOCAB, 7)]
    caches, pending = _prefilled(model, prompts)
    segments = _segments(pending, drafts)
    alone = _each_alone(model, segments, caches)
    batched = model.forward_batch(segments)
    assert [b.shape for b in batched] == [a.shape for a in alone]
    for b, a in zip(batched, alone):
        assert torch.equal(b, a)
    assert [cache_length(c) for c in caches] == [len(p) - 1 + len(s.input_ids) for p, s in zip(prompts, segments)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_wide_batch_of_twelve_sequences_keeps_every_row(dtype):
    """72 rows in one pass (12 sequences, each its pending token and 5 drafts): past the 32 rows
    up to which packed fp32 was measured row-invariant, as a batch of 8 with trees would be."""
    model = qwen_like(dtype, exact_rows=True, layers=1)
    caches, pending = _prefilled(model, [_ids(10 + 3 * i, VOCAB, i) for i in range(12)])
    segments = _segments(pending, [_ids(5, VOCAB, 100 + i) for i in range(12)])
    alone = _each_alone(model, segments, caches)
    assert all(torch.equal(b, a) for b, a in zip(model.forward_batch(segments), alone))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ragged_rollback_then_batched_greedy_decoding_equals_each_ar_alone(dtype):
    """A batched greedy loop (each step: every sequence's pending token plus a draft, one pass,
    each keeps the longest prefix its argmax agrees with) in which one sequence's drafts are always
    wrong and another's always right: every output equals that prompt's AR alone, token for token."""
    model = qwen_like(dtype, exact_rows=True, layers=1)
    prompts = [_ids(9, VOCAB, 10), _ids(17, VOCAB, 11), _ids(3, VOCAB, 12)]
    steps = 10
    reference = [autoregressive_generate(p, model, max_new_tokens=4 * steps, eos_token_ids=[]).tokens for p in prompts]
    caches, pending = _prefilled(model, prompts)
    outputs = [[] for _ in prompts]
    for _ in range(steps):
        drafts = []
        for i, out in enumerate(outputs):
            right = reference[i][len(out):len(out) + 3]
            drafts.append([(t + 1) % VOCAB for t in right] if i == 0 else right if i == 1 else right[:1])
        logits = model.forward_batch([Segment(p + d, c, len(d) + 1) for p, d, c in zip(pending, drafts, caches)])
        for i, (draft, rows, cache) in enumerate(zip(drafts, logits, caches)):
            chosen = rows.argmax(-1).tolist()
            accepted = next((k for k, t in enumerate(draft) if t != chosen[k]), len(draft))
            emitted = draft[:accepted] + [chosen[accepted]]
            crop_cache(cache, len(prompts[i]) + len(outputs[i]) + accepted)  # rejected rows out
            outputs[i] += emitted
            pending[i] = emitted[-1:]
    assert all(out == ref[:len(out)] for out, ref in zip(outputs, reference))
    assert len(outputs[0]) == steps and len(outputs[1]) == 4 * steps  # all rejected / all accepted


def test_the_batched_test_sees_a_sequence_reading_another_ones_keys(monkeypatch):
    """Power check: a routing slip that hands each sequence its neighbour's keys in a layer (what
    a pass without per-sequence masks or caches amounts to) breaks the bit-for-bit equality, or is
    refused where a row's keys would reach past the cache it was handed (our attention kernel)."""
    from specdec.backends import native
    from specdec.backends.cache import SegmentedCache

    model = qwen_like(torch.float32, exact_rows=True, layers=1)
    caches, pending = _prefilled(model, [_ids(12, VOCAB, 20), _ids(30, VOCAB, 21)])
    segments = _segments(pending, [_ids(2, VOCAB, 22), _ids(3, VOCAB, 23)])
    alone = _each_alone(model, segments, caches)
    real_layer = SegmentedCache.layer

    def swapped(self, layer_idx):
        kv = real_layer(self, layer_idx)
        return native.KeyValues(kv.slabs[1:] + kv.slabs[:1], kv.lengths[1:] + kv.lengths[:1])

    monkeypatch.setattr(SegmentedCache, "layer", swapped)
    try:
        batched = model.forward_batch(segments)
    except SpecdecError as error:
        assert "a row's keys reach position" in str(error)
        return
    assert all(not torch.equal(b, a) for b, a in zip(batched, alone))


def test_batched_passes_need_row_exact_passes_and_sane_segments():
    from conftest import tiny_model

    batched_rows = tiny_model(0, exact_rows=False)
    cache = batched_rows.new_cache()
    with pytest.raises(SpecdecError, match="row-exact"):
        batched_rows.forward_batch([Segment([1, 2], cache)])
    model = tiny_model(0, exact_rows=True)
    with pytest.raises(SpecdecError, match="needs >= 1 new token"):
        model.forward_batch([Segment([], model.new_cache())])
    with pytest.raises(SpecdecError, match="needs >= 1 new token"):
        model.forward_batch([Segment([3], model.new_cache(), num_logits=2)])
    assert model.forward_batch([]) == []


def test_the_transformers_backend_is_a_batched_backend():
    from specdec.backends.transformers import TransformersModel

    assert protocol_gaps(TransformersModel, BatchedBackend) == []


def test_the_profile_times_the_engines_batched_pass():
    from specdec.sizing.pass_costs import batch_pass_seconds

    model = qwen_like(torch.bfloat16, exact_rows=True, layers=1)
    assert batch_pass_seconds(model, 3, 4, context=16, repeats=2) > 0
