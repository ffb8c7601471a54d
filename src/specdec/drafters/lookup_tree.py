"""Prompt lookup as a tree: several earlier occurrences of the context's suffix merged into a trie.
"""

from __future__ import annotations

from typing import Sequence

from ..errors import SpecdecError
from ..sizing.schedules import TreeCost, tried_nodes
from ..core.trees import Tree
from .base import Capabilities
from .free_tree import ModelFreeTree
from .lookup import LookupDrafter, find_matches
from .nodes import Node, rank


class LookupTreeDrafter(ModelFreeTree, LookupDrafter):
    """Prompt lookup as a trie: the continuations of up to `branches` earlier occurrences of the
    current suffix (longest n-gram first, then shorter ones), merged where they agree.

    Deterministic (exact under any sampler). Children are ranked by how many continuations pass
    through them, then by recency. A node's value is the lookup acceptance measured in this
    generation for matches as long as its own (`acceptance(n)`: of the lookup nodes from n-token
    suffix matches that verification tried, the share it accepted) to the power of its depth,
    times its share of the continuations; nodes join while they pay for their verification
    width (`TreeCost`, drafting being free). By match length because that is what tells a copy
    from a coincidence: after a 3-token match in a summary the source text usually goes on, after
    a 1-token match it rarely does.
    """

    capabilities = Capabilities(trees=True)

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, branches: int = 4, max_nodes: int = 64,
                 policy: TreeCost | None = None):
        super().__init__(max_ngram, min_ngram)
        if not isinstance(branches, int) or branches < 1:
            raise SpecdecError(f"lookup trees need branches >= 1, got {branches!r}")
        self.branches = branches
        self.policy = policy or TreeCost(max_nodes=max_nodes)
        self.name = f"lookup-tree-{min_ngram}..{max_ngram}x{branches}"
        self.match_kinds = range(min_ngram, max_ngram + 1)  # what `grow` returns when it finds something
        self._drafted = False
        self.reset_counts()

    def reset_counts(self) -> None:
        self.tries = self.hits = 0  # lookup nodes verification tried, and those it accepted
        self.by_ngram: dict[int, list[int]] = {}  # the same by match length: n -> [tries, hits]
        self._parents: list[int] = []  # the last tree's parents
        self._proposed: dict[int, int] = {}  # and its nodes lookup proposed: index -> match length

    def start(self, prompt: Sequence[int]) -> None:
        self.policy.reset()
        self._drafted = False
        self.reset_counts()

    def acceptance(self, ngram: int | None = None) -> float:
        """The measured chance that verification accepts a lookup node it tries (its parent
        accepted): over all lookup nodes, a prior of 1/2 counting twice; for nodes from `ngram`-token
        matches, with that overall rate as the prior, counting twice."""
        overall = (self.hits + 1) / (self.tries + 2)
        if ngram is None:
            return overall
        tries, hits = self.by_ngram.get(ngram, (0, 0))
        return (hits + 2 * overall) / (tries + 2)

    def observe(self, context: Sequence[int]) -> None:
        """Nothing to index: lookup scans the context itself."""

    def remember(self, tree: Tree, proposed: dict[int, Node]) -> None:
        """The tree just proposed, and its nodes lookup proposed: index -> node (for `learn`)."""
        self._parents, self._proposed = tree.parents, {i: node.ngram for i, node in proposed.items()}

    def learn(self, path: list[int]) -> None:
        """Count the lookup nodes of the remembered tree that verification tried (`path`: accepted nodes)."""
        for i, accepted in tried_nodes(self._parents, path):
            if i in self._proposed:
                self.tries += 1
                self.hits += int(accepted)
                counts = self.by_ngram.setdefault(self._proposed[i], [0, 0])
                counts[0] += 1
                counts[1] += int(accepted)
        self._parents, self._proposed = [], {}

    def grow(self, root: Node, context: Sequence[int], max_depth: int, weight: float = 1.0) -> int:
        """Insert the continuations under `root` (children after any it already has), their values
        times `weight` (the chance the target reaches `root`); return the longest suffix match
        found (0: none)."""
        matches = find_matches(context, self.max_ngram, self.min_ngram, max_depth, self.branches)
        if not matches:
            return 0
        share = weight / len(matches)
        for ngram, continuation in matches:
            accept = self.acceptance(ngram)
            node, depth = root, 0
            for token in continuation:
                depth += 1
                child = node.child(token)
                if child is None:
                    child = Node(token, 0.0, "deterministic")
                    child.ngram = ngram  # the longest match reaches a node first
                    node.children.append(child)
                child.value += share * accept ** depth
                node = child
        rank(root)
        return matches[0][0]
