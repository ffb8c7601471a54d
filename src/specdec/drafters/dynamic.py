"""Tree drafters whose shape is decided per step (EAGLE-2) or by an acceptance model (Sequoia).

- `Eagle2Drafter`: EAGLE-2's dynamic trees (Li et al. 2024) with the small drafter model. The
  tree grows one depth per drafter pass: the top-K nodes of the newest depth by path value (the
  product of the drafter's calibrated q along the path) are fed together under tree attention,
  and each gets its top-K tokens as children; then the best nodes of everything drafted are kept
  (reranking), as many as pay for their verification width (`TreeCost`).
- `SequoiaDrafter`: Sequoia's static shapes (Chen et al. 2024). `sequoia_shape` is the tree that
  maximises the expected number of accepted tokens under the positional acceptance model
  (a rank-r child is the accepted one with probability acceptance[r], given its parent was),
  found by dynamic programming; its size is chosen for the measured pass costs and the
  per-rank acceptance is measured as the generation runs. The drafter model fills the shape
  in: a rank-r child is the r-th best token of the drafter's q at its parent.

Both trees are deterministic (top-k siblings: one-hot laws), so they are exact under any
sampler (verify.py), and `probs` is None. Both keep the drafter's KV cache in step with the
target's: the tree's internal nodes are fed after the context (`tree_start`), and `keep_path`
gathers the accepted path's entries into place (`ModelDrafter.keep_path`).
"""

from __future__ import annotations

import functools
import math
from typing import Generator, Sequence

import torch

from ..backends import Backend, Segment
from ..backends.cache import cache_length
from ..errors import SpecdecError
from ..samplers import Sampler
from ..schedules import TreeCost
from ..trees import Tree
from .base import Capabilities, drive
from .model import ModelDrafter
from .nodes import Node, to_tree

NOT_IN_TREE = -2  # `_fed` entry of a fed node that reranking left out of the tree (never on a path)


class _TreeModelDrafter(ModelDrafter):
    """What both drafters share: the policy, the fed-node bookkeeping, keep_path and timing."""

    capabilities = Capabilities(trees=True, batched_passes=True, model=True, catches_up=True)

    def __init__(self, model: Backend, policy: TreeCost | None, max_nodes: int):
        super().__init__(model)
        self.policy = policy or TreeCost(max_nodes=max_nodes)
        self._fed: list[int] = []  # tree node held at drafter cache position start + i (NOT_IN_TREE: none)
        self._drafted = False  # whether the last tree had any node
        self._parent: dict[int, Node] = {}  # id(node) -> its parent, for the tree being drafted
        self._root: Node | None = None
        self._start: int | None = None  # len(context) of the last proposed tree (None: answered)
        self._nodes: list[Node] = []  # the last tree's nodes, in its order
        self._parents: list[int] = []  # and their parents

    def start(self, prompt: Sequence[int]) -> None:
        super().start(prompt)
        self.policy.reset()
        self._fed, self._drafted, self._start = [], False, None

    def propose_tree(self, context: Sequence[int], max_depth: int, sampler: Sampler,
                     generator: torch.Generator) -> Tree:
        """Each subclass's `tree_proposal` (its drafter-model passes left to the caller, as
        `ModelDrafter.proposal`: the engine batches them across sequences), its passes made here."""
        return drive(self.tree_proposal(context, max_depth, sampler, generator), self.model.forward)

    def _feed_root(self, context: Sequence[int]) -> Generator[Segment, torch.Tensor, torch.Tensor]:
        """One plain pass (yielded) over what the drafter has not seen: its logits [V'] at the root."""
        self._catch_up(context)
        pending = self._inputs(context[cache_length(self.cache):])
        logits = (yield Segment(pending, self.cache, 1))[-1]
        self.passes += 1
        return logits

    def _feed_depth(self, nodes: list[Node], fed: list[Node], fed_parent: dict[int, int],
                    start: int) -> Generator[Segment, torch.Tensor, torch.Tensor]:
        """Feed `nodes` (one depth of the tree, children of fed nodes or of the root) in one pass
        (yielded) under tree attention; appends them to `fed`. Returns their logits [len(nodes), V']."""
        for node in nodes:
            fed_parent[id(node)] = len(fed)
            fed.append(node)
        region = [fed_parent[id(self._parent[id(node)])] for node in fed]
        logits = yield Segment(self._inputs([n.token for n in nodes]), self.cache, len(nodes), region, start)
        self.passes += 1
        return logits

    def _over(self, logits: torch.Tensor) -> torch.Tensor:
        """Drafter logits [..., V'] -> [..., V_target]: -inf (q = 0) on the target's ids the drafter
        lacks, and no id past the target's (head padding) is ever proposed."""
        logits = logits[..., :self.vocab_size]
        missing = (self.vocab_size or 0) - logits.shape[-1]
        return logits if missing <= 0 else torch.cat([logits, logits.new_full((*logits.shape[:-1], missing),
                                                                               float("-inf"))], -1)

    def _finish(self, root: Node, keep: set[int] | None, fed: list[Node], start: int) -> Tree:
        tree, order = to_tree(root, keep)
        index = {id(node): i for i, node in enumerate(order)}
        self._fed = [index.get(id(node), NOT_IN_TREE) for node in fed]
        self._drafted = bool(tree.tokens)
        self._root, self._nodes, self._start, self._parents = root, order, start, tree.parents
        return tree

    def _take_last_tree(self, start: int) -> bool:
        """Whether keep_path(start, ...) answers the last proposed tree and it had nodes. The loop
        skips propose_tree when no draft fits (its last step): the last tree is then not the step's."""
        current, self._start = self._start == start, None
        if not current:
            self._fed, self._drafted = [], False
        return self._drafted

    def keep_path(self, start: int, path: list[int]) -> None:
        drafted = self._take_last_tree(start)
        super().keep_path(start, path, self._fed)
        self._learn(drafted, path)

    def _learn(self, drafted: bool, path: list[int]) -> None:
        """Tell the policy what became of the last tree's nodes."""
        if drafted and self._nodes[0].q is not None:  # a tree of the drafter's q (not Sequoia's ranks)
            self.policy.record_tree([node.q for node in self._nodes], self._parents, path)

    def timing(self, draft_seconds: float, drafter_passes: int, verify_seconds: float, width: int,
               emitted: int) -> None:
        self.policy.timing(draft_seconds, drafter_passes, verify_seconds, width, emitted)


