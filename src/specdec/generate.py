"""The decoding loops: autoregressive (the baseline) and speculative (Leviathan et al., Algorithm 1).

Both caches always hold every token of the sequence except those not yet fed; after verification
the rejected draft positions are cropped from both, so no accepted token is ever recomputed.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch

from .errors import SpecdecError
from .drafters import Draft, Drafter, ModelDrafter
from .drafters.base import one_hot
from .models import LanguageModel
from .samplers import GREEDY, Sampler, greedy_tokens, sample
from .schedules import Fixed, Schedule
from .verify import verify_draft, verify_greedy


@dataclass
class Step:
    """One target forward: what was drafted, how much was kept, and the token the target added."""

    draft_tokens: list[int]
    num_accepted: int
    next_token: int
    emitted: list[int]  # tokens appended to the output (accepted drafts + next_token, cut at EOS/limit)
    info: dict = field(default_factory=dict)  # the schedule's per-step values (e.g. EGAG's h_norm, gamma)

    @property
    def next_kind(self) -> str:
        """'target' (no draft), 'bonus' (all drafts accepted) or 'resampled' (after a rejection)."""
        if not self.draft_tokens:
            return "target"
        return "bonus" if self.num_accepted == len(self.draft_tokens) else "resampled"


@dataclass
class GenerationStats:
    new_tokens: int = 0
    target_forwards: int = 0
    drafter_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_per_step: list[int] = field(default_factory=list)
    wall_seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted draft tokens / drafted tokens (None when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def tokens_per_target_forward(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(acceptance_rate=self.acceptance_rate, tokens_per_second=self.tokens_per_second,
                 tokens_per_target_forward=self.tokens_per_target_forward)
        return d


@dataclass
class GenerationResult:
    tokens: list[int]  # the generated tokens only (the prompt excluded)
    steps: list[Step]
    stats: GenerationStats
    stop_reason: str  # "eos", "max_new_tokens" or "context"


StepCallback = Callable[[Step], None]


def autoregressive_generate(prompt_ids: Sequence[int], model: LanguageModel, sampler: Sampler = GREEDY,
                            max_new_tokens: int = 128, eos_token_ids: Sequence[int] | None = None,
                            seed: int | None = None, on_step: StepCallback | None = None) -> GenerationResult:
    """Generate one token per target forward, with a KV cache: the baseline to beat."""
    prompt, limit, limit_reason, eos = _validate(prompt_ids, [model], max_new_tokens, eos_token_ids)
    generator = _generator(seed, model.device)
    out = _Output(limit, limit_reason, eos, on_step)
    cache = model.new_cache()
    start = time.perf_counter()
    pending = prompt
    while not out.done:
        logits = model.forward(pending, cache, num_logits=1)
        out.stats.target_forwards += 1
        token = int(_target_token(logits[-1], sampler, generator))
        out.add(Step([], 0, token, []))
        pending = [token]
    return out.finish(time.perf_counter() - start)


def speculative_generate(prompt_ids: Sequence[int], target: LanguageModel, drafter: LanguageModel | Drafter,
                         gamma: int = 5, sampler: Sampler = GREEDY, max_new_tokens: int = 128,
                         eos_token_ids: Sequence[int] | None = None, seed: int | None = None,
                         first_target: bool = True, on_step: StepCallback | None = None,
                         schedule: Schedule | None = None) -> GenerationResult:
    """Speculative decoding: the drafter proposes tokens, the target scores them in one forward
    pass, and the verification keeps an exact prefix plus one target token.

    drafter: a smaller `LanguageModel` (same vocabulary), or any `Drafter` (drafters/: n-gram,
        prompt lookup).
    schedule: how many tokens to draft per step (schedules.py); default: a fixed `gamma`.

    The output follows the target's distribution under `sampler` exactly (token for token the
    target's greedy output when the sampler is greedy). `first_target=True` makes the first token
    come from the target's prompt pass alone, before any drafting. Drafts shrink near
    `max_new_tokens` and the context limit. Generation stops at any id in `eos_token_ids`
    (default: the target's), also when one arrives inside an accepted draft.
    """
    if not hasattr(drafter, "propose"):  # a model (LanguageModel or anything with its interface)
        drafter = ModelDrafter(drafter)
    drafter.check_target(target)
    if schedule is None:
        schedule = Fixed(gamma)
    models = [target] + ([drafter.model] if isinstance(drafter, ModelDrafter) else [])
    prompt, limit, limit_reason, eos = _validate(prompt_ids, models, max_new_tokens, eos_token_ids)
    generator = _generator(seed, target.device)
    out = _Output(limit, limit_reason, eos, on_step)
    sequence = list(prompt)
    target_cache = target.new_cache()
    drafter.start(prompt)
    schedule.reset()
    start = time.perf_counter()

    if first_target:
        logits = target.forward(sequence, target_cache, num_logits=1)
        out.stats.target_forwards += 1
        sequence += out.add(Step([], 0, int(_target_token(logits[-1], sampler, generator)), []))

    while not out.done:
        # 1. Draft, leaving room for the target's own token: never past the output limit.
        budget = min(schedule.budget(), out.remaining - 1)
        draft = drafter.propose(sequence, budget, sampler, generator, schedule.keep_going) if budget > 0 else Draft([])

        # 2. Score: one target pass over the tokens it has not seen and the whole draft.
        fed = sequence[LanguageModel.cache_length(target_cache):] + draft.tokens
        logits = target.forward(fed, target_cache, num_logits=len(draft.tokens) + 1)  # [γ+1, V]
        out.stats.target_forwards += 1

        # 3. Verify: the acceptance rule lives in verify.py alone.
        num_accepted, next_token = _verify(logits, draft, sampler, generator)

        # 4. Roll back: rejected positions leave both caches.
        kept = len(sequence) + num_accepted
        LanguageModel.crop(target_cache, kept)
        drafter.rollback(kept)
        schedule.update(len(draft.tokens), num_accepted)
        sequence += out.add(Step(draft.tokens, num_accepted, next_token, [], schedule.step_info()))
    out.stats.drafter_forwards = drafter.forwards
    return out.finish(time.perf_counter() - start)


def _target_token(logits: torch.Tensor, sampler: Sampler, generator: torch.Generator) -> torch.Tensor:
    """The target's own token from logits [V] (greedy without building a one-hot row)."""
    return greedy_tokens(logits) if sampler.is_greedy else sample(sampler.probs(logits), generator)


def _verify(logits: torch.Tensor, draft: Draft, sampler: Sampler, generator: torch.Generator) -> tuple[int, int]:
    """(num_accepted, next_token) for the target's logits [γ+1, V] over `draft`."""
    if not draft.tokens:
        return 0, int(_target_token(logits[-1], sampler, generator))
    tokens = torch.tensor(draft.tokens, device=logits.device)
    if sampler.is_greedy:
        num_accepted, next_token = verify_greedy(greedy_tokens(logits), tokens)
    else:
        q = draft.probs if draft.probs is not None else one_hot(draft.tokens, logits.shape[-1], logits.device)
        num_accepted, next_token = verify_draft(sampler.probs(logits), q, tokens, generator)
    return int(num_accepted), int(next_token)


class _Output:
    """Collects emitted tokens and stats; knows when to stop (limit or EOS)."""

    def __init__(self, limit: int, limit_reason: str, eos: set[int], on_step: StepCallback | None):
        self.tokens: list[int] = []
        self.steps: list[Step] = []
        self.stats = GenerationStats()
        self.limit, self.limit_reason, self.eos, self.on_step = limit, limit_reason, eos, on_step
        self.stop_reason: str | None = None

    @property
    def remaining(self) -> int:
        return self.limit - len(self.tokens)

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    def add(self, step: Step) -> list[int]:
        """Append a step's accepted drafts and next token, cut at the first EOS or the limit."""
        emitted = []
        for token in step.draft_tokens[:step.num_accepted] + [step.next_token]:
            emitted.append(token)
            if token in self.eos:
                self.stop_reason = "eos"
                break
        emitted = emitted[:self.remaining]
        step.emitted = emitted
        self.tokens += emitted
        self.steps.append(step)
        self.stats.drafted += len(step.draft_tokens)
        self.stats.accepted += step.num_accepted
        if step.draft_tokens:
            self.stats.accepted_per_step.append(step.num_accepted)
        if self.stop_reason is None and self.remaining <= 0:
            self.stop_reason = self.limit_reason
        if self.on_step is not None:
            self.on_step(step)
        return emitted

    def finish(self, wall_seconds: float) -> GenerationResult:
        self.stats.new_tokens = len(self.tokens)
        self.stats.wall_seconds = wall_seconds
        return GenerationResult(self.tokens, self.steps, self.stats, self.stop_reason or self.limit_reason)


def _validate(prompt_ids: Sequence[int], models: list[LanguageModel], max_new_tokens: int,
              eos_token_ids: Sequence[int] | None) -> tuple[list[int], int, str, set[int]]:
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() == 2 and prompt_ids.shape[0] == 1:
            prompt_ids = prompt_ids[0]
        if prompt_ids.dim() != 1:
            raise SpecdecError(f"prompt_ids must be one sequence [T], got shape {tuple(prompt_ids.shape)}")
        prompt_ids = prompt_ids.tolist()
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise SpecdecError("empty prompt: give at least one token")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise SpecdecError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    vocab = min(m.vocab_size for m in models)
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise SpecdecError(f"prompt holds token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    context = min(m.max_context for m in models)
    if len(prompt) >= context:
        raise SpecdecError(f"prompt of {len(prompt)} tokens leaves no room in the context of {context} tokens")
    limit = min(max_new_tokens, context - len(prompt))
    limit_reason = "max_new_tokens" if limit == max_new_tokens else "context"
    eos = set(models[0].eos_token_ids if eos_token_ids is None else (int(t) for t in eos_token_ids))
    return prompt, limit, limit_reason, eos


def _generator(seed: int | None, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(int(seed))
    return generator
