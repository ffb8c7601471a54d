"""Sibling projections stacked into one GEMM (backends/merged.py): the same bits as apart, in
every pass kind, and the same layer to everything that reads or rewrites a layer."""

import gc
import weakref

import pytest
import torch
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP, Qwen2RMSNorm

import specdec.backends.merged as merged_module
from specdec.backends import Segment
from specdec.backends.kernels import (PackedBf16Linear, dense_weight, differentiable_linears, packed_bf16_least_rows,
                                     packed_bf16_supported,
                                     set_dense_weight, tiled_bf16_supported, int8_kernel_supported)
from specdec.backends.layer_ops import FusedNorm, FusedRotary, FusedSwiGLU
from specdec.backends.merged import ApartGemm, MergedGemm, MergedPart, merge_projections, stacks_exactly

from conftest import cpu_only
from test_rows import _ids, packed_bf16, qwen_like, row_gap

pytestmark = packed_bf16


def _stacks() -> bool:
    """Whether this CPU stacks qwen_like's groups (q 512 + k, v 128 each, bias; gate, up 1536)."""
    least, threads, tiled = packed_bf16_least_rows(), torch.get_num_threads(), tiled_bf16_supported()
    return stacks_exactly(512, (512, 128, 128), True, least, threads, tiled) and \
        stacks_exactly(512, (1536, 1536), False, least, threads, tiled)


stacked_here = pytest.mark.skipif(not _stacks(), reason="oneDNN rounds a stacked GEMM otherwise on this CPU")


def _apart(monkeypatch, **kwargs):
    """The same random model with its projections left apart. (Undoes the test's earlier patches:
    call it first.)"""
    import specdec.backends.transformers

    monkeypatch.setattr(specdec.backends.transformers, "merge_projections", lambda module, family: 0)
    model = qwen_like(torch.bfloat16, **kwargs)
    monkeypatch.undo()
    return model


@stacked_here
def test_a_bf16_target_runs_q_k_v_and_gate_up_as_one_gemm_each():
    model = qwen_like(torch.bfloat16, exact_rows=True, layers=3)
    assert model.merged_groups == 2 * 3
    attention, mlp = model._decoder.layers[0].self_attn, model._decoder.layers[0].mlp
    parts = [attention.q_proj, attention.k_proj, attention.v_proj, mlp.gate_proj, mlp.up_proj]
    assert all(isinstance(p, MergedPart) for p in parts)
    assert attention.q_proj.merged is attention.v_proj.merged and mlp.gate_proj.merged is not attention.q_proj.merged
    assert (attention.k_proj.out_features, attention.k_proj.in_features) == (128, 512)
    # the layers a pass calls: o, down and the two stacks, each packed once
    assert sum(isinstance(m, PackedBf16Linear) for m in model._decoder.modules()) == 4 * 3


@stacked_here
def test_a_merged_swiglu_runs_its_middle_in_one_kernel_with_the_models_own_bits(monkeypatch):
    """silu(gate) * up in one call over the stacked output: the bits of the model's own forward;
    a hook on gate or up (an adapter's) sends the layer back to that forward, which it sees."""
    from specdec.backends import native

    if native.silu_mul_kernel() is None:
        pytest.skip("no C compiler here: the kernels are not built")
    model = qwen_like(torch.bfloat16, exact_rows=True, layers=1)
    mlp = model._decoder.layers[0].mlp
    calls = []
    real = native.silu_mul
    monkeypatch.setattr(native, "silu_mul", lambda x: calls.append(x.shape) or real(x))
    x = torch.randn(2, 5, 512, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.inference_mode():
        assert torch.equal(mlp(x), Qwen2MLP.forward(mlp, x)) and calls == [(10, 3072)]
        handle = mlp.up_proj.register_forward_hook(lambda module, inputs, output: output * 2)
        hooked = mlp(x)
        handle.remove()
        assert calls == [(10, 3072)] and not torch.equal(hooked, mlp(x))
    calls.clear()
    trained = x.clone().requires_grad_()
    with differentiable_linears(model._decoder):  # training: gradients flow through the model's own forward
        mlp(trained).float().sum().backward()
    assert not calls and trained.grad is not None and trained.grad.abs().sum() > 0


@cpu_only
def test_llama_like_norms_run_in_one_kernel_call_with_their_own_bits():
    """A bf16 target's RMSNorms (two a layer and the final one) run the kernel; where gradients flow,
    their own forward (which passes them); a dropped model goes at once (no reference cycle)."""
    from specdec.backends import native

    if native.rms_norm_kernel() is None:
        pytest.skip("no C compiler here: the kernels are not built")
    model = qwen_like(torch.bfloat16, exact_rows=True, layers=2)
    norms = [m for m in model._decoder.modules() if type(m).__name__ == "Qwen2RMSNorm"]
    assert len(norms) == 5 and all(isinstance(n, FusedNorm) for n in norms)
    assert isinstance(model._decoder.layers[0].mlp, FusedSwiGLU)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(1)).bfloat16()
    with torch.inference_mode():
        # the kernel's own rows (within a bf16 step of transformers': tests/backends/test_native.py)
        assert torch.equal(norms[0](x), native.rms_norm(x, norms[0].weight, norms[0].variance_epsilon))
        assert torch.allclose(norms[0](x).float(), Qwen2RMSNorm.forward(norms[0], x).float(), rtol=2 ** -7, atol=0)
    trained = x.clone().requires_grad_()
    norms[0](trained).float().sum().backward()
    assert trained.grad is not None
    # no reference cycle keeps a dropped model's layers (and their weights) alive
    gone = [weakref.ref(norms[0]), weakref.ref(model._decoder.layers[0].mlp)]
    del model, norms
    gc.disable()
    try:
        assert all(ref() is None for ref in gone)
    finally:
        gc.enable()


