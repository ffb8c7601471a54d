"""A cheaper drafter: int8 weight-only linears (kernels.Int8Linear) and a head that scores only the
most frequent ids (models/vocab.py, FR-Spec). Both may change acceptance, never the output."""

import copy

import pytest
import torch
from torch import nn

from specdec import TransformersModel, Sampler, autoregressive_generate, load, speculative_generate
from specdec.drafters import ModelDrafter
from specdec.errors import SpecdecError
from specdec.backends import native
from specdec.backends.kernels import (NORMED_INPUTS, Int8Linear, dynamic_int8_supported, int8_fits, int8_label, int8_supported,
                                     pack_bf16_linears, pack_linears, packed_bf16_label, packed_bf16_supported, quantize_int8,
                                     quantize_linears, int8_kernel_supported)
from specdec.models.vocab import count_tokens, frequent_ids, rank_ids, token_counts

from conftest import TEST_DEVICE, cpu_only, tiny_model
from test_sampling_exactness import ALPHA, chi_square_pvalue, exact_joint

needs_int8 = pytest.mark.skipif(not int8_supported(torch.device("cpu")) or TEST_DEVICE != "cpu",
                                reason="no CPU int8 kernel in this torch, or models on CUDA")
needs_vnni = pytest.mark.skipif(not int8_kernel_supported() or TEST_DEVICE != "cpu",
                                reason="our int8 kernel needs AVX512-VNNI and a C compiler, and models on the CPU")
needs_dynamic = pytest.mark.skipif(not dynamic_int8_supported() or TEST_DEVICE != "cpu",
                                   reason="no fbgemm int8 GEMM here (not x86), or models on CUDA")


def test_int8_rounding_is_within_half_a_step_per_row():
    weight = torch.randn(40, 64) * torch.linspace(0.01, 3, 40)[:, None]
    q, scales = quantize_int8(weight, chunk=7)  # several chunks, one ragged
    assert q.dtype == torch.int8 and scales.shape == (40,)
    error = (q.float() * scales[:, None] - weight).abs()
    assert bool((error <= scales[:, None] / 2 + 1e-7).all())
    assert bool((q.abs().amax(dim=1) == 127).all())  # each row uses its full range


@needs_int8
@pytest.mark.parametrize("in_features,vnni", [(16, False), (48, False), (896, False),
                                              pytest.param(896, True, marks=needs_vnni)])
def test_int8_linear_follows_the_dense_layer_for_short_inputs_and_hands_long_ones_on(in_features, vnni):
    """torch's weight-only op, or our kernel (inputs rounded too, in groups of 32)."""
    torch.manual_seed(0)
    dense = nn.Linear(in_features, 24, bias=True)
    layer = Int8Linear(dense.weight, dense.bias, dense, short_rows=3, vnni=vnni)
    assert layer.vnni is vnni
    for rows in (1, 2, 3):
        x = torch.randn(rows, in_features)
        reference = dense(x).detach()
        scale = float(reference.abs().max())
        assert float((layer(x) - reference).abs().max()) < 0.03 * scale
    x = torch.randn(2, 2, in_features)  # 4 rows > short_rows: the long layer itself
    assert torch.equal(layer(x), dense(x))


@needs_dynamic
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dynamic_int8_linear_follows_the_dense_layer_and_hands_long_inputs_on(dtype):
    torch.manual_seed(0)
    dense = nn.Linear(896, 40, bias=True).to(dtype).requires_grad_(False)
    layer = Int8Linear(dense.weight, dense.bias, dense, short_rows=2, dynamic=True, vnni=False)
    assert layer.dynamic and layer.int8_weight is None  # fbgemm's packed copy only
    for rows in (1, 2):
        x = torch.randn(rows, 896, dtype=dtype)
        reference = dense(x).float()
        out = layer(x)
        assert out.dtype == dtype and out.shape == reference.shape
        # inputs and weights rounded to 8 bits: within a few percent of the largest output
        assert float((out.float() - reference).abs().max()) < 0.05 * float(reference.abs().max())
    x = torch.randn(3, 896, dtype=dtype)
    assert torch.equal(layer(x), dense(x))
    clone = copy.deepcopy(layer)
    x = torch.randn(1, 896, dtype=dtype)
    assert torch.equal(clone(x), layer(x))


