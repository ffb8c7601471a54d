"""`specdec profile --kv-storage`: what keeping many sequences' KV caches costs a step, stored three
ways, on this machine and model.

- `dynamic`: transformers' `DynamicLayer`, which concatenates each pass's keys onto a new tensor
  (the whole cache copied every pass);
- `slab`: our `SlabLayer` (backends/slab.py), a buffer per sequence and layer written in place;
- `paged`: blocks of `BLOCK` positions from a shared pool, as vLLM stores them. torch's attention
  on the CPU reads a sequence's keys as one tensor, so each pass gathers the sequence's blocks
  into one (vLLM's paged-attention kernels read blocks directly; none exists for torch on the CPU).

Two figures: the cache work of one step alone (append a step's rows, give the attention its keys,
roll back), per sequence over all layers; and the engine's whole batched pass with each sequence's
cache stored `dynamic` or `slab` (paged storage is not built into the engine, so it has no pass).
"""

from __future__ import annotations

import statistics
import time

import torch

BLOCK = 16  # positions a paged block holds (vLLM's default)


class _Paged:
    """One layer of one sequence in paged blocks: `update` writes a pass's keys into the pool's
    blocks and returns the sequence's keys gathered into one tensor, as attention reads them."""

    def __init__(self, pool_k: torch.Tensor, pool_v: torch.Tensor, free: list[int]):
        self.pools, self.free, self.table, self.length = (pool_k, pool_v), free, [], 0

    def update(self, keys: torch.Tensor, values: torch.Tensor):
        end = self.length + keys.shape[-2]
        while len(self.table) * BLOCK < end:
            self.table.append(self.free.pop())
        positions = range(self.length, end)
        blocks = torch.tensor([self.table[p // BLOCK] for p in positions], device=keys.device)
        offsets = torch.tensor([p % BLOCK for p in positions], device=keys.device)
        for pool, new in zip(self.pools, (keys, values)):  # pool [blocks, heads, BLOCK, D]; new [1, heads, T, D]
            pool[blocks, :, offsets] = new[0].transpose(0, 1)
        self.length = end
        index = torch.tensor(self.table, device=keys.device)
        return tuple(pool.index_select(0, index).transpose(0, 1).reshape(1, pool.shape[1], -1, pool.shape[-1])
                     [:, :, :end] for pool in self.pools)

    def crop(self, remove: int) -> None:
        self.length += remove
        while len(self.table) * BLOCK >= self.length + BLOCK:
            self.free.append(self.table.pop())


def _shape(model) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a transformers model's KV cache."""
    config = model.hf.config.get_text_config()
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, heads, head_dim


@torch.inference_mode()
def step_ms(model, storage: str, context: int, rows: int = 4, repeats: int = 20) -> float:
    """Median ms of one step's cache work for one sequence over all of `model`'s layers: `rows` new
    positions appended after `context` cached ones (their keys returned as attention reads them),
    then rolled back, so every step starts from `context`. Slabs are reserved as the engine
    reserves them (a request's bound), so none moves while timed."""
    from transformers.cache_utils import DynamicLayer

    from ..backends.slab import SlabLayer

    layers, heads, dim = _shape(model)
    shape = (1, heads, context, dim)
    if storage == "paged":
        blocks = layers * (-(-(context + rows) // BLOCK) + 1)
        pools = [torch.empty(blocks, heads, BLOCK, dim, dtype=model.dtype, device=model.device) for _ in range(2)]
        free = list(range(blocks))
        caches = [_Paged(*pools, free) for _ in range(layers)]
    else:
        caches = [SlabLayer(reserve=context + rows) if storage == "slab" else DynamicLayer() for _ in range(layers)]
    for cache in caches:
        cache.update(torch.randn(shape).to(model.device, model.dtype), torch.randn(shape).to(model.device, model.dtype))
    new = torch.randn(1, heads, rows, dim).to(model.device, model.dtype)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for cache in caches:
            cache.update(new, new)
            cache.crop(-rows)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[1:])


@torch.inference_mode()
def batch_pass_ms(model, contexts: list[int], batch: int = 8, rows: int = 4, repeats: int = 5) -> dict:
    """{storage: {context: median ms}} of the engine's batched pass (`forward_batch`) over `batch`
    sequences, `rows` new tokens each, after `context` cached positions each, the caches stored in
    slabs (the model's own) or transformers' concatenating layers; the two alternate pass by pass."""
    from transformers import DynamicCache

    from ..backends import Segment
    from ..backends.cache import crop_cache, reserve_cache

    ids = [(100 + 7 * i) % model.vocab_size for i in range(max(contexts) + 1)]
    source = model.new_cache()
    model.prefill(ids, source)  # one sequence's keys, copied into every cache below
    new = [(200 + 11 * i) % model.vocab_size for i in range(rows)]
    out = {"slab": {}, "dynamic": {}}
    for context in sorted(contexts):
        caches = {"slab": [model.new_cache() for _ in range(batch)],  # reserved as the engine reserves them
                  "dynamic": [DynamicCache(config=model.hf.config) for _ in range(batch)]}
        for group in caches.values():
            for cache in group:
                reserve_cache(cache, context + rows)
                for layer, kept in zip(cache.layers, source.layers):
                    layer.update(kept.keys[..., :context, :].clone(), kept.values[..., :context, :].clone())
        times = {name: [] for name in caches}
        for _ in range(repeats + 1):
            for name, group in caches.items():
                start = time.perf_counter()
                model.forward_batch([Segment(new, cache, rows) for cache in group])
                times[name].append(time.perf_counter() - start)
                for cache in group:
                    crop_cache(cache, context)
        for name in caches:
            out[name][context] = 1e3 * statistics.median(times[name][1:])
    return out


def kv_storage_profile(model, contexts: list[int], batch: int = 8, rows: int = 4) -> dict:
    """Everything `specdec profile --kv-storage` prints: {"step_ms": {storage: {context: ms}},
    "pass_ms": {storage: {context: ms}}, "batch", "rows"}."""
    return {"batch": batch, "rows": rows,
            "step_ms": {s: {c: step_ms(model, s, c, rows) for c in contexts} for s in ("dynamic", "paged", "slab")},
            "pass_ms": batch_pass_ms(model, contexts, batch, rows)}
