"""A smaller language model as the drafter (Leviathan et al.; Chen et al.)."""

from __future__ import annotations

import time
from typing import Sequence

import torch

from ..backends import Backend, Segment, features
from ..backends.cache import cache_length, compact_cache, crop_cache
from ..backends.prompts import PREFILL_CHUNK
from ..core.samplers import Sampler, draw, greedy_tokens
from ..backends.text import check_pair
from .base import Capabilities, Draft, Drafter, KeepGoing, Proposal, drive


def stand_in_id(tokenizer) -> int:
    """An id to feed a drafter where it has no id of its own to feed: its unknown token, else its
    padding, else 0. It steers drafts only, never the output."""
    return next((i for i in (getattr(tokenizer, "unk_token_id", None), getattr(tokenizer, "pad_token_id", None))
                 if isinstance(i, int)), 0)


class ModelDrafter(Drafter):
    """Drafts with `model` autoregressively, keeping its own KV cache in step with the target's.

    The drafter may pad its output head to another width than the target's while sharing its
    tokenizer (Qwen2.5-7B has 152,064 rows, Qwen2.5-0.5B 151,936): its q is given over the
    target's ids, zero on ids the drafter lacks, and ids beyond the target's are never proposed.
    """

    capabilities = Capabilities(batched_passes=True, model=True, catches_up=True, grammar=True)

    def __init__(self, model: Backend):
        self.model = model
        self.name = model.name
        self.passes = 0
        self.cache = None
        self.caught_up = [0, 0.0]  # tokens fed to catch up with the context (prompt, plain steps), seconds
        self.salt = ""  # the tenant whose kept prompts its model's prompt cache may reuse (Decoding's cache_salt)
        self.constraint = None  # a grammar's state its drafts keep to (`Capabilities.grammar`), set by the loop
        self.vocab_size: int | None = None  # the target's, learned in check_target (None: the drafter's own)
        self._embedded = features(model).embedded
        self._stand_in = stand_in_id(model.tokenizer)

    def check_target(self, target: Backend) -> None:
        from ..adapters.lora import check_adapter_target

        check_pair(target, self.model)
        check_adapter_target(self.model, target)
        self.vocab_size = target.vocab_size

    def start(self, prompt: Sequence[int]) -> None:
        self.cache = self.model.new_cache()
        self.passes = 0

    def lag(self, context: Sequence[int]) -> int:
        """Tokens of `context` this drafter's cache lacks: what its next proposal feeds before it
        drafts (the prompt at first, then the tokens of steps that drafted nothing)."""
        return len(context) - (cache_length(self.cache) if self.cache is not None else 0)

    def propose(self, context: Sequence[int], max_tokens: int, sampler: Sampler, generator: torch.Generator,
                keep_going: KeepGoing) -> Draft:
        return drive(self.proposal(context, max_tokens, sampler, generator, keep_going), self.model.forward)

    def proposal(self, context: Sequence[int], max_tokens: int, sampler: Sampler, generator: torch.Generator,
                 keep_going: KeepGoing) -> Proposal:
        """`propose`, its passes left to the caller (`base.Proposal`): the engine batches them
        across sequences."""
        tokens: list[int] = []
        probs = []
        own = 0  # tokens the drafter chose (not forced by a grammar): what its schedule sizes
        self._catch_up(context)
        # what the drafter has not seen: the target's last token (and the last draft token when
        # the whole previous draft was accepted)
        pending = self._inputs(context[cache_length(self.cache):])
        while len(tokens) < max_tokens:
            forced = [] if self.constraint is None else self.constraint.forced(tokens, max_tokens - len(tokens))
            if forced:  # p_g is 1 there: no pass asks the drafter what the grammar leaves no choice in
                tokens += forced
                probs += [self._one_hot(token, sampler) for token in forced]
                pending = pending + self._inputs(forced)
                if forced[-1] in self.constraint.ends:
                    break  # the output ends there
                continue
            logits = (yield Segment(pending, self.cache, 1))[-1]
            self.passes += 1
            logits = logits[:self.vocab_size]  # ids past the target's (head padding) are never proposed
            if self.constraint is not None:  # q as the target's p is: masked by the grammar
                allowed = self.constraint.mask_after(tokens)[:len(logits)].to(logits.device)
                logits = logits.float().masked_fill(~allowed, float("-inf"))
            token, q = self._choose(logits, sampler, generator, len(context) + len(tokens))
            if q is not None:
                probs.append(q)
            tokens.append(token)
            own += 1
            pending = self._inputs([token])
            if self.constraint is not None and token in self.constraint.ends:
                break  # the output ends there: nothing after it is scored
            if not keep_going(own, logits):
                break
        return Draft(tokens, torch.stack(probs) if probs and not sampler.is_greedy else None)

    def _catch_up(self, context: Sequence[int]) -> None:
        """On a row-exact model, feed the prompt, or the tokens of steps that drafted nothing, as
        `prefill` feeds a prompt: in a plain pass (a row-exact one for a context short enough to
        share a pass, `shared_prefill`). Only when a draft is asked for (a sequence the engine
        never lets draft never pays it)."""
        can = features(self.model)
        if can.exact_rows and len(context) - cache_length(self.cache) > 2:
            began, behind = time.perf_counter(), self.lag(context)
            if cache_length(self.cache) == 0 and can.keeps_prompts and can.prompt_cache:
                self._feed_prompt(self._inputs(context))
            else:
                self.model.prefill(self._inputs(context), self.cache)
            self.caught_up = [self.caught_up[0] + behind, self.caught_up[1] + time.perf_counter() - began]

    def _feed_prompt(self, prompt: list[int]) -> None:
        """With the model's prompt cache: the kept entries this prompt can reuse, the rest fed in
        calls of PREFILL_CHUNK ids from its start, as a target's prompt is, then kept for later
        prompts (backends/prompts.py). The entries are those calls' bits either way."""
        fed = self.model.reuse_prompt(self.cache, prompt, PREFILL_CHUNK, self.salt)
        while fed < len(prompt) - 1:
            fed = min(fed + PREFILL_CHUNK, len(prompt) - 1)
            self.model.prefill(prompt[:fed + 1], self.cache)
        self.model.keep_prompt(self.cache)

    def rollback(self, length: int) -> None:
        crop_cache(self.cache, length)

    def keep_path(self, start: int, path: list[int], fed: list[int]) -> None:
        """After a tree step: the tree hung after `start` tokens, `fed[i]` is the tree node held at
        cache position start + i, and `path` the accepted nodes. Keeps the path's fed prefix in
        the cache (gathered into place); the rest of the path is fed by the next proposal."""
        offsets = []
        for node in path:
            if node not in fed:
                break
            offsets.append(fed.index(node))
        compact_cache(self.cache, start, offsets)

    def _one_hot(self, token: int, sampler: Sampler) -> torch.Tensor | None:
        """The q of a token the grammar forced: one-hot (None under greedy, as `_choose`'s)."""
        if sampler.is_greedy:
            return None
        q = torch.zeros(self.vocab_size or self.model.vocab_size, device=self.model.device)
        q[token] = 1.0
        return q

    def _choose(self, logits: torch.Tensor, sampler: Sampler, generator: torch.Generator,
                position: int) -> tuple[int, torch.Tensor | None]:
        """The draft token at output `position` from the drafter's logits [V_target'] -> (token,
        its q [V_target]; None under greedy, where the draft is deterministic)."""
        if sampler.is_greedy:
            return int(greedy_tokens(logits)), None
        q = sampler.probs(self._over_target_vocabulary(logits))
        return draw(q, generator, position), q

    def _over_target_vocabulary(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V_drafter'] -> [V_target]: -inf (q = 0) on the target's ids the drafter lacks."""
        missing = (self.vocab_size or 0) - logits.shape[-1]
        return logits if missing <= 0 else torch.cat([logits, logits.new_full((missing,), float("-inf"))])

    def _inputs(self, ids: Sequence[int]) -> list[int]:
        """Token ids the drafter can embed: an id past its embedding (one the target's padded head
        emitted) becomes its unknown token. This only steers the drafts, never the output."""
        if self._embedded is None:
            return list(ids)
        return [t if t < self._embedded else self._stand_in for t in ids]