class Eagle2Drafter(_TreeModelDrafter):
    """EAGLE-2 dynamic draft trees (Li et al. 2024) with a small drafter model.

    Per step: a plain pass over what the drafter has not seen gives q at the root, whose top
    `width` tokens are the depth-1 nodes. Then, one drafter pass per depth: the `width` nodes of
    the newest depth with the highest path value (the product of q along the path) are fed
    together under tree attention, and each gets its top `width` tokens as children. Growth
    stops at `max_depth`, or when those `width` nodes together are worth less than a drafter
    pass (`policy.threshold`; their children's values sum to at most theirs). Reranking then
    keeps the nodes of highest value, while they pay for their verification width (value >=
    `policy.node_threshold`) and at most `policy.max_nodes`, the root's best child always (a
    step that drafts drafts something); a node's value never exceeds its parent's, so the kept
    set is closed under ancestors.

    Values are the drafter's q at temperature 1 under a greedy sampler, and the sampler's q
    (`sampler.probs`: temperature, top-k, top-p) otherwise: with deterministic siblings the
    chance that a node is accepted given its parent was is exactly the target's sampled p of
    its token, which the drafter's q under the same sampler estimates, mapped to the acceptance
    measured so far at that q (`TreeCost.acceptance`, for drafters whose q is not calibrated).
    Tokens with q = 0 are never drafted.
    """

    def __init__(self, model: Backend, width: int = 4, max_nodes: int = 64, policy: TreeCost | None = None):
        if not isinstance(width, int) or isinstance(width, bool) or width < 1:
            raise SpecdecError(f"EAGLE-2 tree width (top-k) must be an integer >= 1, got {width!r}")
        super().__init__(model, policy, max_nodes)
        self.width = width
        self.name = f"{model.name}+eagle2x{width}"

    def tree_proposal(self, context: Sequence[int], max_depth: int, sampler: Sampler,
                      generator: torch.Generator) -> Generator[Segment, torch.Tensor, Tree]:
        root = Node(-1, 1.0, "deterministic")
        self._parent = {}
        fed: list[Node] = []
        keep = None
        if max_depth >= 1 and self.policy.should_draft():
            drafted = yield from self._grow(root, context, max_depth, sampler, fed)
            keep = self._select(root, drafted)
        return self._finish(root, keep, fed, len(context))

    def _grow(self, root: Node, context: Sequence[int], max_depth: int, sampler: Sampler,
              fed: list[Node]) -> Generator[Segment, torch.Tensor, list[Node]]:
        """Draft the tree under `root`, feeding its expanded nodes (each pass yielded); returns every
        drafted node in the order drafted (depth by depth)."""
        start = len(context)
        newest = self._expand([root], (yield from self._feed_root(context)).unsqueeze(0), sampler)
        drafted = list(newest)
        fed_parent = {id(root): -1}
        for _ in range(1, max_depth):
            # stable: among equal values the earlier drafted (a better-ranked sibling) first
            frontier = sorted(newest, key=lambda n: -n.value)[:self.width]
            # a depth costs one drafter pass however many nodes it expands: it pays when they are
            # worth it together (for a chain, width 1, this is CostAware's rule)
            if not frontier or sum(n.value for n in frontier) < self.policy.threshold:
                break
            newest = self._expand(frontier, (yield from self._feed_depth(frontier, fed, fed_parent, start)), sampler)
            drafted += newest
        return drafted

    def _expand(self, parents: list[Node], logits: torch.Tensor, sampler: Sampler) -> list[Node]:
        """Each parent's top `width` tokens of q (from its logits row) as its children, best first."""
        children = []
        over = self._over(logits)
        q = over.float().softmax(-1) if sampler.is_greedy else sampler.probs(over)
        top = q.topk(min(self.width, q.shape[-1]), dim=-1)
        acceptance = self.policy.acceptance
        for parent, probs, tokens in zip(parents, top.values.tolist(), top.indices.tolist()):
            for prob, token in zip(probs, tokens):
                if prob <= 0:
                    break
                child = Node(int(token), parent.value * acceptance(prob), "deterministic", q=prob)
                parent.children.append(child)
                self._parent[id(child)] = parent
                children.append(child)
        return children

    def _select(self, root: Node, drafted: list[Node]) -> set[int]:
        """Reranking: the drafted nodes by falling value (ties: earlier drafted first, so an
        ancestor before its descendants) while they pay, each only after its parent."""
        keep: set[int] = set()
        threshold, limit = self.policy.node_threshold, self.policy.max_nodes
        for i, node in sorted(enumerate(drafted), key=lambda item: (-item[1].value, item[0])):
            if len(keep) >= limit or (node.value < threshold and keep):
                break
            parent = self._parent[id(node)]
            if parent is root or id(parent) in keep:
                keep.add(id(node))
        return keep


