"""Row-exact passes: every row of a multi-token pass computed bit for bit as a one-token pass would.

Greedy speculative decoding is token-identical to greedy autoregressive decoding only if the target
gives each position the same logits whether it scores that position alone (a decode step) or
among the γ+1 rows of a verification pass. In floating point that is not automatic: kernels pick
their blocking, their summation order, even their algorithm by the number of rows. Near-ties then
flip. What each CPU kind computes (the probe: tests/backends/test_rows.py, `row_gap`) is in
docs/kernels.md#row-exact-passes; in short:

- linear layers: a 1-row bf16 `F.linear` call may differ from multi-row ones (which agree with
  each other, whatever the row's position), and on AMX calls of over 32 rows round otherwise;
  oneDNN-packed fp32 gives equal rows for 2..32 rows and another result for 1.
  So a row-exact pass makes GEMM calls of 2..32 rows only (`kernels.row_exact_calls`): 1-row
  inputs as 2-row ones, wider ones cut (`kernels.PackedLinear`, `kernels.TwoRowLinear`, the bf16
  head in `TransformersModel._logits`), but where our tiled bf16 kernel runs them
  (`native.linear`), whose rows are equal in calls of any size by construction;
- attention: a 1-query decode step runs sdpa without a mask over exactly the keys it may see, a
  multi-row pass runs another kernel path with a causal mask, and their rows differ. Here a
  row-exact pass computes each query row over exactly the keys its mask allows, by the very code
  a decode step runs — equal by construction, whatever the kernel: our kernel takes every row of
  a pass (every sequence's, in a batch) in one call per layer (`native.attention_rows`), or,
  where it is not built, sdpa takes them one call a row;
- the output head: see `TransformersModel._logits` (fp32 packed head, or bf16 head with the top
  candidates re-scored in fp32, both row-invariant).

The prefill of a prompt past `SHARED_PREFILL` ids is not row-exact (attention one row at a time
would cost a call per prompt token per layer): both decoding loops prefill `prompt[:-1]` by the
same calls, chunk by chunk, and score the prompt's last token in a row-exact pass
(`TransformersModel.prefill`). In a pass shared with other prompts such a chunk attends causally
in the very call its pass alone makes (`Causal`), on linears that round a row alike in calls of
any size (`TransformersModel.shared_chunks`).

On CUDA, cuBLAS may pick a GEMM's kernel by the call's row count, and torch's reductions lay out
their threads by it, so there a row-exact pass also makes every GEMM and norm call with a fixed
number of rows (`kernels.CUDA_ROWS`, `kernels.fix_norm_rows`); measured in docs/kernels.md.

One-query attention, the call every decode step and every row of a row-exact pass makes, runs
with grouped-query heads packed (`one_query_attention`: our kernel, else one sdpa call) in our own
passes on CPU: transformers there asks sdpa for `enable_gqa`, many times slower in bf16
(docs/kernels.md#one-query-attention).
Passes that are not ours (transformers' `generate` on the same model object) stay stock.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
import weakref
from dataclasses import dataclass

import torch

from ..errors import SpecdecError
from . import native

# None outside our passes, else whether the pass is row-exact
_ROW_EXACT: contextvars.ContextVar[bool | None] = contextvars.ContextVar("specdec_row_exact", default=None)
PREFIX = "specdec_rows_"


def row_exact_active() -> bool:
    """True inside a row-exact pass (see `row_exact`)."""
    return _ROW_EXACT.get() is True


@contextlib.contextmanager
def row_exact(enabled: bool = True):
    """Marks a pass of ours: within this block, passes of models set up by `install_attention` are
    row-exact if `enabled`, and run one-query attention with packed heads either way."""
    token = _ROW_EXACT.set(bool(enabled))
    try:
        yield
    finally:
        _ROW_EXACT.reset(token)


def install_attention(hf_model) -> str:
    """Switch `hf_model` to an attention implementation that is row-exact inside `row_exact()`
    (and packs grouped heads for one-query calls inside `row_exact(False)`), and exactly
    transformers' own everywhere else (so transformers' `generate` on the same model object runs
    as usual). Returns the implementation's name; raises SpecdecError where it cannot work."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    base = hf_model.config._attn_implementation
    if base.startswith(PREFIX):
        return base
    if base not in ("sdpa", "eager"):
        raise SpecdecError(f"row-exact passes need sdpa or eager attention, not {base!r}; pass exact_rows=False")
    name = PREFIX + base
    if name not in ALL_ATTENTION_FUNCTIONS:
        function = _model_eager_attention if base == "eager" else ALL_ATTENTION_FUNCTIONS[base]
        AttentionInterface.register(name, _our_attention(function, packs=base == "sdpa"))
        AttentionMaskInterface.register(name, _materialized_mask(ALL_MASK_ATTENTION_FUNCTIONS[base]))
    hf_model.set_attn_implementation(name)
    return name


