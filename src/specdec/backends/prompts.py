"""Prompt caches: a finished prompt's cache entries, reused by a later prompt that starts alike.

An entry is reused only where it came from the very call the new prompt would be fed in (the
engine feeds a prompt in calls of `chunk` ids from its start, `Decoding.prefill_step`): same
bounds, same ids, so it holds the bits a fresh feed would give it, and outputs stay exact.
llama.cpp's backend keeps prompts in its free KV streams (backends/llamacpp.py); transformers'
weights keep copies of them here (`PromptStore`).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Sequence

import torch

PREFILL_CHUNK = 256  # prompt ids fed per call (`Decoding.prefill_step`, a drafter model's `_catch_up`)
# A prompt of at most this many ids is fed row-exactly where attention runs in our kernel
# (`TransformersModel.prefill`), alone as in a shared pass (`prefill_batch`); a longer one's
# attention runs causally over its chunk in one call (attention a row at a time grows with the
# square of its length), in a shared pass too where the linears round a row alike in calls of any
# size (`TransformersModel.shared_chunks`).
SHARED_PREFILL = 65
# prompt tokens the engine feeds a step, about (`Engine(prefill_tokens=...)`): chunks of several
# prompts share one pass (`prefill_batch`), so four chunks' worth streams the weights once where one
# chunk a step streamed them four times; the running sequences wait for that pass (docs/engine.md)
PREFILL_TOKENS = 1024


class Held:
    """The ids a sequence's cache holds, and where each of its prompt-feeding calls (a prefill,
    while nothing else was fed) ended: the entries a later prompt may reuse (`reusable`). `salt`:
    the tenant whose prompt it is (a request's `cache_salt`); only the same salt reuses it."""

    def __init__(self, tokens: list[int], calls: list[int], salt: str = ""):
        self.tokens, self.calls, self.salt = tokens, calls, salt

    def keep(self, length: int) -> None:
        del self.tokens[length:]
        self.calls = [end for end in self.calls if end <= length]

    def fed(self, prompt: Sequence[int], start: int) -> None:
        """A prefill fed `prompt` but its last id, from `start` (what the cache held before it);
        a call of the prompt's feed only if nothing but prompt calls came before it."""
        if start == (self.calls[-1] if self.calls else 0):
            self.tokens[start:] = list(prompt[start:len(prompt) - 1])
            self.calls.append(len(prompt) - 1)


def reusable(held: Held, prompt: Sequence[int], chunk: int, salt: str = "") -> int:
    """How many leading cache entries of `held` a cache for `prompt` can take as they are: those
    of its prompt calls that are the very calls `prompt` would be fed in (calls of `chunk` ids
    from 0, the last one ending before prompt[-1]: `Decoding.prefill_step`), same bounds, same
    ids. Every entry then holds the bits a fresh feed would give it."""
    if held.salt != salt:  # another tenant's prompt: its reuse would tell this one what it sent
        return 0
    start, last = 0, len(prompt) - 1
    for end in held.calls:
        if end != min(start + chunk, last) or held.tokens[start:end] != list(prompt[start:end]):
            break
        start = end
    return start


def salt_tenant(salt: str) -> str:
    """The API key a cache salt belongs to: its part before the first '/' (the server salts the
    requests of each of several keys `keyN/...`), '' where it has none."""
    return salt.partition("/")[0] if "/" in salt else ""


def evictee(kept: dict, salt: str = "", adding: int = 0):
    """Which of the `kept` prompts (key -> `Held`, least recently used first) to drop to keep
    `adding` more positions under `salt`: the least recently used of the tenant (`salt_tenant`)
    that would hold the most, the newcomer counted; None where that is the newcomer's tenant and
    it keeps nothing yet (the newcomer alone is over its share: it is not kept). A tenant filling
    the store pushes out its own prompts first, and never another's while that one holds less."""
    totals = Counter({salt_tenant(salt): adding})
    for held in kept.values():
        totals[salt_tenant(held.salt)] += len(held.tokens)
    heaviest = max(totals, key=totals.__getitem__)
    return next((key for key, held in kept.items() if salt_tenant(held.salt) == heaviest), None)


class PromptStore:
    """Copies of finished prompts' keys and values (transformers' slab caches), at most `tokens`
    positions in all, the least recently used of the tenant holding the most dropped first
    (`evictee`: one API key's clients cannot push out another's prompts).

    keep(cache) copies a cache's prompt entries once its prompt is in; restore(cache, prompt,
    chunk) fills a new cache with the kept entries `prompt` can reuse (`reusable`).
    """

    def __init__(self, tokens: int):
        self.tokens = int(tokens)
        self._entries: OrderedDict[int, tuple[Held, list[tuple[torch.Tensor, torch.Tensor]]]] = OrderedDict()
        self._next = 0

    @property
    def held_tokens(self) -> int:
        """Positions kept now."""
        return sum(held.calls[-1] for held, _ in self._entries.values())

    @torch.inference_mode()
    def keep(self, cache) -> None:
        """Copy the entries of `cache`'s prompt calls (its `held` record), replacing an earlier copy
        of the same ids; nothing where they exceed the store or a layer is not a slab (a sliding
        window)."""
        from .slab import SlabLayer

        held = getattr(cache, "held", None)
        length = held.calls[-1] if held is not None and held.calls else 0
        layers = getattr(cache, "layers", ())
        if not 0 < length <= self.tokens or not all(isinstance(layer, SlabLayer) and layer.keys is not None
                                                    for layer in layers):
            return
        tokens = held.tokens[:length]
        for key in [key for key, (other, _) in self._entries.items()
                    if other.tokens == tokens and other.salt == held.salt]:
            del self._entries[key]
        while self._entries and self.held_tokens + length > self.tokens:
            victim = evictee({key: other for key, (other, _) in self._entries.items()}, held.salt, length)
            if victim is None:
                return
            del self._entries[victim]
        copies = [(layer.keys[..., :length, :].clone(), layer.values[..., :length, :].clone()) for layer in layers]
        self._entries[self._next] = (Held(tokens, list(held.calls), held.salt), copies)
        self._next += 1

    @torch.inference_mode()
    def restore(self, cache, prompt: Sequence[int], chunk: int, salt: str = "") -> int:
        """Give the new, empty `cache` a `held` record and the kept entries `prompt` can reuse (the
        entry with the most, of the same `salt`) -> how many positions it now holds."""
        cache.held = Held([], [], salt)
        best, reuse = None, 0
        for key, (held, _) in self._entries.items():
            count = reusable(held, prompt, chunk, salt)
            if count > reuse:
                best, reuse = key, count
        if best is None:
            return 0
        self._entries.move_to_end(best)
        held, copies = self._entries[best]
        for layer, (keys, values) in zip(cache.layers, copies):
            layer.update(keys[..., :reuse, :], values[..., :reuse, :])
        cache.held = Held(held.tokens[:reuse], [end for end in held.calls if end <= reuse], salt)
        return reuse
