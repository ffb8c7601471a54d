"""What the model-free trees (prompt lookup's, suffix drafting's) share: nodes kept by value while
they pay for their width, the accepted path counted, the step's timings for their cost policy.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..core.samplers import Sampler
from ..sizing.schedules import TreeCost
from ..core.trees import Tree
from .base import KeepGoing
from .nodes import Node, to_tree


class ModelFreeTree:
    """What the model-free trees share: nodes kept by value while they pay for their width, the
    accepted path counted (their `learn`), the step's timings for their cost policy."""

    policy: TreeCost

    def propose(self, context: Sequence[int], max_depth: int, sampler: Sampler,
                 generator: torch.Generator, keep_going: KeepGoing | None = None) -> Tree:
        """The tree its `grow` hangs after the context, cut to what pays (`select`)."""
        self.observe(context)
        root = Node(-1, 1.0, "deterministic")
        if max_depth >= 1 and self.policy.should_draft():
            self.grow(root, context, max_depth)
        tree, order = to_tree(root, self.select(root))
        self._drafted = bool(tree.tokens)
        self.remember(tree, dict(enumerate(order)))
        return tree

    def select(self, root: Node, budget: int | None = None) -> set[int]:
        """Nodes by falling value while they pay, at most `budget` (default: the policy's max_nodes);
        a node's value never exceeds its parent's, so the set is closed."""
        candidates, stack = [], [root]
        while stack:
            node = stack.pop()
            for child in node.children:
                candidates.append(child)
                stack.append(child)
        keep, threshold = set(), self.policy.node_threshold
        budget = self.policy.max_nodes if budget is None else budget
        for child in sorted(candidates, key=lambda c: -c.value):
            if len(keep) >= budget or child.value < threshold:
                break
            keep.add(id(child))
        return keep

    def keep_path(self, start: int, path: list[int]) -> None:
        self.learn(path)  # each tree's own: what of its last tree verification tried and accepted

    def timing(self, draft_seconds: float, drafter_passes: int, verify_seconds: float, width: int,
               emitted: int) -> None:
        self.policy.timing(draft_seconds, drafter_passes, verify_seconds, width, emitted)