def _model_eager_attention(module, *args, **kwargs):
    """'eager' is no registered function: each model's file has its own (Gemma-2's soft-caps scores)."""
    return sys.modules[type(module).__module__].eager_attention_forward(module, *args, **kwargs)


def _materialized_mask(base):
    """transformers' mask function, but in a row-exact pass always a full mask (never None, which
    would hide which keys each row may see)."""
    @functools.wraps(base)
    def mask(*args, **kwargs):
        if _ROW_EXACT.get():
            kwargs["allow_is_causal_skip"] = False
        return base(*args, **kwargs)
    return mask


def _our_attention(base, packs: bool):
    def one_query(module, query, key, value, **kwargs):
        if packs and query.device.type == "cpu" and not any(kwargs.get(name) for name in _EXTRAS):
            return one_query_attention(query, key, value, kwargs.get("scaling"))
        return base(module, query, key, value, None, **kwargs)[0]

    def kernel_takes(query, key, kwargs) -> bool:
        # by the model's shape and dtype alone, never by a tensor's layout: a row must take the
        # same path in a decode step, a tree pass and a batch
        return packs and not any(kwargs.get(name) for name in _EXTRAS) and native.takes(query, key)

    @functools.wraps(base)
    def attention(module, query, key, value, attention_mask, **kwargs):
        """query [B, heads, T, D], key/value [B, kv_heads, L, D] -> ([B, T, heads, D], None)."""
        mode = _ROW_EXACT.get()
        rows, keys = query.shape[2], key.shape[2]
        if mode is None or (not mode and (rows > 1 or attention_mask is not None)):
            return base(module, query, key, value, attention_mask, **kwargs)
        if not mode:
            return one_query(module, query, key, value, **kwargs), None
        batch = _SEGMENTS.get()
        if batch is not None:  # several sequences' rows, each over its own cache (`segmented`)
            cache, parts, layout = batch
            kv = cache.layer(module.layer_idx)
            if any(isinstance(spans, Causal) for _, spans in parts):
                return _with_causal(base, one_query, module, query, kv, parts, layout, kwargs,
                                    layout is not None and kernel_takes(query, kv.slabs[0][0], kwargs)), None
            if kernel_takes(query, kv.slabs[0][0], kwargs):  # every row in one call
                return native.attention_rows(query, kv, layout, _scale(query, kwargs)).unsqueeze(0), None
            keys_of, values_of = kv.views()
            return torch.cat([_rows(one_query, module, query, keys_of[i], values_of[i], spans, start, kwargs)
                              for i, (start, spans) in enumerate(parts)], dim=1), None
        spans = key_spans(attention_mask, rows, keys)
        if rows == 1 and spans[0] == slice(0, keys):
            return one_query(module, query, key, value, **kwargs), None
        if key.shape[0] == 1 and kernel_takes(query, key, kwargs):
            layout = native.RowLayout(list(range(rows)), [0] * rows, spans)
            return native.attention_rows(query, native.KeyValues.of([key], [value]), layout,
                                         _scale(query, kwargs)).unsqueeze(0), None
        return _rows(one_query, module, query, key, value, spans, 0, kwargs), None
    return attention