# ---------------------------------------------------------------------------------------------
# Sequoia

PRIOR_ACCEPTANCE = (0.6, 0.15, 0.07, 0.03, 0.02, 0.01, 0.01, 0.005)


def _check_acceptance(acceptance: Sequence[float]) -> list[float]:
    values = [float(a) for a in acceptance]
    if not values or any(not (0 <= a <= 1) for a in values):
        raise SpecdecError(f"per-rank acceptance must be a non-empty list of numbers in [0, 1], "
                           f"got {list(acceptance)!r}")
    return values


class _ShapeTables:
    """The dynamic programme behind `sequoia_shape`, for all sizes and depth limits at once.

    best[d][m]: the largest Σ_nodes Π_path acceptance[rank] of a forest of exactly m nodes hung
    from one parent, its children of ranks 0, 1, ..., k-1 (a rank-r child needs ranks < r
    beside it: ranks follow the drafter's order of tokens), every node at most d levels below
    the parent (-inf: no such forest). It comes from
        C[d][r][m] = max(C_stop(m), max_{s=1..m} acceptance[r]·F[d][s] + C[d][r+1][m-s]),
        F[d][s]    = 1 + C[d-1][0][s-1]   (a subtree of s nodes: its root, then its own forest),
    C_stop(0) = 0, C_stop(m > 0) = -inf (no child of rank >= r), C[0][.][m > 0] = -inf, and
    best[d] = C[d][0]. The rank-r child's subtree is worth acceptance[r] times its own value
    since every node of it lies below that child. O(D·R·N²) in tensor operations.
    """

    def __init__(self, acceptance: Sequence[float], max_nodes: int, max_depth: int):
        self.acceptance = _check_acceptance(acceptance)
        self.max_nodes = max_nodes
        self.max_depth = max(0, min(max_depth, max_nodes))
        n, ranks = max_nodes, len(self.acceptance)
        neg = float("-inf")
        stop = torch.full((n + 1,), neg, dtype=torch.float64)
        stop[0] = 0.0
        self.best = [stop]  # depth 0: only the empty forest
        self.picks: list[list[torch.Tensor]] = [[]]  # picks[d][r][m]: size of the rank-r subtree (0: stop)
        lead = torch.full((n,), neg, dtype=torch.float64)
        for _ in range(1, self.max_depth + 1):
            subtree = 1.0 + self.best[-1][:n]  # F[s] for s = 1..n (-inf: no such subtree)
            rows, picks = [stop] * (ranks + 1), [torch.zeros(n + 1, dtype=torch.long)] * (ranks + 1)
            for r in range(ranks - 1, -1, -1):
                a = self.acceptance[r]
                gain = a * subtree if a > 0 else torch.where(subtree > neg, 0.0, neg)  # (0 · -inf is NaN)
                # windows[m, j] = C[r+1][m - s] with s = n - j (-inf for s > m): a view, no copy
                windows = torch.cat([lead, rows[r + 1][:n]]).unfold(0, n, 1)  # [n+1, n]
                value, j = (windows + gain.flip(0)).max(-1)
                value[0], j[0] = 0.0, n  # m = 0: the empty forest (s = 0)
                rows[r], picks[r] = value, n - j
            self.best.append(rows[0])
            self.picks.append(picks)

    def expected(self, size: int, depth: int) -> float:
        """Σ_nodes Π_path acceptance of the best tree of exactly `size` nodes and depth <= `depth`
        (-inf where none exists)."""
        return float(self.best[min(depth, self.max_depth)][size])

    def shape(self, size: int, depth: int) -> list[tuple[int, int]]:
        """That tree: (parent index, child rank) per node, depth first, each node's rank-0 child first."""
        depth = min(depth, self.max_depth)
        if size and not math.isfinite(self.expected(size, depth)):
            raise SpecdecError(f"no tree of {size} nodes and depth <= {depth} with {len(self.acceptance)} ranks")
        nodes: list[tuple[int, int]] = []

        def build(parent: int, depth: int, rank: int, count: int) -> None:
            while count > 0:
                size = int(self.picks[depth][rank][count])
                if size <= 0:
                    return
                index = len(nodes)
                nodes.append((parent, rank))
                build(index, depth - 1, 0, size - 1)
                count -= size
                rank += 1

        build(-1, depth, 0, size)
        return nodes


