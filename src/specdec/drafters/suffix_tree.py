"""Suffix drafting's tree mode (SuffixDecoding), no drafter model.
"""

from __future__ import annotations

from typing import Sequence

from ..sizing.schedules import TreeCost, tried_nodes
from ..core.trees import Tree
from .base import Capabilities
from .free_tree import ModelFreeTree
from .nodes import Node, rank
from .suffix import LENGTH_BINS, SuffixCache, SuffixDrafter, best_tree, length_bin


class SuffixTreeDrafter(ModelFreeTree, SuffixDrafter):
    """Suffix drafting's tree mode (SuffixDecoding): from the earlier occurrences of the context's
    suffix (in this request's text, earlier outputs, a datastore: `SuffixDrafter`'s indexes),
    a tree of what followed them, grown best first by the product of count ratios (`best_tree`);
    the best-scoring tree over match lengths and indexes is proposed.

    Deterministic (one-hot at every node), so exact under any sampler. A node's value is its
    parent's times its calibrated chance (`SuffixDrafter.chance`: its count ratio, scaled by what
    verification accepted of the nodes tried after matches of that length in this generation);
    nodes join while they pay for their verification width (`TreeCost`, drafting being free).
    `MixedDrafter(model, lookup=SuffixTreeDrafter())` hangs these trees beside the model's chain.
    """

    capabilities = Capabilities(trees=True, pins=True, finishes=True)

    def __init__(self, cache: SuffixCache | None = None, depth: int = 24, min_prob: float = 0.1,
                 factor: float = 1.0, min_match: int = 1, datastore=None, max_nodes: int = 64,
                 policy: TreeCost | None = None):
        self.policy = policy or TreeCost(max_nodes=max_nodes)
        super().__init__(cache, depth, min_prob, factor, min_match, datastore)
        self.name += "-tree"
        self.match_kinds = range(1, len(LENGTH_BINS) + 1)  # what `grow` returns: a match length's bin, from 1
        self._drafted = False
        self._parents: list[int] = []
        self._proposed: dict[int, Node] = {}

    def start(self, prompt: Sequence[int]) -> None:
        super().start(prompt)
        self.policy.reset()
        self.reset_counts()

    def reset_counts(self) -> None:
        for calibration in self.calibration:
            calibration.reset()
        self._drafted, self._parents, self._proposed = False, [], {}

    def grow(self, root: Node, context: Sequence[int], max_depth: int, weight: float = 1.0) -> int:
        """Hang the best suffix tree under `root` (which has no children yet), its values times
        `weight` (the chance the target reaches `root`) -> the bin of its match length, from 1
        (0: no suffix of the context occurred before). Indexes nothing: `observe` does."""
        best, best_score = None, 0.0
        for index in self.indexes():
            found = index.occurrences(context)
            for length in sorted({matched for _, matched in found if matched >= self.min_match}, reverse=True):
                cap = min(self.policy.max_nodes, max(1, int(self.factor * length)))
                nodes = best_tree(index.tokens, [q for q, matched in found if matched >= length], cap, max_depth,
                                  self.min_prob)
                score = sum(product for *_, product in nodes)
                if score > best_score:
                    best, best_score = (nodes, length), score
        if best is None:
            return 0
        nodes, length = best
        made: list[Node] = []
        for parent, token, ratio, _ in nodes:
            above = root if parent < 0 else made[parent]
            node = Node(token, (weight if parent < 0 else above.value) * self.chance(ratio, length), "deterministic")
            node.ngram, node.ratio = length, ratio
            above.children.append(node)
            made.append(node)
        rank(root)
        return length_bin(length) + 1


    def remember(self, tree: Tree, proposed: dict[int, Node]) -> None:
        """The tree just proposed, and its nodes suffix drafting proposed: index -> node (for `learn`)."""
        self._parents, self._proposed = tree.parents, proposed

    def learn(self, path: list[int]) -> None:
        """Count the remembered tree's suffix nodes that verification tried, by match length and ratio."""
        for i, accepted in tried_nodes(self._parents, path):
            node = self._proposed.get(i)
            if node is not None and node.ratio is not None:
                self.calibration[length_bin(node.ngram)].record(node.ratio, accepted)
        self._parents, self._proposed = [], {}
