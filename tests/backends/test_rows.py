"""Row-exact passes: each row of a multi-token pass equals, bit for bit, a one-token pass there.

Greedy identity of speculative and autoregressive decoding rests on this in every dtype; the
tests force both CPU dtype paths (fp32 with packed kernels, as on AVX2-only CPUs; bf16, as `auto`
picks on CPUs with native bf16), whatever CPU runs them.
"""

import pytest
import torch

from specdec import GREEDY, TransformersModel, Sampler, autoregressive_generate, speculative_generate
from specdec.backends.rows import key_spans, refine_top_logits, widen_and_refine

from conftest import bf16_rows, cpu_only
from specdec.backends.kernels import TILED_LABELS, bf16_rows_exact, cpu_has_native_bf16, fast_bf16


def qwen_like(dtype: torch.dtype, exact_rows: bool | None = None, vocab: int = 4096, seed: int = 0,
              layers: int = 2, kernels: str = "auto") -> TransformersModel:
    """A random Qwen2 with grouped-query attention and hidden sizes where kernels block for real."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab, hidden_size=512, intermediate_size=1536, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    hf = Qwen2ForCausalLM(config).to(dtype)
    return TransformersModel(hf, None, f"qwen-like-{seed}", role="target", exact_rows=exact_rows, kernels=kernels)


def row_gap(model: TransformersModel, prompt: list[int], continuation: list[int]) -> float:
    """max |logits of a pass over `continuation` − logits of one-token passes|, both after `prompt`."""
    one_row = model.new_cache()
    pending = model.prefill(prompt, one_row)
    singles = [model.forward(pending, one_row, 1)] + [model.forward([t], one_row, 1) for t in continuation]
    wide = model.new_cache()
    model.prefill(prompt, wide)
    multi = model.forward(pending + continuation, wide, len(continuation) + 1)
    return float((torch.cat(singles) - multi).abs().max())


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# the bf16 linear paths: transformers' layers through F.linear (TwoRowLinear), and weights packed
# for oneDNN (PackedBf16Linear), which `auto` picks on CPUs with native bf16
packed_bf16 = pytest.mark.skipif(not fast_bf16() or not torch.backends.mkldnn.is_available(),
                                 reason="packed bf16 linears are picked where bf16 is fast only (native, or our tiled kernel)")
BF16_KERNELS = ["stock", pytest.param("auto", marks=packed_bf16)]


@pytest.mark.parametrize("dtype,kernels", [(torch.float32, "auto"), (torch.bfloat16, "stock"),
                                           pytest.param(torch.bfloat16, "auto", marks=packed_bf16)],
                         ids=["fp32", "bf16-stock", "bf16-packed"])
def test_row_exact_passes_equal_one_row_passes_bit_for_bit(dtype, kernels):
    model = qwen_like(dtype, exact_rows=True, kernels=kernels)
    assert model.exact_rows
    for width in (1, 2, 5, 12):
        assert row_gap(model, _ids(37, 4096, width), _ids(width, 4096, 100 + width)) == 0.0


def _one_row_gemv_differs(monkeypatch) -> None:
    """Make every bf16/fp32 GEMM on one row (`F.linear`, and packed bf16 linears' oneDNN call)
    round differently from the same row in a multi-row call, as an AVX512-BF16 EPYC's GEMV path
    did (docs/kernels.md)."""
    from specdec.backends.kernels import PackedBf16Linear

    real = torch.nn.functional.linear

    def linear(x, weight, bias=None):
        y = real(x, weight, bias)
        return y * (1 + 2.0 ** -6) if x.numel() == x.shape[-1] else y
    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    real_packed = PackedBf16Linear._packed

    def packed(self, flat):
        y = real_packed(self, flat)
        return y * (1 + 2.0 ** -6) if len(flat) == 1 else y
    monkeypatch.setattr(PackedBf16Linear, "_packed", packed)


@pytest.mark.parametrize("kernels", BF16_KERNELS, ids=["stock", "packed"])
def test_row_exact_passes_do_not_trust_a_one_row_gemm(monkeypatch, kernels):
    _one_row_gemv_differs(monkeypatch)
    model = qwen_like(torch.bfloat16, exact_rows=True, kernels=kernels)
    for width in (1, 3):
        assert row_gap(model, _ids(20, 4096, width), _ids(width, 4096, 50 + width)) == 0.0


@pytest.mark.parametrize("kernels", BF16_KERNELS, ids=["stock", "packed"])
def test_the_one_row_gemm_test_has_power(monkeypatch, kernels):
    import specdec.backends.kernels

    _one_row_gemv_differs(monkeypatch)
    # every linear path but our tiled kernel (row-exact by construction: tests/backends/test_native.py)
    # makes its calls through row_exact_calls: without it, a lone row is a 1-row call
    monkeypatch.setattr(specdec.backends.kernels, "tiled_bf16_supported", lambda: False)
    monkeypatch.setattr(specdec.backends.kernels, "row_exact_calls", lambda function, flat, least=2: function(flat))
    model = qwen_like(torch.bfloat16, exact_rows=True, kernels=kernels)
    assert row_gap(model, _ids(20, 4096, 3), _ids(3, 4096, 53)) > 0.0


@cpu_only
@packed_bf16
@pytest.mark.skipif(not cpu_has_native_bf16(), reason="oneDNN emulates bf16 without native bf16, rounding rows by the call's size")
def test_packed_bf16_linears_compute_what_f_linear_computes(monkeypatch):
    """A bf16 target on a native-bf16 CPU without our tiled kernel runs every linear, its head too,
    on weights packed once for oneDNN; each row comes out as `F.linear`'s over the same rows, in
    calls of 2..32 rows wherever the row sits, and a lone row padded to `least_rows` is the first
    row of such a call."""
    import specdec.backends.kernels
    from specdec.backends.kernels import ROW_CHUNK, PackedBf16Linear, dense_weight

    monkeypatch.setattr(specdec.backends.kernels, "tiled_bf16_supported", lambda: False)
    model = qwen_like(torch.bfloat16, exact_rows=True, vocab=512)
    assert model.kernels == "onednn-packed-bf16" and model.rows_invariant
    from specdec.backends.merged import MergedGemm

    layers = [m for m in model.hf.modules() if isinstance(m, PackedBf16Linear)]
    # a layer's 7 linears, less those stacked into one GEMM with a sibling (backends/merged.py)
    stacked = sum(len(m.sizes) - 1 for m in model.hf.modules() if isinstance(m, MergedGemm) and m.stacked)
    assert len(layers) == 7 * 2 - stacked and not any(type(m) is torch.nn.Linear for m in model._decoder.modules())
    torch.manual_seed(0)
    for layer in layers[:len(layers) // 2] + [model._packed_head]:
        weight = dense_weight(layer)
        x = torch.randn(ROW_CHUNK, layer.in_features).bfloat16()
        reference = torch.nn.functional.linear(x, weight, layer.bias)
        for rows in (2, 3, 6, 7, 17, ROW_CHUNK):
            assert torch.equal(layer._packed(x[-rows:].clone()), reference[-rows:]), (layer, rows)
        padded = layer._packed(torch.nn.functional.pad(x[:1], (0, 0, 0, layer.least_rows - 1)))[:1]
        assert torch.equal(padded, reference[:1])


@cpu_only
@packed_bf16
def test_a_packed_layer_counts_the_weights_it_computes_with():
    """Packed layers keep their weights as buffers; what a pass's cost goes by (the layer-skipping
    drafters' calibration) counts them as an unpacked layer's parameters, a stacked GEMM once."""
    from specdec.backends.kernels import packed_bf16_label, weight_count

    packed = qwen_like(torch.bfloat16, exact_rows=True, vocab=512)
    stock = qwen_like(torch.bfloat16, exact_rows=True, vocab=512, kernels="stock")
    assert packed.kernels == packed_bf16_label() and stock.kernels == "stock"
    expected = sum(p.numel() for p in stock._decoder.layers[0].parameters())
    assert weight_count(packed._decoder.layers[0]) == expected > 2 * 512 ** 2
    assert weight_count(stock._decoder.layers[0]) == expected


def test_batched_passes_are_not_row_exact_here():
    """What the mode removes: on the machines measured, a plain multi-row bf16 pass rounds rows
    differently from one-row passes. (Kernel-dependent: reported, not asserted, elsewhere.)"""
    model = qwen_like(torch.bfloat16, exact_rows=False)
    gap = row_gap(model, _ids(37, 4096, 1), _ids(8, 4096, 2))
    if gap == 0.0:
        pytest.skip("this machine's batched kernels happen to be row-invariant")
    assert gap > 0


def test_row_exact_on_real_weights(smollm2, humaneval_prompts):
    """SmolLM2 (real weights, tied head) in fp32 and in bf16: every verification-sized pass is row-exact."""
    from specdec import load

    prompt = smollm2.encode(humaneval_prompts[0])[:60]
    continuation = smollm2.encode(humaneval_prompts[1])[:9]
    fp32 = load("smollm2-135m", dtype="fp32", device="cpu", exact_rows=True)
    assert row_gap(fp32, prompt, continuation) == 0.0
    if not bf16_rows_exact():
        pytest.skip("fp32 passed; this CPU emulates bf16 with AVX512, whose rows are not exact (docs/kernels.md)")
    bf16 = load("smollm2-135m", dtype="bf16", device="cpu")
    assert bf16.exact_rows and row_gap(bf16, prompt, continuation) == 0.0  # on by default in bf16


@bf16_rows
def test_greedy_speculative_equals_ar_in_bf16_on_real_weights(smollm2, humaneval_prompts):
    """Greedy identity with a bf16 target, where near-ties are common: SmolLM2 in bf16, drafted by
    its fp32 self (nearly always accepted, so the passes are as wide as γ allows)."""
    from specdec import load

    target = load("smollm2-135m", dtype="bf16", device="cpu")
    for text in humaneval_prompts[:2]:
        ids = target.encode(text)
        ar = autoregressive_generate(ids, target, max_new_tokens=24)
        sd = speculative_generate(ids, target, smollm2, gamma=6, max_new_tokens=24)
        assert sd.tokens == ar.tokens
        assert max(sd.stats.accepted_per_step) >= 4  # the test saw wide passes


def test_sampled_speculative_follows_the_same_p_as_ar_in_bf16():
    """Under sampling a bf16 target's p must be the same function of the context in both loops:
    with one-hot q (a drafter that proposes the target's own greedy tokens) and a shared seed the
    first step's distribution is read off directly — here checked through the logits instead."""
    model = qwen_like(torch.bfloat16, exact_rows=True, seed=3)
    prompt, continuation = _ids(20, 4096, 5), _ids(6, 4096, 6)
    assert row_gap(model, prompt, continuation) == 0.0
    probs = Sampler(0.7).probs(model.forward(prompt, None, len(prompt)))
    assert torch.allclose(probs.sum(-1), torch.ones(len(prompt), device=probs.device))


def test_key_spans_follow_the_mask():
    causal = key_spans(None, 3, 10)
    assert causal == [slice(0, 8), slice(0, 9), slice(0, 10)]
    mask = torch.zeros(1, 1, 3, 6, dtype=torch.bool)
    mask[0, 0, 0, :4] = True          # contiguous
    mask[0, 0, 1, [0, 1, 2, 4]] = True  # a tree branch: its contiguous runs
    mask[0, 0, 2, 2:6] = True         # a sliding window
    spans = key_spans(mask, 3, 6)
    assert spans[0] == slice(0, 4) and spans[2] == slice(2, 6)
    assert spans[1] == (slice(0, 3), slice(4, 5))
    additive = torch.where(mask, 0.0, torch.finfo(torch.float32).min)
    assert key_spans(additive, 3, 6)[1] == (slice(0, 3), slice(4, 5))
    mask[0, 0, 1] = torch.tensor([True, False, True, False, True, True])  # three runs
    assert key_spans(mask, 3, 6)[1] == (slice(0, 1), slice(2, 3), slice(4, 6))


def test_refined_bf16_logits_pick_the_fp32_argmax():
    """The bf16 head plus fp32 re-scoring of near-top candidates chooses what an fp32 head would,
    also where bf16 rounding ties or swaps the top two."""
    torch.manual_seed(0)
    vocab, size = 2000, 256
    weight = (torch.randn(vocab, size) / 16).bfloat16()
    hidden = torch.randn(64, size).bfloat16()
    exact = hidden.double() @ weight.double().t()
    weight[1] = weight[0]  # near-ties: row 1 differs from row 0 in one element by one bf16 ulp
    weight[1, 0] = torch.nextafter(weight[0, 0].float(), torch.tensor(9.0)).bfloat16()
    exact = hidden.double() @ weight.double().t()
    bf16 = torch.nn.functional.linear(hidden, weight).float()
    norm = float(weight.float().norm(dim=-1).max())
    refined = refine_top_logits(bf16, hidden, weight, norm)
    assert torch.equal(refined.argmax(-1), exact.argmax(-1))
    assert (bf16.argmax(-1) != exact.argmax(-1)).any()  # plain bf16 logits get some rows wrong
    top = exact.argmax(-1)
    assert torch.allclose(refined.gather(-1, top[:, None]).double(), exact.gather(-1, top[:, None]), atol=1e-4)


def test_refined_logits_of_a_row_do_not_depend_on_the_other_rows(monkeypatch):
    """A row's re-scored logits are the same bits alone as among 48 others (a batch's pass scores
    every sequence's rows in one call), and with too many candidates for one call, row by row."""
    import specdec.backends.rows as rows

    torch.manual_seed(1)
    vocab, size = 3000, 1536
    weight = (torch.randn(vocab, size) / 40).bfloat16()
    hidden = torch.randn(48, size).bfloat16()
    weight[7:40] = weight[6]  # rows pointing along weight[6] have 34 tied candidates at their top
    hidden[[1, 17]] = (weight[6].float() * 40).bfloat16()
    norm = float(weight.float().norm(dim=-1).max())
    logits = torch.nn.functional.linear(hidden, weight).float()
    together = refine_top_logits(logits, hidden, weight, norm)
    assert int((together[1] != logits[1]).sum()) > 1  # several candidates re-scored in that row
    for t in (0, 1, 17, 47):
        alone = refine_top_logits(logits[t:t + 1], hidden[t:t + 1], weight, norm)
        assert torch.equal(alone[0], together[t])
    monkeypatch.setattr(rows, "REFINED_AT_ONCE", 3)  # more candidates than that: a row at a time
    assert torch.equal(refine_top_logits(logits, hidden, weight, norm), together)
    for at_once in (3, 4096):  # written into the caller's own tensor, the same values
        monkeypatch.setattr(rows, "REFINED_AT_ONCE", at_once)
        mine = logits.clone()
        assert refine_top_logits(mine, hidden, weight, norm, in_place=True) is mine and torch.equal(mine, together)


def test_widening_and_refining_in_one_call_gives_refine_top_logits_bits():
    """`widen_and_refine` (the head's candidates found by one kernel call where it is built) gives
    `refine_top_logits` on the widened logits bit for bit: with ties at a row's top, a row alone or
    among others, a row with more candidates than the kernel keeps and a row holding NaN or inf
    (both the long way), and where the kernel finds them it finds each row's candidates."""
    from specdec.backends import native

    torch.manual_seed(2)
    vocab, size = 3001, 512
    weight = (torch.randn(vocab, size) / 20).bfloat16()
    hidden = torch.randn(24, size).bfloat16()
    weight[7:20] = weight[6]  # rows along weight[6]: 14 tied candidates at their top
    hidden[[1, 5]] = (weight[6].float() * 20).bfloat16()
    norm = float(weight.float().norm(dim=-1).max())
    head_out = torch.nn.functional.linear(hidden, weight)
    expected = refine_top_logits(head_out.float(), hidden, weight, norm)
    assert torch.equal(widen_and_refine(head_out, hidden, weight, norm), expected)
    for t in (0, 1, 23):
        assert torch.equal(widen_and_refine(head_out[t:t + 1], hidden[t:t + 1], weight, norm)[0], expected[t])
    if native.candidates_kernel() is not None:
        found = native.head_candidates(head_out, 2 * size * 2.0 ** -24 * hidden.float().norm(dim=-1) * norm)
        assert found is not None and torch.equal(found[0], head_out.float())
        assert int((found[1] == 1).sum()) >= 14  # the tied row's candidates, all found
    flat = head_out.clone()
    flat[3] = 1.0  # every token a candidate: past the kernel's room
    odd = head_out.clone()
    odd[4, 10], odd[9, 0] = float("nan"), float("inf")
    for logits in (flat, odd):
        if native.candidates_kernel() is not None:
            assert native.head_candidates(logits, torch.zeros(24)) is None
        torch.testing.assert_close(widen_and_refine(logits, hidden, weight, norm),
                                   refine_top_logits(logits.float(), hidden, weight, norm), rtol=0, atol=0, equal_nan=True)


@cpu_only
def test_exact_rows_default_on_for_bf16_cpu_targets_only(monkeypatch):
    import specdec.backends.transformers

    monkeypatch.setattr(specdec.backends.transformers, "bf16_rows_exact", lambda: True)
    assert qwen_like(torch.bfloat16, vocab=256).exact_rows
    assert not qwen_like(torch.float32, vocab=256).exact_rows  # 1-token passes would pay for it
    # AVX512's bf16 emulation rounds rows of 4-row GEMMs otherwise: not by default there, unless
    # the linears run our tiled kernel, whose rows are exact by construction
    monkeypatch.setattr(specdec.backends.transformers, "bf16_rows_exact", lambda: False)
    model = qwen_like(torch.bfloat16, vocab=256)
    assert model.exact_rows == (model.kernels in TILED_LABELS)


def test_native_bf16_is_read_from_the_cpu_flags_on_x86(monkeypatch):
    """oneDNN's own probe says yes on AVX512 CPUs without BF16, where it emulates bf16: the flags
    decide there."""
    import platform

    import specdec.backends.kernels as kernels

    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    for flags, native, rows_exact in (({"avx2", "avx512f", "avx512_vnni"}, False, False), ({"avx2"}, False, True),
                                      ({"avx512f", "avx512_bf16"}, True, True), ({"amx_tile", "amx_bf16"}, True, True)):
        monkeypatch.setattr(kernels, "_cpu_flags", lambda: flags)
        kernels.cpu_has_native_bf16.cache_clear()
        assert (kernels.cpu_has_native_bf16(), kernels.bf16_rows_exact()) == (native, rows_exact), flags
    kernels.cpu_has_native_bf16.cache_clear()


def test_greedy_identity_on_tiny_models_with_every_dtype():
    for dtype in (torch.float32, torch.bfloat16):
        target = qwen_like(dtype, exact_rows=True, seed=1, vocab=512)
        drafter = qwen_like(dtype, seed=2, vocab=512, layers=1)
        prompt = _ids(30, 512, 9)
        ar = autoregressive_generate(prompt, target, GREEDY, max_new_tokens=24, eos_token_ids=[])
        sd = speculative_generate(prompt, target, drafter, gamma=4, max_new_tokens=24, eos_token_ids=[],
                                  first_target=False)
        assert sd.tokens == ar.tokens


def test_one_query_attention_is_grouped_query_attention():
    """Packed heads compute what transformers' repeat_kv layout computes: head h reads key/value
    head h // groups (a wrong grouping, e.g. h % kv_heads, would fail this)."""
    from transformers.integrations.sdpa_attention import repeat_kv

    from specdec.errors import SpecdecError
    from specdec.backends.rows import one_query_attention

    torch.manual_seed(0)
    for heads, kv_heads in ((12, 2), (8, 8), (6, 3)):
        query, key, value = torch.randn(2, heads, 1, 16), torch.randn(2, kv_heads, 40, 16), torch.randn(2, kv_heads, 40, 16)
        groups = heads // kv_heads
        expected = torch.nn.functional.scaled_dot_product_attention(
            query, repeat_kv(key, groups), repeat_kv(value, groups), scale=0.3).transpose(1, 2)
        assert torch.allclose(one_query_attention(query, key, value, 0.3), expected, atol=1e-6)
    with pytest.raises(SpecdecError, match="multiple"):
        one_query_attention(torch.randn(1, 5, 1, 16), torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16))


@cpu_only
@pytest.mark.parametrize("exact_rows", [True, False], ids=["row-exact", "batched"])
def test_our_one_query_passes_pack_heads_and_transformers_own_do_not(monkeypatch, exact_rows):
    """Our decode steps (row-exact target or plain drafter) take the packed call in every layer;
    the same model object called as transformers' own (what its `generate` does) never does."""
    import specdec.backends.rows

    calls = []
    real = specdec.backends.rows.one_query_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(specdec.backends.rows, "one_query_attention", counted)
    model = qwen_like(torch.bfloat16, exact_rows=exact_rows, vocab=256)
    cache = model.new_cache()
    pending = model.prefill(_ids(20, 256, 1), cache)
    model.forward(pending, cache, 1)
    calls.clear()
    model.forward([3], cache, 1)
    assert len(calls) == model.hf.config.num_hidden_layers
    calls.clear()
    with torch.inference_mode():
        model.hf(input_ids=torch.tensor([[3, 4]]), past_key_values=cache, use_cache=True)
        model.hf(input_ids=torch.tensor([[5]]), past_key_values=cache, use_cache=True)
    assert not calls


def test_a_row_exact_pass_calls_each_gemm_with_two_to_32_rows():
    """The row counts at which every CPU measured computes a row the same whatever else the call
    holds (bf16 on an AMX Xeon changes from 33 rows on): a wide row-exact pass is cut to them, a
    lone row padded to two, and the rows come back in order."""
    from specdec.backends.kernels import ROW_CHUNK, row_exact_calls

    for rows in (1, 2, 31, 32, 33, 64, 65, 97):
        sizes = []

        def linear(flat):
            sizes.append(len(flat))
            return flat * 2

        flat = torch.arange(rows * 3, dtype=torch.float32).view(rows, 3)
        assert torch.equal(row_exact_calls(linear, flat), flat * 2)
        assert all(2 <= n <= ROW_CHUNK for n in sizes), (rows, sizes)
        assert sum(sizes) == rows + (rows == 1)
        sizes.clear()  # padded to 6 rows, as packed bf16 linears are where 4-6-row calls are fastest
        assert torch.equal(row_exact_calls(linear, flat, 6), flat * 2)
        assert all(6 <= n <= ROW_CHUNK for n in sizes), (rows, sizes)


def test_on_cuda_a_row_exact_pass_calls_each_gemm_and_norm_with_the_same_rows():
    """cuBLAS and torch's reductions lay a call out by its whole shape, so on CUDA every call of a
    row-exact pass has CUDA_ROWS rows: zero-padded, wide inputs cut, rows back in order. The
    function is device-agnostic; here it runs on the CPU."""
    from specdec.backends.kernels import CUDA_ROWS, fixed_row_calls

    for rows in (1, 2, CUDA_ROWS - 1, CUDA_ROWS, CUDA_ROWS + 1, 3 * CUDA_ROWS + 5):
        sizes = []

        def linear(flat):
            sizes.append(len(flat))
            return flat * 2

        flat = torch.arange(rows * 3, dtype=torch.float32).view(rows, 3) + 1
        assert torch.equal(fixed_row_calls(linear, flat, CUDA_ROWS), flat * 2)
        assert set(sizes) == {CUDA_ROWS} and len(sizes) == -(-rows // CUDA_ROWS), (rows, sizes)


def test_norms_keep_their_output_when_their_rows_are_fixed():
    """`fix_norm_rows` swaps each RMSNorm's class for one that (on CUDA, in a row-exact pass)
    computes in fixed-row calls: the module keeps its weights and computes the same values."""
    import copy

    from specdec.backends.kernels import fix_norm_rows
    from specdec.backends.rows import row_exact

    model = qwen_like(torch.float32, exact_rows=False)
    norms = [m for m in model.hf.modules() if type(m).__name__.endswith("RMSNorm")]
    before = copy.deepcopy(norms[0])
    x = torch.randn(3, 7, norms[0].weight.shape[0], device=model.device)
    assert fix_norm_rows(model.hf) == len(norms) > 0 and fix_norm_rows(model.hf) == 0
    assert all(type(m).__name__.startswith("RowStable") for m in norms)
    with row_exact(True):
        assert torch.equal(norms[0](x), before(x))
        assert torch.equal(norms[0](x[:, :1]), before(x[:, :1]))


@pytest.mark.parametrize("env,expected", [({}, "20000"), ({"OMP_WAIT_POLICY": "ACTIVE"}, None),
                                          ({"GOMP_SPINCOUNT": "7"}, "7")])
def test_importing_specdec_sets_a_short_openmp_spin_unless_the_user_set_one(env, expected):
    """libgomp reads its spin once, when torch loads it: specdec sets it before importing torch,
    and leaves a user's own setting (GOMP_SPINCOUNT or OMP_WAIT_POLICY) alone."""
    import os
    import subprocess
    import sys

    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", "import os, specdec; print(os.environ.get('GOMP_SPINCOUNT'))"],
                         env={**clean, **env}, capture_output=True, text=True, check=True).stdout.split()[-1]
    assert out == str(expected)


@cpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prompts_fed_together_get_the_bits_each_gets_alone(dtype):
    """`prefill_batch` feeds prompts in one pass, each cache (and the first token's logits) bit for
    bit what its own `prefill` gives it: short ones row-exactly; where the linears round a row alike
    in calls of any size (our tiled kernels: `shared_chunks`), longer ones (past `shared_prefill`
    ids) and a long prompt's chunks, first over an empty cache and then over its first chunk's,
    attending causally as alone, a last chunk of one row by the one-query kernel as alone; a prompt
    cache's partial entries are extended. Elsewhere a longer prompt is refused."""
    from specdec.backends import native
    from specdec.backends.prompts import PREFILL_CHUNK, SHARED_PREFILL
    from specdec.errors import SpecdecError

    model = qwen_like(dtype, exact_rows=True, vocab=512)
    if native.one_query_kernel() is None:
        assert model.shared_prefill == 0
        with pytest.raises(SpecdecError, match="cannot share a prompt pass"):
            model.prefill_batch([(_ids(3, 512, 0), model.new_cache())])
        pytest.skip("our attention kernel is not built here: prompts are fed alone")
    assert model.shared_prefill == SHARED_PREFILL and model.features().shared_prefill == SHARED_PREFILL
    chunks = model.kernels in TILED_LABELS
    assert model.shared_chunks == chunks == model.features().shared_chunks
    if chunks:  # one linear off the tiles (an odd input width's) and its rows would round otherwise
        from specdec.backends.kernels import PackedBf16Linear

        layer = next(m for m in model._decoder.modules() if isinstance(m, PackedBf16Linear))
        layer.tiled = False
        assert not model.shared_chunks
        layer.tiled = True
    short = [_ids(n, 512, n) for n in (1, 6, 30, SHARED_PREFILL)]
    longer = [_ids(n, 512, n) for n in (SHARED_PREFILL + 1, 100)]
    long, other, last_row = _ids(PREFILL_CHUNK + 60, 512, 7), _ids(120, 512, 8), _ids(PREFILL_CHUNK + 2, 512, 9)
    if not chunks:
        with pytest.raises(SpecdecError, match=f"prompts of 1..{SHARED_PREFILL} ids"):
            model.prefill_batch([(longer[0], model.new_cache())])
    prompts = short + longer if chunks else short
    alone, together = [model.new_cache() for _ in prompts], [model.new_cache() for _ in prompts]
    for prompt, cache in zip(prompts, alone):
        model.prefill(prompt, cache)
    model.prefill(prompts[2][:11], together[2])  # 10 entries in already (a chunk, a kept prompt)
    fed = [(prompts, alone, together)]
    if chunks:
        extra_alone, extra_together = [model.new_cache() for _ in range(3)], [model.new_cache() for _ in range(3)]
        for prompt, cache in zip((long, other, last_row), extra_alone):  # in the chunks `prefill_step` feeds
            model.prefill(prompt[:PREFILL_CHUNK + 1], cache)
            model.prefill(prompt, cache)
        firsts = [long[:PREFILL_CHUNK + 1], last_row[:PREFILL_CHUNK + 1]]
        model.prefill_batch(list(zip(prompts + firsts, together + extra_together[::2])))
        assert extra_together[0].get_seq_length() == extra_together[2].get_seq_length() == PREFILL_CHUNK
        # second chunks over the first: 59 rows, and a single row
        model.prefill_batch([(other, extra_together[1]), (long, extra_together[0]), (last_row, extra_together[2])])
        fed.append(([long, other, last_row], extra_alone, extra_together))
    else:
        model.prefill_batch(list(zip(prompts, together)))
    for group, ones, shareds in fed:
        for prompt, one, shared in zip(group, ones, shareds):
            assert one.get_seq_length() == shared.get_seq_length() == len(prompt) - 1
            for a, b in zip(one.layers, shared.layers):
                assert (a.keys is None and b.keys is None) or (torch.equal(a.keys, b.keys) and
                                                               torch.equal(a.values, b.values))
            assert torch.equal(model.forward(prompt[-1:], one, 1), model.forward(prompt[-1:], shared, 1))
    with pytest.raises(SpecdecError, match="at least one id"):
        model.prefill_batch([([], model.new_cache())])


@cpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prompts_ride_in_the_pass_that_scores_other_sequences_and_each_gets_its_own_bits(dtype):
    """`prefill_batch(prompts, segments)`: prompt chunks (a short one, and where `shared_chunks` a
    long one's first chunk) and running sequences' new tokens (one token, a draft chain, a token
    tree) in one pass -> each sequence's logits bit for bit what `forward_batch` gives it without
    the prompts (which test_batch.py holds to `forward` alone), each prompt's cache what its own `prefill` gives it."""
    from specdec.backends import Segment, native
    from specdec.backends.prompts import PREFILL_CHUNK

    model = qwen_like(dtype, exact_rows=True, vocab=512)
    if native.one_query_kernel() is None:
        pytest.skip("our attention kernel is not built here: prompts are fed alone")
    contexts = [_ids(n, 512, 20 + n) for n in (9, 40, 17)]
    news = [(_ids(1, 512, 1), None), (_ids(5, 512, 2), None), (_ids(4, 512, 3), [-1, 0, 0, 1])]

    def running():
        caches = [model.new_cache() for _ in contexts]
        for context, cache in zip(contexts, caches):
            model.prefill(context + [0], cache)
        return [Segment(ids, cache, len(ids), parents) for (ids, parents), cache in zip(news, caches)]

    plain = model.forward_batch(running())
    prompts = [_ids(30, 512, 5)] + ([_ids(PREFILL_CHUNK + 60, 512, 6)[:PREFILL_CHUNK + 1]] if model.shared_chunks else [])
    alone, riding = [model.new_cache() for _ in prompts], [model.new_cache() for _ in prompts]
    for prompt, cache in zip(prompts, alone):
        model.prefill(prompt, cache)
    segments = running()
    scored = model.prefill_batch(list(zip(prompts, riding)), segments)
    assert len(scored) == len(segments)
    for a, b, segment in zip(plain, scored, segments):
        assert b.shape == (segment.num_logits, model.vocab_size) and torch.equal(a, b)
    for prompt, one, rode in zip(prompts, alone, riding):
        assert one.get_seq_length() == rode.get_seq_length() == len(prompt) - 1
        for a, b in zip(one.layers, rode.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert model.prefill_batch([], []) == []
