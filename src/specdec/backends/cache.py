"""KV caches that roll back: what stays of a pass after verification. Works on transformers'
`DynamicCache` (sliding-window layers included), on its layers stored in slabs (slab.py, what
`TransformersModel.new_cache` makes) and on any cache with `get_seq_length` and `crop`
(llama.cpp's, backends/llamacpp.py).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..errors import SpecdecError


def reserve_cache(cache, positions: int) -> None:
    """Tell a slab cache how many positions its sequence may reach, so each slab is allocated
    once at that size (the engine knows a request's bound); other caches ignore it."""
    for layer in getattr(cache, "layers", ()):
        if hasattr(layer, "reserve"):
            layer.reserve = positions


def cache_length(cache) -> int:
    """Positions the cache holds."""
    return cache.get_seq_length()


def crop_cache(cache, length: int) -> None:
    """Drop cached positions from `length` on (rejected draft tokens).

    Sliding-window layers that record their past are trimmed back to their window even when
    nothing is dropped. Raises SpecdecError where the cache cannot go back to `length`: layers
    with a recurrent state (Mamba-like), or a sliding layer asked to drop more than the
    tokens fed since its last crop (their keys are gone).
    """
    current = cache.get_seq_length()
    remove = current - length
    layers = getattr(cache, "layers", ())
    if remove > 0:
        if not getattr(cache, "is_croppable", True):
            raise SpecdecError("this model's cache cannot be rolled back (a recurrent state); "
                               "speculative decoding needs a croppable KV cache")
        for layer in layers:
            if getattr(layer, "is_sliding", False) and getattr(layer, "is_initialized", False) and \
                    layer.keys.shape[-2] - remove < min(layer.sliding_window - 1, length):
                raise SpecdecError(f"cannot crop a sliding-window cache from {current} to {length} tokens: "
                                   "it keeps only the window and the tokens fed since its last crop")
        cache.crop(-remove)
    elif remove == 0 and current > 0 and any(getattr(layer, "record_past", False) for layer in layers):
        cache.crop(0)  # restrict sliding layers to their window


def crop_layers(cache, length: int) -> None:
    """Put each layer of a full-attention cache back to `length` positions on its own (a pass that
    failed part way grew its first layers only; `crop_cache` drops one count from every layer)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        crop_cache(cache, length)
        return
    for layer in layers:
        extra = layer.get_seq_length() - length
        if extra > 0:
            layer.crop(-extra)


@torch.inference_mode()
def compact_cache(cache, start: int, offsets: Sequence[int]) -> None:
    """Keep the cache's first `start` positions and then those at start + offsets (ascending),
    moved into place; drop the rest: what stays of a tree pass is the accepted path.

    A main-chain path (offsets 0..k-1) is a plain `crop`.
    """
    offsets = [int(o) for o in offsets]
    if offsets != list(range(len(offsets))):
        for layer in getattr(cache, "layers", ()):
            if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
                continue
            index = torch.tensor([start + o for o in offsets], dtype=torch.long, device=layer.keys.device)
            # index_select copies first, so overlapping source and destination are safe
            layer.keys[..., start:start + len(offsets), :] = layer.keys.index_select(-2, index)
            layer.values[..., start:start + len(offsets), :] = layer.values.index_select(-2, index)
    crop_cache(cache, start + len(offsets))


class SegmentedCache:
    """Several sequences' caches, seen as one by a model's layers in a batched pass (`rows.segmented`).

    Each layer's new keys and values [1, kv_heads, N, D] are cut by sequence (`lengths`, in order)
    and appended to that sequence's own cache, which grows and rolls back on its own as before;
    the pass's attention reads each sequence's whole keys back with `layer`. Slab layers
    (slab.py) take theirs in one kernel call a layer where our kernels are built
    (`native.append_kv`); other layers through their own `update`.
    """

    def __init__(self, caches: Sequence, lengths: Sequence[int]):
        from . import native

        self.caches, self.lengths = list(caches), list(lengths)
        self._layers: dict[int, object] = {}
        self._append = native.append_kernel() is not None

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        from . import native
        from .slab import SlabLayer

        # a cache made without a config grows its layers in its own `update`
        layers = [cache.layers[layer_idx] if layer_idx < len(cache.layers) else None for cache in self.caches] \
            if self._append and key.device.type == "cpu" else ()
        if layers and all(type(layer) is SlabLayer for layer in layers):
            slabs = [layer.room(length, key, value) for layer, length in zip(layers, self.lengths)]
            self._layers[layer_idx] = native.append_kv(key, value, self.lengths, [layer.length for layer in layers],
                                                       slabs, [layer.address for layer in layers])
            for layer, length in zip(layers, self.lengths):
                layer.length += length
            return key, value
        keys, values, start = [], [], 0
        for cache, length in zip(self.caches, self.lengths):
            k, v = cache.update(key[:, :, start:start + length], value[:, :, start:start + length], layer_idx,
                                *args, **kwargs)
            keys.append(k)
            values.append(v)
            start += length
        self._layers[layer_idx] = native.KeyValues.of(keys, values)
        return key, value  # the pass's own keys; its attention reads `layer` instead

    def layer(self, layer_idx: int):
        """Each sequence's keys and values of this layer after the pass's update (a
        `native.KeyValues`; read once)."""
        return self._layers.pop(layer_idx)
