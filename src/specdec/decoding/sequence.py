"""One sequence's decoding, a step at a time (`Decoding`): schedule -> draft -> (one target pass) ->
verify -> roll back. `loop.run` makes the passes for one sequence; the engine (engine/) makes them
for many with one `forward_batch`. Both caches always hold every token of the sequence except those
not yet fed; after verification the rejected draft positions are cropped from both, so no accepted
token is ever recomputed.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Generator, Sequence

import torch

from ..backends import Backend, Segment, features
from ..backends.prompts import PREFILL_CHUNK
from ..backends.cache import cache_length, compact_cache, crop_cache, reserve_cache
from ..drafters import Draft, ModelDrafter
from ..drafters.base import Capabilities, capabilities_of, drive, is_drafter, one_hot, require_drafter_or_model
from ..drafters.retokenize import OtherTokenizerDrafter
from ..errors import SpecdecError
from ..core.logprobs import TokenLogprob, collect as collect_logprobs, emitted_rows
from ..core.penalties import LogitRules
from ..core.samplers import GREEDY, CoupledGenerator, Sampler, SeededNoise, greedy_tokens
from ..sizing.schedules import CostAware, Fixed
from ..backends.text import pair_mode
from ..core.trees import Tree, depths, input_parents
from ..core.verify import Typical


from .config import SEED_RULES
from .speculation import Speculation
from .results import GenerationResult, GenerationStats, Step, StepCallback
from .verifier import Verdict, check_rule, choose_verifier

DEFAULT_GAMMA = 5  # a chain's fixed draft length where neither gamma nor a schedule is given
DRAFT_STREAM = 0x5EED  # the drafter's random stream is seeded with seed + DRAFT_STREAM
DRAFT_ROOM = 64  # cache positions a step's draft may take beyond the output (the trees' default node cap)
RESERVE_MAX = 8192  # cache positions reserved at once at most; a longer sequence's slabs double as it grows


@dataclass(frozen=True)
class Limits:
    """When a sequence stops: after `max_new_tokens`, or at any id of `eos_token_ids` (None: the
    target's own end ids; [] none)."""

    max_new_tokens: int = 128
    eos_token_ids: Sequence[int] | None = None


def seed_pins_drafts(seed: int | None, sampler: Sampler, lenience: float = 1.0,
                     typical: Typical | None = None, seed_rule: str = "coupled") -> bool:
    """Whether a run's sampled output would hang on its drafts (their lengths, the drafter's exact
    logits), so that nothing measured may size them: a seed under the "stream" rule or a lossy one
    (lenience, typical acceptance). Greedy output is the target's argmax whatever was drafted,
    unseeded output keeps the target's law, and a seed under the "coupled" rule ties each token to
    noise of (seed, position) alone (`samplers.SeededNoise`): the seeded AR output, whatever was
    drafted."""
    if seed_rule not in SEED_RULES:
        raise SpecdecError(f"seed_rule must be one of {', '.join(SEED_RULES)}, got {seed_rule!r}")
    return seed is not None and not sampler.is_greedy and \
        (seed_rule == "stream" or lenience != 1 or typical is not None)


class Decoding:
    """One sequence's decoding, a step at a time: `draft` drafts and says what the target's next pass
    must score (a `Segment`), `apply` verifies what that pass returned, rolls the caches back and
    emits. `run` drives one with `forward`; the engine drives many, their passes batched. With no
    drafter it is autoregressive decoding (every pass scores the pending token alone).

    Options as `speculative_generate`'s. Everything random comes from this sequence's own two
    generators, in the same order whatever else shares its passes, so a seed pins its output.
    """

    def __init__(self, prompt_ids: Sequence[int], target: Backend, speculation: Speculation | None = None,
                 sampler: Sampler = GREEDY, limits: Limits | None = None, *, seed: int | None = None,
                 first_target: bool = True, on_step: StepCallback | None = None, debug: bool = False,
                 logprobs: int | None = None, cache_salt: str = "", rules: LogitRules | None = None,
                 grammar=None):
        checked = check_request(prompt_ids, target, speculation, sampler, limits, logprobs=logprobs, rules=rules,
                                grammar=grammar)
        speculation, drafter, self.can = checked.speculation, checked.drafter, checked.can
        self.speculation = speculation  # whole, as the request carried it
        lenience, typical, gamma = speculation.lenience, speculation.typical, speculation.gamma
        self.features = features(target)  # what the target's backend does beyond `Backend`
        self.trees = self.can.trees
        self.reads_hidden = self.can.reads_target_hidden  # self-drafting heads (Medusa, EAGLE)
        self.drafter_model = drafter.model if self.can.model else None
        self.target, self.drafter, self.sampler, self.seed = target, drafter, sampler, seed
        self.cache_salt = cache_salt  # prompt caches reuse only prompts kept under the same salt (a tenant's)
        self.lenience, self.typical, self.debug = lenience, typical, debug
        # the one draft-length policy the loop drives: a chain's schedule, a tree drafter's own TreeCost
        # (which also prices its nodes); `gamma`, where given, is then the tree's depth bound in place of its own
        if drafter is None:
            self.schedule = None
        elif self.trees:
            self.schedule = drafter.policy
        else:
            self.schedule = speculation.schedule() or Fixed(DEFAULT_GAMMA if gamma is None else gamma)
            if self.can.one_pass and isinstance(self.schedule, CostAware):
                self.schedule.one_pass = drafter.k  # a token inside a pass costs a row, not a drafter pass
        self._depth = gamma if self.trees else None
        prompt, limit, limit_reason, eos = checked.prompt, checked.limit, checked.limit_reason, checked.eos
        # Under a seed with an exact rule, every sampled token is a coupled draw from noise of
        # (seed, position) alone, shared by the drafter: the output is the seeded AR output.
        self.seed_rule = speculation.seed_rule
        pins = seed_pins_drafts(seed, sampler, lenience, typical, self.seed_rule)
        self.noise = SeededNoise(seed) if seed is not None and not sampler.is_greedy and not pins else None
        # Two random streams: what the drafter draws never shifts the verification's draws.
        self.generator = _generator(seed, target.device)
        if drafter is None:
            self.draft_generator = None
        elif self.noise is not None:
            self.draft_generator = CoupledGenerator(self.noise, seed + DRAFT_STREAM, target.device)
        else:
            self.draft_generator = _generator(None if seed is None else seed + DRAFT_STREAM, target.device)
        self.out = _Output(limit, limit_reason, eos, on_step)
        self.logprobs = logprobs  # None, or the top tokens each emitted token's log-probability comes with
        self.out.logprobs = None if logprobs is None else []
        self.stats = self.out.stats
        self.sequence = list(prompt)
        self.rules = checked.rules
        self._prompt_tokens = None if self.rules is None else \
            self.rules.prompt_tokens(prompt, target.vocab_size, target.device)
        self.constraint = checked.constraint  # the grammar's state (None: unconstrained)
        if self.can.grammar:  # it drafts under the same masks (None: none; a drafter object may be reused)
            drafter.constraint = self.constraint
        # cache positions the sequence can reach: its prompt, its output and the widest draft
        self.positions = len(prompt) + limit + (DRAFT_ROOM if drafter is not None else 0)
        self.cache = None
        self._target_only = first_target or drafter is None  # the next pass scores the pending tokens alone
        self._draft = None
        # a drafter model learning from its rejections between requests (lora.OnlineDistiller)
        self.online = features(self.drafter_model).online if isinstance(drafter, ModelDrafter) else None
        self.verifier = choose_verifier(self.sampler, self.noise, self.lenience, self.typical, self.trees, drafter is not None)

    @property
    def done(self) -> bool:
        return self.out.done

    def prefill(self) -> None:
        """Start: a cache for the target, the prompt fed (in the same chunks as every loop's), the drafter told."""
        self.begin()
        while not self.prefill_step():
            pass

    def begin(self) -> None:
        """A cache for the target, the drafter told of the prompt, the clock started; the prompt
        is then fed by `prefill_step`."""
        if self._chunked and self.features.prompt_cache:
            # starts with the kept entries of an earlier prompt's feeding calls that this one repeats
            self.cache = self.target.new_cache(prompt=self.sequence, chunk=PREFILL_CHUNK, salt=self.cache_salt)
            self.stats.cached_prompt_tokens = cache_length(self.cache)
        else:
            self.cache = self.target.new_cache()
        reserve = min(self.positions, RESERVE_MAX)  # a huge max_new_tokens must not claim its memory up front
        reserve_cache(self.cache, reserve)
        if self.drafter is not None:
            if isinstance(self.drafter, ModelDrafter):
                self.drafter.salt = self.cache_salt
            self.drafter.start(self.sequence)
            if self.pinned and self.can.pins:
                self.drafter.pin()  # drafts that hang on other generations would change a seeded output
            if self.can.model:
                reserve_cache(self.drafter.cache, reserve)  # a drafter model's
            self.schedule.reset()
        self.out.start_clock()
        self.prefilled = False

    def prefill_step(self) -> bool:
        """Feed the prompt's next chunk of PREFILL_CHUNK tokens (the engine feeds about a chunk's
        worth a step, so a long prompt does not stall the running sequences for its whole length)
        -> whether the prompt is in. Chunk bounds are fixed multiples of PREFILL_CHUNK, alone and in a batch,
        so the cache entries are the same calls' either way. A self-drafting drafter reads every
        prompt position's hidden state from one call: its prompt goes whole."""
        with _timed(self.stats, "target_seconds"):
            if self._chunked:
                chunk = self.prefill_chunk
                self.target.prefill(chunk, self.cache)
                self.prefilled = len(chunk) == len(self.sequence)
                if self.prefilled and self.features.keeps_prompts:
                    self.target.keep_prompt(self.cache)  # transformers' prompt cache copies it now
            else:
                self.target.prefill(self.sequence, self.cache)  # the same call as the AR baseline's
                self.prefilled = True
        if self.prefilled and self.reads_hidden:
            with _timed(self.stats, "drafter_seconds"):
                self.drafter.observe(self.target.pass_hidden)
        return self.prefilled

    @property
    def prefill_chunk(self) -> list[int]:
        """The prompt up to the end of its next chunk (`prefill_step` feeds it but its last id):
        PREFILL_CHUNK ids past what the cache holds, or the whole prompt."""
        end = min(len(self.sequence) - 1, cache_length(self.cache) + PREFILL_CHUNK)
        return self.sequence[:end + 1]

    @property
    def shares_prefill(self) -> bool:
        """Whether the prompt's next chunk may be fed in one pass with other sequences' chunks
        (`prefilled_together`): a short prompt on a target that shares prompt passes
        (`shared_prefill`), a longer one's chunk where it shares those too (`shared_chunks`), its
        cache then holding what this sequence's own `prefill_step` would give it."""
        can = self.features
        return self._chunked and not self.prefilled and can.shared_prefill > 0 and \
            (len(self.sequence) <= can.shared_prefill or can.shared_chunks)

    def prefilled_together(self, seconds: float) -> bool:
        """The prompt's next chunk (`prefill_chunk`) was fed by a pass shared with other sequences'
        (`Backend.prefill_batch`), at `seconds` of its time -> whether the prompt is in."""
        self.stats.add_seconds("target_seconds", seconds)
        self.prefilled = cache_length(self.cache) >= len(self.sequence) - 1
        if self.prefilled and self.features.keeps_prompts:
            self.target.keep_prompt(self.cache)
        return self.prefilled

    @property
    def _chunked(self) -> bool:
        """Whether the prompt is fed in chunks (`prefill_step`)."""
        return self.features.exact_rows and self.features.batched and not self.reads_hidden

    def draft(self) -> Segment:
        """Draft (a chain, or a token tree no deeper than the budget), leaving room for the target's
        own token, never past the output limit -> what the target's next pass scores: the tokens it
        has not seen and the whole draft (a tree under its tree attention mask)."""
        return drive(self.drafting(), self.drafter.model.forward if self.batches_drafts else None)

    @property
    def pinned(self) -> bool:
        """Whether a seed pins this sequence's sampled output to its drafts, so that any change in
        them (their lengths, or a drafter's logits rounded otherwise) would change it: only under
        `seed_rule="stream"` or a lossy rule (lenience, typical acceptance). A coupled seed ties every
        draw to noise of (seed, position) alone, so no draft changes the output."""
        return seed_pins_drafts(self.seed, self.sampler, self.lenience, self.typical, self.seed_rule)

    @property
    def steerable(self) -> CostAware | None:
        """The cost-aware policy sizing this sequence's drafts, where the engine may impose the
        batch's costs on it: only when draft lengths cannot change the output (greedy, or sampled
        without a seed; the rule that keeps timings out of seeded runs)."""
        if self.drafter is None or self.pinned:
            return None
        return self.schedule if isinstance(self.schedule, CostAware) else None

    @property
    def drafts_next(self) -> bool:
        """Whether the next step may draft (not the first token, scored from the prompt alone, nor
        plain decoding)."""
        return not self._target_only

    @property
    def batches_drafts(self) -> bool:
        """Whether this sequence's drafter passes can be left to the caller (`planning`): a drafter
        model's chains and trees, whose passes the engine batches with other sequences' on the same
        model."""
        return self.can.batched_passes

    def drafting(self) -> Generator[Segment, torch.Tensor, Segment]:
        """`draft`, with the drafter model's passes left to the caller: yields each drafter pass
        (a `Segment` on `drafter.model`), is sent its logits, returns the target's `Segment`."""
        pending = self.sequence[cache_length(self.cache):]
        if self._target_only:
            self._draft = None
            return Segment(pending, self.cache, 1)
        drafter, stats = self.drafter, self.stats
        budget = min(self.schedule.budget() if self._depth is None else self._depth, self.out.remaining - 1)
        self._step_start, self._passes = time.perf_counter(), drafter.passes
        keep_going = None if self.trees else self.schedule.keep_going  # a tree's policy sizes it whole
        if budget <= 0:
            draft = Tree([], []) if self.trees else Draft([])
        elif self.batches_drafts:
            draft = yield from drafter.proposal(self.sequence, budget, self.sampler, self.draft_generator, keep_going)
        else:
            draft = drafter.propose(self.sequence, budget, self.sampler, self.draft_generator, keep_going)
        if self.constraint is not None:
            draft = self._constrained(draft)
        self._drafted_at = time.perf_counter()
        stats.drafter_seconds += self._drafted_at - self._step_start
        stats.drafter_passes_per_step.append(drafter.passes - self._passes)
        stats.widths_per_step.append(len(pending) + len(draft.tokens))
        self._draft, self._budget, self._pending = draft, budget, len(pending)
        parents = None if draft.parents is None else input_parents(len(pending), draft.parents)
        return Segment(pending + draft.tokens, self.cache, len(draft.tokens) + 1, parents)

    def apply(self, logits: torch.Tensor, pass_seconds: float, decided: tuple[int, int] | None = None,
              timed: bool = True) -> list[int]:
        """Verify the planned draft against the pass's logits [γ+1, V] (the acceptance rule lives in
        core/verify.py alone, reached through this sequence's `verifier`), roll back what was
        rejected, emit -> the tokens emitted. decided: the draft's (num_accepted, next_token) where
        the caller verified it already, with other sequences' in one call (`verifies_by_tokens`,
        `verifier.decide_batch`: a batched step's). timed: whether the step's wall time is this
        sequence's step cost, for its schedule to learn from (not where other prompts' rows rode in
        the pass)."""
        stats, drafter, draft = self.stats, self.drafter, self._draft
        raw = logits  # the model's own: what logprobs report
        rows = 1 if draft is None else len(draft.tokens) + 1
        if self.rules is not None:
            logits = self.rules.apply(logits[-rows:], self._prompt_tokens, self.out.tokens,
                                      [] if draft is None else draft.tokens, self.out.eos)
        forced: tuple[int, ...] = ()  # draft positions where the grammar left one token: drafted for free
        if self.constraint is not None:
            logits = self.constraint.mask_logits(logits[-rows:], [] if draft is None else draft.tokens)
            forced = tuple(j for j in range(rows - 1) if self.constraint.single[j])
        stats.target_seconds += pass_seconds
        stats.target_passes += 1
        if self.noise is not None:
            self.noise.forget(len(self.sequence))
        if draft is None:  # the target's token alone (AR, or the first token from the prompt pass)
            token = decided[1] if decided is not None else \
                self.verifier.target_token(logits[-1], self.generator, len(self.sequence))
            emitted = self.out.add(Step([], 0, int(token), []))
            self._record_logprobs(raw, [len(raw) - 1], emitted)
            self.sequence += emitted
            if self.constraint is not None:
                self.constraint.commit(emitted)
            self._target_only = drafter is None
            if self.reads_hidden:
                with _timed(stats, "drafter_seconds"):
                    drafter.observe(self.target.pass_hidden)
            self._finish()
            return emitted
        details = {} if self.debug else None
        length = len(self.sequence)
        verdict = Verdict(*decided) if decided is not None else \
            self.verifier.verify(logits, draft, self.generator, length, details)
        num_accepted, next_token = verdict.num_accepted, verdict.next_token
        # α's β at the rows this pass judged (a chain's): a min and a sum, no pass of its own
        beta_sum, beta_positions = self.verifier.beta(logits, draft, verdict, forced)
        stats.beta_sum += beta_sum
        stats.beta_positions += beta_positions

        # Roll back: rejected positions leave both caches (a tree keeps its accepted path).
        if self.online is not None and verdict.rejected(draft):  # p where q failed
            self.online.record(id(self), length + num_accepted, raw[len(raw) - len(logits) + num_accepted])
        if verdict.path is None:
            crop_cache(self.cache, length + num_accepted)
        else:
            compact_cache(self.cache, length, verdict.path)
        accepted = verdict.accepted
        with _timed(stats, "drafter_seconds"):
            if self.can.reads_target_tokens and self._budget > 0:  # lookahead: the target's argmax at every node
                drafter.observe_targets(greedy_tokens(logits[-len(draft.tokens) - 1:]).tolist())
            if not self.trees or self._budget > 0:  # a tree drafter proposed no tree otherwise
                drafter.accept(length, accepted)
            if self.reads_hidden:  # the committed positions: the pending tokens, then the accepted drafts
                drafter.observe(self.target.pass_hidden[list(range(self._pending)) +
                                                        [self._pending + i for i in accepted]])
        # the drafter's own tokens (not those the grammar forced): what its schedule learns from
        self.schedule.update(len(draft.tokens) - len(forced), sum(j not in forced for j in range(num_accepted)))
        # greedy and coupled output are the same whatever the draft lengths, so timings may steer
        # them; under a lossy rule a seed pins the output, and draft lengths decide which draws are used
        if not self.pinned and timed:
            timings = (self._drafted_at - self._step_start, drafter.passes - self._passes,
                       time.perf_counter() - self._drafted_at, self._pending + len(draft.tokens), num_accepted + 1)
            (drafter if self.trees else self.schedule).timing(*timings)
        step = Step(draft.tokens, num_accepted, next_token, [], {**self.schedule.step_info(), **(details or {})},
                    forced=forced)
        if verdict.path is not None:
            step.tree_parents, step.path = draft.parents, verdict.path
        emitted = self.out.add(step)
        self._record_logprobs(raw, emitted_rows(num_accepted, verdict.path), emitted)
        self.sequence += emitted
        if self.constraint is not None:
            self.constraint.commit(emitted)
        self._finish()
        return emitted

    def _constrained(self, draft: Draft) -> Draft:
        """The chain `draft` under the grammar: cut before the first token it forbids where that
        changes nothing (the token would be rejected for certain, and the next one is then the
        target's own from that row: under greedy and seeded verification, and for a one-hot q),
        then the run of tokens the grammar forces after it appended, with q one-hot (p_g is 1
        there: accepted for certain), up to the output's and the draft room's limits."""
        tokens, probs = list(draft.tokens), draft.probs
        keep = self.constraint.valid(tokens)
        if keep < len(tokens):
            if not (self.sampler.is_greedy or probs is None or self.noise is not None):
                return draft  # a sampled q: its rejection's residual needs the forbidden token's q
            tokens, probs = tokens[:keep], None if probs is None else probs[:keep]
        room = min(self.out.remaining - 1, DRAFT_ROOM) - len(tokens)
        forced = self.constraint.forced(tokens, room)
        if forced:
            if probs is not None:
                probs = torch.cat([probs, one_hot(forced, probs.shape[-1], probs.device).to(probs.dtype)])
            tokens += forced
        return Draft(tokens, probs)

    @property
    def verifies_by_tokens(self) -> bool:
        """Whether the target's own token at each row of the next pass decides this sequence's
        step (a chain, or no draft, under a greedy sampler or a seed's coupled draws, no logit
        rules, no step details): a batched step then verifies it with the other such sequences
        in one call (`verifier.decide_batch`) and commits the decision."""
        return self.verifier.batchable and self.rules is None and self.constraint is None and not self.debug

    @property
    def draft_tokens(self) -> list[int]:
        """The planned draft's tokens (none for a step that scores the target's token alone)."""
        return [] if self._draft is None else self._draft.tokens

    def _finish(self) -> None:
        """A drafter that learns across generations (`SuffixDrafter.finish`, an online distiller)
        sees the finished sequence."""
        if self.done and self.can.finishes:
            self.drafter.finish(self.sequence)
        if self.done and self.online is not None:
            self.online.finish(id(self), self.sequence)

    def _record_logprobs(self, logits: torch.Tensor, rows: list[int], emitted: list[int]) -> None:
        if self.logprobs is not None:
            self.out.logprobs += collect_logprobs(logits, rows, emitted, self.logprobs)

    def result(self) -> GenerationResult:
        """The finished generation (its stats closed); the cache is let go."""
        self.cache = None
        self.stats.drafter_passes = self.drafter.passes if self.drafter is not None else 0
        if self.drafter is not None:
            self.stats.lenience = float(self.lenience)
            self.stats.typical = self.typical.describe() if self.typical is not None else None
        self.stats.greedy = self.sampler.is_greedy
        if self.drafter is not None and not self.trees and type(self.schedule) is Fixed:
            self.stats.fixed_gamma = self.schedule.gamma
        return self.out.finish()

    # ---- What the engine reads of a sequence (engine/scheduler.py, engine/runner.py), one hop
    # deep: the engine never reaches into a sequence's drafter, output or caches itself.

    @property
    def remaining(self) -> int:
        """Tokens this sequence may still emit."""
        return self.out.remaining

    @property
    def drafter_passes(self) -> int:
        """Drafter passes made since the start (0 without a drafter)."""
        return self.drafter.passes if self.drafter is not None else 0

    def lag(self) -> int | None:
        """Context tokens its drafter model has yet to feed (`ModelDrafter.lag`); None where its
        drafter keeps no model in step with the context."""
        return self.drafter.lag(self.sequence) if self.can.catches_up else None

    @property
    def caught_up(self) -> tuple[int, float] | None:
        """Tokens its drafter model has fed to catch up with the context, and the seconds that
        took, so far (`ModelDrafter.caught_up`); None as for `lag`."""
        return self.drafter.caught_up if self.can.catches_up else None

    def charged_positions(self) -> int:
        """The cache positions a KV budget charges this sequence (`positions`), once its widest
        draft (a tree's node cap, a chain's longest) is known to fit the DRAFT_ROOM they keep for
        it: a wider one would write past the charge, an unknown one cannot be charged (raised)."""
        from ..drafters.base import most_nodes

        if self.drafter is None:
            width = 0
        else:
            width = most_nodes(self.drafter) if self.trees else self.schedule.ceiling()
        if width is None:
            raise SpecdecError(f"the tree drafter {self.drafter.name} does not say how wide its trees grow "
                               "(subclass drafters.Drafter, whose most_nodes reads its policy), so a KV budget cannot "
                               "charge them; run without a budget")
        if width > DRAFT_ROOM:
            kind = "tree nodes" if self.trees else "draft tokens"
            raise SpecdecError(f"this request drafts up to {width} {kind} a step, more than the {DRAFT_ROOM} "
                               "positions a KV budget keeps for a draft; lower the tree's max_nodes (or gamma)")
        return self.positions

    def emitted_logprobs(self, count: int) -> list[TokenLogprob] | None:
        """The `TokenLogprob`s of the last `count` tokens emitted (None: not asked for)."""
        return None if self.logprobs is None else self.out.logprobs[len(self.out.logprobs) - count:]

    def free(self) -> None:
        """Let go of the sequence's caches (the target's and its drafter model's) at once."""
        self.cache = None
        if self.can.model:
            self.drafter.cache = None


def _constraint(grammar, target: Backend, ends: set[int]):
    """One sequence's grammar state (`grammar.Constraint`), or None without a grammar."""
    from ..core.grammar import Grammar

    grammar = Grammar.parse(grammar)
    if grammar is None:
        return None
    if not ends:
        raise SpecdecError("a grammar ends the output where it is complete, which needs an end token: "
                           "not with ignore_eos and no stop token ids")
    return grammar.constraint(target, sorted(ends))


@contextlib.contextmanager
def _timed(stats: GenerationStats, counter: str):
    """Add the block's wall-clock time to `stats.<counter>` (where a step's time goes)."""
    began = time.perf_counter()
    try:
        yield
    finally:
        stats.add_seconds(counter, time.perf_counter() - began)


class _Output:
    """Collects emitted tokens and stats; knows when to stop (limit or EOS)."""

    def __init__(self, limit: int, limit_reason: str, eos: set[int], on_step: StepCallback | None):
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] | None = None  # one per token where asked for (`Decoding`)
        self.steps: list[Step] = []
        self.stats = GenerationStats()
        self.limit, self.limit_reason, self.eos, self.on_step = limit, limit_reason, eos, on_step
        self.stop_reason: str | None = None
        self._start = time.perf_counter()
        self._callback_seconds = 0.0  # spent in on_step: rendering is not decoding, so the clock leaves it out

    def start_clock(self) -> None:
        self._start = time.perf_counter()
        self._callback_seconds = 0.0

    def _elapsed(self) -> float:
        """Seconds since start_clock, less the time spent in on_step."""
        return time.perf_counter() - self._start - self._callback_seconds

    @property
    def remaining(self) -> int:
        return self.limit - len(self.tokens)

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    def add(self, step: Step) -> list[int]:
        """Append a step's accepted drafts and next token, cut at the first EOS or the limit."""
        emitted = []
        for token in step.accepted_tokens + [step.next_token]:
            emitted.append(token)
            if token in self.eos:
                self.stop_reason = "eos"
                break
        emitted = emitted[:self.remaining]
        if emitted and not self.tokens:
            self.stats.first_token_seconds = self._elapsed()
        step.emitted = emitted
        self.tokens += emitted
        self.steps.append(step)
        # a grammar's forced tokens are counted apart, so that acceptance says what the drafter did
        drafted = len(step.draft_tokens) - len(step.forced)
        self.stats.drafted += drafted
        # accepted drafts after an EOS that ended the output were never emitted: they do not count
        kept = min(step.num_accepted, len(emitted))
        forced = sum(j in step.forced for j in range(kept))
        self.stats.forced += forced
        accepted = kept - forced
        self.stats.accepted += accepted
        if drafted:
            self.stats.accepted_per_step.append(accepted)
            self.stats.count_positions(max(depths(step.tree_parents)) if step.tree_parents is not None
                                       else drafted, accepted)
        if step.tree_parents is not None:
            self.stats.nodes_per_step.append(len(step.draft_tokens))
        if self.stop_reason is None and self.remaining <= 0:
            self.stop_reason = self.limit_reason
        if self.on_step is not None:
            began = time.perf_counter()
            self.on_step(step)
            self._callback_seconds += time.perf_counter() - began
        return emitted

    def finish(self) -> GenerationResult:
        """The result; then an on_step callback with a `flush()` method (StepPrinter) gets it
        called, outside the clock, to print what it held back."""
        self.stats.new_tokens = len(self.tokens)
        self.stats.wall_seconds = self._elapsed()
        flush = getattr(self.on_step, "flush", None)
        if callable(flush):
            flush()
        return GenerationResult(self.tokens, self.steps, self.stats, self.stop_reason or self.limit_reason,
                                self.logprobs)


