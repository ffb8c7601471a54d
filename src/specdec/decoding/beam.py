"""Beam search, and beam search made speculative without changing its output.

`BeamState` holds the search's decisions (transformers' rules), one step at a time from the
running beams' logits. `beam_search_generate` feeds it one pass per step. `speculative_beam_search`
drafts a token tree per running beam, scores every beam's tree in one batched pass, and replays
the search over the scored nodes while every surviving beam's last token was scored; at the first
step where a survivor falls off its tree, the survivors carry on from there (their caches keep the
accepted nodes). The logits the search sees are the same numbers either way, a tree's rows
being computed as 1-row passes compute them (row-exact passes), so the output is identical to
`beam_search_generate`'s on a row-exact model. Leviathan et al. left speculative beam search as
future work; the published variants (DSBD, Qin et al. 2025) match beam *sampling* in law, not
deterministic beam search.
"""

from __future__ import annotations

import copy
import time
from typing import Callable, Sequence

import torch

from ..backends import Backend, Segment, declares_features, features
from ..backends.cache import cache_length, compact_cache
from ..drafters.base import accept_draft, capabilities_of, is_factory
from ..errors import SpecdecError
from .results import GenerationResult, GenerationStats
from .sequence import _timed, _validate
from ..core.samplers import GREEDY
from ..core.trees import Tree, input_parents


class BeamState:
    """Beam search's bookkeeping, transformers' rules: each step takes the top K =
    max(2, 1 + #EOS)·num_beams continuations of the running beams' scores; one that ends in EOS
    (or reaches the limit) among the top `num_beams` becomes a finished hypothesis scored
    sum(log p) / length**length_penalty (length counts generated tokens); the best `num_beams`
    others run on. The search stops when no running beam can beat the worst of `num_beams`
    finished ones (early_stopping=False: judged at the current length; "never": at the longest
    length when length_penalty > 0; True: as soon as `num_beams` hypotheses are finished)."""

    def __init__(self, num_beams: int, limit: int, eos: set[int], length_penalty: float,
                 early_stopping: bool | str, device: torch.device):
        self.num_beams, self.limit, self.eos = num_beams, limit, eos
        self.length_penalty, self.early_stopping = length_penalty, early_stopping
        self.keep = max(2, 1 + len(eos)) * num_beams
        self.device = device
        self.running = torch.zeros(num_beams, 0, dtype=torch.long, device=device)
        self.running_scores = torch.full((num_beams,), -1e9, device=device)
        self.running_scores[0] = 0.0  # one real beam at first: the copies must not yield duplicate candidates
        self.finished: list[tuple[float, list[int]]] = []  # (score, tokens), best first
        self.improvable = True
        self.length = 0
        self.done = False

    def advance(self, logits: torch.Tensor) -> tuple[list[int], list[int]] | None:
        """One step from the running beams' next-token logits [num_beams, V] -> (parent beam,
        token) of each running beam after it, or None where the search has ended."""
        if torch.isnan(logits).any():
            raise SpecdecError("model produced NaN logits; the weights or the dtype are unusable here")
        self.length += 1
        length, num_beams, vocab = self.length, self.num_beams, logits.shape[-1]
        scores = (logits.float().log_softmax(-1) + self.running_scores[:, None]).view(-1)  # [B·V]
        top_scores, top_index = scores.topk(self.keep)
        beams, tokens = top_index // vocab, top_index % vocab
        hits = torch.tensor([int(t) in self.eos for t in tokens.tolist()], dtype=torch.bool, device=self.device)
        hits |= length == self.limit

        # finished hypotheses: only among the top num_beams, and only while improvement is possible
        full = len(self.finished) == num_beams and self.early_stopping is True
        if self.improvable and not full:
            for rank in range(num_beams):
                if hits[rank]:
                    seq = self.running[beams[rank]].tolist() + [int(tokens[rank])]
                    self.finished.append((float(top_scores[rank]) / length ** self.length_penalty, seq))
            self.finished = sorted(self.finished, key=lambda f: -f[0])[:num_beams]
        if bool(hits.all()) or (self.early_stopping is True and len(self.finished) == num_beams):
            self.done = True
            return None

        # the best non-finished continuations run on
        alive = top_scores.masked_fill(hits, -1e9).topk(num_beams).indices
        self.running = torch.cat([self.running[beams[alive]], tokens[alive, None]], dim=1)
        self.running_scores = top_scores[alive].masked_fill(hits[alive], -1e9)
        if len(self.finished) == num_beams:
            best_length = self.limit if self.early_stopping == "never" and self.length_penalty > 0 else length
            self.improvable = self.improvable and \
                float(self.running_scores[0]) / best_length ** self.length_penalty > self.finished[-1][0]
            if not self.improvable:
                self.done = True
                return None
        return beams[alive].tolist(), tokens[alive].tolist()

    def best(self) -> list[int]:
        """The best finished hypothesis (EOS included), or the best running beam."""
        return self.finished[0][1] if self.finished else self.running[0].tolist()


