"""EAGLE-2's dynamic trees (Li et al. 2024) with the small drafter model.

The tree grows one depth per drafter pass: the top-K nodes of the newest depth by path value (the
product of the drafter's calibrated q along the path) are fed together under tree attention,
and each gets its top-K tokens as children; then the best nodes of everything drafted are kept
(reranking), as many as pay for their verification width (`TreeCost`). Deterministic (top-k
siblings: one-hot laws), so exact under any sampler (core/verify.py).
"""

from __future__ import annotations

from typing import Generator, Sequence

import torch

from ..backends import Backend, Segment
from ..errors import SpecdecError
from ..core.samplers import Sampler
from ..sizing.schedules import TreeCost
from .base import KeepGoing, Proposal
from .nodes import Node
from .tree_model import TreeModelDrafter


class Eagle2Drafter(TreeModelDrafter):
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

    def proposal(self, context: Sequence[int], max_depth: int, sampler: Sampler,
                  generator: torch.Generator, keep_going: KeepGoing | None = None) -> Proposal:
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
