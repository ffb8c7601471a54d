"""Medusa drafting (Cai et al. 2024): a token tree from the target's own hidden state, no drafter model.

After each verification pass the loop hands the drafter the target's final hidden states at the
positions it committed (`observe`); at the last one, where its next token came from, the heads
(adapters/medusa_heads.py) give K distributions over tokens 2..K+1 ahead of that position. The tree is their
Cartesian product pruned by path value: best first, a node at depth d gets head d's top `width`
tokens as children, its value the product along the path of the heads' probabilities, each
mapped to the acceptance measured at that probability so far (`TreeCost.acceptance`: heads
trained on little text are not calibrated). Nodes join in falling value while they pay for their
verification width (`TreeCost`), which also decides whether to draft at all.

The tree is deterministic (no random draw of the drafter), so the one-hot verification law is
exact under every sampler (core/verify.py), and greedy output is token-identical to greedy AR.
"""

from __future__ import annotations

import heapq
from pathlib import Path
from typing import Sequence

import torch

from ..adapters.checkpoints import head_rows
from ..errors import SpecdecError
from ..adapters.medusa_heads import Heads, check_heads_target, load_heads
from ..core.samplers import Sampler
from ..sizing.schedules import TreeCost
from ..core.trees import Tree
from .base import Capabilities, Drafter, KeepGoing
from .nodes import Node, rank, to_tree


class MedusaDrafter(Drafter):
    """Drafts token trees with Medusa heads (a checkpoint folder or loaded `Heads`)."""

    capabilities = Capabilities(trees=True, reads_target_hidden=True)

    def __init__(self, heads: Heads | str | Path, width: int = 4, max_nodes: int = 64,
                 policy: TreeCost | None = None):
        if not isinstance(width, int) or width < 1:
            raise SpecdecError(f"Medusa tree width must be an integer >= 1, got {width!r}")
        self.heads = heads if isinstance(heads, Heads) else load_heads(heads)
        self.width = width
        self.policy = policy or TreeCost(max_nodes=max_nodes)
        self.name = f"medusa{self.heads.heads.num_heads}"
        self.passes = 0
        self._hidden: torch.Tensor | None = None
        self._weight: torch.Tensor | None = None  # [N, H] the target's head rows for the scored ids
        self._ids: torch.Tensor | None = None  # [N] the scored ids, on the target's device
        self._drafted = False
        self._q: list[float] = []  # the last tree's heads' probabilities per node
        self._parents: list[int] = []  # and its parents
        self._target = None

    def check_target(self, target) -> None:
        if self._target is target:  # checked and prepared for this target by an earlier generation
            return
        check_heads_target(self.heads, target)
        self._target = target
        ids = self.heads.vocab_ids.to(target.device)
        self._ids = ids
        self._weight = head_rows(target, ids).to(target.dtype)
        self._blocks = self.heads.heads_for(target.device, target.dtype)

    def start(self, prompt: Sequence[int]) -> None:
        self.passes = 0
        self._hidden = None
        self._drafted = False
        self.policy.reset()

    def observe(self, hidden: torch.Tensor) -> None:
        """hidden [n, H]: the target's final hidden states at the positions its last pass committed;
        the last one is where it chose its newest token, the one the heads draft from."""
        if len(hidden):
            self._hidden = hidden[-1]

    @torch.inference_mode()
    def head_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [H] -> [K, N] each head's probabilities over the scored ids."""
        inputs = self._blocks(hidden.to(self._weight.dtype))  # [K, H]
        return (inputs @ self._weight.T).float().softmax(-1)

    def propose(self, context: Sequence[int], max_depth: int, sampler: Sampler,
                 generator: torch.Generator, keep_going: KeepGoing | None = None) -> Tree:
        root = Node(-1, 1.0, "deterministic")
        self._drafted = False
        if self._hidden is None or max_depth < 1 or not self.policy.should_draft():
            return Tree([], [])
        probs = self.head_probs(self._hidden)
        self.passes += 1
        depth_limit = min(max_depth, probs.shape[0])
        top = probs[:depth_limit].topk(min(self.width, probs.shape[1]), dim=-1)
        values, tokens = top.values.tolist(), self._ids[top.indices].tolist()  # [D][width]
        threshold, budget = self.policy.node_threshold, self.policy.max_nodes
        acceptance = self.policy.acceptance
        # best first over the Cartesian product: a child's value never exceeds its parent's, so
        # every popped node's parent is already in the tree
        frontier = [(-acceptance(v), r, 0, root, t, v) for r, (t, v) in enumerate(zip(tokens[0], values[0]))]
        heapq.heapify(frontier)
        count, order = 0, len(frontier)
        while frontier and count < budget:
            value, _, depth, parent, token, q = heapq.heappop(frontier)
            value = -value
            if value < threshold:
                break
            node = Node(token, value, "deterministic", q=q)
            parent.children.append(node)
            count += 1
            if depth + 1 < depth_limit:
                for t, v in zip(tokens[depth + 1], values[depth + 1]):
                    order += 1
                    heapq.heappush(frontier, (-(value * acceptance(v)), order, depth + 1, node, t, v))
        rank(root)
        tree, nodes = to_tree(root)
        self._drafted = bool(tree.tokens)
        self._q, self._parents = [n.q for n in nodes], tree.parents
        return tree

    def keep_path(self, start: int, path: list[int]) -> None:
        if self._drafted:
            self.policy.record_tree(self._q, self._parents, path)

    def timing(self, draft_seconds: float, drafter_passes: int, verify_seconds: float, width: int,
               emitted: int) -> None:
        self.policy.timing(draft_seconds, drafter_passes, verify_seconds, width, emitted)
