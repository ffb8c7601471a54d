"""A layer's small ops in our kernels, for Llama-like models' bf16 layers on the CPU: RMSNorm
(`native.rms_norm`, csrc/norm.c), a SwiGLU MLP's silu(gate) * up over its merged gate/up output
(`native.silu_mul`, csrc/activation.c; backends/merged.py stacks them) and the rotary embedding of
q and k over their merged q/k/v output (`native.rotary`, csrc/rotary.c). Eager torch makes seven
ops of each of a pass's 57 norms (the 1.5B target) and two copies, a silu and a product of each
MLP's middle, each paying its dispatch (docs/kernels.md#merged-projections).

Each op computes an element (a norm: a row) on its own, so a row's result never depends on what
shares its pass; they round as transformers does (after the norm's division and its weight, after
the silu and the product), so results differ from torch's only where a different exp or sum order
lands an fp32 value across a bf16 rounding boundary (tests/backends/test_native.py). A module
takes the kernel by its class becoming a subclass whose `forward` calls it (no reference cycle,
unlike a bound function stored on the module); under hooks, for other dtypes or devices, or where
gradients flow (training), the subclass hands back to the model's own forward. transformers' own
`generate` on the same model object runs them too, as it runs the packed and stacked linears.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from . import native

# transformers' classes computing weight * bf16(x / sqrt(mean(x²) + eps)) on an fp32 copy of x
# (read in transformers 5.23's modeling files; Gemma's scales by 1 + weight and stays its own)
RMS_NORMS = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm"})


def _hooked(*modules: nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def _trains(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _on_cpu_bf16(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in tensors)


class FusedNorm:
    """Mixin over an `RMS_NORMS` class: its forward in one kernel call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] -> weight * x / sqrt(mean(x²) + eps), [..., H]."""
        if not _on_cpu_bf16(x, self.weight) or _hooked(self) or _trains(x, self.weight):
            return super().forward(x)
        return native.rms_norm(x, self.weight, self.variance_epsilon)


class FusedSwiGLU:
    """Mixin over a SwiGLU MLP class whose gate_proj and up_proj are parts of one merged output
    (`merged.MergedPart`: a stacked GEMM's, or the layers' apart): down(silu(gate) * up) with the
    middle in one kernel call over that output, the halves never copied out."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] -> [..., H]."""
        if not _on_cpu_bf16(x) or _hooked(self.gate_proj, self.up_proj, self.act_fn) or _trains(x):
            return super().forward(x)
        return swiglu(self, x)


