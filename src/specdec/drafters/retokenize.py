"""A drafter model with another tokenizer (Hugging Face's universal assisted generation; Timor et
al. 2025): it drafts text, and the text is tokenized again with the target's tokenizer.

Each step the context (target ids) is decoded to text and encoded with the drafter's tokenizer;
the drafter's cache keeps the longest prefix it shares with what it held, so only the new tokens
are fed. The drafter then drafts in its own tokens, and its draft's text, appended to the last
few context tokens' text, is encoded with the target's tokenizer; the ids past the context's are
the draft. Where that boundary re-encodes differently (a merge across it), nothing is drafted.

The draft reaches the target as a deterministic proposal (q one-hot at each token), which is
exact under any sampler: rejection sampling against a one-hot q keeps the target's law for
whatever draft it is handed, so also for one the drafter sampled on its own draws, independent
of the target's. (The exact alternative that keeps the drafter's q needs q mapped onto the
target's ids over the two vocabularies' intersection; not built.)
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..backends import Backend
from ..backends.cache import crop_cache
from ..errors import SpecdecError
from ..samplers import Sampler, greedy_tokens, sample
from .base import Draft, KeepGoing
from .model import stand_in_id

LOOKBEHIND = (8, 2)  # context tokens re-encoded with the draft's text, tried in turn


class OtherTokenizerDrafter:
    """Drafts with `model`, whose tokenizer differs from the target's, through text."""

    def __init__(self, model: Backend):
        if getattr(model, "tokenizer", None) is None:
            raise SpecdecError(f"a drafter with another tokenizer drafts through text; {model.name} has no tokenizer")
        self.model = model
        self.name = f"{model.name} (retokenized)"
        self.forwards = 0
        self.cache = None
        self.target = None
        self._held: list[int] = []  # the drafter's ids in its cache, in order

    def check_target(self, target: Backend) -> None:
        if getattr(target, "tokenizer", None) is None:
            raise SpecdecError(f"a drafter with another tokenizer drafts through text; target {target.name} has "
                               "no tokenizer")
        if target.device != self.model.device:
            raise SpecdecError(f"target is on {target.device} but drafter on {self.model.device}; load both on one "
                               "device")
        self.target = target

    def start(self, prompt: Sequence[int]) -> None:
        self.cache = self.model.new_cache()
        self.forwards = 0
        self._held = []

    def propose(self, context: Sequence[int], max_tokens: int, sampler: Sampler, generator: torch.Generator,
                keep_going: KeepGoing) -> Draft:
        target_tokenizer, tokenizer = self.target.tokenizer, self.model.tokenizer
        # no clean-up of spaces: the text must re-encode to what the target wrote
        ids = tokenizer.encode(target_tokenizer.decode(list(context), clean_up_tokenization_spaces=False),
                               add_special_tokens=False) or [stand_in_id(tokenizer)]
        keep = min(_shared_prefix(self._held, ids), len(ids) - 1)  # at least one id fed, for its logits
        crop_cache(self.cache, keep)
        pending, self._held = ids[keep:], ids[:keep]
        drafted: list[int] = []
        while len(drafted) < max_tokens:
            logits = self.model.forward(pending, self.cache, 1)[-1]
            self.forwards += 1
            self._held += pending
            token = int(greedy_tokens(logits)) if sampler.is_greedy else int(sample(sampler.probs(logits), generator))
            drafted.append(token)
            pending = [token]
            if not keep_going(len(drafted), logits):
                break
        text = tokenizer.decode(drafted, clean_up_tokenization_spaces=False)
        return Draft(self.retokenize(context, text)[:max_tokens], None)

    def retokenize(self, context: Sequence[int], draft_text: str) -> list[int]:
        """The target's ids of `draft_text` as it continues `context` ([] where the boundary does not
        re-encode to the context's own ids)."""
        draft_text = draft_text.rstrip("\ufffd")  # a character cut in the middle of its bytes
        if not draft_text:
            return []
        tokenizer = self.target.tokenizer
        for behind in LOOKBEHIND:
            tail = list(context[-behind:])
            ids = tokenizer.encode(tokenizer.decode(tail, clean_up_tokenization_spaces=False) + draft_text,
                                   add_special_tokens=False)
            if ids[:len(tail)] == tail:
                return ids[len(tail):]
        return []

    def rollback(self, length: int) -> None:
        """Nothing to do: the next proposal finds what its cache still shares with the context."""


def _shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