def _merged(monkeypatch, stack: bool, **kwargs):
    """qwen_like in bf16, its groups stacked (`stack`: where this CPU stacks exactly, else the test
    skips) or held apart behind their parts as where a stack would change a bit (`ApartGemm`)."""
    from specdec.backends import native

    if stack and not _stacks():
        pytest.skip("oneDNN rounds a stacked GEMM otherwise on this CPU")
    if not stack and None in (native.rotary_kernel(), native.silu_mul_kernel()):
        pytest.skip("our kernels are not built here: nothing fuses over parts held apart, so none are")
    if not stack:
        monkeypatch.setattr(merged_module, "stacks_exactly", lambda *args: False)
    model = qwen_like(torch.bfloat16, **kwargs)
    assert all(m.stacked == stack for m in model.hf.modules() if isinstance(m, MergedGemm))
    return model


modes = pytest.mark.parametrize("stack", [True, False], ids=["stacked", "apart-gemm"])


def _alone(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A linear of `weight` alone on this CPU's packed bf16 path: our tiles where they run (a row's
    bits do not depend on its neighbours or the outputs beside it), else oneDNN's, `F.linear`'s bits."""
    if not tiled_bf16_supported():
        return torch.nn.functional.linear(x, weight, bias)
    return PackedBf16Linear(weight, bias, tiled=True)(x)


@modes
def test_merged_passes_give_the_bits_of_separate_ones(monkeypatch, stack):
    """Logits of one-token, multi-token, prompt and batched passes are equal bit for bit with the
    projections merged (stacked, or apart behind their parts) or left as they were."""
    apart = _apart(monkeypatch, exact_rows=True, layers=3)
    stacked = _merged(monkeypatch, stack, exact_rows=True, layers=3)
    assert apart.merged_groups == 0 and stacked.merged_groups == 6
    # where the kernels are built, q and k are rotated out of the stack (layer_ops.FusedRotary)
    from specdec.backends import native
    assert isinstance(stacked._decoder.layers[0].self_attn, FusedRotary) == (native.rotary_kernel() is not None)
    prompt = _ids(300, 4096, 0)  # over one 256-id prompt chunk
    for model in (apart, stacked):
        cache = model.new_cache()
        first = model.forward(model.prefill(prompt, cache), cache, 1)
        wide = model.forward(_ids(7, 4096, 1), cache, 7)
        tree = model.forward(_ids(5, 4096, 2), cache, 5, parents=[-1, 0, 0, 1, 1])
        caches = [model.new_cache() for _ in range(3)]
        for i, c in enumerate(caches):
            model.forward(model.prefill(_ids(20 + i, 4096, 10 + i), c), c, 1)
        batch = model.forward_batch([Segment(_ids(n, 4096, 20 + n), c, n) for n, c in zip((1, 4, 2), caches)])
        model.outputs = [first, wide, tree, *batch]
    for a, b in zip(apart.outputs, stacked.outputs):
        assert torch.equal(a, b)
    for width in (1, 2, 5, 12, 20, 40):  # 40: a 32-row call and the rest
        assert row_gap(stacked, _ids(37, 4096, width), _ids(width, 4096, 100 + width)) == 0.0


@modes
@pytest.mark.parametrize("shape", [(2, 3, 512), (1, 1, 512)], ids=["rows", "one-row"])
def test_a_part_called_on_its_own_input_computes_its_own_rows(monkeypatch, shape, stack):
    """A part asked for an input its siblings have not seen runs the stacked GEMM for it; every
    part's output is a tensor of its own (a hook may change it in place), one row's too."""
    model = _merged(monkeypatch, stack, exact_rows=True, layers=1)
    attention = model._decoder.layers[0].self_attn
    x, y = torch.randn(*shape).bfloat16(), torch.randn(*shape).bfloat16()
    with torch.inference_mode():
        k_alone = attention.k_proj(y)
        q, k, v = attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)
        assert attention.q_proj.merged._memo is None  # nothing held once every part took its share
        reference = [_alone(x, dense_weight(p), p.bias) for p in
                     (attention.q_proj, attention.k_proj, attention.v_proj)]
        assert all(torch.equal(a, b) for a, b in zip((q, k, v), reference))
        assert torch.equal(k_alone, _alone(y, dense_weight(attention.k_proj), attention.k_proj.bias))
        assert q.is_contiguous() and k.shape == (*shape[:-1], 128) and k.untyped_storage().data_ptr() != \
            q.untyped_storage().data_ptr()


@modes
def test_a_part_takes_a_new_weight_and_passes_gradients(monkeypatch, stack):
    """What an adapter does to a layer (adapters/lora.py): read its weight, write a new one in its
    layout, and train through it."""
    model = _merged(monkeypatch, stack, exact_rows=True, layers=1)
    attention = model._decoder.layers[0].self_attn
    v = attention.v_proj
    before_q = dense_weight(attention.q_proj).clone()
    new = (dense_weight(v).float() * 0.5).bfloat16()
    x = torch.randn(4, 512).bfloat16()
    with torch.inference_mode():
        attention.q_proj(x)  # a pass under way, its v not taken yet, computed with the old weight
        set_dense_weight(v, new)
        assert torch.equal(v(x), _alone(x, new, v.bias))
    assert torch.equal(dense_weight(v), new) and torch.equal(dense_weight(attention.q_proj), before_q)
    x = torch.randn(4, 512, dtype=torch.bfloat16, requires_grad=True)
    with differentiable_linears(model._decoder):
        v(x).float().sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_a_stack_that_would_change_bits_is_not_made(monkeypatch):
    """The group's layers then stay as they are, each called on its own, behind its parts: every
    linear still packed once, the fused rotary and SwiGLU taking the parts' outputs side by side."""
    model = _apart(monkeypatch, exact_rows=True, layers=1)
    monkeypatch.setattr(merged_module, "stacks_exactly", lambda *args: False)
    module = model._decoder
    from specdec.backends import native
    fusing = (native.rotary_kernel() is not None) + (native.silu_mul_kernel() is not None)
    assert merge_projections(module, "qwen2") == fusing  # nothing held apart where nothing would fuse
    groups = [m for m in module.modules() if isinstance(m, MergedGemm)]
    assert len(groups) == fusing and not any(m.stacked for m in groups)
    assert all(isinstance(m.gemm, ApartGemm) for m in groups)
    assert sum(isinstance(m, PackedBf16Linear) for m in module.modules()) == 7
    layer = module.layers[0]
    assert isinstance(layer.self_attn, FusedRotary) == (native.rotary_kernel() is not None)
    assert isinstance(layer.mlp, FusedSwiGLU) == (native.silu_mul_kernel() is not None)