def swiglu(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`FusedSwiGLU`'s computation, its conditions checked by the caller: x [..., H] -> [..., H]."""
    both = mlp.gate_proj.merged.gemm(x)
    return mlp.down_proj(native.silu_mul(both.reshape(-1, both.shape[-1])).view(*x.shape[:-1], -1))


# transformers' attention classes whose forward is just: q, k and v projections of one input,
# each viewed [B, T, heads, D] and transposed, `apply_rotary_pos_emb` on q and k, the cache's
# update, the attention function (with the layer's sliding window, where True), o_proj on its
# output (read in transformers 5.23's modeling files)
ROTARY_ATTENTIONS = {"LlamaAttention": False, "Qwen2Attention": True}


class FusedRotary:
    """Mixin over a `ROTARY_ATTENTIONS` class whose q/k/v projections are parts of one merged output
    (`merged.MergedPart`: a stacked GEMM's, or the layers' apart): q and k rotated out of it in one
    kernel call each (`native.rotary`, transformers' rounding), v a view of it. The parts' copies
    and views and transformers' rotary ops (five a tensor) are not made; the values are the same."""

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                attention_mask: torch.Tensor | None = None, past_key_values=None, **kwargs):
        """hidden_states [1, T, H] -> (attention output [1, T, H], its weights or None)."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        implementation = self.config._attn_implementation
        if (hidden_states.dim() != 3 or hidden_states.shape[0] != 1 or position_embeddings is None
                or any(t.shape != (1, hidden_states.shape[1], self.head_dim) for t in position_embeddings)
                or not _on_cpu_bf16(hidden_states, *position_embeddings) or implementation not in ALL_ATTENTION_FUNCTIONS
                or _hooked(self.q_proj, self.k_proj, self.v_proj) or _trains(hidden_states)):
            return super().forward(hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
        dropout = 0.0 if not self.training else self.attention_dropout
        return rotary_attention(self, hidden_states, position_embeddings, attention_mask, past_key_values,
                                ALL_ATTENTION_FUNCTIONS[implementation], dropout=dropout, **kwargs)


def rotary_attention(attention: nn.Module, hidden_states: torch.Tensor, position_embeddings, attention_mask,
                     past_key_values, attend, **kwargs):
    """`FusedRotary`'s computation, its conditions checked by the caller: hidden_states [1, T, H]
    -> (attention output [1, T, H], its weights or None), `attend` the attention function."""
    parts = attention.q_proj.merged.sizes
    dim, rows = attention.head_dim, hidden_states.shape[1]
    stacked = attention.q_proj.merged.gemm(hidden_states)
    cos, sin = position_embeddings
    query, key = native.rotary(stacked, cos, sin, parts[0] // dim, parts[1] // dim, dim)
    value = stacked[..., parts[0] + parts[1]:].view(1, rows, -1, dim).transpose(1, 2)
    if past_key_values is not None:
        key, value = past_key_values.update(key, value, attention.layer_idx)
    window = {"sliding_window": attention.sliding_window} if ROTARY_ATTENTIONS[type(attention).__name__] else {}
    output, weights = attend(attention, query, key, value, attention_mask, scaling=attention.scaling, **window,
                             **kwargs)
    return attention.o_proj(output.reshape(1, rows, -1).contiguous()), weights


@functools.cache
def _subclass(base: type, mixin: type) -> type:
    """`base` with `mixin`'s forward in front, under base's own name (reprs and type names as before)."""
    return type(base.__name__, (mixin, base), {"__module__": base.__module__, "__qualname__": base.__qualname__})


def fuse_norms(module: nn.Module) -> int:
    """Every RMSNorm of `module` (`RMS_NORMS`) with a bf16 weight on the CPU computes in one kernel
    call, where our kernels are built -> how many."""
    if native.rms_norm_kernel() is None:
        return 0
    count = 0
    for child in module.modules():
        weight = child._parameters.get("weight")
        if type(child).__name__ in RMS_NORMS and not isinstance(child, FusedNorm) and weight is not None \
                and _on_cpu_bf16(weight):
            child.__class__ = _subclass(type(child), FusedNorm)
            count += 1
    return count


def rotary_fuses(attention: nn.Module) -> bool:
    """Whether `attention` can rotate q and k out of one merged q/k/v output (`fuse_rotary`): its
    class is one of `ROTARY_ATTENTIONS` and our kernels are built."""
    return type(attention).__name__ in ROTARY_ATTENTIONS and native.rotary_kernel() is not None


def fuse_rotary(attention: nn.Module) -> bool:
    """`attention`, whose q_proj, k_proj and v_proj were just merged into one output, rotates its q
    and k in one kernel call each, where it can (`rotary_fuses`) -> whether."""
    if not rotary_fuses(attention) or isinstance(attention, FusedRotary):
        return False
    attention.__class__ = _subclass(type(attention), FusedRotary)
    return True


def swiglu_fuses(mlp: nn.Module, sizes: list[int]) -> bool:
    """Whether `mlp` can run its middle over one merged gate/up output of `sizes` (`fuse_swiglu`): a
    SwiGLU MLP (its activation SiLU, gate and up alike) and our kernels built."""
    from transformers.activations import SiLUActivation

    act = mlp._modules.get("act_fn")
    return act is not None and "down_proj" in mlp._modules and type(act) in (SiLUActivation, nn.SiLU) \
        and len(set(sizes)) == 1 and native.silu_mul_kernel() is not None


def fuse_swiglu(mlp: nn.Module, sizes: list[int]) -> bool:
    """`mlp`, whose gate_proj and up_proj were just merged into one output of `sizes`, runs its
    middle in one kernel call, where it can (`swiglu_fuses`) -> whether."""
    if not swiglu_fuses(mlp, sizes) or isinstance(mlp, FusedSwiGLU):
        return False
    mlp.__class__ = _subclass(type(mlp), FusedSwiGLU)
    return True
