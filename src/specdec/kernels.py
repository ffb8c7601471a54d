"""Faster CPU linear layers for scoring several tokens at once.

On CPUs without native bf16 (AVX2-only machines), PyTorch's default GEMM for a handful of rows
costs about as much per row as a matrix-vector product: in fp32, scoring 6 tokens took 3.0x the
time of 1 token for the 1.5B target, in bf16 4.7x, which leaves speculative decoding nothing to
gain. oneDNN with the weight prepacked into its blocked layout costs ~1.0x for 1 row and ~1.7x
for 6 (docs/KERNELS.md). oneDNN has no bf16 path on such CPUs, so:

- a target in fp32 gets `PackedLinear` everywhere (same fp32 dot products, another summation order);
- a drafter in bf16 keeps its bf16 weights for 1-2-row passes (half the weight traffic wins
  there) and also holds a packed fp32 copy for longer passes such as the prompt prefill, which
  would otherwise cost ~35 ms per token. A drafter's rounding can only change acceptance, never
  the output, so mixing precisions there is safe.
"""

from __future__ import annotations

import torch
from torch import nn

from .rows import row_exact_active


def has_onednn() -> bool:
    return torch.backends.mkldnn.is_available()


class PackedLinear(nn.Module):
    """y = x W^T + b with W prepacked for oneDNN (fp32, CPU).

    dense_rows > 0 keeps the original (e.g. bf16) weight too and uses it for inputs of at most
    that many rows; longer inputs go through the packed fp32 copy and come back in x's dtype.

    In a row-exact pass (rows.py) a 1-row input is computed as the first row of a 2-row one:
    oneDNN takes another path for one row, and only from 2 rows on is each row's result
    independent of how many rows the call holds.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, dense_rows: int = 0):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dense_rows = dense_rows
        weight = weight.detach()
        self.register_buffer("packed_weight", weight.float().contiguous().to_mkldnn(), persistent=False)
        self.register_buffer("packed_bias", None if bias is None else bias.detach().float().clone(),
                             persistent=False)
        self.register_buffer("dense_weight", weight if dense_rows else None, persistent=False)
        self.register_buffer("dense_bias", None if bias is None or not dense_rows else bias.detach(),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features], in x's dtype."""
        rows = x.numel() // self.in_features
        if rows <= self.dense_rows:
            return nn.functional.linear(x, self.dense_weight, self.dense_bias)
        flat = x.reshape(rows, self.in_features).float()
        if rows == 1 and row_exact_active():
            flat = torch.cat([flat, torch.zeros_like(flat)])
        y = torch._C._nn.mkldnn_linear(flat.contiguous().to_mkldnn(), self.packed_weight, self.packed_bias).to_dense()
        return y[:rows].view(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dense_rows={self.dense_rows}"


def pack_linears(module: nn.Module, dense_rows: int = 0) -> int:
    """Replace every nn.Linear inside `module` by a PackedLinear; return how many were replaced."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child.weight, child.bias, dense_rows))
            count += 1
        else:
            count += pack_linears(child, dense_rows)
    return count