def test_families_not_read_for_one_input_stay_apart(monkeypatch):
    """A model type outside `FAMILIES` (a cross-attention's q reads another input) is not stacked."""
    model = _apart(monkeypatch, exact_rows=True, layers=1)
    assert merge_projections(model._decoder, "mllama") == 0


def test_the_stacking_check_sees_a_changed_bit(monkeypatch):
    """`stacks_exactly` compares the bits: a stacked GEMM off by one part in 2⁸ fails it (oneDNN's
    layout, whose calls the test can reach; tiles stack exactly by construction)."""
    import specdec.backends.kernels

    stacks_exactly.cache_clear()
    if tiled_bf16_supported():  # tiles stack exactly by construction: a check that says otherwise is broken
        assert stacks_exactly(512, (512, 128, 128), True, 6, torch.get_num_threads(), tiled=True)
    if not packed_bf16_supported():
        pytest.skip("oneDNN has no bf16 path on this CPU (AVX2): only tiles here")
    monkeypatch.setattr(specdec.backends.kernels, "tiled_bf16_supported", lambda: False)
    stacks_exactly.cache_clear()
    if not stacks_exactly(512, (512, 128, 128), True, 6, torch.get_num_threads()):
        pytest.skip("oneDNN's layout rounds this stack otherwise on this CPU (as on AMX): no bit left to change")
    real = PackedBf16Linear._packed

    def off(self, flat):
        y = real(self, flat)
        return y * (1 + 2.0 ** -8) if self.out_features == 768 else y
    monkeypatch.setattr(PackedBf16Linear, "_packed", off)
    stacks_exactly.cache_clear()
    assert not stacks_exactly(512, (512, 128, 128), True, 6, torch.get_num_threads())
    stacks_exactly.cache_clear()


