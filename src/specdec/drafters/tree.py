"""Tree drafters: token trees for one target pass (trees.py), sized by measured cost.

- `SidesDrafter`: the model drafter's chain plus, at each chain position, the drafter's next
  best tokens as leaves, at no extra drafter pass (the "sides" of the chain).
- `LookupTreeDrafter`: prompt lookup with several earlier occurrences merged into a trie.
- `SuffixTreeDrafter`: suffix drafting's tree mode (SuffixDecoding), no drafter model.
- `MixedDrafter`: a model-drafted chain with sides, and lookup (or suffix) branches, in the same pass.

`drafters.make_tree_drafter` builds one by name (the CLI's `--tree`, the bench's `tree-*` methods).
A tree drafter has `propose_tree(context, max_depth, sampler, generator) -> Tree`,
`keep_path(start, path)` (what of its last tree was accepted) and `timing(...)` (the step's
measured costs, for its `TreeCost` policy).
"""

from __future__ import annotations

from typing import Generator, Sequence

import torch

from ..backends import Backend, Segment
from ..backends.cache import cache_length
from ..errors import SpecdecError
from ..samplers import CoupledGenerator, Sampler, draw, greedy_tokens
from ..schedules import AssumedCosts, FasterOf, TreeCost, tried_nodes
from ..trees import SCHEMES, Tree
from .base import Capabilities, drive
from .lookup import LookupDrafter, find_matches
from .model import ModelDrafter
from .nodes import Node, rank, to_tree
from .suffix import LENGTH_BINS, SuffixCache, SuffixDrafter, best_tree, length_bin


class SidesDrafter(ModelDrafter):
    """The model drafter's chain, with the drafter's next best tokens at each position as leaves.

    The chain grows while its path value pays for a drafter pass and a wider target pass; then
    the best `width - 1` alternatives at each chain position join in falling path value while
    they pay for their verification width (`TreeCost`). A path value is the product, along the
    path, of each token's acceptance as measured so far in this generation at the drafter's q of
    it (`TreeCost.acceptance`: q itself until verified nodes have been counted), not of q alone:
    a drafter's q is not its acceptance (on the Spec-Bench summary the 0.5B drafter's tokens at
    q >= 0.9 were accepted 50 times of 50, those at q in 0.1-0.3 5 times of 19, in one measured
    run). The chain's
    tokens are counted under any sampler, greedy sides too (the target's argmax decides them as
    it does the chain's); sampled sides, verified against a residual, are not.

    Under a greedy sampler the leaves are the drafter's next ranks; under sampling the chain is
    drawn from q and the leaves by `scheme`: "without-replacement" (default; recursive rejection
    sampling), "iid" (SpecInfer), or "deterministic" (the next ranks of q; exact too, verified
    with a one-hot law after the sampled chain token).

    A sampled chain token x is accepted with min(1, p(x)/q(x)), which its own q(x) predicts
    poorly: at T = 1 on Spec-Bench's maths and rag prompts the 0.5B drafter's tokens sampled at
    q(x) < 0.1 were accepted 31-54% of the time in one measured run. The calibration learns that within a generation, but starts from q(x). So
    under sampling a chain node is valued, and counted in the calibration, by the drafter's top
    probability at its position (`sampled_value="top"`, the default, and `sd-cost`'s measure),
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

    def propose_tree(self, context: Sequence[int], max_depth: int, sampler: Sampler,
                     generator: torch.Generator) -> Tree:
        return drive(self.tree_proposal(context, max_depth, sampler, generator), self.model.forward)

    def tree_proposal(self, context: Sequence[int], max_depth: int, sampler: Sampler,
                      generator: torch.Generator) -> Generator[Segment, torch.Tensor, Tree]:
        """`propose_tree`, its drafter-model passes left to the caller (as `ModelDrafter.proposal`):
        the engine batches them across sequences."""
        root = Node(-1, 1.0, "deterministic")
        self._fed = []
        if max_depth >= 1 and self.policy.should_draft():
            yield from self._grow(root, context, max_depth, sampler, generator)
            _prune(root, self._select(root))
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
        return _closed(root, keep)

    def keep_path(self, start: int, path: list[int]) -> None:
        super().keep_path(start, path, self._fed)
        if self._drafted:
            self.policy.record_tree(self._q, self._parents, path)
        self._drafted, self._q, self._parents = False, [], []

    def timing(self, draft_seconds: float, drafter_passes: int, verify_seconds: float, width: int,
               emitted: int) -> None:
        self.policy.timing(draft_seconds, drafter_passes, verify_seconds, width, emitted)


class _FreeTree:
    """What the model-free trees share: nodes kept by value while they pay for their width, the
    accepted path counted (their `learn`), the step's timings for their cost policy."""

    policy: TreeCost

    def propose_tree(self, context: Sequence[int], max_depth: int, sampler: Sampler,
                     generator: torch.Generator) -> Tree:
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


