"""A layer's small ops in our kernels, for Llama-like models' bf16 layers on the CPU: RMSNorm
(`native.rms_norm`, csrc/norm.c) and a SwiGLU MLP's silu(gate) * up over its stacked gate/up GEMM
(`native.silu_mul`, csrc/activation.c; backends/merged.py stacks them). Eager torch makes seven
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
    """Mixin over a SwiGLU MLP class whose gate_proj and up_proj are parts of one stacked GEMM
    (`merged.MergedPart`): down(silu(gate) * up) with the middle in one kernel call over the stacked
    output, the halves never copied out."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] -> [..., H]."""
        if not _on_cpu_bf16(x) or _hooked(self.gate_proj, self.up_proj, self.act_fn) or _trains(x):
            return super().forward(x)
        both = self.gate_proj.merged.gemm(x)
        return self.down_proj(native.silu_mul(both.reshape(-1, both.shape[-1])).view(*x.shape[:-1], -1))


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


def fuse_swiglu(mlp: nn.Module, sizes: list[int]) -> bool:
    """`mlp`, whose gate_proj and up_proj were just stacked into one GEMM of output `sizes`, runs its
    middle in one kernel call, where its activation is SiLU and our kernels are built -> whether."""
    from transformers.activations import SiLUActivation

    if type(mlp.act_fn) not in (SiLUActivation, nn.SiLU) or len(set(sizes)) != 1 or isinstance(mlp, FusedSwiGLU) \
            or native.silu_mul_kernel() is None:
        return False
    mlp.__class__ = _subclass(type(mlp), FusedSwiGLU)
    return True
