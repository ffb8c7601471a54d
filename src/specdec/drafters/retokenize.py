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
of the target's. But a one-hot q accepts a sampled token only with p(x).

So under sampling the drafter drafts over the two vocabularies' intersection instead (Timor et
al. 2025, token-level intersection): the tokens both tokenizers spell alike. Its q, restricted to
them and renormalised, is drawn from and mapped onto the target's ids, so each drafted token is
a target token with a known q, verified by min(1, p/q) as a shared-vocabulary drafter's is:
exact, and accepted more often where p and q agree.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..backends import Backend
from ..backends.cache import crop_cache
from ..errors import SpecdecError
from ..core.samplers import Sampler, draw, greedy_tokens, sample
from .base import Capabilities, Draft, Drafter, KeepGoing
from .model import stand_in_id

LOOKBEHIND = (8, 2)  # context tokens re-encoded with the draft's text, tried in turn


MODES = ("auto", "text", "intersection")
_SHARED: dict[tuple, tuple] = {}  # (tokenizers' ids, head widths, device) -> (tokenizers, shared tokens)


class OtherTokenizerDrafter(Drafter):
    """Drafts with `model`, whose tokenizer differs from the target's.

    mode: "text" (draft text, re-encoded with the target's tokenizer; q one-hot), "intersection"
    (draft over the shared tokens, q mapped onto the target's ids), or "auto" (default): text
    under greedy decoding, where q plays no part and any text can be drafted, the intersection
    under sampling."""

    capabilities = Capabilities(model=True)

    def __init__(self, model: Backend, mode: str = "auto"):
        if model.tokenizer is None:
            raise SpecdecError(f"a drafter with another tokenizer drafts through text; {model.name} has no tokenizer")
        if mode not in MODES:
            raise SpecdecError(f"unknown mode {mode!r} for a drafter of another tokenizer; use {', '.join(MODES)}")
        self.model, self.mode = model, mode
        self.name = f"{model.name} (retokenized)"
        self.passes = 0
        self.cache = None
        self.target = None
        self._held: list[int] = []  # the drafter's ids in its cache, in order
        self._shared: tuple[torch.Tensor, torch.Tensor] | None = None  # (drafter ids, target ids) spelled alike

    def check_target(self, target: Backend) -> None:
        if target.tokenizer is None:
            raise SpecdecError(f"a drafter with another tokenizer drafts through text; target {target.name} has "
                               "no tokenizer")
        if target.device != self.model.device:
            raise SpecdecError(f"target is on {target.device} but drafter on {self.model.device}; load both on one "
                               "device")
        self.target = target

    def start(self, prompt: Sequence[int]) -> None:
        self.cache = self.model.new_cache()
        self.passes = 0
        self._held = []

    def shared_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens both vocabularies spell alike, special tokens left out: (drafter ids [S],
        target ids [S]), computed once per pair of tokenizers (a generation wraps its drafter anew)."""
        key = (id(self.model.tokenizer), id(self.target.tokenizer), self.model.vocab_size, self.target.vocab_size,
               str(self.model.device))
        if self._shared is None and key in _SHARED:
            self._shared = _SHARED[key][2]
        if self._shared is None:
            mine, theirs = self.model.tokenizer, self.target.tokenizer
            specials = set(getattr(mine, "all_special_tokens", ())) | set(getattr(theirs, "all_special_tokens", ()))
            target_vocab = theirs.get_vocab()
            pairs = sorted((d, target_vocab[text]) for text, d in mine.get_vocab().items()
                           if text in target_vocab and text not in specials and d < self.model.vocab_size
                           and target_vocab[text] < self.target.vocab_size)
            if not pairs:
                raise SpecdecError(f"{self.model.name} and {self.target.name} share no token: draft through text "
                                   "(mode='text')")
            device = self.model.device
            self._shared = (torch.tensor([d for d, _ in pairs], device=device),
                            torch.tensor([t for _, t in pairs], device=device))
            _SHARED[key] = (mine, theirs, self._shared)  # the tokenizers held, so their ids stay theirs
        return self._shared

    def propose(self, context: Sequence[int], max_tokens: int, sampler: Sampler, generator: torch.Generator,
                keep_going: KeepGoing) -> Draft:
        pending = self._catch_up(context)
        if self.mode == "intersection" or (self.mode == "auto" and not sampler.is_greedy):
            return self._propose_shared(pending, max_tokens, sampler, generator, keep_going, len(context))
        tokenizer = self.model.tokenizer
        drafted: list[int] = []
        while len(drafted) < max_tokens:
            logits = self.model.forward(pending, self.cache, 1)[-1]
            self.passes += 1
            self._held += pending
            token = int(greedy_tokens(logits)) if sampler.is_greedy else int(sample(sampler.probs(logits), generator))
            drafted.append(token)
            pending = [token]
            if not keep_going(len(drafted), logits):
                break
        text = tokenizer.decode(drafted, clean_up_tokenization_spaces=False)
        return Draft(self.retokenize(context, text)[:max_tokens], None)

    def _catch_up(self, context: Sequence[int]) -> list[int]:
        """The context in the drafter's ids; its cache keeps what it shares with them -> the ids to feed."""
        tokenizer = self.model.tokenizer
        # no clean-up of spaces: the text must re-encode to what the target wrote
        ids = tokenizer.encode(self.target.tokenizer.decode(list(context), clean_up_tokenization_spaces=False),
                               add_special_tokens=False) or [stand_in_id(tokenizer)]
        keep = min(_shared_prefix(self._held, ids), len(ids) - 1)  # at least one id fed, for its logits
        crop_cache(self.cache, keep)
        self._held = ids[:keep]
        return ids[keep:]

    def _propose_shared(self, pending: list[int], max_tokens: int, sampler: Sampler, generator: torch.Generator,
                        keep_going: KeepGoing, start: int) -> Draft:
        """Draft over the shared tokens: q restricted to them (renormalised by the sampler), each
        token drawn from it and mapped, with its q, onto the target's ids; `start`: the target
        position of the first (where a seed couples the draws)."""
        mine, theirs = self.shared_tokens()
        tokens, probs = [], []
        while len(tokens) < max_tokens:
            logits = self.model.forward(pending, self.cache, 1)[-1]
            self.passes += 1
            self._held += pending
            shared = logits.new_full(logits.shape, float("-inf"))
            shared[mine] = logits[mine]
            if sampler.is_greedy:
                token = int(greedy_tokens(shared))
            else:
                q = sampler.probs(shared)
                row = q.new_zeros(self.target.vocab_size)
                row[theirs] = q[mine]
                # drawn over the target's ids, so that a seed's noise of that position couples it
                token = int(mine[theirs == draw(row, generator, start + len(tokens))][0])
                probs.append(row)
            tokens.append(int(theirs[mine == token][0]))
            pending = [token]
            if not keep_going(len(tokens), shared):
                break
        return Draft(tokens, torch.stack(probs) if probs else None)

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
