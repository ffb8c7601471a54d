"""EAGLE-2 and Sequoia tree drafters (drafters/eagle2.py, drafters/sequoia.py) and Sequoia's shape programme.

- Greedy speculative decoding with either drafter is token for token greedy autoregressive
  decoding on tiny random Llamas, and some accepted paths leave the main chain.
- Each drafter's tree equals a reference built from cache-free drafter passes (so the tree passes
  over its KV cache compute the right q), and follows its algorithm's rules.
- After keep_path the drafter's KV cache equals a fresh cache-free pass over the accepted context.
- Sampled decoding is lossless: the law of the first 3 emitted tokens against the target's
  enumerated law (chi-square, significance 1e-4; a correct loop fails by chance about once in
  10^4 runs; seeds are fixed, so runs are repeatable), on fast table models that take tree
  passes; a power check shows the test catches a tree verified with the wrong sibling law.
- sequoia_shape is optimal against brute force over every tree of up to 5 nodes, also for
  acceptance vectors that are not non-increasing in rank, where best-first selection fails.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from specdec import GREEDY, TransformersModel, Sampler, autoregressive_generate, speculative_generate
from specdec.drafters.eagle2 import Eagle2Drafter
from specdec.drafters.sequoia import SequoiaDrafter, _ShapeTables, sequoia_shape
from specdec.sizing.schedules import TreeCost
from specdec.sizing.theory import expected_tree_tokens
from specdec.core.trees import Tree

from conftest import TableModel, tiny_model
from test_sampling_exactness import chi_square_pvalue, exact_joint
from specdec.backends.cache import cache_length, crop_cache

ALPHA = 1e-4
POWER = 1e-6
VOCAB = 32


# --- tiny transformers -------------------------------------------------------------------------
# Every run is seeded: a seed keeps wall-clock timings away from the tree policy (decoding/loop.py), so
# the trees, and the counts the tests assert, are the same on every machine and every run.

@functools.lru_cache(maxsize=1)
def _pair() -> tuple[TransformersModel, TransformersModel]:
    """The target, and a drafter that is the target with a noisy output head: its top token is
    often the target's, its second or third often when the top one is not (off-chain paths)."""
    target = tiny_model(0, vocab=VOCAB, name="tiny-target")
    drafter = tiny_model(0, vocab=VOCAB, name="tiny-near-drafter", kernels="stock")
    with torch.no_grad():
        head = drafter.hf.lm_head.weight
        head.add_(0.6 * head.std() * torch.randn(head.shape, generator=torch.Generator().manual_seed(5)).to(head.device))
    return target, drafter


def _policy(max_nodes: int = 16) -> TreeCost:
    """Thresholds low enough for deep, wide trees, never replaced by measured ones (greedy runs are
    timed even under a seed, and the tests count what the trees did)."""
    return TreeCost(max_nodes=max_nodes, threshold=0.05, node_threshold=0.01, warmup=10**9)


def _drafter(kind: str, model: TransformersModel, max_nodes: int = 16):
    if kind == "eagle2":
        return Eagle2Drafter(model, width=3, policy=_policy(max_nodes))
    # cheap drafter passes and target width: Sequoia's sizing then picks deep, wide shapes
    return SequoiaDrafter(model, policy=_policy(max_nodes), prior_costs=(0.02, 0.01, 1.0))


KINDS = ["eagle2", "sequoia"]
PROMPTS = [[3, 7, 9], [5], [10, 11, 12, 13, 14, 15, 16, 17], [2, 30, 2, 30]]


def _off_chain(step) -> bool:
    return bool(step.path) and step.path != list(range(len(step.path)))


