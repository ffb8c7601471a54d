"""Sequoia's static tree shapes (Chen et al. 2024), filled in by the drafter model.

`sequoia_shape` is the tree that maximises the expected number of accepted tokens under the
positional acceptance model (a rank-r child is the accepted one with probability acceptance[r],
given its parent was), found by dynamic programming; its size is chosen for the measured pass
costs and the per-rank acceptance is measured as the generation runs. The drafter model fills
the shape in: a rank-r child is the r-th best token of the drafter's q at its parent.
Deterministic (top-k siblings), so exact under any sampler (core/verify.py).
"""

from __future__ import annotations

import functools
import math
from typing import Generator, Sequence

import torch

from ..backends import Backend, Segment
from ..errors import SpecdecError
from ..core.samplers import Sampler
from ..sizing.schedules import TreeCost
from .base import KeepGoing, Proposal
from .nodes import Node, rank, subtree
from .tree_model import TreeModelDrafter


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
    first with each node's rank-0 child first (core/trees.py's layout: the main chain is 0..D-1).
    Among trees of equal value the smallest is returned (no node of value 0 is added).
    """
    if not isinstance(max_nodes, int) or max_nodes < 0 or not isinstance(max_depth, int) or max_depth < 0:
        raise SpecdecError(f"max_nodes and max_depth must be integers >= 0, got {max_nodes!r}, {max_depth!r}")
    tables = _ShapeTables(acceptance, max_nodes, max_depth)
    values = tables.best[tables.max_depth]
    top = float(values.max())
    size = int(torch.nonzero(values >= top - 1e-12 * max(1.0, top))[0])
    return tables.shape(size, tables.max_depth)


class SequoiaDrafter(TreeModelDrafter):
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

    def proposal(self, context: Sequence[int], max_depth: int, sampler: Sampler,
                  generator: torch.Generator, keep_going: KeepGoing | None = None) -> Proposal:
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
