"""Lookahead decoding (Fu et al. 2024): Jacobi iteration and an n-gram pool, no drafter model.

One target pass scores, hung from the last committed token:
- the lookahead branch: a window of W guessed positions kept at N − 1 levels (the last N − 1
  Jacobi iterations). Level 0 is a chain of W tokens; from its column-j token hangs a chain of
  column j's later levels, so the token at (level l, column j) sees level 0 up to column j and
  levels 1..l − 1 of column j, at depth j + 1 + l: the mask of the reference implementations
  (hao-ai-lab/LookaheadDecoding, llama.cpp's examples/lookahead), written as a token tree;
- the verification branch: up to G n-grams from the pool whose first token is the last committed
  one, each a chain of N − 1 tokens.
Each column's tokens and the target's argmax after its last level make an n-gram for the pool
(keyed by its first token); the levels then move on one iteration, the target's argmax as the
newest. Nodes the two branches share are one node (a trie).

Every node is a candidate (the window's guesses too, as in Jacobi decoding), verified as a point
mass: the deterministic-sibling rule (accept with p(x), else zero it and renormalise), which is
lade's rule under sampling and exact under any sampler. Nothing the drafter keeps depends on a
random draw: its trees depend on the committed text alone.

The shape comes from the measured pass-cost profile (`lookahead_shape`): the published W = 15,
N = 5, G = 15 fills 121 rows, which a GPU scores at little more than the cost of one; a 2-core
CPU pays for every row past a few, and where no row is cheap nothing is drafted (W = N = G = 0).
"""

from __future__ import annotations

import math
import random
from typing import Sequence

import torch

from ..errors import SpecdecError
from ..core.samplers import Sampler
from ..sizing.schedules import TreeCost, tried_nodes
from ..core.trees import Tree
from .base import Capabilities, Drafter, KeepGoing
from .nodes import Node, rank, to_tree

OVERHEAD = 0.2  # a lookahead pass may cost at most this much more than a one-token pass
# rows ≈ ROWS_PER_LEVEL2 · (N − 1)² (W = G): probes of the shapes on the default pair favoured N = 2
# at 16 rows and N = 3 at 60 (docs/methods.md, "Lookahead decoding")
ROWS_PER_LEVEL2 = 15


def lookahead_shape(rows: int) -> tuple[int, int, int]:
    """(W, N, G) for a pass with `rows` rows besides the pending token's: (W + G)(N − 1) <= rows,
    W = G, and N − 1 growing with the square root of the rows (`ROWS_PER_LEVEL2`; the published
    W = 15, N = 5, G = 15 was tuned for a 7B model on an A100); (0, 0, 0) below 2 rows, where
    nothing is drafted."""
    if not isinstance(rows, int) or rows < 2:
        return 0, 0, 0
    levels = max(1, int(math.sqrt(rows / ROWS_PER_LEVEL2) + 0.5))
    while levels > 1 and rows // (2 * levels) < 1:
        levels -= 1
    window = rows // (2 * levels)
    return window, levels + 1, window


def check_shape(shape: tuple) -> None:
    """Raise SpecdecError unless (W, N, G) are all None or window >= 1, ngram >= 2, guesses >= 0."""
    window, ngram, guesses = shape
    if any(v is not None for v in shape):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in shape) or window < 1 or ngram < 2 \
                or guesses < 0:
            raise SpecdecError(f"lookahead needs window >= 1, ngram >= 2 and guesses >= 0 given together, "
                               f"got {window!r}, {ngram!r}, {guesses!r}")


