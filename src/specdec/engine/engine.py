"""The step-wise engine: add requests, `step`, read each request's tokens as they are committed.

One step: admit waiting requests up to `max_batch` (each one's prompt pass), let every running
sequence draft (`Decoding.plan`), score all of their new tokens in one target pass, verify and
roll back each sequence on its own (`Decoding.commit`), and free what finished. A sequence's
output does not depend on what shares its passes: its rows are computed bit for bit as its own
pass computes them (`forward_batch`), and everything random comes from its own generators.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..backends import Backend, Segment
from ..errors import SpecdecError
from ..generate import Decoding, GenerationResult
from ..samplers import GREEDY, Sampler
from ..schedules import Schedule

@dataclass
class Request:
    """What to generate: the prompt's ids, how to sample, when to stop, and who drafts.

    drafter: None (plain decoding), a drafter model (each request drafts with it through its own
    cache), or a factory returning a fresh `Drafter` for this request (`LookupDrafter`,
    `lambda: make_tree_drafter("mixed", model)`): a drafter holds one sequence's state.
    schedule: a factory returning this request's draft-length schedule (default: fixed `gamma`).
    """

    prompt_ids: Sequence[int]
    drafter: object = None
    sampler: Sampler = GREEDY
    max_new_tokens: int = 128
    eos_token_ids: Sequence[int] | None = None
    seed: int | None = None
    gamma: int = 5
    schedule: Callable[[], Schedule] | None = None
    id: int = field(default=-1, compare=False)


class Engine:
    """Requests in, tokens out, one batched target pass per step.

    target: a model; with `forward_batch` (transformers' backend with row-exact passes, on the CPU)
        the running sequences share each pass; otherwise each sequence gets its own pass in turn
        (max_batch must then be 1 for a backend with one live sequence, llama.cpp's).
    max_batch: the most sequences running at once; later requests wait, in order.
    """

    def __init__(self, target: Backend, max_batch: int = 8):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise SpecdecError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        batched = hasattr(target, "forward_batch")
        if batched and not getattr(target, "exact_rows", False):
            raise SpecdecError(f"{target.name} runs without row-exact passes, so a sequence's output would depend "
                               "on what shares its passes; load it with exact_rows=True (on the CPU)")
        if not batched and max_batch > 1 and getattr(target, "kernels", "") == "llama.cpp":
            raise SpecdecError("llama.cpp's backend holds one sequence per model here; use max_batch=1")
        self.target, self.max_batch, self._batched = target, max_batch, batched
        self._ids = itertools.count()
        self.waiting: list[Request] = []
        self.running: dict[int, Decoding] = {}
        self.results: dict[int, GenerationResult] = {}
        self.passes = 0  # target passes made (one per step with running sequences)

    def add(self, request: Request) -> int:
        """Queue a request; returns its id. Its options are checked now (a clear error), its
        memory is taken when it is admitted."""
        request.id = next(self._ids)
        self._decoding(request)  # validates the options; the real one is built at admission
        self.waiting.append(request)
        return request.id

    def cancel(self, request_id: int) -> bool:
        """Drop a waiting or running request; a running one's cache is freed at once."""
        for i, request in enumerate(self.waiting):
            if request.id == request_id:
                del self.waiting[i]
                return True
        decoding = self.running.pop(request_id, None)
        if decoding is not None:
            decoding.cache = None
            return True
        return False

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> dict[int, list[int]]:
        """Admit, draft, one target pass, verify, roll back -> the tokens each request emitted."""
        while self.waiting and len(self.running) < self.max_batch:
            request = self.waiting.pop(0)
            decoding = self._decoding(request)
            decoding.prefill()
            self.running[request.id] = decoding
        if not self.running:
            return {}
        ids = list(self.running)
        segments = [self.running[i].plan() for i in ids]
        began = time.perf_counter()
        if self._batched:
            logits = self.target.forward_batch(segments)
        else:
            logits = [self.target.forward(s.input_ids, s.cache, s.num_logits, parents=s.parents) for s in segments]
        seconds = time.perf_counter() - began
        self.passes += 1
        emitted = {}
        for request_id, rows in zip(ids, logits):
            decoding = self.running[request_id]
            emitted[request_id] = decoding.commit(rows, seconds)
            if decoding.done:
                self.results[request_id] = decoding.result()  # frees its cache
                del self.running[request_id]
        return emitted

    def run(self) -> dict[int, GenerationResult]:
        """Step until every request has ended -> results by request id."""
        while self.busy:
            self.step()
        return self.results

    def _decoding(self, request: Request) -> Decoding:
        drafter = request.drafter
        if not isinstance(drafter, type) and (hasattr(drafter, "propose") or hasattr(drafter, "propose_tree")):
            raise SpecdecError(f"a drafter object holds one sequence's state; give requests a factory that makes one "
                               f"each (e.g. {type(drafter).__name__} itself, or a lambda), or a drafter model")
        if callable(drafter) and not hasattr(drafter, "forward"):
            drafter = drafter()  # a factory: this request's own drafter
        if getattr(drafter, "reads_target_hidden", False) and self._batched:
            raise SpecdecError("self-drafting heads (Medusa, EAGLE) read the target's hidden states, which "
                               "batched passes do not keep yet; run them with speculative_generate")
        return Decoding(request.prompt_ids, self.target, drafter, gamma=request.gamma, sampler=request.sampler,
                        max_new_tokens=request.max_new_tokens, eos_token_ids=request.eos_token_ids, seed=request.seed,
                        schedule=request.schedule() if request.schedule else None)


def generate_many(prompts: Sequence[Sequence[int]], target: Backend, drafter=None, max_batch: int = 8,
                  samples: int = 1, seeds: Sequence[int | None] | None = None, **options) -> list[GenerationResult]:
    """Generate for every prompt (`samples` each, in order), up to `max_batch` sequences at once.

    drafter: as `Request.drafter` (a model, a factory of drafters, or None).
    seeds: one per generated sequence (len(prompts) * samples), or None.
    options: the rest of `Request`'s fields (sampler, max_new_tokens, eos_token_ids, gamma, schedule).
    Returns the results in the order of the prompts (each prompt's samples together).
    """
    if not isinstance(samples, int) or samples < 1:
        raise SpecdecError(f"samples must be an integer >= 1, got {samples!r}")
    count = len(prompts) * samples
    if seeds is not None and len(seeds) != count:
        raise SpecdecError(f"seeds: one per generated sequence ({count}), got {len(seeds)}")
    engine = Engine(target, max_batch)
    ids = [engine.add(Request(prompt, drafter, seed=None if seeds is None else seeds[i * samples + k], **options))
           for i, prompt in enumerate(prompts) for k in range(samples)]
    results = engine.run()
    return [results[i] for i in ids]