def test_fbgemm_inputs_keep_7_bits_unless_the_cpu_has_avx512_vnni(monkeypatch):
    # fbgemm sums u8*s8 pairs in 16 bits on its AVX2 kernel (which AVX-VNNI-only CPUs run): 8-bit inputs saturate there
    import specdec.backends.kernels as kernels

    for flags, reduce in (({"avx2"}, True), ({"avx2", "avx_vnni"}, True), ({"avx512f", "avx512_vnni"}, False), (None, True)):
        monkeypatch.setattr(kernels, "_cpu_flags", lambda flags=flags: flags)
        kernels._reduce_range.cache_clear()
        assert kernels._reduce_range() is reduce, flags
    kernels._reduce_range.cache_clear()


@needs_dynamic
@pytest.mark.skipif(not packed_bf16_supported(), reason="no packed bf16 here (no native bf16 or oneDNN)")
def test_only_layers_fed_by_a_norm_round_their_inputs_and_only_over_packed_bf16(monkeypatch):
    import specdec.backends.kernels as kernels

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.o_proj = nn.Linear(64, 64), nn.Linear(64, 64)
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(64, 128), nn.Linear(64, 128), nn.Linear(128, 64)

    monkeypatch.setattr(kernels, "cpu_has_amx", lambda: False)  # an AVX512-BF16 CPU, the kind measured
    monkeypatch.setattr(kernels, "int8_kernel_supported", lambda: False)  # where our int8 kernel is not built
    block = Block().bfloat16()
    assert pack_bf16_linears(block, int8_rows=2) == 5
    kinds = {name: layer.dynamic for name, layer in block.named_children()}
    assert kinds == {name: name in NORMED_INPUTS for name in kinds}
    assert kinds["q_proj"] and kinds["up_proj"] and not kinds["o_proj"] and not kinds["down_proj"]
    assert int8_label(block) == "int8/fbgemm"
    # the CPU kinds not measured with it keep the weight-only op everywhere: AMX (packed bf16 too),
    # AVX2-only (packed fp32), and plain bf16 layers
    monkeypatch.setattr(kernels, "cpu_has_amx", lambda: True)
    amx, avx2, plain = Block().bfloat16(), Block(), Block().bfloat16()
    assert pack_bf16_linears(amx, int8_rows=2) == 5
    assert pack_linears(avx2, int8_rows=16) == 5
    assert quantize_linears(plain, short_rows=2) == 5
    for other in (amx, avx2, plain):
        assert not any(layer.dynamic for layer in other.children()) and int8_label(other) == "int8"


@needs_int8
def test_int8_linear_takes_a_view_into_a_longer_tensor():
    # torch's op reads misaligned inputs out of bounds (a crash, seen for offsets of 2-16 bytes)
    torch.manual_seed(0)
    dense = nn.Linear(896, 64).to(torch.bfloat16).requires_grad_(False)
    layer = Int8Linear(dense.weight, dense.bias, dense, short_rows=2, vnni=False)
    storage = torch.randn(3 * 896 + 8, dtype=torch.bfloat16)
    for offset in (1, 2, 4, 8):
        x = storage[offset:offset + 2 * 896].view(2, 896)
        assert float((layer(x).float() - dense(x).float()).abs().max()) < 0.05 * float(dense(x).abs().max())