class LookupTreeDrafter(_FreeTree, LookupDrafter):
    """Prompt lookup as a trie: the continuations of up to `branches` earlier occurrences of the
    current suffix (longest n-gram first, then shorter ones), merged where they agree.

    Deterministic (exact under any sampler). Children are ranked by how many continuations pass
    through them, then by recency. A node's value is the lookup acceptance measured in this
    generation for matches as long as its own (`acceptance(n)`: of the lookup nodes from n-token
    suffix matches that verification tried, the share it accepted) to the power of its depth,
    times its share of the continuations; nodes join while they pay for their verification
    width (`TreeCost`, drafting being free). By match length because that is what tells a copy
    from a coincidence: after a 3-token match in a summary the source text usually goes on, after
    a 1-token match it rarely does.
    """

    capabilities = Capabilities(trees=True)

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, branches: int = 4, max_nodes: int = 64,
                 policy: TreeCost | None = None):
        super().__init__(max_ngram, min_ngram)
        if not isinstance(branches, int) or branches < 1:
            raise SpecdecError(f"lookup trees need branches >= 1, got {branches!r}")
        self.branches = branches
        self.policy = policy or TreeCost(max_nodes=max_nodes)
        self.name = f"lookup-tree-{min_ngram}..{max_ngram}x{branches}"
        self.match_kinds = range(min_ngram, max_ngram + 1)  # what `grow` returns when it finds something
        self._drafted = False
        self.reset_counts()

    def reset_counts(self) -> None:
        self.tries = self.hits = 0  # lookup nodes verification tried, and those it accepted
        self.by_ngram: dict[int, list[int]] = {}  # the same by match length: n -> [tries, hits]
        self._parents: list[int] = []  # the last tree's parents
        self._proposed: dict[int, int] = {}  # and its nodes lookup proposed: index -> match length

    def start(self, prompt: Sequence[int]) -> None:
        self.policy.reset()
        self._drafted = False
        self.reset_counts()

    def acceptance(self, ngram: int | None = None) -> float:
        """The measured chance that verification accepts a lookup node it tries (its parent
        accepted): over all lookup nodes, a prior of 1/2 counting twice; for nodes from `ngram`-token
        matches, with that overall rate as the prior, counting twice."""
        overall = (self.hits + 1) / (self.tries + 2)
        if ngram is None:
            return overall
        tries, hits = self.by_ngram.get(ngram, (0, 0))
        return (hits + 2 * overall) / (tries + 2)

    def observe(self, context: Sequence[int]) -> None:
        """Nothing to index: lookup scans the context itself."""

    def remember(self, tree: Tree, proposed: dict[int, Node]) -> None:
        """The tree just proposed, and its nodes lookup proposed: index -> node (for `learn`)."""
        self._parents, self._proposed = tree.parents, {i: node.ngram for i, node in proposed.items()}

    def learn(self, path: list[int]) -> None:
        """Count the lookup nodes of the remembered tree that verification tried (`path`: accepted nodes)."""
        for i, accepted in tried_nodes(self._parents, path):
            if i in self._proposed:
                self.tries += 1
                self.hits += int(accepted)
                counts = self.by_ngram.setdefault(self._proposed[i], [0, 0])
                counts[0] += 1
                counts[1] += int(accepted)
        self._parents, self._proposed = [], {}

    def grow(self, root: Node, context: Sequence[int], max_depth: int, weight: float = 1.0) -> int:
        """Insert the continuations under `root` (children after any it already has), their values
        times `weight` (the chance the target reaches `root`); return the longest suffix match
        found (0: none)."""
        matches = find_matches(context, self.max_ngram, self.min_ngram, max_depth, self.branches)
        if not matches:
            return 0
        share = weight / len(matches)
        for ngram, continuation in matches:
            accept = self.acceptance(ngram)
            node, depth = root, 0
            for token in continuation:
                depth += 1
                child = node.child(token)
                if child is None:
                    child = Node(token, 0.0, "deterministic")
                    child.ngram = ngram  # the longest match reaches a node first
                    node.children.append(child)
                child.value += share * accept ** depth
                node = child
        rank(root)
        return matches[0][0]




