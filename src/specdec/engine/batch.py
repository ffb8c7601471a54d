"""`generate_many`: a list of prompts through one engine, the results in the prompts' order."""

from __future__ import annotations

from typing import Sequence

from ..backends import Backend
from ..decoding.results import GenerationResult
from ..errors import SpecdecError
from ..sizing.pass_costs import LoadCosts
from .engine import Engine
from .request import Request


def generate_many(prompts: Sequence[Sequence[int]], target: Backend, drafter=None, max_batch: int = 8,
                  samples: int = 1, seeds: Sequence[int | None] | None = None, kv_memory: int | None = None,
                  load_costs: LoadCosts | None = None, allow_larger_drafter: bool = False,
                  **options) -> list[GenerationResult]:
    """Generate for every prompt (`samples` each, in order), up to `max_batch` sequences at once.

    drafter: as `Request.drafter` (a model, a factory of drafters, or None).
    seeds: one per generated sequence (len(prompts) * samples), or None.
    kv_memory: the engine's KV budget in bytes (`Engine`), or None.
    load_costs: the machine's batched pass costs with the drafter's model
    (`pass_costs.load_costs(target, drafter)`), so that batch sizes where no draft can pay decode
    plainly from the first step (`Engine`); None: every size is learned from its own steps.
    allow_larger_drafter: as `speculative_generate`'s (a drafter model larger than the target, or
    the two loaded the other way round, is refused: `roles.check_roles`).
    options: the rest of `Request`'s fields (sampler, max_new_tokens, eos_token_ids, gamma, schedule).
    Returns the results in the order of the prompts (each prompt's samples together).
    """
    if not isinstance(samples, int) or samples < 1:
        raise SpecdecError(f"samples must be an integer >= 1, got {samples!r}")
    count = len(prompts) * samples
    if seeds is not None and len(seeds) != count:
        raise SpecdecError(f"seeds: one per generated sequence ({count}), got {len(seeds)}")
    from ..models.roles import check_roles

    check_roles(target, drafter, allow_larger_drafter)
    engine = Engine(target, max_batch, kv_memory, load_costs=load_costs)
    ids = [engine.add(Request(prompt, drafter, seed=None if seeds is None else seeds[i * samples + k], **options))
           for i, prompt in enumerate(prompts) for k in range(samples)]
    results = engine.run()
    return [results[i] for i in ids]
