"""Token trees under construction: the tree drafters grow `Node`s, rank their children by value,
and serialise them depth first into a `trees.Tree` for the target's pass (`to_tree`).
"""

from __future__ import annotations

import torch

from ..core.trees import Tree


class Node:
    """A node of a tree under construction (trees are serialised depth first by `to_tree`)."""

    __slots__ = ("token", "value", "rank_value", "scheme", "children", "prob_row", "q", "ngram", "ratio")

    def __init__(self, token: int, value: float, scheme: str, prob_row: torch.Tensor | None = None,
                 rank_value: float | None = None, q: float | None = None):
        self.token, self.value, self.scheme, self.prob_row = token, value, scheme, prob_row
        self.q = q  # the drafter's probability of this token at its parent, where a drafter calibrates it
        # what decides whether the node joins the tree: its value, except for a sampled side,
        # whose presence must not depend on its own token (core/verify.py: that would bias the output)
        self.rank_value = value if rank_value is None else rank_value
        self.children: list[Node] = []
        self.ngram = 0  # for a node lookup proposed: the longest suffix match that proposed it
        self.ratio: float | None = None  # for a node suffix drafting proposed: its count ratio at its parent

    def child(self, token: int) -> "Node | None":
        return next((c for c in self.children if c.token == token), None)


def to_tree(root: Node, keep: set[int] | None = None) -> tuple[Tree, list[Node]]:
    """Depth first, children in their rank order (the first child first), so the main chain is
    nodes 0..D-1. `keep`: ids of the nodes to include (their ancestors must be included)."""
    tokens, parents, values, schemes, rows, order = [], [], [], [], [], []

    def visit(node: Node, parent: int) -> None:
        for child in node.children:
            if keep is not None and id(child) not in keep:
                continue
            index = len(tokens)
            tokens.append(child.token)
            parents.append(parent)
            values.append(child.value)
            schemes.append(child.scheme)
            rows.append(child.prob_row)
            order.append(child)
            visit(child, index)

    visit(root, -1)
    probs = None
    if rows and any(r is not None for r in rows):
        width = next(r for r in rows if r is not None)
        probs = torch.stack([r if r is not None else torch.zeros_like(width) for r in rows])
    scheme: str | list[str] = schemes[0] if schemes and len(set(schemes)) == 1 else schemes
    return Tree(tokens, parents, probs, values, scheme if tokens else "deterministic"), order


def rank(node: Node) -> None:
    """Children in falling value (a stable sort: earlier insertions win ties)."""
    node.children.sort(key=lambda c: -c.value)
    for child in node.children:
        rank(child)


def merge(into: Node, other: Node, proposed: list[Node]) -> None:
    """Add `other`'s subtrees under `into`, sharing the nodes whose tokens agree (a model node
    keeps its own law and takes the larger of the two values); appends to `proposed` the node
    that stands for each of `other`'s.

    The added nodes rank after every existing sibling. That is what keeps sampled verification
    exact: whether a lookup token gets a node of its own then depends only on its earlier
    siblings (it is dropped when one of them carries it), so its law given them is one-hot. Were
    it ranked before a sampled sibling it might later coincide with, its presence would tell
    about that later draw, whose law would no longer be the one verification assumes. Dropping
    a one-hot duplicate is lossless: its earlier twin's rejection left p = 0 at that token, so
    its own rejection would not change the residual.
    """
    for child in other.children:
        same = into.child(child.token)
        if same is None:
            into.children.append(child)
            proposed += subtree(child)
        else:
            same.value = max(same.value, child.value)
            same.ngram = max(same.ngram, child.ngram)
            if same.ratio is None:
                same.ratio = child.ratio  # a suffix node's count ratio, for its calibration
            proposed.append(same)
            merge(same, child, proposed)


def subtree(node: Node) -> list[Node]:
    return [node] + [n for child in node.children for n in subtree(child)]


def prune(node: Node, keep: set[int]) -> None:
    """Drop the children (and their subtrees) not in `keep`."""
    node.children = [c for c in node.children if id(c) in keep]
    for child in node.children:
        prune(child, keep)


def count_nodes(node: Node) -> int:
    return sum(1 + count_nodes(c) for c in node.children)


def closed(root: Node, keep: set[int]) -> set[int]:
    """`keep` with every kept node's ancestors (so the tree stays connected)."""
    closed: set[int] = set()

    def visit(node: Node) -> bool:
        any_kept = False
        for child in node.children:
            below = visit(child)
            if below or id(child) in keep:
                closed.add(id(child))
                any_kept = True
        return any_kept

    visit(root)
    return closed
