"""The `forced` method's drafter: it proposes nothing, so that under a grammar the tokens the
grammar forces are the whole draft (`Decoding._constrained` appends them, accepted for certain):
what forced tokens gain with no drafter at all. Without a grammar it is plain decoding."""

from __future__ import annotations

from typing import Sequence

import torch

from ..core.samplers import Sampler
from .base import Capabilities, Draft, Drafter, KeepGoing


class ForcedOnlyDrafter(Drafter):
    capabilities = Capabilities()
    name = "forced"

    def start(self, prompt: Sequence[int]) -> None:
        pass

    def propose(self, context: Sequence[int], max_tokens: int, sampler: Sampler, generator: torch.Generator,
                keep_going: KeepGoing) -> Draft:
        return Draft([], None)
