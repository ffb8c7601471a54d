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
    rollback (`crop`) is a length change; a slab full for a pass moves to one twice as large, so a
    sequence's slab moves O(log length) times. docs/engine.md ("KV storage: slabs") has the measurement
    that chose slabs over paged blocks. A batched pass writes every sequence's keys in one kernel
    call (`room`, then `cache.SegmentedCache`).
    """

    def __init__(self, reserve: int = 0):
        self._slabs: tuple[torch.Tensor, torch.Tensor] | None = None
        self._address: tuple | None = None  # `address`
        self.length = 0  # positions held
        super().__init__()
        self.reserve = reserve  # positions to allocate at once, when known (a request's bound)

    # `keys` / `values`: views of the slabs' first `length` positions, made when read (a batched
    # pass advances hundreds of layers' lengths and reads none of them); set whole by transformers
    # (None, offloading) and by beam search's reordering
    @property
    def keys(self) -> torch.Tensor | None:
        return self._view(0)

    @keys.setter
    def keys(self, tensor: torch.Tensor | None) -> None:
        self._set(0, tensor)

    @property
    def values(self) -> torch.Tensor | None:
        return self._view(1)

    @values.setter
    def values(self, tensor: torch.Tensor | None) -> None:
        self._set(1, tensor)

    def _view(self, which: int) -> torch.Tensor | None:
        slab = None if self._slabs is None else self._slabs[which]
        return None if slab is None else slab[..., :self.length, :]

    def _set(self, which: int, tensor: torch.Tensor | None) -> None:
        """A whole tensor becomes the slab (keys or values), full; None empties both."""
        self._address = None
        if tensor is None:
            self._slabs, self.length = None, 0
            return
        other = None if self._slabs is None else self._slabs[1 - which]
        self._slabs = (tensor, other) if which == 0 else (other, tensor)
        self.length = tensor.shape[-2]

    def __getstate__(self) -> dict:
        # a copy (a beam forked by deepcopy) gets slabs of its own: their addresses are found anew
        return {**self.__dict__, "_address": None}

    @property
    def slabs(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The buffers (keys, values) [B, kv_heads, capacity, D], or None before the first pass."""
        return self._slabs

    @property
    def address(self) -> tuple[int, int, int, int, int]:
        """Where our kernels find the slabs (`native.address`), kept until they move."""
        if self._address is None:
            from . import native

            self._address = native.address(*self._slabs)
        return self._address

    @property
    def capacity(self) -> int:
        """Positions the slab holds before it moves."""
        return 0 if self._slabs is None else self._slabs[0].shape[-2]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def room(self, new: int, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Make room for `new` more positions of keys and values shaped like `key_states` /
        `value_states` ([B, kv_heads, T, D]), moving to a larger slab where full -> the slabs
        [B, kv_heads, capacity, D]; the caller writes positions length..length+new-1 and adds `new` to `length`."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.length
        end = length + new
        if end > self.capacity:
            # with a reserve, sizes stay on its doubling ladder: never past what `slab_capacity` says,
            # which the engine charges to its KV budget
            size = slab_capacity(end, self.reserve) if self.reserve else max(end, 2 * self.capacity, SLAB_MIN)
            slabs = tuple(x.new_empty(*x.shape[:-2], size, x.shape[-1]) for x in (key_states, value_states))
            if length:
                slabs[0][..., :length, :].copy_(self.keys)
                slabs[1][..., :length, :].copy_(self.values)
            self._slabs, self._address = slabs, None
        return self._slabs

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append a pass's keys and values [B, kv_heads, T, D] -> all of them, [B, kv_heads, length, D] (views)."""
        new = key_states.shape[-2]
        keys, values = self.room(new, key_states, value_states)
        keys[..., self.length:self.length + new, :].copy_(key_states)
        values[..., self.length:self.length + new, :].copy_(value_states)
        self.length += new
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last -tokens_to_remove positions (transformers' convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to drop, got {tokens_to_remove}")
        self.length = max(0, self.length + tokens_to_remove)

    def reset(self) -> None:
        self._slabs, self._address, self.length = None, None, 0
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.length:  # index_select copies first, so the slab may take its result in place
            with torch.inference_mode():  # the slabs are inference tensors (written in passes)
                self.keys.copy_(self.keys.index_select(0, beam_idx.to(self.keys.device)))
                self.values.copy_(self.values.index_select(0, beam_idx.to(self.values.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.length:
            self.keys, self.values = self.keys.repeat_interleave(repeats, 0), self.values.repeat_interleave(repeats, 0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.length:
            self.keys, self.values = self.keys[indices, ...].contiguous(), self.values[indices, ...].contiguous()


def slab_cache(config):
    """transformers' `DynamicCache` for `config`, its full-attention layers stored in slabs
    (`SlabLayer`); sliding-window and other layers stay transformers' own."""
    cache = DynamicCache(config=config)
    cache.layers = [SlabLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
