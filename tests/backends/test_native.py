"""Our compiled kernels (backends/native.py): each row of a call computed as it would be alone."""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch

from specdec.backends import native, rows
from specdec.backends.kernels import tiled_bf16_supported
from specdec.errors import SpecdecError

built = pytest.mark.skipif(native.library() is None, reason="no C compiler here: the kernels are not built")
tiled = pytest.mark.skipif(not tiled_bf16_supported(), reason="the tiled bf16 kernel needs AVX512 or AVX2 with FMA")
amx = pytest.mark.skipif(native.library() is None or native.linear_amx_kernel() is None,
                         reason="the AMX linear kernel needs a CPU with AMX")


def _reference(query, keys, values, spans, scale):
    """Attention in float64, row by row: [rows, heads, Dv]."""
    heads, kv_heads = query.shape[1], keys.shape[1]
    out = []
    for t, span in enumerate(spans):
        index = torch.cat([torch.arange(s.start, s.stop) for s in (span if isinstance(span, tuple) else (span,))])
        k = keys[0][:, index].double().repeat_interleave(heads // kv_heads, 0)
        v = values[0][:, index].double().repeat_interleave(heads // kv_heads, 0)
        q = query[0, :, t].double()
        weights = torch.softmax((k @ q[:, :, None]).squeeze(-1) * scale, dim=-1)
        out.append((weights[:, None, :] @ v).squeeze(1))
    return torch.stack(out)


def _cache(kv_heads, length, dim, dtype, capacity=None, generator=None):
    """A slab's view: [1, kv_heads, length, dim] of a [1, kv_heads, capacity, dim] buffer."""
    capacity = capacity or length + 13
    make = lambda: torch.randn(1, kv_heads, capacity, dim, generator=generator).to(dtype)[:, :, :length]  # noqa: E731
    return make(), make()


@built
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,dim", [(12, 2, 128), (8, 8, 64), (9, 3, 72), (24, 2, 8), (4, 1, 256)])
def test_attention_rows_match_float64_and_a_row_alone(dtype, heads, kv_heads, dim):
    """Every shape our models have (groups 1..12, head sizes off the 16-lane grid too): within
    float rounding of float64 attention, and each row bit for bit what it is alone, among rows of
    other sequences, with keys in gapped runs (a tree's), on 1 thread or 2."""
    generator = torch.Generator().manual_seed(heads * dim)
    caches = [_cache(kv_heads, length, dim, dtype, generator=generator) for length in (37, 90)]
    query = torch.randn(1, heads, 5, dim, generator=generator).to(dtype)
    spans = [slice(0, 35), (slice(0, 20), slice(30, 37)), slice(0, 90), (slice(0, 80), slice(85, 86)), slice(3, 4)]
    sequences = [0, 0, 1, 1, 0]
    layout = native.RowLayout(list(range(5)), sequences, spans)
    keys, values = [c[0] for c in caches], [c[1] for c in caches]
    scale = dim ** -0.5
    out = native.attention_rows(query, native.KeyValues.of(keys, values), layout, scale)
    assert out.shape == (5, heads, dim) and out.dtype == dtype
    for t, (sequence, span) in enumerate(zip(sequences, spans)):
        expected = _reference(query[:, :, t:t + 1], *caches[sequence], [span], scale)[0]
        tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
        assert torch.allclose(out[t].double(), expected, atol=tolerance, rtol=tolerance), t
        alone = native.attention_rows(query, native.KeyValues.of([keys[sequence]], [values[sequence]]),
                                      native.RowLayout([t], [0], [span]), scale)
        assert torch.equal(alone[0], out[t]), t
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        assert torch.equal(native.attention_rows(query, native.KeyValues.of(keys, values), layout, scale), out)
    finally:
        torch.set_num_threads(threads)


@built
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,dim", [(12, 2, 128), (12, 2, 72), (2, 2, 64), (32, 2, 64)])
@pytest.mark.parametrize("length", [70, 32])
def test_keys_scored_sixteen_at_once_have_the_bits_of_keys_scored_one_by_one(dtype, heads, kv_heads, dim, length):
    """A run's keys are scored 16 at a time (their sums reduced together), the rest of it one by
    one: the same keys split into runs too short for that (the same positions, in order) give the
    same bits, so the blocking changes no row (1, 6 and 16 query heads a key/value head; runs with
    and without keys left over)."""
    generator = torch.Generator().manual_seed(dim + heads + length)
    keys, values = _cache(kv_heads, length, dim, dtype, generator=generator)
    query = torch.randn(1, heads, 1, dim, generator=generator).to(dtype) * 3
    kv = native.KeyValues.of([keys], [values])
    whole = native.attention_rows(query, kv, native.RowLayout([0], [0], [slice(0, length)]), dim ** -0.5)
    pieces = tuple(slice(a, min(a + 7, length)) for a in range(0, length, 7))
    assert torch.equal(native.attention_rows(query, kv, native.RowLayout([0], [0], [pieces]), dim ** -0.5), whole)


def test_the_build_stamp_names_the_loaded_build_or_off(monkeypatch):
    """What pass costs are keyed by (`build_stamp`): the loaded library's stamp, "off" where the
    kernels are off."""
    try:
        monkeypatch.setenv("SPECDEC_NATIVE", "0")
        native.library.cache_clear()
        assert native.build_stamp() == "off"
        monkeypatch.delenv("SPECDEC_NATIVE")
        native.library.cache_clear()
        if native.library() is not None:  # a hash: one build per sources, flags, compiler and CPU
            from specdec.models.catalogue import home

            stamp = native.build_stamp()
            assert len(stamp) == 16 and int(stamp, 16) >= 0
            assert (home() / "kernels" / f"specdec-{stamp}.so").is_file()
    finally:
        native.library.cache_clear()


@built
def test_one_query_attention_is_the_kernels_row_and_sdpas_within_rounding():
    """A decode step's attention (`rows.one_query_attention`, batch rows of their own caches) is the
    kernel's, and within bf16 rounding of what sdpa computes."""
    generator = torch.Generator().manual_seed(1)
    key, value = _cache(2, 50, 64, torch.bfloat16, capacity=50, generator=generator)
    key, value = key.repeat(3, 1, 1, 1), value.repeat(3, 1, 1, 1)
    query = torch.randn(3, 12, 1, 64, generator=generator).bfloat16()
    out = rows.one_query_attention(query, key, value, 0.125)
    assert out.shape == (3, 1, 12, 64)
    for b in range(3):
        row = native.attention_rows(query[b:b + 1], native.KeyValues.of([key[b:b + 1]], [value[b:b + 1]]),
                                    native.RowLayout([0], [0], [slice(0, 50)]), 0.125)
        assert torch.equal(out[b, 0], row[0])
    packed = query.reshape(3, 2, 6, 64)
    sdpa = torch.nn.functional.scaled_dot_product_attention(packed, key, value, scale=0.125).reshape(3, 1, 12, 64)
    assert torch.allclose(out.float(), sdpa.float(), atol=1e-2)


@built
def test_the_kernel_takes_a_model_by_its_shape_and_copies_what_it_cannot_read_in_place():
    """fp16, or over 16 query heads per key/value head: sdpa's, for every row of the model. Keys
    laid out otherwise (positions not contiguous) are copied, not sent elsewhere: the same bits
    as the contiguous copy. A row's span past its cache is refused, not read."""
    key, value = _cache(1, 8, 16, torch.bfloat16)
    assert native.takes(torch.zeros(1, 16, 1, 16, dtype=torch.bfloat16), key)
    assert not native.takes(torch.zeros(1, 17, 1, 16, dtype=torch.bfloat16), key)
    assert not native.takes(torch.zeros(1, 4, 1, 16, dtype=torch.float16), key.half())
    query = torch.randn(1, 4, 1, 16).bfloat16()
    strided = torch.randn(1, 1, 16, 16).bfloat16()[:, :, ::2]
    layout = native.RowLayout([0], [0], [slice(0, 8)])
    assert torch.equal(native.attention_rows(query, native.KeyValues.of([strided], [value]), layout, 0.25),
                       native.attention_rows(query, native.KeyValues.of([strided.contiguous()], [value]), layout, 0.25))
    from specdec.errors import SpecdecError

    with pytest.raises(SpecdecError, match="reach position 9"):
        native.attention_rows(query, native.KeyValues.of([key], [value]), native.RowLayout([0], [0], [slice(0, 9)]), 0.25)


@built
def test_append_kv_writes_each_sequences_rows_at_its_own_position_and_refuses_what_does_not_fit():
    """A batched pass's keys [1, heads, rows, D] (laid out as a projection's transposed view) go to
    each sequence's slab from its own position on; nothing else of a slab changes; rows past a
    slab's room are refused before anything is written."""
    from specdec.errors import SpecdecError

    generator = torch.Generator().manual_seed(3)
    key = torch.randn(1, 5, 2, 8, generator=generator).bfloat16().transpose(1, 2)  # [1, 2 heads, 5 rows, 8]
    value = torch.randn(1, 2, 5, 8, generator=generator).bfloat16()
    slabs = [(torch.zeros(1, 2, 10, 8, dtype=torch.bfloat16), torch.zeros(1, 2, 12, 8, dtype=torch.bfloat16)[:, :, :10])
             for _ in range(2)]
    slabs = [(k, v.contiguous()) for k, v in slabs]
    kv = native.append_kv(key, value, [2, 3], [4, 0], slabs)
    assert kv.lengths == [6, 3]
    for s, (start, first, count) in enumerate([(4, 0, 2), (0, 2, 3)]):
        for slab, new in zip(slabs[s], (key, value)):
            assert torch.equal(slab[:, :, start:start + count], new[:, :, first:first + count])
            assert not slab[:, :, :start].any() and not slab[:, :, start + count:].any()
    before = [(k.clone(), v.clone()) for k, v in slabs]
    with pytest.raises(SpecdecError, match="no room"):
        native.append_kv(key, value, [2, 3], [4, 8], slabs)
    assert all(torch.equal(a, b) for pair, old in zip(slabs, before) for a, b in zip(pair, old))
    with pytest.raises(SpecdecError, match="do not fit"):
        native.append_kv(key.float(), value.float(), [2, 3], [0, 0], slabs)


def _torchs_bits_but_boundaries(got: torch.Tensor, want: torch.Tensor) -> None:
    """got equals want bit for bit but where an fp32 value near a bf16 rounding boundary rounded the
    other way (another exp, another sum order): at most one element in 10^4, by one bf16 step. Bits,
    not values: -0 is not +0."""
    differ = got.view(torch.int16) != want.view(torch.int16)
    assert int(differ.sum()) <= max(1, want.numel() // 10_000), int(differ.sum())
    steps = (got[differ].float() - want[differ].float()).abs() / want[differ].float().abs()
    assert bool((steps <= 2.0 ** -7).all())


@built
@pytest.mark.parametrize("rows,width", [(1, 8960), (7, 37), (300, 64)])
def test_silu_mul_has_torchs_bits(rows, width):
    """Gates and ups of every scale, gates past exp's range (where torch's silu gives -0) too:
    torch's silu and product (`_torchs_bits_but_boundaries`); a row's result does not depend on the
    rows beside it (element by element)."""
    generator = torch.Generator().manual_seed(rows)
    both = (torch.randn(rows, 2 * width, generator=generator) * torch.logspace(-3, 3, 2 * width)).bfloat16()
    both[0, :8] = torch.tensor([-1e19, -1000.0, -100.0, -88.5, -87.5, -80.5, -0.0, float("inf")])
    got = native.silu_mul(both)
    _torchs_bits_but_boundaries(got, torch.nn.functional.silu(both[:, :width]) * both[:, width:])
    assert torch.equal(native.silu_mul(both[-1:]), got[-1:])


@built
@pytest.mark.parametrize("rows,width", [(1, 1536), (9, 896), (300, 40)])
def test_rms_norm_has_transformers_bits(rows, width):
    """Rows of very different scales, widths off the 16-lane grid: transformers' own RMSNorm
    (`_torchs_bits_but_boundaries`: our sum of squares runs in another order); a row alone the same
    as among others, bit for bit."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    generator = torch.Generator().manual_seed(rows)
    norm = Qwen2RMSNorm(width, 1e-6).bfloat16()
    norm.weight.data = (torch.randn(width, generator=generator) * 0.3 + 1).bfloat16()
    x = (torch.randn(rows, width, generator=generator) * torch.logspace(-3, 3, rows)[:, None]).bfloat16()
    with torch.inference_mode():
        got = native.rms_norm(x, norm.weight, 1e-6)
        _torchs_bits_but_boundaries(got, type(norm).forward(norm, x))
        assert torch.equal(native.rms_norm(x[-1:], norm.weight, 1e-6), got[-1:])


@built
@tiled
@pytest.mark.parametrize("n,k,bias", [(100, 64, True), (2048, 1536, False), (16, 2, True), (77, 1030, False)])
def test_tiled_linear_matches_float64_and_a_row_alone(n, k, bias):
    """Outputs off the 16-wide tiles, inputs past a block of pairs, with and without bias: within
    bf16 rounding of float64, and each row bit for bit what it is in a call of 1..136 rows (AVX2
    widens the weights for 128 rows and more), on 1 thread or 2."""
    generator = torch.Generator().manual_seed(n + k)
    weight = (torch.randn(n, k, generator=generator) * 0.05).bfloat16()
    b = torch.randn(n, generator=generator).bfloat16() if bias else None
    packed = native.pack_tiles(weight)
    assert torch.equal(native.unpack_tiles(packed, n), weight)
    x = torch.randn(136, k, generator=generator).bfloat16()
    full = native.linear(x, packed, n, b)
    expected = x.double() @ weight.double().T + (b.double() if bias else 0)
    assert torch.allclose(full.double(), expected, rtol=2 ** -7, atol=1e-2)
    for count in (1, 2, 5, 6, 7, 8, 13, 40, 127, 128):  # 7 and 8 rows run in blocks of their own shape
        assert torch.equal(native.linear(x[-count:].clone(), packed, n, b), full[-count:]), count
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        assert torch.equal(native.linear(x, packed, n, b), full)
    finally:
        torch.set_num_threads(threads)


@built
@pytest.mark.skipif(not native.linear_widens(), reason="the fused multiply-add path runs on AVX512 without BF16 and on AVX2")
@pytest.mark.parametrize("n,k,bias,rows", [(20, 64, True, 9), (40, 2050, False, 9), (17, 70, True, 9),
                                           (40, 2050, True, 130)])
def test_without_bf16_dot_products_a_row_is_its_products_summed_in_order(n, k, bias, rows):
    """On AVX512 without BF16 and on AVX2 each output is its k products (exact in float32: bf16
    times bf16) added one by one in input order from zero, the bias added and the sum rounded to
    bf16, bit for bit, past a block of pairs too, and in a call long enough that AVX2 widens each
    block of weights once for all rows; NaN and infinity pass through the rounding as they should."""
    generator = torch.Generator().manual_seed(n * k)
    weight = (torch.randn(n, k, generator=generator) * 0.05).bfloat16()
    b = torch.randn(n, generator=generator).bfloat16() if bias else None
    x = torch.randn(rows, k, generator=generator).bfloat16()
    x[7, 3], x[8, 5] = float("nan"), float("inf")
    acc = torch.zeros(x.shape[0], n)
    for i in range(k):
        acc = acc + x[:, i, None].float() * weight[None, :, i].float()
    expected = (acc if b is None else acc + b.float()).bfloat16()
    got = native.linear(x, native.pack_tiles(weight), n, b)
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(got.nan_to_num(), expected.nan_to_num())


def _amx_order(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T summed in float32 as AMX's TDPBF16PS sums (csrc/linear_amx.c): per
    block of 16 input pairs an even and an odd lane from zero, pair after pair, then their sum added
    to the accumulator; the bias added and the result rounded to bf16 -> [M, N] bf16."""
    xs, ws = x.float(), weight.float()
    acc = torch.zeros(x.shape[0], weight.shape[0])
    for start in range(0, x.shape[1], 32):
        even, odd = torch.zeros_like(acc), torch.zeros_like(acc)
        for i in range(start, min(start + 32, x.shape[1]), 2):
            even = even + xs[:, i, None] * ws[None, :, i]  # a bf16 product is exact in float32
            odd = odd + xs[:, i + 1, None] * ws[None, :, i + 1]
        acc = acc + (even + odd)
    return (acc if bias is None else acc + bias.float()).bfloat16()


@amx
@pytest.mark.parametrize("n,k,bias", [(20, 64, True), (40, 96, False), (17, 70, True)])
def test_on_amx_a_row_has_amx_s_rounding_on_the_tiles_and_on_fmas(n, k, bias):
    """On an AMX CPU every tiled call rounds as AMX does, whether its rows run on the tiles or on
    FMAs (`specdec_linear_amx_least_rows` moves the switch; 70 inputs are no whole block of 16
    pairs, which only the FMAs take): the same bits as a float32 model of AMX's order, for calls of
    1, 3, 16, 17 and 40 rows."""
    import ctypes

    generator = torch.Generator().manual_seed(n * k)
    weight = (torch.randn(n, k, generator=generator) * 0.05).bfloat16()
    b = torch.randn(n, generator=generator).bfloat16() if bias else None
    x = torch.randn(40, k, generator=generator).bfloat16()
    # rows whose sum is 1 in AMX's order and 0 in others: pair after pair (2^24 + 1 rounds to 2^24),
    # or the odd lane added to the accumulator after the even one
    weight[:, [0, 1, 2, 32, 33]] = 1
    crafted = torch.zeros(k)
    crafted[[0, 1, 2, 32, 33]] = torch.tensor([2.0 ** 24, 1, -2.0 ** 24, 2.0 ** 24, -2.0 ** 24])
    x[[5, 20]] = crafted.bfloat16()
    expected = _amx_order(x, weight, b)
    assert torch.equal(expected[[5, 20]].float(), (1 + (b.float() if bias else torch.zeros(n))).bfloat16().float().expand(2, n))
    packed = native.pack_tiles(weight)
    least = native.library().specdec_linear_amx_least_rows
    least.restype, least.argtypes = ctypes.c_int64, [ctypes.c_int64]
    before = least(0)
    try:
        for switch in (1, 10 ** 6):  # every call on the tiles, then every call on FMAs
            least(switch)
            for count in (1, 3, 16, 17, 40):
                assert torch.equal(native.linear(x[:count].clone(), packed, n, b), expected[:count]), (switch, count)
    finally:
        least(before)


@amx
def test_on_amx_a_prompt_chunk_s_rows_are_a_decode_step_s():
    """The 1.5B target's widths: a row of a 256-row call (a prompt chunk) has the bits it has alone."""
    generator = torch.Generator().manual_seed(7)
    weight = (torch.randn(256, 1536, generator=generator) * 0.05).bfloat16()
    x = torch.randn(256, 1536, generator=generator).bfloat16()
    packed = native.pack_tiles(weight)
    full = native.linear(x, packed, 256, None)
    for row in (0, 100, 255):
        assert torch.equal(native.linear(x[row:row + 1].clone(), packed, 256, None), full[row:row + 1])


@tiled
def test_a_tiled_layer_unpacks_rewrites_and_copies_its_weight():
    """`PackedBf16Linear` in tiles: `dense` gives the weight back, `set_weight` computes with a new
    one, a deep copy computes the same."""
    import copy

    from specdec.backends.kernels import PackedBf16Linear, dense_weight, set_dense_weight

    weight = torch.randn(48, 32).bfloat16()
    layer = PackedBf16Linear(weight, torch.randn(48).bfloat16())
    assert layer.tiled and torch.equal(dense_weight(layer), weight)
    x = torch.randn(3, 32).bfloat16()
    assert torch.equal(copy.deepcopy(layer)(x), layer(x))
    set_dense_weight(layer, weight * 2)
    assert torch.equal(layer.dense(), weight * 2)
    assert torch.allclose(layer(x).float(), (x.float() @ (weight * 2).float().T + layer.bias.float()), atol=0.1, rtol=0.02)


@built
@pytest.mark.parametrize("rows,heads,kv_heads,dim", [(1, 12, 2, 128), (40, 14, 2, 64), (3, 2, 1, 24), (2, 3, 1, 80)])
def test_rotary_has_transformers_bits(rows, heads, kv_heads, dim):
    """q and k rotated out of a stacked q/k/v output: transformers' apply_rotary_pos_emb's bits (its
    eager bf16 ops), zeros of either sign and subnormal products too; a row's bits whatever else the
    call holds. 24 wide: the element-by-element path alone; 80: 16-wide chunks and that path."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    generator = torch.Generator().manual_seed(rows + dim)
    width = (heads + 2 * kv_heads) * dim
    stacked = torch.randn(1, rows, width, generator=generator).bfloat16()
    stacked[0, 0, :dim // 2] = 0.0
    stacked[0, 0, dim // 2:dim] = -0.0
    stacked[0, -1, :dim] = 1e-38  # products below 2^-126: torch keeps them subnormal
    angles = torch.randn(1, rows, dim, generator=generator) * 3
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    q, k = native.rotary(stacked, cos, sin, heads, kv_heads, dim)
    view = lambda x: x.view(1, rows, -1, dim).transpose(1, 2)  # noqa: E731
    want_q, want_k = apply_rotary_pos_emb(view(stacked[..., :heads * dim].clone()),
                                          view(stacked[..., heads * dim:(heads + kv_heads) * dim].clone()), cos, sin)
    assert torch.equal(q.view(torch.int16), want_q.contiguous().view(torch.int16))
    assert torch.equal(k.view(torch.int16), want_k.contiguous().view(torch.int16))
    last_q, _ = native.rotary(stacked[:, -1:].clone(), cos[:, -1:].clone(), sin[:, -1:].clone(), heads, kv_heads, dim)
    assert torch.equal(last_q[:, :, 0], q[:, :, -1])
    with pytest.raises(SpecdecError, match="rotary takes"):
        native.rotary(stacked.float(), cos, sin, heads, kv_heads, dim)


vnni = pytest.mark.skipif(native.linear_i8_kernel() is None, reason="the int8 kernel needs AVX512-VNNI or AVX2")


def _i8_reference(x: torch.Tensor, int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The int8 kernel's arithmetic in float64 but for its last sums: each row rounded to int8 in
    groups of I8_GROUP as the kernel rounds it (fp32, half to even), group sums exact -> [M, N]."""
    rows, k = x.shape
    groups = x.float().view(rows, k // native.I8_GROUP, native.I8_GROUP)
    most = groups.abs().amax(-1, keepdim=True)
    # a tensor over a tensor: torch's scalar-over-tensor division is not correctly rounded, C's is
    inverse = torch.where(most > 0, torch.full_like(most, 127.0) / most, torch.zeros_like(most))
    q = torch.round(groups * inverse)
    assert float(q.abs().max()) <= 127
    sums = torch.einsum("mgi,ngi->mng", q.double(), int8.double().view(len(int8), -1, native.I8_GROUP))
    y = (sums * (most / 127).double().squeeze(-1)[:, None, :]).sum(-1) * scales.double()
    return y + (bias.double() if bias is not None else 0)


@built
@vnni
@pytest.mark.parametrize("n,k,bias", [(100, 64, True), (1152, 896, True), (16, 32, False), (77, 4864, False)])
def test_int8_linear_matches_its_rounding_in_float64_and_a_row_alone(n, k, bias):
    """Outputs off the 16-wide tiles, with and without bias, a zero row, a row with one outlier:
    within bf16 rounding of its arithmetic in float64, and each row bit for bit what it is in a
    call of 1..20 rows, on 1 thread or 2, and read from a longer row."""
    from specdec.backends.kernels import quantize_int8

    generator = torch.Generator().manual_seed(n + k)
    int8, scales = quantize_int8(torch.randn(n, k, generator=generator) * 0.05)
    b = torch.randn(n, generator=generator).bfloat16() if bias else None
    packed = native.pack_i8(int8)
    assert packed.shape == (-(-n // 16), k // 4, 16, 4) and packed.dtype == torch.uint8
    assert int(packed[0, 1, 2, 3]) == int(int8[2, 7]) + 128  # tile 0, quad 1: output 2, input 4 + 3
    x = torch.randn(20, k, generator=generator).bfloat16()
    x[3] = 0
    x[5, 7] = 300.0  # flattens its own group only
    full = native.linear_i8(x, packed, scales, n, b)
    expected = _i8_reference(x, int8, scales, b)
    assert torch.allclose(full.double(), expected, rtol=2 ** -8, atol=1e-5)  # bf16 rounding of the result
    assert torch.equal(full[3], b if bias else torch.zeros(n, dtype=torch.bfloat16))
    for count in (1, 2, 3, 4, 5, 8, 20):
        assert torch.equal(native.linear_i8(x[-count:].clone(), packed, scales, n, b), full[-count:]), count
    wide = torch.cat([x, torch.randn(20, 32, generator=generator).bfloat16()], dim=1)
    assert torch.equal(native.linear_i8(wide[:, :k], packed, scales, n, b), full)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        assert torch.equal(native.linear_i8(x, packed, scales, n, b), full)
    finally:
        torch.set_num_threads(threads)


@built
@vnni
def test_the_int8_kernel_refuses_what_it_cannot_read():
    int8 = torch.zeros(16, 64, dtype=torch.int8)
    packed, scales = native.pack_i8(int8), torch.ones(16)
    with pytest.raises(SpecdecError, match="divisible by 32"):
        native.linear_i8(torch.zeros(1, 48).bfloat16(), native.pack_i8(torch.zeros(16, 48, dtype=torch.int8)), scales, 16, None)
    with pytest.raises(SpecdecError, match="bf16 inputs"):
        native.linear_i8(torch.zeros(1, 64), packed, scales, 16, None)
    with pytest.raises(SpecdecError, match="packed by pack_i8"):
        native.linear_i8(torch.zeros(1, 64).bfloat16(), packed, scales.double(), 16, None)
    with pytest.raises(SpecdecError, match="bias"):
        native.linear_i8(torch.zeros(1, 64).bfloat16(), packed, scales, 16, torch.zeros(16))
    assert native.linear_i8(torch.zeros(0, 64).bfloat16(), packed, scales, 16, None).shape == (0, 16)


def test_without_a_compiler_the_kernels_are_off_with_a_warning(monkeypatch, tmp_path, caplog):
    """A machine with no working C compiler keeps sdpa and oneDNN: one warning, nothing raised."""
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    monkeypatch.delenv("SPECDEC_NATIVE", raising=False)  # a run with the kernels off still tries the compiler here
    native.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="specdec.backends"):
            assert native.library() is None
        assert "could not be built" in caplog.text
        monkeypatch.setenv("SPECDEC_NATIVE", "0")
        native.library.cache_clear()
        assert native.library() is None
    finally:
        monkeypatch.undo()
        native.library.cache_clear()


def test_a_new_build_removes_builds_no_process_loaded_for_a_month(monkeypatch, tmp_path):
    """Each change of sources, compiler or CPU leaves its build behind; the next build removes
    those not loaded for STALE_SECONDS, a load touches its build, and a build pruned by another
    process between our look and our load is made again. Builds and loads are stubbed."""
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    old, recent, other = kernels / "specdec-old.so", kernels / "specdec-recent.so", kernels / "notes.txt"
    for path in (old, recent, other):
        path.write_bytes(b"")
    month_ago = time.time() - native.STALE_SECONDS - 60
    for path in (old, other):
        os.utime(path, (month_ago, month_ago))
    builds, loads = [], []
    monkeypatch.setattr(native, "_build", lambda target, compiler: (builds.append(target), target.write_bytes(b"")))

    def load(path):
        loads.append(path)
        if not os.path.exists(path):
            raise OSError(f"{path}: cannot open shared object file")
        return object()

    monkeypatch.setattr(native.ctypes, "CDLL", load)
    target = kernels / "specdec-new.so"
    native._load(target, "cc")
    assert builds == [target] and not old.exists() and recent.exists() and other.exists()

    os.utime(target, (month_ago, month_ago))
    kept = kernels / "specdec-kept.so"
    kept.write_bytes(b"")
    os.utime(kept, (month_ago, month_ago))
    native._load(target, "cc")  # found: loaded as it is, nothing pruned
    assert builds == [target] and kept.exists()
    assert time.time() - target.stat().st_mtime < 3600  # loaded: touched

    calls = []

    def pruned_first(path):  # another process prunes it between our look and our load
        calls.append(path)
        if len(calls) == 1:
            os.unlink(path)
        return load(path)

    monkeypatch.setattr(native.ctypes, "CDLL", pruned_first)
    native._load(target, "cc")
    assert builds == [target, target] and target.exists()

    monkeypatch.setattr(native.ctypes, "CDLL", lambda path: (_ for _ in ()).throw(OSError("bad ELF header")))
    with pytest.raises(OSError, match="bad ELF"):  # a build that is there but will not load: said once, not rebuilt
        native._load(target, "cc")
    assert builds == [target, target]


def test_packed_weights_are_copied_onto_huge_pages_where_linux_grants_them():
    """`huge_pages`: the same values and shape, 2 MB aligned on Linux; a small tensor, or one on
    another OS, stays itself; the copy lives on after the mapping's other references go."""
    import platform

    big = torch.randn(3000, 1000)
    copy = native.huge_pages(big)
    assert torch.equal(copy, big) and copy.shape == big.shape and copy.dtype == big.dtype
    if platform.system() == "Linux":
        assert copy.data_ptr() % native.HUGE_PAGE == 0 and copy.data_ptr() != big.data_ptr()
    small = torch.randn(16, 16)
    assert native.huge_pages(small) is small
    expected = big.clone()
    del big
    assert torch.equal(copy * 1, expected)