def test_layers_the_int8_op_cannot_take_keep_their_kernel():
    module = nn.Sequential(nn.Linear(40, 16), nn.Linear(16, 40))  # 40 inputs: the op returns NaN there
    assert not int8_fits(module[0]) and int8_fits(module[1])
    with pytest.raises(ValueError, match="divisible by 16"):
        Int8Linear(module[0].weight, None, module[0], 2)
    assert quantize_linears(module, short_rows=2) == 1
    assert isinstance(module[0], nn.Linear) and isinstance(module[1], Int8Linear)
    packed = nn.Sequential(nn.Linear(40, 16), nn.Linear(16, 48))
    if torch.backends.mkldnn.is_available():
        assert pack_linears(packed, int8_rows=16) == 2
        assert not isinstance(packed[0], Int8Linear) and packed[0].dense_rows == 2  # the bf16 short path
        assert isinstance(packed[1], Int8Linear)
        assert pack_linears(nn.Sequential(nn.Linear(40, 16))) == 1  # no int8: packing as before


def _drafter(seed: int, vocab: int, int8: bool) -> TransformersModel:
    hf = tiny_model(seed, vocab=vocab, layers=1, kernels="stock").hf
    return TransformersModel(hf, None, f"tiny-drafter-{seed}", role="drafter", int8=int8)


@pytest.mark.parametrize("int8", [False, pytest.param(True, marks=needs_int8)])
def test_a_restricted_head_scores_its_ids_as_the_full_head_does_and_no_others(int8):
    drafter = _drafter(1, vocab=12, int8=int8)
    full = drafter.forward([2, 3, 4], None, num_logits=3)
    drafter.restrict_vocabulary([7, 0, 3, 3])
    assert drafter.draft_vocabulary == 3
    logits = drafter.forward([2, 3, 4], None, num_logits=3)
    assert logits.shape == full.shape
    kept = torch.tensor([0, 3, 7])
    torch.testing.assert_close(logits[:, kept], full[:, kept], rtol=1e-4, atol=1e-4)
    others = torch.ones(12, dtype=torch.bool)
    others[kept] = False
    assert bool(torch.isneginf(logits[:, others]).all())
    drafter.restrict_vocabulary(None)
    torch.testing.assert_close(drafter.forward([2, 3, 4], None, num_logits=3), full)


def test_restricting_is_refused_for_targets_and_for_bad_ids():
    target = tiny_model(0, vocab=12)
    with pytest.raises(SpecdecError, match="drafters only"):
        target.restrict_vocabulary([1, 2])
    drafter = _drafter(1, vocab=12, int8=False)
    for ids in ([], [3, 12], [-1, 2]):
        with pytest.raises(SpecdecError, match=r"non-empty set of ids in \[0, 12\)"):
            drafter.restrict_vocabulary(ids)
    with pytest.raises(SpecdecError, match="drafters on the CPU only"):
        TransformersModel(tiny_model(0, vocab=12).hf, None, "t", role="target", int8=True)


@pytest.mark.parametrize("int8", [False, pytest.param(True, marks=needs_int8)])
def test_greedy_output_with_a_cheap_drafter_is_the_targets(int8):
    hf = tiny_model(0, vocab=32, logit_scale=0.2, kernels="stock").hf
    target = TransformersModel(copy.deepcopy(hf), None, "tiny-target")
    drafter = TransformersModel(copy.deepcopy(hf), None, "tiny-self-drafter", role="drafter", int8=int8)
    prompt = [2, 5, 7]
    reference = autoregressive_generate(prompt, target, max_new_tokens=24, eos_token_ids=[]).tokens
    lacking = reference[5]
    drafter.restrict_vocabulary([i for i in range(32) if i != lacking])
    out = speculative_generate(prompt, target, ModelDrafter(drafter), gamma=3, max_new_tokens=24, eos_token_ids=[])
    assert out.tokens == reference
    assert out.stats.accepted > 0 and out.stats.accepted < out.stats.drafted  # kept most, never `lacking`