def _scale(query: torch.Tensor, kwargs) -> float:
    """The scores' scale: the model's, else sdpa's default 1/sqrt(head size)."""
    scaling = kwargs.get("scaling")
    return query.shape[-1] ** -0.5 if scaling is None else float(scaling)


@dataclass(frozen=True)
class Causal:
    """A segment of a batched pass fed as `prefill` feeds a long prompt's chunk alone, not
    row-exactly: its `rows` queries attend causally over its cache (`cached` keys before them) in
    one call of the model's own attention function, the very call that chunk's pass alone makes."""

    rows: int
    cached: int


def _with_causal(base, one_query, module, query, kv, parts, layout, kwargs, kernel: bool) -> torch.Tensor:
    """A batched pass's attention where some segments are `Causal`: each of those in its own call of
    `base` as that chunk's pass alone calls it (its queries [1, heads, rows, D] contiguous, its
    cache's keys and values, transformers' causal mask: none over an empty cache, else every key up
    to the row's position), the other rows row-exactly (`layout`: theirs alone) -> [1, T, heads, D]."""
    keys_of, values_of = kv.views()
    exact = native.attention_rows(query, kv, layout, _scale(query, kwargs)) if kernel and layout.rows else None
    pieces, taken = [], 0
    for i, (start, spans) in enumerate(parts):
        if isinstance(spans, Causal):
            rows = query[:, :, start:start + spans.rows].contiguous()
            mask = None
            if spans.cached:
                keys = torch.arange(spans.cached + spans.rows, device=query.device)
                mask = (keys[None, :] <= spans.cached + torch.arange(spans.rows, device=query.device)[:, None])
                mask = mask[None, None]
            pieces.append(base(module, rows, keys_of[i], values_of[i], mask, **kwargs)[0])
        elif exact is not None:
            pieces.append(exact[taken:taken + len(spans)].unsqueeze(0))
            taken += len(spans)
        else:
            pieces.append(_rows(one_query, module, query, keys_of[i], values_of[i], spans, start, kwargs))
    return torch.cat(pieces, dim=1)


def _segments_layout(parts: list[tuple[int, list]]) -> native.RowLayout:
    """The kernel's rows for a batched pass (`segmented`): sequence i's rows start, start + 1, ...
    of the pass's query, each over its spans in sequence i's own cache (`Causal` segments: none)."""
    query_rows, sequences, spans = [], [], []
    for i, (start, row_spans) in enumerate(parts):
        if isinstance(row_spans, Causal):
            continue
        query_rows += range(start, start + len(row_spans))
        sequences += [i] * len(row_spans)
        spans += row_spans
    return native.RowLayout(query_rows, sequences, spans)


def _rows(one_query, module, query, key, value, spans, start: int, kwargs) -> torch.Tensor:
    """Query rows start, start + 1, ... one at a time, row t over the keys `spans[t]`: [B, rows, heads, D]."""
    outputs = []
    for t, span in enumerate(spans):
        if isinstance(span, slice):
            k, v = key[:, :, span], value[:, :, span]
        else:  # the same values in the same order as a gather: the same result, at a copy's cost
            k, v = (torch.cat([x[:, :, run] for run in span], dim=2) for x in (key, value))
        # no mask: exactly the call a decode step makes for this position
        outputs.append(one_query(module, query[:, :, start + t:start + t + 1], k, v, **kwargs))
    return torch.cat(outputs, dim=1)


# inside a batched pass: (the pass's `backends.cache.SegmentedCache`, [(first row, key spans of
# each row)] per sequence, those rows as the kernel takes them or None); None elsewhere
_SEGMENTS: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("specdec_segments", default=None)