@functools.lru_cache(maxsize=16)
def _shape_tables(acceptance: tuple[float, ...], max_nodes: int, max_depth: int) -> _ShapeTables:
    """Shared between drafters and generations (the prior's tables serve every first step)."""
    return _ShapeTables(acceptance, max_nodes, max_depth)


def sequoia_shape(acceptance: Sequence[float], max_nodes: int, max_depth: int) -> list[tuple[int, int]]:
    """The draft tree shape that maximises the expected number of accepted tokens,
    Σ_nodes Π_path acceptance[rank], under the positional acceptance model (Sequoia, Chen et al.
    2024): acceptance[r] is the chance that the rank-r child (the drafter's r-th best token) is
    the accepted one, given its parent was. At most `max_nodes` nodes, at most `max_depth`
    levels; a rank-r child needs its ranks < r siblings (any acceptance vector, also one that is
    not non-increasing in rank); ranks run below len(acceptance).

    Returns [(parent index, child rank)] per node (-1: the root), parents before children, depth
    first with each node's rank-0 child first (trees.py's layout: the main chain is 0..D-1).
    Among trees of equal value the smallest is returned (no node of value 0 is added).
    """
    if not isinstance(max_nodes, int) or max_nodes < 0 or not isinstance(max_depth, int) or max_depth < 0:
        raise SpecdecError(f"max_nodes and max_depth must be integers >= 0, got {max_nodes!r}, {max_depth!r}")
    tables = _ShapeTables(acceptance, max_nodes, max_depth)
    values = tables.best[tables.max_depth]
    top = float(values.max())
    size = int(torch.nonzero(values >= top - 1e-12 * max(1.0, top))[0])
    return tables.shape(size, tables.max_depth)