@needs_int8
@pytest.mark.slow
def test_sampling_with_an_int8_restricted_drafter_keeps_the_targets_law():
    target = tiny_model(0, vocab=4, name="tiny-target")
    drafter = _drafter(1, vocab=4, int8=True)
    drafter.restrict_vocabulary([1, 3])  # q = 0 on ids 0 and 2: only the target's residual yields them
    prompt, length, runs = [2, 3, 1], 3, 600

    class Reference:
        def next_probs(self, context, sampler):
            return sampler.probs(target.forward(context, None, 1)[-1])

    joint = exact_joint(Reference(), prompt, length, Sampler(1.0))
    assert sum(p for seq, p in joint.items() if any(t % 2 == 0 for t in seq)) > 0.3
    samples = [tuple(speculative_generate(prompt, target, ModelDrafter(drafter), gamma=3, sampler=Sampler(1.0),
                                          max_new_tokens=length, seed=seed, seed_rule="stream", first_target=False,
                                          eos_token_ids=[]).tokens) for seed in range(runs)]
    assert chi_square_pvalue(samples, joint) > ALPHA


class _Tokenizer:
    """Enough of a tokenizer for the counting: ids are characters' codes mod 10; line ends are dropped."""
    all_special_ids = [9]
    added_tokens_decoder = {8: "<end>"}

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[ord(c) % 10 for c in text if c != "\n"] for text in texts]}

    def get_vocab(self):
        return {str(i): i for i in range(10)}


def test_ids_are_ranked_by_count_then_by_id():
    counts = torch.tensor([0, 5, 2, 5, 0, 1])
    assert rank_ids(counts).tolist() == [1, 3, 2, 5, 0, 4]
    assert count_tokens(_Tokenizer(), ["\x01\x01\x03", "\x01"], 10).tolist() == [0, 3, 0, 1, 0, 0, 0, 0, 0, 0]


def test_frequent_ids_come_from_the_corpus_plus_specials_and_are_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\x05\x05\x05\x02\x02\n\x07\n")
    ids = frequent_ids(_Tokenizer(), 10, 2, corpus)
    assert ids.tolist() == [2, 5, 8, 9]  # the two most frequent, then the special ids
    cached = list((tmp_path / "home" / "vocab").glob("*.pt"))
    assert len(cached) == 1
    torch.save(torch.arange(10), cached[0])  # the cache is what later calls read
    assert frequent_ids(_Tokenizer(), 10, 2, corpus).tolist() == [8, 9]
    corpus.write_text("\x03\x03")  # another text is another cache entry
    assert frequent_ids(_Tokenizer(), 10, 1, corpus).tolist() == [3, 8, 9]
    cached[0].write_bytes(b"damaged")
    assert token_counts(_Tokenizer(), 10, tmp_path / "corpus.txt").tolist()[3] == 2