@contextlib.contextmanager
def segmented(cache, parts: list[tuple[int, list]]):
    """Marks a row-exact pass over several sequences' rows: attention reads each sequence's keys
    from `cache` (a `SegmentedCache`) and computes its rows over their spans (every row of a layer
    in one call of our kernel, else one sdpa call a row), so every row is computed as that
    sequence's own row-exact pass computes it."""
    layout = _segments_layout(parts) if native.one_query_kernel() is not None else None
    token = _SEGMENTS.set((cache, parts, layout))
    try:
        with row_exact(True):
            yield
    finally:
        _SEGMENTS.reset(token)


# keyword arguments that, when set (not None or 0), change what sdpa computes beyond q, k, v and the
# scale: such calls are left to transformers
_EXTRAS = frozenset({"softcap", "position_bias", "s_aux", "sinks", "dropout"})


def one_query_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        scale: float | None = None) -> torch.Tensor:
    """Unmasked attention of one query position over all of `key`/`value`, grouped-query heads
    packed as query rows of their key/value head (head h reads key/value head h // groups, as
    transformers' `repeat_kv` lays them out).

    query [B, heads, 1, D]; key, value [B, kv_heads, L, D] (heads a multiple of kv_heads).
    Returns [B, 1, heads, Dv], the layout transformers' attention functions return.
    """
    batch, heads, rows, dim = query.shape
    kv_heads = key.shape[1]
    if rows != 1 or heads % kv_heads:
        raise SpecdecError(f"one-query attention takes 1 query row and heads a multiple of key/value heads, "
                           f"not {rows} rows and {heads} over {kv_heads}")
    if native.takes(query, key):
        keys, values = [key[b:b + 1] for b in range(batch)], [value[b:b + 1] for b in range(batch)]
        layout = native.RowLayout(list(range(batch)), list(range(batch)), [slice(0, key.shape[2])] * batch)
        scale = dim ** -0.5 if scale is None else float(scale)
        return native.attention_rows(query, native.KeyValues.of(keys, values), layout, scale).unsqueeze(1)
    packed = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, scale=scale)
    return out.reshape(batch, heads, 1, value.shape[-1]).transpose(1, 2)


_spans_memo: dict[int, tuple[weakref.ref, list]] = {}


def key_spans(mask: torch.Tensor | None, rows: int, keys: int) -> list[slice | tuple[slice, ...]]:
    """For each query row, the keys it may attend to: a slice when they are contiguous, else a
    tuple of slices, their contiguous runs in order (a tree node sees the cache and the pending
    tokens, one run, then its ancestors in the tree, which depth-first order mostly keeps
    together; joining the runs' copies costs less than a gather by index). mask: [B, 1, rows, keys] boolean
    (True = attend) or additive (0 = attend), the same for every batch row, or None (causal, the
    queries being the last `rows` positions)."""
    if mask is None:
        return [slice(0, keys - rows + t + 1) for t in range(rows)]
    memo = _spans_memo.get(id(mask))  # one mask serves every layer of a pass
    if memo is not None and memo[0]() is mask:
        return memo[1]
    if mask.shape[0] > 1 and not bool((mask == mask[:1]).all()):
        raise SpecdecError("row-exact passes need one attention mask for all sequences in the batch")
    allowed = mask[0, 0] if mask.dtype == torch.bool else mask[0, 0] == 0
    allowed = allowed.expand(rows, keys).cpu()
    spans: list[slice | tuple[slice, ...]] = []
    for row in allowed:
        index = row.nonzero().squeeze(-1)
        if index.numel() == 0:
            raise SpecdecError("a query row may attend to no key at all")
        lo, hi = int(index[0]), int(index[-1])
        if hi - lo + 1 == index.numel():
            spans.append(slice(lo, hi + 1))
            continue
        breaks = ((index[1:] - index[:-1]) != 1).nonzero().squeeze(-1).tolist()
        starts = [lo] + [int(index[b + 1]) for b in breaks]
        ends = [int(index[b]) + 1 for b in breaks] + [hi + 1]
        spans.append(tuple(slice(a, b) for a, b in zip(starts, ends)))
    _spans_memo.clear()
    _spans_memo[id(mask)] = (weakref.ref(mask), spans)
    return spans


