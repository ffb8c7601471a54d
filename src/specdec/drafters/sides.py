"""The sides tree: the drafter model's chain plus, at each chain position, the drafter's next best
tokens as leaves, at no extra drafter pass.

A tree drafter's `propose(context, max_depth, sampler, generator) -> Tree` (or its
`proposal`, which leaves the drafter model's passes to the caller), `keep_path(start, path)`
(what of its last tree was accepted) and `timing(...)` (the step's measured costs, for its
`TreeCost` policy). `drafters.make_tree_drafter` builds one by name.
"""

from __future__ import annotations

from typing import Generator, Sequence

import torch

from ..backends import Backend, Segment
from ..backends.cache import cache_length
from ..errors import SpecdecError
from ..core.samplers import CoupledGenerator, Sampler, draw, greedy_tokens
from ..sizing.schedules import TreeCost
from ..core.trees import SCHEMES, Tree
from .base import Capabilities, KeepGoing, Proposal, drive
from .model import ModelDrafter
from .nodes import Node, closed, prune, to_tree


class SidesDrafter(ModelDrafter):
    """The model drafter's chain, with the drafter's next best tokens at each position as leaves.

    The chain grows while its path value pays for a drafter pass and a wider target pass; then
    the best `width - 1` alternatives at each chain position join in falling path value while
    they pay for their verification width (`TreeCost`). A path value is the product, along the
    path, of each token's acceptance as measured so far in this generation at the drafter's q of
    it (`TreeCost.acceptance`: q itself until verified nodes have been counted), not of q alone:
    a drafter's q is not its acceptance (docs/methods.md#token-trees). The chain's tokens are
    counted under any sampler, greedy sides too (the target's argmax decides them as it does the
    chain's); sampled sides, verified against a residual, are not.

    Under a greedy sampler the leaves are the drafter's next ranks; under sampling the chain is
    drawn from q and the leaves by `scheme`: "without-replacement" (default; recursive rejection
    sampling), "iid" (SpecInfer), or "deterministic" (the next ranks of q; exact too, verified
    with a one-hot law after the sampled chain token).

    A sampled chain token x is accepted with min(1, p(x)/q(x)), which its own q(x) predicts
    poorly (docs/methods.md#token-trees). The calibration learns that within a generation, but
    starts from q(x). So under sampling a chain node is valued, and counted in the calibration, by
    the drafter's top probability at its position (`sampled_value="top"`, the default, and `sd-cost`'s measure),
    whose starting values lie closer to the measured acceptance, not by q(x) ("token"). Under
    greedy the two are one number. Only values change, never the tokens drawn or how they are
    verified: exactness does not depend on it.
    """

    capabilities = Capabilities(trees=True, batched_passes=True, model=True, catches_up=True)

    def __init__(self, model: Backend, width: int = 3, max_nodes: int = 64,
                 scheme: str = "without-replacement", policy: TreeCost | None = None, sampled_value: str = "top"):
        super().__init__(model)
        if not isinstance(width, int) or width < 1:
            raise SpecdecError(f"tree width must be an integer >= 1, got {width!r}")
        if sampled_value not in ("top", "token"):
            raise SpecdecError(f"sampled_value must be 'top' or 'token', got {sampled_value!r}")
        if scheme not in SCHEMES:
            raise SpecdecError(f"unknown sibling scheme {scheme!r}; use one of {', '.join(SCHEMES)}")
        self.width, self.scheme = width, scheme
        self.policy = policy or TreeCost(max_nodes=max_nodes)
        self.name = f"{model.name}+sides{width}"
        self._fed: list[int] = []
        self._drafted = False
        self._q: list[float | None] = []  # the last tree's nodes' drafter q (None: not calibrated)
        self._parents: list[int] = []
        self.sampled_value = sampled_value

    def start(self, prompt: Sequence[int]) -> None:
        super().start(prompt)
        self.policy.reset()
        self._fed, self._drafted, self._q, self._parents = [], False, [], []

    def propose(self, context: Sequence[int], max_depth: int, sampler: Sampler,
                 generator: torch.Generator, keep_going: KeepGoing | None = None) -> Tree:
        return drive(self.proposal(context, max_depth, sampler, generator), self.model.forward)

    def proposal(self, context: Sequence[int], max_depth: int, sampler: Sampler,
                  generator: torch.Generator, keep_going: KeepGoing | None = None) -> Proposal:
        """`propose`, its drafter-model passes left to the caller (as `ModelDrafter.proposal`):
        the engine batches them across sequences."""
        root = Node(-1, 1.0, "deterministic")
        self._fed = []
        if max_depth >= 1 and self.policy.should_draft():
            yield from self._grow(root, context, max_depth, sampler, generator)
            prune(root, self._select(root))
        tree, order = to_tree(root)
        self._remember(tree, order)
        return tree

    def _remember(self, tree: Tree, order: list[Node]) -> None:
        """The tree just proposed, and its nodes' drafter q where the calibration counts them."""
        self._drafted = bool(tree.tokens)
        self._q, self._parents = [node.q for node in order], tree.parents

    def _grow(self, root: Node, context: Sequence[int], max_depth: int, sampler: Sampler,
              generator: torch.Generator) -> Generator[Segment, torch.Tensor, list[Node]]:
        """Draft the chain under `root` (one drafter pass per token, each yielded) with its side
        leaves; returns the chain's nodes. The chain's tokens but the last are fed to the
        drafter's cache."""
        self._catch_up(context)
        pending = self._inputs(context[cache_length(self.cache):])
        parent, chain = root, []
        greedy = sampler.is_greedy
        acceptance = self.policy.acceptance
        while len(chain) < max_depth:
            logits = (yield Segment(pending, self.cache, 1))[-1]
            self.passes += 1
            if chain:
                self._fed.append(len(chain) - 1)
            over = self._over_target_vocabulary(logits[:self.vocab_size])
            q = (over.float().softmax(-1) if greedy else sampler.probs(over))
            token = int(greedy_tokens(over)) if greedy else draw(q, generator, len(context) + len(chain))
            row = None if greedy else q
            # a sampled token is accepted with min(1, p/q), which its own q predicts poorly: value it by
            # the drafter's top probability there (`sampled_value`); under greedy the two are one number
            chance = float(q[token]) if greedy or self.sampled_value == "token" else float(q.max())
            node = Node(token, parent.value * acceptance(chance), "deterministic" if greedy else
                         ("iid" if self.scheme == "iid" else "without-replacement"), row, q=chance)
            parent.children.append(node)
            kind = "deterministic" if greedy else self.scheme
            taken = {token}
            for alt in self._alternatives(q, token, greedy, generator):
                # a sampled side joins by what the parent and its earlier siblings leave (the mass
                # not yet drafted), never by its own q
                slot = None if kind == "deterministic" else parent.value * max(0.0, 1 - float(q[list(taken)].sum()))
                side = float(q[alt])
                # under greedy a side is accepted as a chain token is (the target's argmax is its
                # token), so both share the calibration; a sampled side is judged by a residual law
                parent.children.append(Node(alt, parent.value * (acceptance(side) if greedy else side), kind, row,
                                             slot, q=side if greedy else None))
                taken.add(alt)
            chain.append(node)
            parent = node
            pending = self._inputs([token])
            if node.value < self.policy.threshold:
                break
        return chain

    def _alternatives(self, q: torch.Tensor, token: int, greedy: bool, generator: torch.Generator) -> list[int]:
        """The leaves beside a chain token: `width - 1` more tokens from q [V]."""
        count = self.width - 1
        if count <= 0:
            return []
        # under a seed a child passes iff it is the target's coupled draw: the likeliest cover it best
        if greedy or self.scheme == "deterministic" or isinstance(generator, CoupledGenerator):
            rest = q.clone()
            rest[token] = -1.0
            top = rest.topk(count)
            return [int(t) for t, v in zip(top.indices, top.values) if v > 0]
        if self.scheme == "iid":
            return [int(t) for t in torch.multinomial(q, count, replacement=True, generator=generator)]
        rest = q.clone()
        rest[token] = 0.0
        count = min(count, int((rest > 0).sum()))
        return [int(t) for t in torch.multinomial(rest, count, replacement=False, generator=generator)] if count else []

    def _select(self, root: Node) -> set[int]:
        """The chain, then other nodes in falling path value while they pay (`TreeCost`)."""
        keep, candidates = set(), []
        node = root
        while node.children:  # the main chain: every node's first child
            node = node.children[0]
            keep.add(id(node))
        stack = [root]
        while stack:
            node = stack.pop()
            for child in node.children:
                stack.append(child)
                if id(child) not in keep:
                    candidates.append(child)
        threshold = self.policy.node_threshold
        for child in sorted(candidates, key=lambda c: -c.rank_value):
            if len(keep) >= self.policy.max_nodes or child.rank_value < threshold:
                break
            keep.add(id(child))
        return closed(root, keep)

    def keep_path(self, start: int, path: list[int]) -> None:
        super().keep_path(start, path, self._fed)
        if self._drafted:
            self.policy.record_tree(self._q, self._parents, path)
        self._drafted, self._q, self._parents = False, [], []

    def timing(self, draft_seconds: float, drafter_passes: int, verify_seconds: float, width: int,
               emitted: int) -> None:
        self.policy.timing(draft_seconds, drafter_passes, verify_seconds, width, emitted)
