"""A smaller language model as the drafter (Leviathan et al.; Chen et al.)."""

from __future__ import annotations

from typing import Sequence

import torch

from ..models import LanguageModel, check_pair
from ..samplers import Sampler, greedy_tokens, sample
from .base import Draft, KeepGoing


class ModelDrafter:
    """Drafts with `model` autoregressively, keeping its own KV cache in step with the target's."""

    def __init__(self, model: LanguageModel):
        self.model = model
        self.name = model.name
        self.forwards = 0
        self.cache = None

    def check_target(self, target: LanguageModel) -> None:
        check_pair(target, self.model)

    def start(self, prompt: Sequence[int]) -> None:
        self.cache = self.model.new_cache()
        self.forwards = 0

    def propose(self, context: Sequence[int], max_tokens: int, sampler: Sampler, generator: torch.Generator,
                keep_going: KeepGoing) -> Draft:
        tokens: list[int] = []
        probs = []
        # what the drafter has not seen: the target's last token (and the last draft token when
        # the whole previous draft was accepted)
        pending = list(context[LanguageModel.cache_length(self.cache):])
        while len(tokens) < max_tokens:
            logits = self.model.forward(pending, self.cache, num_logits=1)[-1]
            self.forwards += 1
            if sampler.is_greedy:
                token = int(greedy_tokens(logits))
            else:
                q = sampler.probs(logits)
                token = int(sample(q, generator))
                probs.append(q)
            tokens.append(token)
            pending = [token]
            if not keep_going(len(tokens), logits):
                break
        return Draft(tokens, torch.stack(probs) if probs else None)

    def rollback(self, length: int) -> None:
        LanguageModel.crop(self.cache, length)