@functools.lru_cache(maxsize=None)
def _greedy_reference(prompt: tuple[int, ...]) -> list[int]:
    return autoregressive_generate(list(prompt), _pair()[0], max_new_tokens=24, eos_token_ids=[]).tokens


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_autoregressive_and_paths_leave_the_main_chain(kind):
    target, model = _pair()
    off_chain = deep = 0
    for prompt in PROMPTS:
        sd = speculative_generate(prompt, target, _drafter(kind, model), gamma=4, max_new_tokens=24,
                                  eos_token_ids=[], first_target=False, seed=0)
        assert sd.tokens == _greedy_reference(tuple(prompt))
        off_chain += sum(_off_chain(step) for step in sd.steps)
        deep += sum(len(step.path or ()) >= 2 for step in sd.steps)
        assert sd.stats.target_passes < 24  # the trees saved target passes
    assert off_chain >= 8, off_chain  # accepted paths that are not nodes 0..k-1 (16 and 23 today)
    assert deep >= 8, deep  # paths of 2 nodes or more (14 and 17 today)


# --- the trees themselves, against references built from cache-free drafter passes --------------

def _fresh_logits(model: TransformersModel, context: list[int]) -> torch.Tensor:
    return model.forward(context, None, num_logits=1)[-1]


def _paths(tree: Tree) -> dict[tuple[int, ...], float]:
    """{the tokens of the path to each node: its value}."""
    return {tuple(tree.tokens[i] for i in tree.path_to(n)): value for n, value in enumerate(tree.values)}


def _eagle2_reference(model, context, width, max_depth, threshold, node_threshold, max_nodes):
    """EAGLE-2 written out plainly: each expanded node's q from a cache-free pass over the context
    and its path. Returns {path tokens: value} of the kept nodes."""
    def children(path, value):
        q = _fresh_logits(model, context + list(path)).softmax(-1)
        top = q.topk(width)
        return [(path + (int(t),), value * float(p)) for p, t in zip(top.values, top.indices)]

    newest = children((), 1.0)
    drafted = list(newest)
    for _ in range(1, max_depth):
        frontier = sorted(newest, key=lambda item: -item[1])[:width]
        if sum(value for _, value in frontier) < threshold:
            break
        newest = [child for path, value in frontier for child in children(path, value)]
        drafted += newest
    ranked = sorted(drafted, key=lambda item: -item[1])
    kept = dict(ranked[:1] + [item for item in ranked[1:max_nodes] if item[1] >= node_threshold])
    return kept


@pytest.mark.parametrize("max_depth,threshold,node_threshold,max_nodes", [
    (4, 0.02, 0.01, 20),  # deep and wide
    (3, 0.3, 0.05, 6),  # max_nodes binds
    (5, 0.99, 0.5, 10),  # no expansion pays: one drafter pass, the root's best child at least
    (3, 0.6, 0.01, 20),  # no node of a frontier is worth a pass alone (best 0.44, 0.34), all of it is
])
def test_eagle2_tree_is_the_reference_tree(max_depth, threshold, node_threshold, max_nodes):
    _, model = _pair()
    prompt, width = [4, 8, 15, 16, 23], 3
    drafter = Eagle2Drafter(model, width=width, policy=TreeCost(max_nodes=max_nodes, threshold=threshold,
                                                                 node_threshold=node_threshold))
    drafter.check_target(model)
    drafter.start(prompt)
    tree = drafter.propose(prompt, max_depth, GREEDY, torch.Generator())
    got = _paths(tree)
    expected = _eagle2_reference(model, prompt, width, max_depth, threshold, node_threshold, max_nodes)
    assert set(got) == set(expected)
    assert all(abs(got[p] - expected[p]) < 1e-5 for p in got)
    # the layout: children by falling value, the main chain the best child at each level
    for node in [-1, *range(len(tree))]:
        values = [tree.values[c] for c in tree.children(node)]
        assert values == sorted(values, reverse=True)
    assert tree.scheme == "deterministic" and tree.probs is None and len(tree) <= max_nodes
    # one drafter pass per depth grown (the kept tree may be shallower than the grown one)
    assert drafter.passes >= max(tree.depths)
    if threshold == 0.99:
        assert drafter.passes == 1 and len(tree) >= 1
    if threshold == 0.6:
        assert drafter.passes == 3 and max(tree.depths) == 3


