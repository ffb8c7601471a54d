"""A batched pass of a Llama-like decoder as one loop over its layers: the calls its fused modules
make (layer_ops.py: a kernel call for each norm, for q's and k's rotation and for the SwiGLU
middle; merged.py: q/k/v and gate/up as one GEMM each), in the same order on the same tensors, so
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

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from . import native
from .layer_ops import ROTARY_ATTENTIONS, FusedNorm, FusedRotary, FusedSwiGLU, _on_cpu_bf16

# decoder classes whose forward (and whose layers' forward) the loop mirrors: embed, rotary
# embedding, per layer x + attention(norm(x)) then x + mlp(norm(x)), a final norm (read in
# transformers 5.23's modeling files; tests/backends/test_lean.py compares the bits)
DECODERS = frozenset({"Qwen2Model", "LlamaModel"})


def _bypassed(decoder: nn.Module) -> list[nn.Module] | None:
    """The modules whose `__call__` the loop skips (each layer, its norms, attention and MLP, and
    the projections and activation the fused forwards read), or None where a layer's norms,
    attention or MLP lack their fused forward. Read afresh each pass: a module swapped in or a hook
    added is seen at once."""
    modules = [decoder.norm]
    for layer in decoder.layers:
        children = layer._modules
        attention, mlp = children["self_attn"], children["mlp"]
        first, second = children["input_layernorm"], children["post_attention_layernorm"]
        if not (isinstance(first, FusedNorm) and isinstance(second, FusedNorm) and isinstance(attention, FusedRotary)
                and isinstance(mlp, FusedSwiGLU)):
            return None
        inner, parts = attention._modules, mlp._modules
        modules += [layer, first, second, attention, inner["q_proj"], inner["k_proj"], inner["v_proj"], mlp,
                    parts["gate_proj"], parts["up_proj"], parts["act_fn"]]
    return modules if isinstance(decoder.norm, FusedNorm) else None


def _hooked(modules: list[nn.Module]) -> bool:
    """Whether a forward hook would run on one of `modules` (theirs, or a global one: an adapter's, a
    profiler's) in the decoder's own pass, which the loop would skip."""
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def forward(decoder: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, cache,
            attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The decoder's final hidden states for input_ids [1, T] at position_ids [1, T], `cache`
    growing by the pass's keys and values -> [1, T, H], the bits `decoder(...)`'s
    last_hidden_state has; None (nothing computed, the cache untouched) where a module of it would
    not take its fused path."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    implementation = decoder.config._attn_implementation
    if type(decoder).__name__ not in DECODERS or torch.is_grad_enabled() or implementation not in ALL_ATTENTION_FUNCTIONS:
        return None
    modules = _bypassed(decoder)
    if modules is None or _hooked(modules):
        return None
    layers = decoder.layers[: decoder.config.num_hidden_layers]
    hidden = decoder.embed_tokens(input_ids)
    rows = hidden.shape[1]
    cos, sin = decoder.rotary_emb(hidden, position_ids)
    head_dim = layers[0].self_attn.head_dim if len(layers) else 0
    # the fused forwards' own conditions, for the pass's tensors (a norm's weight of another dtype
    # than the model's is refused by its kernel, in one line)
    if hidden.dim() != 3 or hidden.shape[0] != 1 or not _on_cpu_bf16(hidden, cos, sin, decoder.norm.weight) \
            or any(t.shape != (1, rows, head_dim) for t in (cos, sin)):
        return None
    attend = ALL_ATTENTION_FUNCTIONS[implementation]
    for layer in layers:
        attention, mlp = layer.self_attn, layer.mlp
        norm = layer.input_layernorm
        x = native.rms_norm(hidden, norm.weight, norm.variance_epsilon)
        # FusedRotary.forward's body
        parts, dim = attention.q_proj.merged.sizes, attention.head_dim
        stacked = attention.q_proj.merged.gemm(x)
        query, key = native.rotary(stacked, cos, sin, parts[0] // dim, parts[1] // dim, dim)
        value = stacked[..., parts[0] + parts[1]:].view(1, rows, -1, dim).transpose(1, 2)
        key, value = cache.update(key, value, attention.layer_idx)
        window = {"sliding_window": attention.sliding_window} if ROTARY_ATTENTIONS[type(attention).__name__] else {}
        dropout = 0.0 if not attention.training else attention.attention_dropout
        output, _ = attend(attention, query, key, value, attention_mask, dropout=dropout, scaling=attention.scaling,
                           **window, position_ids=position_ids, use_cache=True)
        hidden = hidden + attention.o_proj(output.reshape(1, rows, -1).contiguous())
        norm = layer.post_attention_layernorm
        x = native.rms_norm(hidden, norm.weight, norm.variance_epsilon)
        # FusedSwiGLU.forward's body
        both = mlp.gate_proj.merged.gemm(x)
        hidden = hidden + mlp.down_proj(native.silu_mul(both.reshape(-1, both.shape[-1])).view(*x.shape[:-1], -1))
    return native.rms_norm(hidden, decoder.norm.weight, decoder.norm.variance_epsilon)