class SuffixTreeDrafter(_FreeTree, SuffixDrafter):
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



class MixedDrafter(SidesDrafter):
    """The default tree: the model drafter's chain with its sides, plus prompt-lookup branches,
    in one target pass, sized by cost.

    Lookup branches hang beside the model's chain (ranked after it) and merge into it where
    they agree, so a token drafted by both is scored once. Lookup nodes are deterministic (a
    one-hot law), model nodes keep theirs: exact under any sampler (verify.py). A lookup node's
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

    def tree_proposal(self, context: Sequence[int], max_depth: int, sampler: Sampler,
                      generator: torch.Generator) -> Generator[Segment, torch.Tensor, Tree]:
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
                _prune(found, alone)
            else:
                chain = yield from self._grow(root, context, max_depth, sampler, generator)
                _prune(root, self._select(root))
                # lookup nodes fill what the budget leaves; they are deterministic, so any rule may pick them
                _prune(found, self.lookup.select(found, self.policy.max_nodes - _count(root)))
                if self.chain_lookup and chain and len(chain) < max_depth:
                    self._extend(chain, context, max_depth - len(chain), self.policy.max_nodes - _count(root)
                                 - _count(found), proposed)
            _merge(root, found, proposed)
        tree, order = to_tree(root)
        self._remember(tree, order)
        ids = {id(node) for node in proposed}
        self.lookup.remember(tree, {i: node for i, node in enumerate(order) if id(node) in ids})
        return tree

    def check_target(self, target) -> None:
        super().check_target(target)
        if hasattr(self.lookup, "check_target"):
            self.lookup.check_target(target)  # a datastore's tokenizer

    def pin(self) -> None:
        """A seeded sampled generation: the branches draft from its own text alone (`SuffixDrafter.pin`)."""
        if hasattr(self.lookup, "pin"):
            self.lookup.pin()

    def finish(self, sequence: Sequence[int]) -> None:
        """The generation ended: its output joins the branches' shared cache, if they keep one."""
        if hasattr(self.lookup, "finish"):
            self.lookup.finish(sequence)

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
            _prune(tail, self.lookup.select(tail, budget))
            _merge(end, tail, proposed)

    def keep_path(self, start: int, path: list[int]) -> None:
        super().keep_path(start, path)
        self.lookup.learn(path)

    def timing(self, draft_seconds: float, drafter_passes: int, verify_seconds: float, width: int,
               emitted: int) -> None:
        super().timing(draft_seconds, drafter_passes, verify_seconds, width, emitted)
        if self.with_model is not None and self.policy.timed_steps > 1:  # the first holds the drafter's prompt pass
            self.kinds[self.ngram].record(self.with_model, emitted,
                              sum(self.policy.step_seconds(draft_seconds, drafter_passes, verify_seconds, width)))


def _merge(into: Node, other: Node, proposed: list[Node]) -> None:
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
            proposed += _subtree(child)
        else:
            same.value = max(same.value, child.value)
            same.ngram = max(same.ngram, child.ngram)
            if same.ratio is None:
                same.ratio = child.ratio  # a suffix node's count ratio, for its calibration
            proposed.append(same)
            _merge(same, child, proposed)


def _subtree(node: Node) -> list[Node]:
    return [node] + [n for child in node.children for n in _subtree(child)]


def _prune(node: Node, keep: set[int]) -> None:
    """Drop the children (and their subtrees) not in `keep`."""
    node.children = [c for c in node.children if id(c) in keep]
    for child in node.children:
        _prune(child, keep)


def _count(node: Node) -> int:
    return sum(1 + _count(c) for c in node.children)


def _closed(root: Node, keep: set[int]) -> set[int]:
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
