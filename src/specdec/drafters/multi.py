"""Several drafters at once (SpecInfer, Miao et al. 2024: several small models' candidates merged
into one token tree and verified together).

Each drafter drafts a chain after the context; the chains hang from the root side by side, in the
order the drafters are given (the first drafter's chain is the tree's main chain). Under greedy,
or where every chain is deterministic, chains that agree share their common prefix (one node).
Under sampling they never merge: each chain is drawn from its own drafter's q, independently of
the others, so siblings from different drafters are independent draws from different laws, which
`verify.verify_tree` keeps exact when each node's law is its own drafter's q (SpecInfer's
multi-step speculative sampling, scheme "iid" per node). Merging two drafters' equal first tokens
into one node would not be exact in general: the merged node's law would be neither q.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..errors import SpecdecError
from ..core.samplers import CoupledGenerator, Sampler
from ..sizing.schedules import TreeCost
from ..core.trees import Tree
from .base import Capabilities, Drafter, KeepGoing, accept_draft, capabilities_of


class MultiDrafter(Drafter):
    """`drafters` (chain drafters, e.g. `ModelDrafter`s on models of the target's vocabulary), each
    drafting a chain of up to `gamma` tokens a step, merged into one tree (see the module docstring).
    The tree's depth bound is its `policy`'s (a `TreeCost`, whose `max_depth` also caps `gamma`)."""

    capabilities = Capabilities(trees=True)

    def __init__(self, drafters: Sequence, gamma: int = 5, policy: TreeCost | None = None):
        drafters = list(drafters)
        if len(drafters) < 2:
            raise SpecdecError(f"multi-draft needs at least two drafters, got {len(drafters)}")
        if any(capabilities_of(d).trees for d in drafters):
            raise SpecdecError("multi-draft merges chains: each of its drafters must propose chains, not trees")
        if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
            raise SpecdecError(f"multi-draft needs gamma >= 1 tokens per chain, got {gamma!r}")
        self.drafters, self.gamma = drafters, gamma
        self.policy = policy or TreeCost(max_depth=gamma, max_nodes=len(drafters) * gamma)
        self.policy.max_nodes = max(self.policy.max_nodes, len(drafters) * gamma)  # every chain fits
        self.name = "multi(" + ", ".join(d.name for d in drafters) + ")"
        self.chains: list[list[int]] = []  # the last step's chain of each drafter
        self._tokens: list[int] = []  # and the last tree's tokens
        self.merged = 0  # chain tokens that shared a node with an earlier chain's (greedy only)

    @property
    def passes(self) -> int:
        return sum(d.passes for d in self.drafters)

    def check_target(self, target) -> None:
        for drafter in self.drafters:
            drafter.check_target(target)

    def start(self, prompt: Sequence[int]) -> None:
        for drafter in self.drafters:
            drafter.start(prompt)
        self.policy.reset()
        self.chains, self.merged = [], 0

    def propose(self, context: Sequence[int], max_depth: int, sampler: Sampler,
                 generator: torch.Generator, keep_going: KeepGoing | None = None) -> Tree:
        depth = min(max_depth, self.gamma)
        drafts = [d.propose(context, depth, sampler, generator if k == 0 else _ordinary(generator),
                            lambda drafted, estimate: True)
                  for k, d in enumerate(self.drafters)]
        self.chains = [list(draft.tokens) for draft in drafts]
        tree, merged = merge_chains(drafts, merge=sampler.is_greedy or all(d.probs is None for d in drafts))
        self._tokens, self.merged = tree.tokens, self.merged + merged
        return tree

    def keep_path(self, start: int, path: list[int]) -> None:
        """Each drafter keeps the part of its chain that the accepted tokens begin with (a chain
        whose tokens equal the accepted ones holds them in its cache, whichever node verification
        walked)."""
        accepted = [self._tokens[node] for node in path]
        for drafter, chain in zip(self.drafters, self.chains):
            kept = 0
            while kept < min(len(chain), len(accepted)) and chain[kept] == accepted[kept]:
                kept += 1
            accept_draft(drafter, start, list(range(kept)))

    def timing(self, draft_seconds: float, drafter_passes: int, verify_seconds: float, width: int,
               emitted: int) -> None:
        self.policy.timing(draft_seconds, drafter_passes, verify_seconds, width, emitted)


def _ordinary(generator: torch.Generator) -> torch.Generator:
    """The later chains' random source: under a seed (`CoupledGenerator`) the first chain's draws
    race the shared noise, and a later chain drawing from that same noise would mostly repeat it;
    its draws come from an ordinary stream seeded off the seeded generator instead (still pinned by
    the seed; the coupled verification keeps the output whatever the siblings)."""
    if not isinstance(generator, CoupledGenerator):
        return generator
    plain = torch.Generator(device=generator.device)
    plain.manual_seed(int(torch.randint(2 ** 62, (1,), generator=generator, device=generator.device)))
    return plain


def merge_chains(drafts: Sequence, merge: bool) -> tuple[Tree, int]:
    """Chains (`Draft`s, each with probs [n, V] or None) -> one tree: the first chain is nodes
    0..n-1; each later chain's nodes follow, its first hung from the root. With `merge` a later
    chain reuses the nodes of an earlier one while their tokens agree (greedy or deterministic
    chains only: see the module docstring). Node laws: the chain's q row (scheme "iid"), or
    one-hot for a chain without probs (scheme "deterministic"). Returns (the tree, the chain
    tokens merged into an earlier chain's node)."""
    tokens: list[int] = []
    parents: list[int] = []
    schemes: list[str] = []
    rows: list[torch.Tensor | None] = []
    children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node, for merging
    merged = 0
    for draft in drafts:
        parent = -1
        for i, token in enumerate(draft.tokens):
            if merge and (parent, token) in children:
                parent = children[parent, token]
                merged += 1
                continue
            tokens.append(int(token))
            parents.append(parent)
            sampled = draft.probs is not None
            schemes.append("iid" if sampled else "deterministic")
            rows.append(draft.probs[i] if sampled else None)
            children.setdefault((parent, int(token)), len(tokens) - 1)
            parent = len(tokens) - 1
    probs = None
    if any(row is not None for row in rows):
        like = next(row for row in rows if row is not None)
        probs = torch.stack([row if row is not None else
                             torch.nn.functional.one_hot(torch.tensor(token, device=like.device),
                                                         like.shape[-1]).to(like.dtype)
                             for row, token in zip(rows, tokens)])
    scheme = schemes[0] if len(set(schemes)) == 1 else schemes
    return Tree(tokens, parents, probs, scheme=scheme if tokens else "deterministic"), merged