def _check_beams(num_beams) -> None:
    if isinstance(num_beams, bool) or not isinstance(num_beams, int) or num_beams < 1:
        raise SpecdecError(f"num_beams must be an integer >= 1, got {num_beams!r}")


def _row_exact(model) -> bool:
    can = features(model)
    return can.exact_rows and can.batched


def beam_search_generate(prompt_ids: Sequence[int], model: Backend, num_beams: int = 4,
                         length_penalty: float = 1.0, max_new_tokens: int = 128,
                         eos_token_ids: Sequence[int] | None = None, early_stopping: bool | str = False
                         ) -> GenerationResult:
    """Beam search (the deterministic baseline), following transformers' rules so the two agree
    (`BeamState`).

    On a row-exact model (`exact_rows`, the CPU default for bf16 targets) each beam keeps its own
    cache and every step scores the beams in one row-exact batched pass (`forward_batch`): each
    beam's logits are what a 1-row pass computes, whatever the other beams are, which is what
    `speculative_beam_search` reproduces. Otherwise the beams share one reordered KV cache and a
    batched pass (`forward_rows`), as transformers' `generate(num_beams=…)` does.
    Returns the best finished hypothesis (EOS included).
    """
    _check_beams(num_beams)
    prompt, limit, limit_reason, eos = _validate(prompt_ids, [model], max_new_tokens, eos_token_ids)
    stats = GenerationStats()
    start = time.perf_counter()
    cache, logits = _prompt_pass(model, prompt, num_beams, stats)
    state = BeamState(num_beams, limit, eos, length_penalty, early_stopping, logits.device)
    if _row_exact(model):
        caches = [cache] * num_beams
        while (step := state.advance(logits)) is not None:
            parents, tokens = step
            caches = _fork([caches[p] for p in parents])
            with _timed(stats, "target_seconds"):
                logits = torch.cat(model.forward_batch([Segment([t], c, 1) for t, c in zip(tokens, caches)]))
            stats.target_passes += 1
    else:
        cache.batch_repeat_interleave(num_beams)
        while (step := state.advance(logits)) is not None:
            parents, tokens = step
            cache.reorder_cache(torch.tensor(parents, device=model.device))
            with _timed(stats, "target_seconds"):
                logits = model.forward_rows(torch.tensor(tokens, device=logits.device)[:, None], cache)
            stats.target_passes += 1
    return _result(state, stats, start, limit_reason)


def _prompt_pass(model, prompt: list[int], num_beams: int, stats: GenerationStats) -> tuple[object, torch.Tensor]:
    """The prompt in a new cache -> (cache, the first token's logits [num_beams, V], one per beam)."""
    cache = model.new_cache()
    with _timed(stats, "target_seconds"):
        logits = model.forward(model.prefill(prompt, cache), cache, num_logits=1).expand(num_beams, -1)
    stats.target_passes += 1
    return cache, logits


def _result(state: BeamState, stats: GenerationStats, start: float, limit_reason: str) -> GenerationResult:
    best = state.best()
    stats.new_tokens, stats.wall_seconds = len(best), time.perf_counter() - start
    return GenerationResult(best, [], stats, "eos" if best and best[-1] in state.eos else limit_reason)


@torch.inference_mode()
def clone_cache(cache):
    """A copy of a transformers cache that grows apart from it (a beam forked from another)."""
    return copy.deepcopy(cache)


def _fork(parents: list, clone: Callable | None = None) -> list:
    """What each beam after a step holds (a cache, a drafter), given its parent's: a parent kept by
    several beams is copied (`clone`, default `clone_cache`) for all but the first, before any of
    them changes."""
    clone = clone or clone_cache
    seen: set[int] = set()
    out = []
    for item in parents:
        out.append(item if id(item) not in seen else clone(item))
        seen.add(id(item))
    return out


def _fork_drafter(drafter):
    """A tree drafter's copy for a forked beam: its own model cache (a drafter model's), the rest
    (counts, policy) shared."""
    twin = copy.copy(drafter)
    if capabilities_of(drafter).model and drafter.cache is not None:
        twin.cache = clone_cache(drafter.cache)
    return twin