@cpu_only
@pytest.mark.parametrize("names", [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")])
def test_groups_of_unlike_layers_stay_apart(monkeypatch, names):
    """Parts of a group must share their input width and whether they add a bias."""
    model = _apart(monkeypatch, exact_rows=True, layers=1)
    layer = model._decoder.layers[0]
    owner = layer.self_attn if names[0] == "q_proj" else layer.mlp
    first = owner._modules[names[0]]
    flipped = None if first.bias is not None else torch.zeros(first.out_features, dtype=torch.bfloat16)
    owner._modules[names[0]] = PackedBf16Linear(dense_weight(first), flipped, first.least_rows)
    assert merge_projections(owner, "qwen2") == 0


@pytest.mark.skipif(not int8_kernel_supported() or not tiled_bf16_supported(),
                    reason="an int8 drafter's layers stack where our int8 kernel runs them, in front of tiled bf16")
def test_an_int8_drafter_stacks_its_projections_with_each_parts_own_result(monkeypatch):
    """Our int8 kernel rounds an input row once whatever the outputs: the stacked call gives each
    part what its own layer gives, in a few-row call and in a long one (the bf16 stack behind)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from specdec.backends.kernels import Int8Linear
    from specdec.backends.transformers import TransformersModel

    def drafter(merge: bool) -> TransformersModel:
        import specdec.backends.transformers

        if not merge:
            monkeypatch.setattr(specdec.backends.transformers, "merge_projections", lambda module, family: 0)
        config = Qwen2Config(vocab_size=256, hidden_size=512, intermediate_size=1536, num_hidden_layers=1,
                             num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)
        torch.manual_seed(0)
        model = TransformersModel(Qwen2ForCausalLM(config).bfloat16(), None, "int8-drafter", role="drafter", int8=True)
        monkeypatch.undo()
        return model

    stacked, apart = drafter(True), drafter(False)
    assert stacked.merged_groups == 2 and apart.merged_groups == 0 and stacked.kernels.startswith(("int8/vnni", "int8/avx2"))
    attention = stacked._decoder.layers[0].self_attn
    assert isinstance(attention.q_proj, MergedPart) and isinstance(attention.q_proj.merged.gemm, Int8Linear)
    separate = apart._decoder.layers[0].self_attn
    for rows in (1, 3, 8, 20):  # 20: past the int8 rows, the stacked bf16 layer
        x = torch.randn(rows, 512).bfloat16()
        with torch.inference_mode():
            for name in ("q_proj", "k_proj", "v_proj"):
                assert torch.equal(getattr(attention, name)(x), getattr(separate, name)(x)), (rows, name)
    assert torch.equal(dense_weight(attention.v_proj), dense_weight(separate.v_proj))
    new = (dense_weight(attention.v_proj).float() * 0.5).bfloat16()
    set_dense_weight(attention.v_proj, new)  # an adapter's merge: rounded to int8 again, in the stack
    set_dense_weight(separate.v_proj, new)
    x = torch.randn(2, 512).bfloat16()
    with torch.inference_mode():
        assert torch.equal(attention.v_proj(x), separate.v_proj(x))