def refine_top_logits(logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                      weight_row_norm: float, in_place: bool = False) -> torch.Tensor:
    """Re-score in fp32 every token that may be a row's true maximum, from bf16 head logits.

    logits: [T, V] fp32 copies of a bf16 head's output (each entry the fp32 dot product rounded to
        bf16: half a bf16 ulp of error, plus the kernel's fp32 summation error).
    hidden: [T, H] the head's input; weight: [V, H] the head's weight (bf16).
    weight_row_norm: max over vocabulary rows of ||weight[v]||₂ (bounds the summation error).
    Returns logits [T, V] where every token within a safe margin of the row's maximum holds its
    fp32 dot product (products of bf16 values are exact in fp32; summed row by row here, the same
    way for a row whatever the pass it came from), and the rest their bf16 value. The greedy choice
    is thus the fp32 head's, at half the bytes an fp32 copy of the head would read.
    in_place: write into `logits` itself (a caller's temporary: no copy of a [T, V] tensor).
    """
    out = logits if in_place else logits.clone()
    top = logits.max(-1).values  # [T]
    _, exponent = torch.frexp(top.abs().clamp_min(1e-30))
    # 4 bf16 ulps of the maximum (rounding of both values, generously) plus a worst-case bound on
    # fp32 summation error for each of the two values (`_sum_error`)
    margin = torch.ldexp(torch.ones_like(top), exponent - 6) + _sum_error(hidden, weight_row_norm)
    # every row's candidates in one scan of the logits, not a scan per row (a batch's pass has a row
    # per sequence)
    rows, candidates = (logits >= (top - margin)[:, None]).nonzero(as_tuple=True)
    return _rescore(out, rows, candidates, hidden, weight)


def widen_and_refine(head_out: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                     weight_row_norm: float) -> torch.Tensor:
    """`refine_top_logits(head_out.float(), hidden, weight, weight_row_norm)`, the same bits, with
    the widening and the candidates' scan in one kernel call where it is built
    (`native.head_candidates`: 1 ms less at 16 rows of a 151,936-token head, 1.4 ms at 8).

    head_out: [T, V] a bf16 head's output; hidden [T, H], weight [V, H] as `refine_top_logits`.
    Returns logits [T, V] fp32.
    """
    found = native.head_candidates(head_out, _sum_error(hidden, weight_row_norm))
    if found is None:
        return refine_top_logits(head_out.float(), hidden, weight, weight_row_norm, in_place=True)
    logits, rows, candidates = found
    return _rescore(logits, rows, candidates, hidden, weight)


def _sum_error(hidden: torch.Tensor, weight_row_norm: float) -> torch.Tensor:
    """[T] fp32: for each row of hidden [T, H], twice a worst-case bound on an fp32 dot product's
    summation error against any head row, (H−1)·2⁻²⁴·||h||·||w|| (taken as H·…): one for each of
    the two values a candidate is compared by."""
    return 2 * hidden.shape[-1] * 2.0 ** -24 * hidden.float().norm(dim=-1) * weight_row_norm


def _rescore(out: torch.Tensor, rows: torch.Tensor, candidates: torch.Tensor, hidden: torch.Tensor,
             weight: torch.Tensor) -> torch.Tensor:
    """out [T, V] fp32 with out[rows[i], candidates[i]] set to the fp32 dot product of hidden[rows[i]]
    and weight[candidates[i]], each along its own contiguous row (the same way however many rows
    there are)."""
    if len(candidates) <= REFINED_AT_ONCE:
        out[rows, candidates] = (weight[candidates].float() * hidden.float()[rows]).sum(-1)
        return out
    for t in range(out.shape[0]):  # flat logits (a degenerate model): one row's products at a time
        picked = candidates[rows == t]
        out[t, picked] = (weight[picked].float() * hidden[t].float()).sum(-1)
    return out


# candidates re-scored in one call (`refine_top_logits`): [n, H] fp32 products, 25 MB at H = 1536
REFINED_AT_ONCE = 4096
