"""Fused kernels for captured passes (backends/captured.py), in Triton: the small ops between a
layer's GEMMs, three kernels a layer instead of some thirty.

A captured pass of the 1.5B target made with torch's own ops ran ~1,000 kernels, and at a few
microseconds each they, not the weights, set its cost
(docs/kernels.md#captured-passes-on-cuda---kernels-captured). Here a layer runs: norm (fused with
the residual add), the q/k/v GEMM, `rope_store` (rotary embedding of q and k, k and v written into
the KV slab), attention, the output GEMM, norm, the gate/up GEMM, `silu_mul`, the down GEMM.

Every kernel runs one program per row with sizes fixed when it is compiled, so a row's result
cannot depend on how many rows the pass holds: these kernels keep passes row-exact by
construction. They compute in fp32 and round once, so their results differ from torch's op by op
rounding (which is why the torch path and this one are never mixed within a model).

Triton comes with torch's CUDA builds; where it is missing, or on the CPU, captured passes run
torch's ops (`available`). `TRITON_INTERPRET=1` runs these kernels on CPU tensors (the tests).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch come without it
    triton = tl = None


def available(device: torch.device) -> bool:
    """Whether the fused kernels run on `device`: CUDA with Triton, or Triton's interpreter."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


if triton is not None:
    @triton.jit
    def _norm_kernel(x_ptr, add_ptr, weight_ptr, out_ptr, sum_ptr, size, eps,
                     ADD: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < size
        x = tl.load(x_ptr + row * size + cols, mask=mask, other=0.0).to(tl.float32)
        if ADD:  # the residual stream, rounded to its dtype as a separate add would round it
            x = x + tl.load(add_ptr + row * size + cols, mask=mask, other=0.0).to(tl.float32)
            x = x.to(sum_ptr.dtype.element_ty)
            tl.store(sum_ptr + row * size + cols, x, mask=mask)
            x = x.to(tl.float32)
        inverse = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / size + eps)
        normed = (x * inverse).to(out_ptr.dtype.element_ty).to(tl.float32)
        weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * size + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_store_kernel(qkv_ptr, positions_ptr, where_ptr, cos_ptr, sin_ptr, q_ptr, keys_ptr, values_ptr,
                           HEADS: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr):
        row = tl.program_id(0)
        half = tl.arange(0, D // 2)
        full = tl.arange(0, D)
        position = tl.load(positions_ptr + row)
        where = tl.load(where_ptr + row)
        cos1 = tl.load(cos_ptr + position * D + half).to(tl.float32)
        cos2 = tl.load(cos_ptr + position * D + D // 2 + half).to(tl.float32)
        sin1 = tl.load(sin_ptr + position * D + half).to(tl.float32)
        sin2 = tl.load(sin_ptr + position * D + D // 2 + half).to(tl.float32)
        width = (HEADS + 2 * KV_HEADS) * D
        for head in tl.static_range(HEADS + KV_HEADS):
            source = qkv_ptr + row * width + head * D
            x1 = tl.load(source + half).to(tl.float32)
            x2 = tl.load(source + D // 2 + half).to(tl.float32)
            out1 = x1 * cos1 - x2 * sin1  # x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1)
            out2 = x2 * cos2 + x1 * sin2
            if head < HEADS:
                target = q_ptr + (row * HEADS + head) * D
            else:
                target = keys_ptr + (where * KV_HEADS + head - HEADS) * D
            tl.store(target + half, out1.to(q_ptr.dtype.element_ty))
            tl.store(target + D // 2 + half, out2.to(q_ptr.dtype.element_ty))
        for head in tl.static_range(KV_HEADS):
            value = tl.load(qkv_ptr + row * width + (HEADS + KV_HEADS + head) * D + full)
            tl.store(values_ptr + (where * KV_HEADS + head) * D + full, value)

    @triton.jit
    def _silu_mul_kernel(gate_up_ptr, out_ptr, size, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < size
        gate = tl.load(gate_up_ptr + row * 2 * size + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + row * 2 * size + size + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * size + cols, (gate / (1.0 + tl.exp(-gate)) * up).to(out_ptr.dtype.element_ty),
                 mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             add: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x [N, H] (of x + add, the residual stream's next value, where add is given) ->
    (normed [N, H], the stream: x + add, or x)."""
    rows, size = x.shape
    out = torch.empty_like(x)
    total = torch.empty_like(x) if add is not None else x
    _norm_kernel[(rows,)](x, add if add is not None else x, weight, out, total, size, eps,
                          ADD=add is not None, BLOCK=_power_of_two(size), num_warps=8)
    return out, total


def rope_store(qkv: torch.Tensor, positions: torch.Tensor, where: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, heads: int) -> torch.Tensor:
    """qkv [N, (heads + 2 kv_heads) D] (contiguous), positions and where [N] (each row's position
    and its row in the slabs), cos and sin [capacity, D]: writes each row's rotated key and its
    value into keys/values [slots x capacity, kv_heads, D] at `where` -> rotated queries [N, heads, D]."""
    qkv = qkv.contiguous()  # rows read at a stride of their width
    rows = qkv.shape[0]
    kv_heads, dim = keys.shape[1], keys.shape[2]
    q = torch.empty(rows, heads, dim, dtype=qkv.dtype, device=qkv.device)
    _rope_store_kernel[(rows,)](qkv, positions, where, cos, sin, q, keys, values,
                                HEADS=heads, KV_HEADS=kv_heads, D=dim, num_warps=4)
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [N, 2I] (gate, then up) -> silu(gate) * up [N, I]."""
    rows, width = gate_up.shape
    size = width // 2
    out = torch.empty(rows, size, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(size, block))](gate_up, out, size, BLOCK=block, num_warps=4)
    return out


def supports(head_dim: int) -> bool:
    """Whether `rope_store` takes this head size (a power of two, as Triton's ranges must be)."""
    return head_dim >= 2 and head_dim & (head_dim - 1) == 0