def test_sequoia_tree_is_its_shape_filled_with_the_drafters_ranks():
    _, model = _pair()
    prompt = [4, 8, 15, 16, 23]
    drafter = SequoiaDrafter(model, policy=_policy(12), prior_costs=(0.02, 0.01, 1.0))
    drafter.check_target(model)
    drafter.start(prompt)
    tree = drafter.propose(prompt, 4, GREEDY, torch.Generator())
    size, depth = drafter.choose(4)
    shape = drafter._tables.shape(size, depth)
    assert tree.parents == [parent for parent, _ in shape]
    assert max(tree.depths) >= 3 and len(tree.children(-1)) >= 2  # deep and wide
    for node, (parent, rank) in enumerate(shape):
        context = prompt + [tree.tokens[i] for i in tree.path_to(parent)]
        ranking = _fresh_logits(model, context).topk(rank + 1).indices.tolist()
        assert tree.tokens[node] == ranking[rank]
    assert drafter.passes == max(tree.depths)  # one pass per depth with internal nodes, the root's included


def test_sequoia_picks_the_shape_with_the_best_tokens_per_cost():
    """choose() against a plain search over every (size, depth) for the costs given."""
    _, model = _pair()
    for costs in [(0.02, 0.01, 1.0), (0.3, 0.2, 1.0), (0.1, 0.001, 1.0)]:
        drafter = SequoiaDrafter(model, policy=_policy(20), prior_costs=costs)
        size, depth = drafter.choose(6)
        tables = _ShapeTables(drafter.acceptance, 20, 6)

        def rate(s, d):
            return (1 + tables.expected(s, d)) / (costs[0] * d + costs[2] + costs[1] * s)

        best = max(rate(s, d) for s in range(1, 21) for d in range(1, 7))
        assert rate(size, depth) == pytest.approx(best, rel=1e-12)
    assert SequoiaDrafter(model, policy=_policy(20), prior_costs=(0.3, 0.2, 1.0)).choose(6)[0] < \
        SequoiaDrafter(model, policy=_policy(20), prior_costs=(0.02, 0.01, 1.0)).choose(6)[0]  # cheap width: wider


def test_sequoia_measures_the_rank_of_each_emitted_token():
    """The online per-rank counts equal the ranks recomputed from cache-free drafter passes at
    every node the walk passed whose q was computed (the root and internal path nodes), for every
    step followed by another proposal (the drafter learns the emitted tokens from the next
    context: not after the last tree, which the loop's final one-token step follows)."""
    target, model = _pair()
    drafter = _drafter("sequoia", model)
    prompt, steps = [9, 1, 4], []
    out = speculative_generate(prompt, target, drafter, gamma=4, max_new_tokens=30, eos_token_ids=[],
                               first_target=False, on_step=steps.append, seed=0)
    counts, observations, sequence = [0] * len(drafter.prior), 0, list(prompt)
    for step, following in zip(steps, steps[1:]):
        walk = [-1] + step.path if following.draft_tokens else []
        for i, node in enumerate(walk):
            if node == -1 and not step.draft_tokens or node >= 0 and node not in step.tree_parents:
                continue  # no tree, or a leaf: no q there
            context = sequence + step.emitted[:i]
            ranking = _fresh_logits(model, context).topk(len(counts)).indices.tolist()
            observations += 1
            if step.emitted[i] in ranking:
                counts[ranking.index(step.emitted[i])] += 1
        sequence += step.emitted
    assert out.tokens == sequence[len(prompt):] + steps[-1].emitted
    assert drafter.observations == observations and drafter.rank_counts == counts
    assert counts[0] > 0 and sum(counts[1:]) > 0 and observations > sum(counts[:3])  # every kind occurs


# --- the drafter's KV cache after keep_path ------------------------------------------------------

