"""What the tree drafters that grow their tree with the drafter model (EAGLE-2, Sequoia) share.

Both keep the drafter's KV cache in step with the target's: the tree's internal nodes are fed
after the context (`tree_start`), and `keep_path` gathers the accepted path's entries into place
(`ModelDrafter.keep_path`).
"""

from __future__ import annotations

from typing import Generator, Sequence

import torch

from ..backends import Backend, Segment
from ..backends.cache import cache_length
from ..core.samplers import Sampler
from ..sizing.schedules import TreeCost
from ..core.trees import Tree
from .base import Capabilities, KeepGoing, drive
from .model import ModelDrafter
from .nodes import Node, to_tree


NOT_IN_TREE = -2  # `_fed` entry of a fed node that reranking left out of the tree (never on a path)


class TreeModelDrafter(ModelDrafter):
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

    def propose(self, context: Sequence[int], max_depth: int, sampler: Sampler,
                 generator: torch.Generator, keep_going: KeepGoing | None = None) -> Tree:
        """Each subclass's `proposal` (its drafter-model passes left to the caller, as
        `ModelDrafter.proposal`: the engine batches them across sequences), its passes made here."""
        return drive(self.proposal(context, max_depth, sampler, generator), self.model.forward)

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
        skips propose when no draft fits (its last step): the last tree is then not the step's."""
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
