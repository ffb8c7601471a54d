"""KV slabs (backends/slab.py): a pass writes its keys in place, rollback is a length change, and
a slab holds what transformers' concatenating layers hold, step for step."""

import pytest
import torch
from transformers.cache_utils import DynamicLayer

from specdec.backends.cache import compact_cache, crop_cache, reserve_cache
from specdec.backends.slab import SLAB_MIN, SlabLayer, slab_cache
from specdec.bench.kvstorage import BLOCK, _Paged, kv_storage_profile

from conftest import tiny_model


def _keys(n: int, start: int = 0) -> torch.Tensor:
    """[1, 2 heads, n, 4 dims] distinct values per position."""
    return torch.arange(start, start + n, dtype=torch.float32).view(1, 1, n, 1).expand(1, 2, n, 4).clone()


def test_a_slab_holds_what_a_dynamic_layer_holds_through_passes_crops_and_growth():
    slab, dynamic = SlabLayer(), DynamicLayer()
    position = 0
    for new, keep in [(40, 40), (7, 3), (30, 30), (6, 1), (50, 45), (1, 0)]:  # grows past 64 and 128
        for layer in (slab, dynamic):
            out_k, out_v = layer.update(_keys(new, position), -_keys(new, position))
            assert torch.equal(out_k, dynamic.keys if layer is dynamic else slab.keys)
            layer.crop(keep - new)
        position += keep
        assert slab.get_seq_length() == dynamic.get_seq_length() == position
        assert torch.equal(slab.keys, dynamic.keys) and torch.equal(slab.values, dynamic.values)
    assert slab.capacity >= position


def test_passes_within_capacity_and_rollback_neither_copy_nor_reallocate():
    slab = SlabLayer()
    slab.update(_keys(10), _keys(10))
    storage = slab.keys.untyped_storage().data_ptr()
    for step in range(20):  # a speculative step: 5 tokens in, 3 rolled back
        slab.update(_keys(5, 10 + 2 * step), _keys(5))
        slab.crop(-3)
        assert slab.keys.untyped_storage().data_ptr() == storage
        assert slab.keys.data_ptr() == storage  # views of the slab's start, never a copy
    assert slab.get_seq_length() == 50 and slab.capacity == SLAB_MIN


def test_a_full_slab_doubles_and_a_reserved_one_is_allocated_once():
    slab = SlabLayer()
    moves, last = 0, None
    for _ in range(300):
        slab.update(_keys(1), _keys(1))
        if slab.keys.data_ptr() != last:
            moves, last = moves + 1, slab.keys.data_ptr()
    assert slab.capacity == 8 * SLAB_MIN and moves == 4  # 64 -> 128 -> 256 -> 512 (>= 300)
    reserved = SlabLayer(reserve=300)
    reserved.update(_keys(10), _keys(10))
    assert reserved.capacity == 300


def test_a_copied_slab_has_its_own_address():
    """A forked beam's cache (a deep copy) must be written at its own slabs, not its parent's."""
    import copy

    from specdec.backends import native

    slab = SlabLayer()
    slab.update(_keys(10), _keys(10))
    parent = slab.address
    twin = copy.deepcopy(slab)
    assert twin.slabs[0].data_ptr() != slab.slabs[0].data_ptr()
    assert twin.address == native.address(*twin.slabs) and slab.address == parent


def test_compaction_and_crops_act_on_a_slab_cache_of_a_real_model():
    """A tree pass's accepted path moved into place, then a crop, on the model's own slab cache:
    the following pass's logits equal a cache-free pass over the same tokens."""
    model = tiny_model(0, exact_rows=False)
    cache = model.new_cache()
    assert all(isinstance(layer, SlabLayer) for layer in cache.layers)
    reserve_cache(cache, 100)
    ids = [(3 * i + 1) % 16 for i in range(12)]
    model.forward(ids[:8], cache, 1)
    # a tree: 5 and 6 at depth 1, 7 under 5, 9 under 6; the accepted path 5 -> 7 is offsets 0 and 2
    model.forward([5, 6, 7, 9], cache, 1, parents=[-1, -1, 0, 1])
    compact_cache(cache, 8, [0, 2])
    assert cache.get_seq_length() == 10 and cache.layers[0].capacity == 100
    got = model.forward([11], cache, 1)
    want = model.forward(ids[:8] + [5, 7, 11], None, 1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    crop_cache(cache, 4)
    assert cache.get_seq_length() == 4


def test_sliding_window_layers_stay_transformers_own():
    from transformers import MistralConfig

    config = MistralConfig(num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                           num_key_value_heads=1, vocab_size=16, sliding_window=8)
    kinds = {type(layer).__name__ for layer in slab_cache(config).layers}
    assert kinds and "SlabLayer" not in kinds


def test_crop_takes_a_negative_count_like_transformers():
    slab = SlabLayer()
    slab.update(_keys(3), _keys(3))
    with pytest.raises(ValueError, match="negative count"):
        slab.crop(1)


def test_the_measured_paged_store_gives_attention_what_a_dynamic_layer_holds():
    """`profile --kv-storage` times paged blocks against slabs: the paged store it times must hold
    the right keys, across block bounds, rollbacks and freed blocks."""
    blocks = 8
    pools = [torch.zeros(blocks, 2, BLOCK, 4) for _ in range(2)]
    free = list(range(blocks))
    paged, dynamic = _Paged(*pools, free), DynamicLayer()
    position = 0
    for new, keep in [(20, 20), (7, 2), (30, 30), (5, 0), (1, 1)]:
        got = paged.update(_keys(new, position), -_keys(new, position))
        want = dynamic.update(_keys(new, position), -_keys(new, position))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        paged.crop(keep - new)
        dynamic.crop(keep - new)
        position += keep
    assert paged.length == position == 53 and len(free) == blocks - 4  # 53 positions: 4 blocks held


def test_the_kv_storage_profile_times_each_storage_at_each_length():
    figures = kv_storage_profile(tiny_model(0, exact_rows=True), [8, 40], batch=2, rows=3)
    assert set(figures["step_ms"]) == {"dynamic", "paged", "slab"} and set(figures["pass_ms"]) == {"dynamic", "slab"}
    assert all(set(by_length) == {8, 40} and min(by_length.values()) > 0
               for part in ("step_ms", "pass_ms") for by_length in figures[part].values())