def _cache_check(kind: str, prompt: list[int]) -> tuple[float, int]:
    """Run a greedy generation; after every step compare the drafter's next pass over its cache
    with a cache-free pass over the whole context. Returns (largest logit difference, steps whose
    accepted path was gathered from off the main chain into the cache)."""
    target, model = _pair()
    drafter = _drafter(kind, model)
    sequence, worst, gathered = list(prompt), 0.0, 0

    def check(step):
        nonlocal worst, gathered
        sequence.extend(step.emitted)
        if step.path and _off_chain(step) and step.path[0] in drafter._fed:
            gathered += 1
        length = cache_length(drafter.cache)
        assert length <= len(sequence) - 1 or not step.draft_tokens
        cached = model.forward(sequence[length:], drafter.cache, num_logits=1)[-1]
        crop_cache(drafter.cache, length)
        worst = max(worst, float((cached - _fresh_logits(model, sequence)).abs().max()))

    speculative_generate(prompt, target, drafter, gamma=4, max_new_tokens=24, eos_token_ids=[], first_target=False,
                         on_step=check, seed=0)
    return worst, gathered


@pytest.mark.parametrize("kind", KINDS)
def test_drafter_cache_after_keep_path_equals_a_fresh_pass(kind):
    worst, gathered = _cache_check(kind, [3, 7, 9])
    assert gathered >= 2  # off-chain paths really were gathered into place
    assert worst < 1e-5  # float32 rounding of the two orders of summation (about 3e-6 here)


def test_the_cache_check_catches_a_keep_path_that_only_crops(monkeypatch):
    """Power check: keeping the first positions of the tree region instead of the accepted path's
    (a crop where a gather is needed) is detected."""
    import specdec.drafters.model as drafter_module

    right = drafter_module.compact_cache  # what ModelDrafter.keep_path rolls the drafter's cache back with

    def crop_only(cache, start, offsets):
        right(cache, start, list(range(len(offsets))))

    monkeypatch.setattr(drafter_module, "compact_cache", crop_only)
    worst, gathered = _cache_check("eagle2", [3, 7, 9])
    assert gathered >= 1 and worst > 1e-2


# --- sampled decoding is lossless ---------------------------------------------------------------
# Table models (conftest.TableModel: logits = table[previous token, token]) that also take tree
# passes, with a cache laid out like a KV cache (a layer whose keys hold each position's token and
# values the token it follows), so backends.cache.compact_cache gathers it: thousands of generations in
# seconds.

class _TokenLayer:
    is_initialized = True

    def __init__(self):
        self.keys = torch.zeros(1, 1, 0, 1, dtype=torch.long)
        self.values = torch.zeros(1, 1, 0, 1, dtype=torch.long)


class _TreeCache:
    is_croppable = True

    def __init__(self):
        self.layers = [_TokenLayer()]

    def get_seq_length(self) -> int:
        return self.layers[0].keys.shape[-2]

    def crop(self, n: int) -> None:
        assert n <= 0
        if n:
            layer = self.layers[0]
            layer.keys, layer.values = layer.keys[..., :n, :], layer.values[..., :n, :]


class TreeTableModel(TableModel):
    def new_cache(self):
        return _TreeCache()

    def forward(self, input_ids, cache=None, num_logits=1, parents=None, tree_start=None):
        cache = cache if cache is not None else _TreeCache()
        ids, layer = [int(t) for t in input_ids], cache.layers[0]
        tokens, cached, none = layer.keys.flatten().tolist(), cache.get_seq_length(), self.vocab_size
        if parents is None:
            previous = ([tokens[-1]] if tokens else [none]) + ids[:-1]
        else:
            start = cached if tree_start is None else tree_start
            assert start + len(parents) == cached + len(ids)
            region, before = tokens[start:] + ids, tokens[start - 1] if start else none
            previous = [region[p] if p >= 0 else before for p in parents[cached - start:]]
        layer.keys = torch.cat([layer.keys, torch.tensor(ids).view(1, 1, -1, 1)], -2)
        layer.values = torch.cat([layer.values, torch.tensor(previous).view(1, 1, -1, 1)], -2)
        return self.table[torch.tensor(previous[-num_logits:]), torch.tensor(ids[-num_logits:])]

    def prefill(self, prompt, cache):
        if len(prompt) > 1:
            self.forward(prompt[:-1], cache)
        return list(prompt)[-1:]


