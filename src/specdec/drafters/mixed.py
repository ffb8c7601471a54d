"""The mixed tree (the default tree): a model-drafted chain with sides, and lookup (or suffix)
branches, in the same target pass.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..backends import Backend
from ..core.samplers import Sampler
from ..sizing.schedules import FasterOf, TreeCost
from .base import Capabilities, KeepGoing, Proposal, capabilities_of
from .lookup_tree import LookupTreeDrafter
from .nodes import Node, count_nodes, merge, prune, to_tree
from .sides import SidesDrafter
from .suffix import SuffixDrafter


class MixedDrafter(SidesDrafter):
    """The default tree: the model drafter's chain with its sides, plus prompt-lookup branches,
    in one target pass, sized by cost.

    Lookup branches hang beside the model's chain (ranked after it) and merge into it where
    they agree, so a token drafted by both is scored once. Lookup nodes are deterministic (a
    one-hot law), model nodes keep theirs: exact under any sampler (core/verify.py). A lookup node's
    value is its lookup estimate, from the acceptance of lookup's own nodes (a token both
    proposed counts for both; the model's acceptance does not lend lookup its rate); they join
    while they pay for their width, like the sides. When drafting does not pay the tree is
    empty: the target decodes alone.

    Where lookup finds a continuation, the step may also skip the model: on text that copies
    its input (summaries, edits, retrieval) the lookup branch alone carries the accepted tokens
    and the drafter's passes only add cost. Which of the two kinds of step (lookup alone, or
    model and lookup) makes more tokens per second is measured on the steps where lookup found
    something, apart for each length of the suffix match (`kinds[n]`, each a `FasterOf` as the
    policy's draft-or-not rule: the model kind first, then one lookup-alone step as a baseline,
    then the faster one, probing the other): a 3-token match in a summary usually starts a copy,
    a 1-token match rarely does. After lookup-alone steps the drafter catches up on what it
    missed in its next pass.

    Lookup also runs from the end of the model's chain (`_extend`; `chain_lookup=False` turns it
    off): the context with the chain drafted onto it may recur where the context alone does
    not, and what followed it then carries the draft on past the point where the model's values
    stopped it, at no drafter pass.
    """

    capabilities = Capabilities(trees=True, batched_passes=True, model=True, catches_up=True, pins=True,
                                finishes=True)

    def __init__(self, model: Backend, width: int = 2, max_nodes: int = 64,
                 scheme: str = "without-replacement", lookup: LookupTreeDrafter | None = None,
                 policy: TreeCost | None = None, chain_lookup: bool = True, sampled_value: str = "top"):
        super().__init__(model, width, max_nodes, scheme, policy, sampled_value)
        self.lookup = lookup or LookupTreeDrafter(policy=self.policy)
        self.lookup.policy = self.policy
        self.name = f"{model.name}+sides{width}+" + ("suffix" if isinstance(self.lookup, SuffixDrafter) else "lookup")
        policy = self.policy
        # by the length of the step's longest suffix match; the first kind: steps with the model,
        # the other: lookup alone
        self.kinds = {n: FasterOf(policy.warmup, policy.probe, policy.decay, {True: policy.probe, False: policy.probe})
                      for n in self.lookup.match_kinds}
        self.chain_lookup = chain_lookup  # lookup also from the model chain's end (`_extend`)
        self.with_model: bool | None = None  # the last step's kind, where lookup found something (None: it did not)
        self.ngram = 0  # and its longest suffix match

    def start(self, prompt: Sequence[int]) -> None:
        super().start(prompt)
        self.lookup.start(prompt)  # its counts (and a suffix drafter's indexes); the policy is shared
        for kinds in self.kinds.values():
            kinds.reset()
        self.with_model, self.ngram = None, 0

    def proposal(self, context: Sequence[int], max_depth: int, sampler: Sampler,
                  generator: torch.Generator, keep_going: KeepGoing | None = None) -> Proposal:
        root = Node(-1, 1.0, "deterministic")
        self._fed, self.with_model = [], None
        proposed: list[Node] = []  # the tree's nodes that lookup proposed
        self.lookup.observe(context)
        if max_depth >= 1 and self.policy.should_draft():
            found = Node(-1, 1.0, "deterministic")
            self.ngram = self.lookup.grow(found, context, max_depth)
            alone = self.lookup.select(found) if found.children else set()
            if alone:
                self.with_model = self.kinds[self.ngram].choose()
            if self.with_model is False:
                prune(found, alone)
            else:
                chain = yield from self._grow(root, context, max_depth, sampler, generator)
                prune(root, self._select(root))
                # lookup nodes fill what the budget leaves; they are deterministic, so any rule may pick them
                prune(found, self.lookup.select(found, self.policy.max_nodes - count_nodes(root)))
                if self.chain_lookup and chain and len(chain) < max_depth:
                    self._extend(chain, context, max_depth - len(chain), self.policy.max_nodes - count_nodes(root)
                                 - count_nodes(found), proposed)
            merge(root, found, proposed)
        tree, order = to_tree(root)
        self._remember(tree, order)
        ids = {id(node) for node in proposed}
        self.lookup.remember(tree, {i: node for i, node in enumerate(order) if id(node) in ids})
        return tree

    def check_target(self, target) -> None:
        super().check_target(target)
        self.lookup.check_target(target)  # a datastore's tokenizer

    def pin(self) -> None:
        """A seeded sampled generation: the branches draft from its own text alone (`SuffixDrafter.pin`)."""
        if capabilities_of(self.lookup).pins:
            self.lookup.pin()

    def finish(self, sequence: Sequence[int]) -> None:
        """The generation ended: its output joins the branches' shared cache, if they keep one."""
        self.lookup.finish(sequence)  # the base's does nothing: prompt lookup keeps no cache

    def _extend(self, chain: list[Node], context: Sequence[int], max_depth: int, budget: int,
                proposed: list[Node]) -> None:
        """Hang under the chain's last node what followed earlier occurrences of the context with
        the chain drafted onto it: where the model has drafted into a passage the text repeats
        (a name, a call, a line of code written before), lookup carries the draft on past the
        point where the model's confidence stopped it, at no drafter pass. The nodes' values are
        the chain end's times lookup's (the chance the target reaches them); they join while they
        pay for their width, in what the budget leaves."""
        if budget <= 0:
            return
        end, tail = chain[-1], Node(-1, 1.0, "deterministic")
        if self.lookup.grow(tail, list(context) + [node.token for node in chain], max_depth, end.value):
            prune(tail, self.lookup.select(tail, budget))
            merge(end, tail, proposed)

    def keep_path(self, start: int, path: list[int]) -> None:
        super().keep_path(start, path)
        self.lookup.learn(path)

    def timing(self, draft_seconds: float, drafter_passes: int, verify_seconds: float, width: int,
               emitted: int) -> None:
        super().timing(draft_seconds, drafter_passes, verify_seconds, width, emitted)
        if self.with_model is not None and self.policy.timed_steps > 1:  # the first holds the drafter's prompt pass
            self.kinds[self.ngram].record(self.with_model, emitted,
                              sum(self.policy.step_seconds(draft_seconds, drafter_passes, verify_seconds, width)))