class SequoiaDrafter(_TreeModelDrafter):
    """Sequoia's static tree shapes (Chen et al. 2024), filled in by the drafter model.

    Each step takes the shape that maximises (1 + E[accepted](size, depth)) / (cost of the step)
    over sizes 1..`policy.max_nodes` and depths 1..max_depth: the expected tokens of the best
    tree of that size and depth limit (`_ShapeTables`) per second of `depth` drafter passes and
    a target pass over size + 1 tokens, t_draft·depth + t_1 + slope·size. The costs are the
    policy's measured ones (`TreeCost.measured`: drafter pass, slope, one-token pass) or, before
    they are measured (always when sampling under a seed), `prior_costs`; by default the ones the
    policy's own priors imply: a node pays when its value reaches node_threshold = slope/t_1 and
    a chain token when it reaches threshold = (t_draft + slope)/t_1.

    The per-rank acceptance is measured online: at every node the walk passed (the root and the
    accepted path) whose drafter q was computed, the rank of the token the target emitted next
    in that q is one observation (rank >= len(acceptance): none of the ranks). The emitted token
    is accepted at a rank-r child exactly when it is that child's token, and given the walk
    reached the node, it follows the target's (sampled) p: so the share of observations at rank
    r estimates acceptance[r] without bias, also for ranks the tree did not draft. The prior
    counts as `prior_weight` observations.

    The drafter fills the shape depth by depth: one plain pass gives q at the root, then one pass
    per depth feeds the shape's internal nodes of that depth under tree attention; a rank-r child
    is the r-th best token of the drafter's logits at its parent (a rank past the tokens the
    drafter can give is left out, with its subtree). Deterministic: exact under any sampler.
    Node values are the positional model's path products. The shape tables are redone when the
    measured acceptance moves by more than `tolerance` (in any rank) from the one they were made for.
    """

    def __init__(self, model: Backend, max_nodes: int = 64, acceptance: Sequence[float] = PRIOR_ACCEPTANCE,
                 prior_weight: float = 8.0, prior_costs: tuple[float, float, float] | None = None,
                 policy: TreeCost | None = None, tolerance: float = 0.01):
        super().__init__(model, policy, max_nodes)
        self.prior = _check_acceptance(acceptance)
        if not prior_weight > 0:
            raise SpecdecError(f"prior_weight must be > 0, got {prior_weight!r}")
        if prior_costs is not None and (len(prior_costs) != 3 or min(prior_costs) < 0 or prior_costs[2] <= 0):
            raise SpecdecError(f"prior_costs must be (drafter pass, slope, one-token pass) >= 0 with a positive "
                               f"one-token pass, got {prior_costs!r}")
        self.prior_weight, self.prior_costs, self.tolerance = float(prior_weight), prior_costs, float(tolerance)
        self.name = f"{model.name}+sequoia"
        self._tables: _ShapeTables | None = None
        self._reset_counts()

    def _reset_counts(self) -> None:
        self.rank_counts = [0] * len(self.prior)
        self.observations = 0
        self._walk: tuple[int, list[list[int] | None], list[int]] | None = None  # (start, rankings, path tokens)
        self._rankings: dict[int, list[int]] = {}

    def start(self, prompt: Sequence[int]) -> None:
        super().start(prompt)
        self._reset_counts()

    @property
    def acceptance(self) -> list[float]:
        """The per-rank acceptance measured so far, the prior counting as `prior_weight` observations."""
        w = self.prior_weight
        return [(hits + w * prior) / (self.observations + w) for hits, prior in zip(self.rank_counts, self.prior)]

    def costs(self) -> tuple[float, float, float]:
        """(drafter pass, slope per scored token, one-token target pass) in seconds, or in units of
        the one-token pass before they are measured."""
        if self.policy.measured is not None:
            _, per_pass, slope, one = self.policy.measured
            if one > 0:
                return per_pass, slope, one
        if self.prior_costs is not None:
            return tuple(self.prior_costs)
        node, chain = self.policy.node_prior, self.policy.prior
        return max(0.0, chain - node), node, 1.0

    def choose(self, max_depth: int) -> tuple[int, int]:
        """(size, depth limit) of this step's shape: the best expected tokens per second."""
        acceptance = self.acceptance
        limit = self.policy.max_nodes
        tables = self._tables
        # the tables (a few ms at depth 5, ~25 ms at depth 32 on a CPU) are redone only when the
        # measured acceptance has moved by more than `tolerance` since they were made
        if tables is None or tables.max_nodes != limit or tables.max_depth < min(max_depth, limit) or \
                max(abs(a - b) for a, b in zip(acceptance, tables.acceptance)) > self.tolerance:
            tables = self._tables = _shape_tables(tuple(acceptance), limit, max(max_depth, 1))
        t_draft, slope, one = self.costs()
        depths = min(max_depth, tables.max_depth)
        values = torch.stack(tables.best[1:depths + 1])[:, 1:]  # [depth, size]: sizes 1..limit
        cost = (t_draft * torch.arange(1, depths + 1, dtype=torch.float64)[:, None] + one +
                slope * torch.arange(1, limit + 1, dtype=torch.float64)[None, :])
        rates = torch.where(torch.isfinite(values), (1.0 + values) / cost, float("-inf"))
        best = int(rates.flatten().argmax())  # the first among equals: the shallowest, then the smallest
        return best % limit + 1, best // limit + 1

    def tree_proposal(self, context: Sequence[int], max_depth: int, sampler: Sampler,
                      generator: torch.Generator) -> Generator[Segment, torch.Tensor, Tree]:
        self._observe(context)
        root = Node(-1, 1.0, "deterministic")
        self._parent, self._rankings = {}, {}
        fed: list[Node] = []
        if max_depth >= 1 and self.policy.should_draft():
            size, depth = self.choose(max_depth)
            yield from self._fill(root, context, self._tables.shape(size, depth), fed)
        tree = self._finish(root, None, fed, len(context))
        self._walk = None
        return tree

    def _fill(self, root: Node, context: Sequence[int], shape: list[tuple[int, int]],
              fed: list[Node]) -> Generator[Segment, torch.Tensor, None]:
        """Build the shape's nodes under `root` with the drafter's ranked tokens, feeding the
        internal nodes one depth per pass (each yielded)."""
        acceptance = self.acceptance
        kids: dict[int, list[tuple[int, int]]] = {}  # shape index (-1: root) -> [(child index, rank)]
        for i, (parent, rank) in enumerate(shape):
            kids.setdefault(parent, []).append((i, rank))
        built: dict[int, Node] = {-1: root}
        start, fed_parent = len(context), {id(root): -1}
        level = [-1]  # shape indices of this depth's internal nodes (the root first)
        logits = (yield from self._feed_root(context)).unsqueeze(0)
        while level:
            following = []
            over = self._over(logits)
            ranking = over.topk(min(len(self.prior), over.shape[-1]), dim=-1)
            for index, values, indices in zip(level, ranking.values.tolist(), ranking.indices.tolist()):
                parent = built[index]
                tokens = [t for t, v in zip(indices, values) if v > -math.inf]
                self._rankings[id(parent)] = tokens
                for child, rank in sorted(kids.get(index, []), key=lambda c: c[1]):
                    if rank >= len(tokens):
                        break  # the drafter has no token of that rank: the child and its subtree go
                    node = Node(tokens[rank], parent.value * acceptance[rank], "deterministic")
                    parent.children.append(node)
                    self._parent[id(node)] = parent
                    built[child] = node
                    if child in kids:
                        following.append(child)
            level = following
            if level:
                logits = yield from self._feed_depth([built[i] for i in level], fed, fed_parent, start)

    def keep_path(self, start: int, path: list[int]) -> None:
        current = self._start == start and self._drafted
        super().keep_path(start, path)
        if not current:
            self._walk = None
            return
        walk = [self._root] + [self._nodes[i] for i in path]
        self._walk = (start, [self._rankings.get(id(node)) for node in walk], [n.token for n in walk[1:]])

    def _observe(self, context: Sequence[int]) -> None:
        """Count the ranks of the tokens emitted after the last step's walk (see the class docstring)."""
        if self._walk is None:
            return
        start, rankings, path_tokens = self._walk
        emitted = list(context[start:start + len(path_tokens) + 1])
        if emitted[:len(path_tokens)] != path_tokens:
            return  # not the continuation of the last step (another caller): nothing to learn
        for ranking, token in zip(rankings, emitted):
            if ranking is None:
                continue  # a leaf: the drafter's q there was never computed
            self.observations += 1
            if token in ranking:
                self.rank_counts[ranking.index(token)] += 1