def test_bad_vocabulary_requests_are_refused(tmp_path):
    with pytest.raises(SpecdecError, match="positive number"):
        frequent_ids(_Tokenizer(), 10, 0)
    with pytest.raises(SpecdecError, match="corpus not found"):
        frequent_ids(_Tokenizer(), 10, 3, tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(SpecdecError, match="is empty"):
        frequent_ids(_Tokenizer(), 10, 3, tmp_path / "empty.txt")
    with pytest.raises(SpecdecError, match="drafters only"):
        load("smollm2-135m", role="target", vocab=100)
    with pytest.raises(SpecdecError, match=">= 0"):
        load("smollm2-135m", role="drafter", vocab=-3)
    with pytest.raises(SpecdecError, match="drafters only"):
        load("smollm2-135m", dtype="int8", role="target")


def test_the_default_drafter_is_int8_with_a_frequent_vocabulary(default_pair):
    target, drafter = default_pair
    if int8_supported(drafter.device):
        assert drafter.kernels.startswith("int8")
    assert 65536 <= drafter.draft_vocabulary <= 65536 + 64  # plus the special tokens
    assert target.draft_vocabulary is None and not target.int8
    eos = drafter.eos_token_ids
    logits = drafter.forward(drafter.encode("def add(a, b):"), None)[-1]
    assert bool(torch.isfinite(logits[eos]).all())  # the drafter can still propose the end
    assert int(torch.isfinite(logits).sum()) == drafter.draft_vocabulary


@needs_int8
@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
@pytest.mark.parametrize("native_bf16,amx", [(True, True), (True, False), (False, False)],
                         ids=["amx", "avx512-bf16", "avx2"])
@cpu_only
def test_every_cpu_kind_builds_an_int8_drafter_that_keeps_greedy_output(monkeypatch, native_bf16, amx):
    import specdec.backends.transformers
    import specdec.backends.kernels

    monkeypatch.setattr(specdec.backends.transformers, "fast_bf16", lambda: native_bf16)
    monkeypatch.setattr(specdec.backends.kernels, "cpu_has_amx", lambda: amx)
    vnni = int8_kernel_supported()
    tiled = native.linear_kernel() is not None and not amx
    short = 2 if amx else (2 if native.linear_i8_on_avx2() else 8) if vnni and tiled else \
        (4 if dynamic_int8_supported() else 2) if packed_bf16_supported() else 8
    hf = tiny_model(0, vocab=32, logit_scale=0.2, kernels="stock").hf
    target = TransformersModel(copy.deepcopy(hf), None, "tiny-target")
    drafter = TransformersModel(copy.deepcopy(hf).to(torch.bfloat16), None, "tiny-drafter", role="drafter", int8=True)
    # its long path: bf16 packed (in tiles for our kernel, else for oneDNN) where this build and CPU run it
    packs = tiled or packed_bf16_supported()
    long_path = packed_bf16_label() if packs else "bfloat16"
    # tiny_model is a Llama: its q/k/v/gate/up layers round their inputs over packed bf16 without AMX
    # (every int8 layer runs our kernel where it is built: "int8/vnni", "int8/avx2" on AVX2)
    int8 = ("int8/avx2" if native.linear_i8_on_avx2() else "int8/vnni") if vnni else \
        "int8/fbgemm" if dynamic_int8_supported() and native_bf16 and not amx and packs else "int8"
    assert drafter.kernels == (f"{int8}+{long_path}" if native_bf16 else f"{int8}+onednn-packed-fp32")
    layers = [m for m in drafter.hf.modules() if isinstance(m, Int8Linear)]
    assert layers and all(m.short_rows == (short if native_bf16 else 16) for m in layers)
    assert drafter._draft_head.short_rows == (short if native_bf16 else 8)
    long_pass = drafter.forward(list(range(2, 22)), None, num_logits=20)  # 20 rows: the long path
    assert long_pass.shape == (20, 32) and bool(torch.isfinite(long_pass).all())
    prompt = [2, 5, 7]
    reference = autoregressive_generate(prompt, target, max_new_tokens=16, eos_token_ids=[]).tokens
    out = speculative_generate(prompt, target, ModelDrafter(drafter), gamma=3, max_new_tokens=16, eos_token_ids=[])
    assert out.tokens == reference and out.stats.accepted > 0


def test_amx_is_read_from_the_cpu_flags(monkeypatch, tmp_path):
    import builtins

    import specdec.backends.kernels

    real_open = builtins.open
    for flags, expected in (("fpu avx512_bf16 amx_bf16 amx_tile amx_int8", True), ("fpu avx512_bf16", False)):
        info = tmp_path / "cpuinfo"
        info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        monkeypatch.setattr(builtins, "open", lambda path, *a, **k: real_open(info if path == "/proc/cpuinfo" else path, *a, **k))
        assert specdec.backends.kernels.cpu_has_amx() is expected
        # without AMX: 8 rows where our int8 kernel runs in front of tiled bf16; 4 where the bf16 path is
        # packed for oneDNN and fbgemm runs (else 2), 8 over plain bf16
        # (2 where both kernels run on AVX2)
        ours = int8_kernel_supported() and native.linear_kernel() is not None
        packed = (2 if native.linear_i8_on_avx2() else 8) if ours else 4 if dynamic_int8_supported() else 2
        assert specdec.backends.kernels.int8_short_rows() == (2 if expected else packed if ours or packed_bf16_supported() else 8)
        monkeypatch.setattr(specdec.backends.kernels, "packed_bf16_supported", lambda: False)
        assert specdec.backends.kernels.int8_short_rows() == (2 if expected else packed if ours else 8)
        monkeypatch.undo()
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: (_ for _ in ()).throw(OSError("no such file")))
    assert specdec.backends.kernels.cpu_has_amx() is False
