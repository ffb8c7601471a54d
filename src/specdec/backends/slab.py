"""KV cache layers stored in slabs: a pass writes its keys in place, rollback is a length change.
Kept apart from cache.py because it subclasses transformers' layers (importing transformers)."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

SLAB_MIN = 64  # positions of a slab's first allocation


def slab_capacity(length: int, reserve: int = 0) -> int:
    """Positions a slab holds once `length` positions are written where its sequence reserved
    `reserve` (`reserve_cache`): the reserve (at least SLAB_MIN), doubled until `length` fits. A
    sequence longer than its reserve holds up to twice its length: what its memory really costs."""
    size = max(reserve, SLAB_MIN)
    while size < length:
        size *= 2
    return size


class SlabLayer(DynamicLayer):
    """One layer's keys and values in a slab: buffers [B, kv_heads, capacity, D] that a pass writes
    into, and `keys` / `values`, views of their first `length` positions (what attention reads).

    transformers' `DynamicLayer` concatenates every pass's keys onto a new tensor, copying the
    whole cache each pass (and each of a drafter's passes). Here a pass copies only its own keys;
    rollback (`crop`) narrows the views; a slab full for a pass moves to one twice as large, so a
    sequence's slab moves O(log length) times. docs/engine.md ("KV storage: slabs") has the measurement
    that chose slabs over paged blocks.
    """

    def __init__(self, reserve: int = 0):
        super().__init__()
        self.reserve = reserve  # positions to allocate at once, when known (a request's bound)
        self._slabs: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def capacity(self) -> int:
        """Positions the slab holds before it moves."""
        return 0 if self._slabs is None else self._slabs[0].shape[-2]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append a pass's keys and values [B, kv_heads, T, D] -> all of them, [B, kv_heads, length, D] (views)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        end = length + key_states.shape[-2]
        if end > self.capacity:
            # with a reserve, sizes stay on its doubling ladder: never past what `slab_capacity` says,
            # which the engine charges to its KV budget
            size = slab_capacity(end, self.reserve) if self.reserve else max(end, 2 * self.capacity, SLAB_MIN)
            slabs = tuple(x.new_empty(*x.shape[:-2], size, x.shape[-1]) for x in (key_states, value_states))
            if length:
                slabs[0][..., :length, :].copy_(self.keys)
                slabs[1][..., :length, :].copy_(self.values)
            self._slabs = slabs
        keys, values = self._slabs
        keys[..., length:end, :].copy_(key_states)
        values[..., length:end, :].copy_(value_states)
        self.keys, self.values = keys[..., :end, :], values[..., :end, :]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last -tokens_to_remove positions (transformers' convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to drop, got {tokens_to_remove}")
        if tokens_to_remove and self.keys is not None:
            end = max(0, self.get_seq_length() + tokens_to_remove)
            self.keys, self.values = self._slabs[0][..., :end, :], self._slabs[1][..., :end, :]

    def reset(self) -> None:
        self.keys = self.values = self._slabs = None
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.get_seq_length():  # index_select copies first, so the slab may take its result in place
            with torch.inference_mode():  # the slabs are inference tensors (written in passes)
                self.keys.copy_(self.keys.index_select(0, beam_idx.to(self.keys.device)))
                self.values.copy_(self.values.index_select(0, beam_idx.to(self.values.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length():
            self.keys, self.values = self.keys.repeat_interleave(repeats, 0), self.values.repeat_interleave(repeats, 0)
            self._slabs = (self.keys, self.values)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length():
            self.keys, self.values = self.keys[indices, ...], self.values[indices, ...]
            self._slabs = (self.keys.contiguous(), self.values.contiguous())
            self.keys, self.values = self._slabs


def slab_cache(config):
    """transformers' `DynamicCache` for `config`, its full-attention layers stored in slabs
    (`SlabLayer`); sliding-window and other layers stay transformers' own."""
    cache = DynamicCache(config=config)
    cache.layers = [SlabLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