class LookaheadDrafter(Drafter):
    """Lookahead decoding's proposals as a token tree (see the module docstring).

    window, ngram, guesses: W, N, G, all given or none (then chosen at `check_target` from the
    target's measured pass costs, or the policy's assumed ones, capped by its max_nodes).
    """

    capabilities = Capabilities(trees=True, reads_target_tokens=True)

    def __init__(self, window: int | None = None, ngram: int | None = None, guesses: int | None = None,
                 max_nodes: int = 64, policy: TreeCost | None = None):
        shape = (window, ngram, guesses)
        check_shape(shape)
        self.policy = policy or TreeCost(max_nodes=max_nodes)
        self.shape: tuple[int, int, int] | None = shape if window is not None else None
        self.passes = 0
        self.model = None
        self._name()
        self.start([])

    def _name(self) -> None:
        self.name = "lookahead" + ("" if self.shape is None else "-w{}n{}g{}".format(*self.shape))

    def check_target(self, target) -> None:
        """Size the shape for `target` where none was given: from the policy's assumed costs, or
        the target's measured ones (`pass_costs.flat_rows`, measured once per machine and cached)."""
        if self.shape is not None:
            return
        assumed = self.policy.assumed
        if assumed is not None:
            rows = self.policy.max_nodes if assumed.slope == 0 else int(OVERHEAD / assumed.slope + 1e-9)
        else:
            from ..sizing.pass_costs import flat_rows

            rows = flat_rows(target, OVERHEAD)
        self.shape = lookahead_shape(min(rows, self.policy.max_nodes))
        self._name()

    def start(self, prompt: Sequence[int]) -> None:
        """A new generation: an empty pool, and the window's levels filled with prompt tokens
        (the references' random start, drawn here from a fixed seed so that a generation's trees
        depend on its text alone)."""
        window, ngram, _ = self.shape or (0, 0, 0)
        self._rng = random.Random(0)
        self._fill = list(prompt) or [0]
        self.levels = [[self._filler() for _ in range(window)] for _ in range(max(0, ngram - 1))]
        self.pool: dict[int, list[tuple[int, ...]]] = {}  # first token -> its n-grams' rest, newest first
        self.tries = {"window": [0, 0], "pool": [0, 0]}  # nodes verification tried, and those accepted
        self.policy.reset()
        self._drafted = False
        self._columns: list[int | None] = []  # each column's last-level node index in the last tree
        self._sources: dict[int, set[str]] = {}
        self._parents: list[int] = []
        self._outputs: list[int] | None = None

    def _filler(self) -> int:
        return self._fill[self._rng.randrange(len(self._fill))]

    def acceptance(self, source: str) -> float:
        """The share of `source`'s nodes ("window" or "pool") that verification accepted when it
        tried them, in this generation (a prior of 1/2 counting twice): the nodes' ranks."""
        tries, hits = self.tries[source]
        return (hits + 1) / (tries + 2)

    def propose(self, context: Sequence[int], max_depth: int, sampler: Sampler,
                 generator: torch.Generator, keep_going: KeepGoing | None = None) -> Tree:
        """The window's levels and the pool's n-grams after `context`, no deeper than `max_depth`."""
        root = Node(-1, 1.0, "deterministic")
        window, ngram, guesses = self.shape or (0, 0, 0)
        columns: list[Node | None] = []
        sources: dict[tuple[int, str], tuple[Node, str]] = {}  # (node id, source) -> the node
        if window and max_depth >= 1 and self.policy.should_draft():
            value = {source: self.acceptance(source) for source in self.tries}
            parent = root
            for j in range(min(window, max_depth)):
                parent = _add(parent, self.levels[0][j], value["window"], sources, "window")
                node = parent
                for depth, level in enumerate(self.levels[1:], start=j + 2):
                    if depth > max_depth:
                        node = None
                        break
                    node = _add(node, level[j], value["window"], sources, "window")
                columns.append(node)
            for gram in self.pool.get(context[-1], [])[:guesses]:
                node = root
                for token in gram[:max_depth]:
                    node = _add(node, token, value["pool"], sources, "pool")
            rank(root)
        tree, order = to_tree(root)
        index = {id(node): i for i, node in enumerate(order)}
        self._columns = [None if node is None else index[id(node)] for node in columns]
        self._sources = {}
        for key, (node, source) in sources.items():
            self._sources.setdefault(index[id(node)], set()).add(source)
        self._parents, self._drafted, self._outputs = tree.parents, bool(tree.tokens), None
        return tree

    def observe_targets(self, tokens: Sequence[int]) -> None:
        """The target's argmax after the root and after each node of the last tree ([N + 1])."""
        self._outputs = list(tokens)

    def keep_path(self, start: int, path: list[int]) -> None:
        """Count the tried nodes by source, add each scored column's n-gram to the pool, and move
        the window on to the committed text (`len(path) + 1` tokens)."""
        if not self._drafted:
            return
        for i, accepted in tried_nodes(self._parents, path):
            for source in self._sources.get(i, ()):
                self.tries[source][0] += 1
                self.tries[source][1] += int(accepted)
        outputs = self._outputs
        if outputs is None:
            raise SpecdecError("lookahead needs the target's tokens at its nodes (observe_targets) before keep_path")
        newest = []
        for j, last in enumerate(self._columns):
            if last is None:
                break
            gram = tuple(level[j] for level in self.levels) + (outputs[1 + last],)
            self._remember(gram)
            newest.append(outputs[1 + last])
        self._advance(newest, len(path) + 1)
        self._drafted, self._outputs = False, None

    def _remember(self, gram: tuple[int, ...]) -> None:
        """Add an n-gram to the pool under its first token: newest first, at most G kept."""
        grams = self.pool.setdefault(gram[0], [])
        rest = gram[1:]
        if rest in grams:
            grams.remove(rest)
        grams.insert(0, rest)
        del grams[max(1, self.shape[2]):]

    def _advance(self, newest: list[int], committed: int) -> None:
        """One Jacobi iteration, aligned to the committed text: the token at (level l, column j)
        guessed the position j + 1 + l after the old last token; after `committed` tokens the new
        (l, j) is the old (l + 1, j + committed − 1), the newest level the target's argmax after the
        old last level. Columns shifted in from past the window start from prompt tokens."""
        shift = committed - 1
        window = len(self.levels[0])
        newest = newest + self.levels[-1][len(newest):]  # unscored columns keep their guesses
        moved = self.levels[1:] + [newest]
        self.levels = [level[shift:] + [self._filler() for _ in range(min(shift, window))] for level in moved]
        self.levels = [level[:window] for level in self.levels]

    def timing(self, draft_seconds: float, drafter_passes: int, verify_seconds: float, width: int,
               emitted: int) -> None:
        self.policy.timing(draft_seconds, drafter_passes, verify_seconds, width, emitted)


def _add(parent: Node, token: int, chance: float, sources: dict, source: str) -> Node:
    """The child of `parent` for `token` (made if new; valued by the path's chance), noted as `source`'s."""
    node = parent.child(token)
    if node is None:
        node = Node(token, 0.0, "deterministic")
        parent.children.append(node)
    node.value = max(node.value, parent.value * chance)
    sources[(id(node), source)] = (node, source)
    return node
