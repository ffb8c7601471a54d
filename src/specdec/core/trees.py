"""Token trees: several candidate continuations verified in one target pass (SpecInfer, EAGLE-2).

A tree hangs from the last committed token (the root, index -1). Nodes come parent before child,
siblings in rank order (best first), depth first with each node's top-ranked child first: so the
main chain is nodes 0..D-1 and a chain draft is a tree whose every node is the first child of the
one before. Accepting a path that is the main chain is then a plain crop of the caches.

How siblings were drawn decides which verification rule is exact (core/verify.py, `sibling_laws`):
    "iid"                  each sibling drawn independently from the drafter's q at the parent
                           (SpecInfer's multi-step speculative sampling);
    "without-replacement"  siblings drawn in turn from q with the earlier ones removed
                           (recursive rejection sampling, Jeon et al. 2024);
    "deterministic"        siblings chosen without any random draw that verification could see
                           (top-k, EAGLE-2 reranking, lookup tries): q is one-hot at each.
Greedy verification ignores the scheme.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..errors import SpecdecError

SCHEMES = ("iid", "without-replacement", "deterministic")


@dataclass
class Draft:
    """A proposal, a chain or a tree.

    tokens:  [n] token ids.
    probs:   [n, V] the q each token was drawn from, or None when the drafter proposes
             deterministically (q one-hot at each token) or the sampler is greedy (verification
             then only compares tokens).
    parents: [n] each token's parent (< its own index; -1: the root, the last committed token),
             or None for a chain: the tree whose parents are -1, 0, 1, ... (`Tree.chain`).
    """

    tokens: list[int]
    probs: torch.Tensor | None = None
    parents: list[int] | None = None

    def __post_init__(self):
        if self.parents is not None:
            check_parents(self.parents)
            if len(self.tokens) != len(self.parents):
                raise SpecdecError(f"a tree needs one parent per token: {len(self.tokens)} tokens, "
                                   f"{len(self.parents)} parents")


@dataclass(init=False)
class Tree(Draft):
    """A draft tree: a `Draft` with its parents, and what sizing and verification need besides.

    tokens:  [N] token ids.
    parents: [N] index of each node's parent (< its own index), -1 for children of the root.
    probs:   [N, V] the drafter's distribution at each node's parent (the q its siblings were
             drawn from; rows of siblings are equal), or None for deterministic and greedy trees.
    values:  [N] path value: the drafter's estimate that the node lies on the accepted path
             (the product of its q along the path), used to size and prune trees.
    scheme:  how siblings were drawn (see the module docstring), for the whole tree or one per
             node (a mixed tree: a sampled model chain with deterministic lookup branches).
    """

    values: list[float] = field(default_factory=list)
    scheme: str | list[str] = "deterministic"

    def __init__(self, tokens: list[int], parents: list[int], probs: torch.Tensor | None = None,
                 values: list[float] | None = None, scheme: str | list[str] = "deterministic"):
        self.tokens, self.parents, self.probs = tokens, parents, probs
        self.values, self.scheme = list(values) if values else [], scheme
        self.__post_init__()

    def __post_init__(self):
        if self.parents is None:
            raise SpecdecError("a tree needs its parents (a chain: Tree.chain)")
        super().__post_init__()
        schemes = [self.scheme] if isinstance(self.scheme, str) else list(self.scheme)
        if any(kind not in SCHEMES for kind in schemes) or (not isinstance(self.scheme, str) and
                                                              len(schemes) != len(self.tokens)):
            raise SpecdecError(f"unknown sibling scheme {self.scheme!r}: give one of {', '.join(SCHEMES)} "
                               "for the tree or one per node")
        if self.probs is not None and self.probs.shape[0] != len(self.tokens):
            raise SpecdecError(f"tree probs must have one row per node, got {tuple(self.probs.shape)} "
                               f"for {len(self.tokens)} nodes")
        if not self.values:
            self.values = [1.0] * len(self.tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens: Sequence[int], probs: torch.Tensor | None = None) -> "Tree":
        """A chain draft as a tree of width 1 (node i is the only child of node i-1)."""
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), probs,
                   scheme="deterministic" if probs is None else "iid")

    @property
    def depths(self) -> list[int]:
        """[N] depth of each node (children of the root have depth 1)."""
        return depths(self.parents)

    @property
    def main_chain_length(self) -> int:
        """D: nodes 0..D-1 form the main chain (each the first child of the one before)."""
        return main_chain_length(self.parents)

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to `node` (empty for the root, -1)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def is_chain(self) -> bool:
        return self.main_chain_length == len(self.tokens)

    def children(self, node: int) -> list[int]:
        """The children of `node` (-1: the root), in rank order."""
        return [i for i, parent in enumerate(self.parents) if parent == node]


def check_parents(parents: Sequence[int]) -> None:
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise SpecdecError(f"tree node {i} has parent {parent}: a parent must come before its child "
                               "(or be -1, the root)")


def depths(parents: Sequence[int]) -> list[int]:
    out: list[int] = []
    for parent in parents:
        out.append(1 if parent < 0 else out[parent] + 1)
    return out


def main_chain_length(parents: Sequence[int]) -> int:
    length = 0
    while length < len(parents) and parents[length] == length - 1:
        length += 1
    return length


def input_parents(num_prefix: int, tree_parents: Sequence[int]) -> list[int]:
    """Parents over a pass's inputs: `num_prefix` pending tokens in a chain (the first after the
    cache), then the tree hung from the last of them. -1 means "follows the cache"."""
    offset = num_prefix - 1
    return list(range(-1, num_prefix - 1)) + [offset if p < 0 else p + num_prefix for p in tree_parents]


def tree_attention(parents: Sequence[int], past: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                   additive: bool = False, new: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The 4D mask and position ids of a pass over tokens hung from a cache of `past` positions.

    parents: [R] for each token of the tree region (the positions from `past` on), the index of
        its parent in the region (< its own), or -1 for a token that follows the first `past`
        positions directly. The pass feeds the region's last `new` tokens (default: all of it;
        fewer when a drafter grows its tree one depth per pass, the earlier ones being cached).
    Returns:
        mask: [1, 1, new, past + R]: each fed token sees the first `past` positions, its
            ancestors and itself. Boolean (True = attend) for sdpa; with `additive`, 0 / the
            dtype's finite minimum for eager attention, which adds the mask to the scores (a
            boolean mask would be silently wrong there: it adds 0 or 1).
        position_ids: [1, new] long: past + depth - 1 (a chain gets past, past+1, ...).
    """
    check_parents(parents)
    count = len(parents)
    new = count if new is None else new
    seen = torch.zeros(count, past + count, dtype=torch.bool)
    seen[:, :past] = True
    depth = []
    for i, parent in enumerate(parents):
        if parent >= 0:
            seen[i] = seen[parent]
        seen[i, past + i] = True
        depth.append(0 if parent < 0 else depth[parent] + 1)
    positions = torch.tensor(depth[count - new:], dtype=torch.long).add_(past).view(1, -1).to(device)
    mask = seen[count - new:].reshape(1, 1, new, past + count).to(device)
    if additive:
        mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, torch.finfo(dtype).min)
    return mask, positions
