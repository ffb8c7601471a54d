"""A batched pass of a Llama-like decoder as one loop over its layers: the calls its fused modules
make (layer_ops.py: a kernel call for each norm, for q's and k's rotation and for the SwiGLU
middle; merged.py: q/k/v and gate/up each one merged output), in the same order on the same tensors, so
the same bits, without the module machinery around them: each layer's, norm's, attention's and
MLP's `__call__`, the checks each fused forward repeats, and the decoder's mask and output
plumbing. Between GEMMs that stream the weights, that Python runs with cold caches, and a pass
pays for it (docs/kernels.md#the-layer-loop).

`forward` serves the row-exact batched pass (`TransformersModel._segmented_pass`: the engine's
steps, the server's, shared prompt passes), where attention reads each row's keys from the pass's
segments (`rows.segmented`), never from a mask. Where any module would not take its fused path
(hooks, gradients, another dtype or device, a decoder class it does not mirror) it returns None
and the caller runs the decoder's own forward.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from . import native
from .layer_ops import FusedNorm, FusedRotary, FusedSwiGLU, _on_cpu_bf16, rotary_attention, swiglu

# decoder classes whose forward (and whose layers' forward) the loop mirrors: embed, rotary
# embedding, per layer x + attention(norm(x)) then x + mlp(norm(x)), a final norm (read in
# transformers 5.23's modeling files; tests/backends/test_lean.py compares the bits)
DECODERS = frozenset({"Qwen2Model", "LlamaModel"})


@functools.cache
def _mirrored() -> dict[str, tuple]:
    """Decoder class name -> (its transformers forward, its layer class's forward): a class of that
    name whose forward is another (a subclass's, remote code's) is not mirrored."""
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2

    return {"Qwen2Model": (modeling_qwen2.Qwen2Model.forward, modeling_qwen2.Qwen2DecoderLayer.forward),
            "LlamaModel": (modeling_llama.LlamaModel.forward, modeling_llama.LlamaDecoderLayer.forward)}


def _plain_call(module: nn.Module) -> bool:
    """Whether calling `module` runs its class's forward and nothing else: no hook of its own, no
    forward set on the instance (accelerate's hooks do that), not compiled."""
    return not (module._forward_hooks or module._forward_pre_hooks) and "forward" not in module.__dict__ \
        and module._compiled_call_impl is None


def _skippable(decoder: nn.Module) -> bool:
    """Whether every module whose call the loop skips (the decoder, each layer, its norms, attention
    and MLP, the projections and activation the fused forwards read) would run its fused forward
    and nothing else: the decoder and layer forwards transformers' own, the norms, attention and MLP
    fused (norms with bf16 weights on the CPU), no hook on any (nor a global one: an adapter's, a
    profiler's). Read afresh each pass: a module swapped in or a hook added is seen at once."""
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return False
    name = type(decoder).__name__
    decoder_forward, layer_forward = _mirrored()[name]
    if type(decoder).forward is not decoder_forward or not isinstance(decoder.norm, FusedNorm) \
            or not _on_cpu_bf16(decoder.norm.weight):
        return False
    modules = [decoder, decoder.norm]
    for layer in decoder.layers:
        children = layer._modules
        attention, mlp = children.get("self_attn"), children.get("mlp")
        first, second = children.get("input_layernorm"), children.get("post_attention_layernorm")
        if type(layer).forward is not layer_forward or not (
                isinstance(first, FusedNorm) and isinstance(second, FusedNorm) and isinstance(attention, FusedRotary)
                and isinstance(mlp, FusedSwiGLU) and _on_cpu_bf16(first.weight, second.weight)):
            return False
        inner, parts = attention._modules, mlp._modules
        modules += [layer, first, second, attention, inner["q_proj"], inner["k_proj"], inner["v_proj"], mlp,
                    parts["gate_proj"], parts["up_proj"], parts["act_fn"]]
    return all(_plain_call(m) for m in modules)


def forward(decoder: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, cache,
            attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The decoder's final hidden states for input_ids [1, T] at position_ids [1, T], `cache`
    growing by the pass's keys and values -> [1, T, H], the bits `decoder(...)`'s
    last_hidden_state has; None (the cache untouched) where a module of it would not take its fused
    path, or the decoder is training (the modules' forwards then drop the cache)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    implementation = decoder.config._attn_implementation
    if type(decoder).__name__ not in DECODERS or cache is None or torch.is_grad_enabled() or decoder.training \
            or implementation not in ALL_ATTENTION_FUNCTIONS or not _skippable(decoder):
        return None
    layers = decoder.layers[: decoder.config.num_hidden_layers]
    hidden = decoder.embed_tokens(input_ids)
    rows = hidden.shape[1]
    cos, sin = decoder.rotary_emb(hidden, position_ids)
    head_dim = layers[0].self_attn.head_dim if len(layers) else 0
    # the fused attention's own conditions, for the pass's tensors
    if hidden.dim() != 3 or hidden.shape[0] != 1 or not _on_cpu_bf16(hidden, cos, sin) \
            or any(t.shape != (1, rows, head_dim) for t in (cos, sin)):
        return None
    attend = ALL_ATTENTION_FUNCTIONS[implementation]
    for layer in layers:
        norm = layer.input_layernorm
        x = native.rms_norm(hidden, norm.weight, norm.variance_epsilon)
        output, _ = rotary_attention(layer.self_attn, x, (cos, sin), attention_mask, cache, attend, dropout=0.0,
                                     position_ids=position_ids, use_cache=True)
        hidden = hidden + output
        norm = layer.post_attention_layernorm
        hidden = hidden + swiglu(layer.mlp, native.rms_norm(hidden, norm.weight, norm.variance_epsilon))
    return native.rms_norm(hidden, decoder.norm.weight, decoder.norm.variance_epsilon)