def _table_pair() -> tuple[TreeTableModel, TreeTableModel]:
    target = TreeTableModel(vocab=4, seed=0, sharpness=1.2)
    drafter = TreeTableModel(vocab=4, seed=1)
    drafter.table = target.table + 0.8 * torch.randn(target.table.shape, generator=torch.Generator().manual_seed(9))
    return target, drafter


class _MislabelledEagle2(Eagle2Drafter):
    """A plausible slip: EAGLE-2's nodes come from the drafter's q, so verify them with q as the
    law of siblings drawn without replacement. But top-k draws nothing: biased."""

    def _expand(self, parents, logits, sampler):
        children = super()._expand(parents, logits, sampler)
        for parent, row in zip(parents, sampler.probs(self._over(logits))):
            for child in parent.children:
                child.prob_row = row
        return children

    def proposal(self, *args):
        tree = yield from super().proposal(*args)
        if tree.tokens:
            tree.scheme = "without-replacement"
        return tree


SAMPLED = {"eagle2": (Sampler(1.0), lambda model: Eagle2Drafter(model, width=2, policy=_policy(8))),
           "sequoia": (Sampler(0.8, top_k=3), lambda model: SequoiaDrafter(model, policy=_policy(8),
                                                                           prior_costs=(0.02, 0.01, 1.0))),
           "mislabelled": (Sampler(1.0), lambda model: _MislabelledEagle2(model, width=2, policy=_policy(8)))}
PROMPT, LENGTH, RUNS = [2, 3], 3, 1_200


def _sampled(kind: str, runs: int = RUNS):
    sampler, make = SAMPLED[kind]
    target, model = _table_pair()
    joint = exact_joint(target, PROMPT, LENGTH, sampler)
    samples, off_chain, deep, none = [], 0, 0, 0
    for seed in range(runs):
        out = speculative_generate(PROMPT, target, make(model), gamma=4, sampler=sampler, max_new_tokens=LENGTH,
                                   seed=seed, seed_rule="stream", first_target=False, eos_token_ids=[])
        samples.append(tuple(out.tokens))
        for step in out.steps:
            off_chain += _off_chain(step)
            deep += len(step.path) >= 2
            none += bool(step.draft_tokens) and not step.path
    return chi_square_pvalue(samples, joint), off_chain, deep, none


@pytest.mark.parametrize("kind", ["eagle2", "sequoia"])
def test_sampled_generation_follows_the_target_law(kind):
    pvalue, off_chain, deep, none = _sampled(kind)
    # not vacuous: accepted paths off the main chain, depth-2 paths, and steps where every child
    # of the root was rejected all occur often
    assert off_chain >= 200 and deep >= 200 and none >= 100, (off_chain, deep, none)
    assert pvalue > ALPHA


def test_the_sampled_test_catches_a_tree_verified_with_the_wrong_law():
    pvalue, _, _, _ = _sampled("mislabelled", runs=400)
    assert pvalue < POWER


# --- sequoia_shape against brute force -----------------------------------------------------------

def _all_trees(ranks: int, max_nodes: int, max_depth: int) -> set[frozenset]:
    """Every tree of up to `max_nodes` nodes, as the set of each node's path of ranks; a rank-r
    child needs ranks < r beside it (new children take the next free rank)."""
    trees, layer = {frozenset()}, [frozenset()]
    for _ in range(max_nodes):
        grown = []
        for tree in layer:
            for parent in [(), *tree]:
                rank = sum(1 for node in tree if node[:-1] == parent)
                if len(parent) < max_depth and rank < ranks:
                    bigger = tree | {parent + (rank,)}
                    if bigger not in trees:
                        trees.add(bigger)
                        grown.append(bigger)
        layer = grown
    return trees