def speculative_beam_search(prompt_ids: Sequence[int], target: Backend, drafter, num_beams: int = 4,
                            length_penalty: float = 1.0, max_new_tokens: int = 128,
                            eos_token_ids: Sequence[int] | None = None, early_stopping: bool | str = False,
                            max_depth: int = 8) -> GenerationResult:
    """Beam search with drafted token trees, its output identical to `beam_search_generate`'s.

    drafter: a zero-argument callable making a tree drafter (`make_tree_drafter`; one per beam,
        forked with the beam), or a drafter model (each beam then drafts with `SidesDrafter`: its
        chain and its next best token beside each chain token, where beam search's runners-up may lie).
    max_depth: the deepest a beam's tree goes.

    Each step drafts a tree after every running beam's last token and scores all trees in one
    row-exact batched pass. `BeamState` then advances over the scored rows: a beam whose new token
    is a child of its node in its tree has its next logits already; while every running beam
    has them the search goes on without another pass. The stats count target passes
    (`target_passes`) and drafted / accepted nodes (accepted: on the path of a beam after a step).
    """
    _check_beams(num_beams)
    if not _row_exact(target):
        raise SpecdecError("speculative beam search needs a row-exact target (exact_rows=True): its "
                           "replayed steps must see the numbers a 1-row pass computes")
    if declares_features(drafter):
        model = drafter
        from ..drafters import SidesDrafter
        from ..sizing.schedules import TreeCost

        # every step drafts (no step timings steer it here), at most 16 nodes a beam
        drafter = lambda: SidesDrafter(model, width=2, policy=TreeCost(max_nodes=16, warmup=10**9))  # noqa: E731
    elif not is_factory(drafter):
        raise SpecdecError(f"speculative beam search takes a drafter model or a factory of tree drafters "
                           f"(one per beam), not {type(drafter).__name__}")
    prompt, limit, limit_reason, eos = _validate(prompt_ids, [target], max_new_tokens, eos_token_ids)
    stats = GenerationStats()
    start = time.perf_counter()
    cache, logits = _prompt_pass(target, prompt, num_beams, stats)
    state = BeamState(num_beams, limit, eos, length_penalty, early_stopping, logits.device)
    first = drafter()
    first.check_target(target)
    first.start(prompt)
    step = state.advance(logits)
    if step is None:
        return _result(state, stats, start, limit_reason)
    parents, pending = step
    caches = _fork([cache] * num_beams)
    drafters = _fork([first] * num_beams, _fork_drafter)
    generator = torch.Generator(device=target.device)
    while True:
        # draft a tree after each running beam's last token, and score them all in one pass
        contexts = [prompt + state.running[b].tolist() for b in range(num_beams)]
        with _timed(stats, "drafter_seconds"):
            passes = sum(d.passes for d in drafters)
            depth = max(0, min(max_depth, limit - state.length - 1))
            trees = [d.propose(c, depth, GREEDY, generator) if depth else Tree([], [])
                     for d, c in zip(drafters, contexts)]
            stats.drafter_passes_per_step.append(sum(d.passes for d in drafters) - passes)
        lengths = [cache_length(c) for c in caches]
        segments = [Segment([token] + tree.tokens, c, 1 + len(tree), input_parents(1, tree.parents))
                    for token, tree, c in zip(pending, trees, caches)]
        with _timed(stats, "target_seconds"):
            scored = target.forward_batch(segments)
        stats.target_passes += 1
        stats.drafted += sum(len(t) for t in trees)
        stats.widths_per_step.append(sum(len(s.input_ids) for s in segments))
        # replay the search over the scored nodes: where[i] = (source beam, node; -1: its pending token)
        where = [(b, -1) for b in range(num_beams)]
        while True:
            step = state.advance(torch.stack([scored[b][1 + node] for b, node in where]))
            if step is None:
                return _result(state, stats, start, limit_reason)
            parents, tokens = step
            moved = [(where[p][0], _child(trees[where[p][0]], where[p][1], t)) for p, t in zip(parents, tokens)]
            if any(node is None for _, node in moved):
                break
            where = moved
        # the survivors carry on from their parents' nodes; their new tokens are pending
        sources = [where[p] for p in parents]
        caches = _fork([caches[b] for b, _ in sources])
        drafters = _fork([drafters[b] for b, _ in sources], _fork_drafter)
        for cache_i, drafter_i, (b, node) in zip(caches, drafters, sources):
            path = trees[b].path_to(node) if node >= 0 else []
            compact_cache(cache_i, lengths[b] + 1, path)
            if trees[b].tokens:
                accept_draft(drafter_i, len(contexts[b]), path)
            stats.accepted += len(path)
        pending = tokens


def _child(tree: Tree, node: int, token: int) -> int | None:
    """The child of `node` (-1: the root) carrying `token` in `tree`, or None."""
    return next((c for c in tree.children(node) if tree.tokens[c] == token), None)
