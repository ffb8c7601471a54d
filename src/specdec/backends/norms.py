"""RMSNorm in one kernel call (`native.rms_norm`, csrc/norm.c) for Llama-like models' bf16 layers
on the CPU: eager torch makes seven ops of each of a pass's 57 norms (the 1.5B target), each paying
its dispatch; the kernel gives transformers' bits (tests/backends/test_native.py) at a third of
the time for a prompt chunk's rows (docs/kernels.md#merged-projections).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from . import native

# transformers' classes computing weight * bf16(x / sqrt(mean(x²) + eps)) on an fp32 copy of x
# (read in transformers 5.23's modeling files; Gemma's scales by 1 + weight and stays its own)
RMS_NORMS = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm"})


def fuse_norms(module: nn.Module) -> int:
    """Give every RMSNorm of `module` (`RMS_NORMS`) with a bf16 weight on the CPU the kernel's
    forward, where our kernels are built -> how many."""
    if native.rms_norm_kernel() is None:
        return 0
    count = 0
    for child in module.modules():
        weight = child._parameters.get("weight") if type(child).__name__ in RMS_NORMS else None
        if weight is not None and weight.dtype == torch.bfloat16 and weight.device.type == "cpu":
            child.forward = functools.partial(_norm_forward, child)
            count += 1
    return count


def _norm_forward(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x [..., H] -> the norm's output in one kernel call; the model's own forward for other dtypes,
    under a hook, or where gradients flow (training)."""
    if x.dtype != torch.bfloat16 or norm._forward_hooks or norm._forward_pre_hooks or \
            (torch.is_grad_enabled() and (x.requires_grad or norm.weight.requires_grad)):
        return type(norm).forward(norm, x)
    return native.rms_norm(x, norm.weight, norm.variance_epsilon)