def _value(tree, acceptance) -> float:
    total = 0.0
    for path in tree:
        total += torch.tensor([acceptance[r] for r in path], dtype=torch.float64).prod().item()
    return total


def _best_first(acceptance, max_nodes, max_depth) -> float:
    """Best-first selection (optimal only for a non-increasing acceptance): each step adds the
    feasible node of highest value."""
    tree = set()
    while len(tree) < max_nodes:
        options = [parent + (sum(1 for n in tree if n[:-1] == parent),) for parent in [(), *tree]
                   if len(parent) < max_depth]
        options = [o for o in options if o[-1] < len(acceptance)]
        if not options:
            break
        tree.add(max(options, key=lambda o: _value([o], acceptance)))
    return _value(tree, acceptance)


ACCEPTANCES = [[0.6, 0.15, 0.07], [0.8, 0.1, 0.05], [0.3, 0.0, 0.9], [0.1, 0.9, 0.0], [0.2, 0.7, 0.5],
               [0.5, 0.5, 0.5], [0.0, 0.0, 0.0], [1.0, 0.3, 0.2]]


def test_sequoia_shape_is_optimal_against_brute_force():
    trees = {depth: _all_trees(3, 5, depth) for depth in range(1, 6)}
    for acceptance, depth, max_nodes in itertools.product(ACCEPTANCES, range(1, 6), range(0, 6)):
        shape = sequoia_shape(acceptance, max_nodes, depth)
        parents, ranks = [p for p, _ in shape], [r for _, r in shape]
        Tree([0] * len(shape), parents)  # parents before children
        assert len(shape) <= max_nodes and (not shape or max(Tree([0] * len(shape), parents).depths) <= depth)
        for node, (parent, rank) in enumerate(shape):  # ranks 0..k-1 under each parent, in order
            assert rank == sum(1 for p, _ in shape[:node] if p == parent)
        best = max(_value(t, acceptance) for t in trees[depth] if len(t) <= max_nodes)
        got = expected_tree_tokens(parents, ranks, acceptance) - 1
        assert got == pytest.approx(best, abs=1e-12), (acceptance, depth, max_nodes)
        # the smallest of the best trees: no node of value 0
        assert len(shape) == min(len(t) for t in trees[depth] if len(t) <= max_nodes and
                                 abs(_value(t, acceptance) - best) < 1e-12)
    # the layout of core/trees.py: the main chain (rank 0 at each level) is nodes 0..D-1
    shape = sequoia_shape([0.7, 0.2], 6, 4)
    chain = [i for i, (p, r) in enumerate(shape) if r == 0 and (p == i - 1)]
    assert chain[:2] == [0, 1] and Tree([0] * 6, [p for p, _ in shape]).main_chain_length >= 2


def test_best_first_is_not_optimal_for_a_non_monotone_acceptance():
    """Why the dynamic programme: with acceptance (0.3, 0, 0.9) the rank-2 child (0.9) needs a
    worthless rank-1 sibling first, which best-first never takes; the test above would catch it."""
    acceptance = [0.3, 0.0, 0.9]
    assert _best_first(acceptance, 3, 3) == pytest.approx(0.3 + 0.3 * 0.3 + 0.3 ** 3)
    shape = sequoia_shape(acceptance, 3, 3)
    assert shape == [(-1, 0), (-1, 1), (-1, 2)]
    assert expected_tree_tokens([-1, -1, -1], [0, 1, 2], acceptance) == pytest.approx(1 + 1.2)
    assert _best_first([0.6, 0.15, 0.07], 5, 5) == pytest.approx(
        expected_tree_tokens(*zip(*sequoia_shape([0.6, 0.15, 0.07], 5, 5)), [0.6, 0.15, 0.07]) - 1)