@dataclass
class Checked:
    """What `check_request` found a request's options to make: the speculation, the drafter made for
    one sequence (a model wrapped as the sequence drafts with it; None: plain decoding) and its
    declared capabilities, the prompt and its limits, the active logit rules and the grammar's state."""

    speculation: Speculation
    drafter: object
    can: Capabilities
    prompt: list[int]
    limit: int
    limit_reason: str
    eos: set[int]
    rules: LogitRules | None
    constraint: object


def check_request(prompt_ids: Sequence[int], target: Backend, speculation: Speculation | None = None,
                  sampler: Sampler = GREEDY, limits: Limits | None = None, *, logprobs: int | None = None,
                  rules: LogitRules | None = None, grammar=None) -> Checked:
    """Every refusal a sequence of these options would make, checked once: by the engine's `add`
    before the request waits (a clear error at once, not on admission) and by `Decoding` itself,
    which takes what this makes. SpecdecError naming what is wrong."""
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
        raise SpecdecError(f"logprobs must be None or the number of top tokens to report (>= 0), got {logprobs!r}")
    speculation = Speculation.of() if speculation is None else speculation
    if not isinstance(speculation, Speculation):
        raise SpecdecError(f"a sequence takes a Speculation (`build(config, parts)`, `Speculation.of(drafter)`), "
                           f"got {type(speculation).__name__}")
    drafter = speculation.make_drafter() if speculation.make_drafter is not None else None
    if drafter is not None and not is_drafter(drafter):
        require_drafter_or_model(drafter)  # an object that is neither: a clear error, never a probe
        # a model: its ids as they are, or through text where its tokenizer is another
        drafter = ModelDrafter(drafter) if pair_mode(target, drafter) == "shared" else OtherTokenizerDrafter(drafter)
    can = capabilities_of(drafter) if drafter is not None else Capabilities()  # declared by its class
    if drafter is not None:
        speculation.check_drafter(drafter, target, can.trees)
        if can.trees and rules is not None and rules.active:
            raise SpecdecError("penalties, logit bias and min_tokens apply to chain drafts only (a tree's "
                               "positions have other pasts); use a chain method")
        if can.trees and grammar is not None:
            raise SpecdecError("a grammar constrains chain drafts only (a tree's nodes would each need a "
                               "matcher of their own); use a chain method")
        drafter.check_target(target)
    if drafter is not None:
        check_rule(speculation.lenience, speculation.typical, can.trees)
    prompt, limit, limit_reason, eos = check_limits(prompt_ids, target, limits or Limits(),
                                                    drafter.model if can.model else None)
    if rules is not None and not isinstance(rules, LogitRules):
        raise SpecdecError(f"rules must be a penalties.LogitRules, got {rules!r}")
    rules = rules if rules is not None and rules.active else None
    constraint = _constraint(grammar, target, eos)
    if constraint is not None and rules is not None and (rules.min_tokens or rules.allowed):
        # the grammar decides where the output ends and what may come: these could leave no token
        raise SpecdecError("min_tokens and allowed tokens do not combine with a grammar (which decides where "
                           "the output ends and which tokens may come)")
    return Checked(speculation, drafter, can, prompt, limit, limit_reason, eos, rules, constraint)


def check_limits(prompt_ids: Sequence[int], target: Backend, limits: Limits,
                 drafter_model: Backend | None = None) -> tuple[list[int], int, str, set[int]]:
    """A request's prompt and limits against its target (and drafter model), before its sequence
    exists -> (prompt, the most new tokens, why that many, the end ids); SpecdecError where bad."""
    models = [target] + ([drafter_model] if drafter_model is not None else [])
    return _validate(prompt_ids, models, limits.max_new_tokens, limits.eos_token_ids)


def _validate(prompt_ids: Sequence[int], models: list[Backend], max_new_tokens: int,
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
    vocab = models[0].vocab_size  # the target's: a drafter with a narrower head drafts around ids it lacks
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
