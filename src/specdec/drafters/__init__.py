"""Drafters: whatever proposes tokens for the target to verify, behind one small base class (`Drafter`).

A drafter proposes up to n tokens after a context, with the distribution q each was drawn
from (or None when the proposal is deterministic: q is then one-hot at each token, which keeps
rejection sampling exact). The loop in `decoding/loop.py` knows nothing else about it.

Tree drafters (sides.py, mixed.py, lookup_tree.py, suffix_tree.py, eagle2.py, sequoia.py,
lookahead.py; self-drafting in medusa.py, eagle.py) propose a token tree
instead; `make_tree_drafter` builds one by name (the CLI's `--tree`, the bench's `tree-*` methods).
"""

from __future__ import annotations

from ..backends import Backend
from ..errors import SpecdecError
from ..sizing.schedules import AssumedCosts, TreeCost
from ..core.trees import SCHEMES
from .base import Draft, Drafter, KeepGoing
from .cascade import CascadeDrafter
from .eagle2 import Eagle2Drafter
from .lookahead import LookaheadDrafter, lookahead_shape
from .lookup import LookupDrafter
from .lookup_tree import LookupTreeDrafter
from .mixed import MixedDrafter
from .model import ModelDrafter
from .ngram import NgramDrafter
from .retokenize import OtherTokenizerDrafter
from .sequoia import SequoiaDrafter, sequoia_shape
from .sides import SidesDrafter
from .suffix import SuffixCache, SuffixDrafter, SuffixIndex
from .suffix_tree import SuffixTreeDrafter

__all__ = ["CascadeDrafter", "Draft", "Drafter", "Eagle2Drafter", "KeepGoing", "SequoiaDrafter", "sequoia_shape",
           "LookaheadDrafter", "lookahead_shape", "LookupDrafter",
           "LookupTreeDrafter", "MixedDrafter", "ModelDrafter", "NgramDrafter", "OtherTokenizerDrafter", "SidesDrafter", "SuffixCache", "SuffixDrafter", "SuffixIndex",
           "SuffixTreeDrafter", "MODEL_FREE_TREES", "TREES", "check_tree_options", "make_tree_drafter"]


TREES = {
    "sides": "the drafter model's chain plus its next best tokens beside each chain token",
    "eagle2": "EAGLE-2 dynamic tree: the best nodes by path value, expanded one drafter pass per depth",
    "sequoia": "Sequoia static shape from measured per-rank acceptance, sized by measured costs",
    "lookup": "prompt lookup trie over several earlier occurrences (no drafter model)",
    "mixed": "the drafter model's chain with sides plus prompt-lookup branches, or lookup alone where that "
             "is measured faster (the default tree)",
    "suffix": "suffix drafting's tree mode (SuffixDecoding) over the prompt and output (no drafter model)",
    "mixed-suffix": "the mixed tree with suffix-tree branches in place of prompt lookup's",
    "lookahead": "lookahead decoding: Jacobi iteration's window and its n-gram pool (no drafter model), "
                 "its shape from the measured cost of wide passes",
}
MODEL_FREE_TREES = {"lookup", "suffix", "lookahead"}  # trees that need no drafter model


def check_tree_options(kind: str, max_nodes: int, scheme: str) -> None:
    """Raise SpecdecError for an unknown tree, a node budget below 1 or an unknown sibling scheme."""
    if kind not in TREES:
        raise SpecdecError(f"unknown tree '{kind}'; choose from off, {', '.join(TREES)}")
    if not isinstance(max_nodes, int) or max_nodes < 1:
        raise SpecdecError(f"tree nodes must be an integer >= 1, got {max_nodes!r}")
    if scheme not in SCHEMES:
        raise SpecdecError(f"unknown sibling scheme {scheme!r}; use one of {', '.join(SCHEMES)}")


def make_tree_drafter(kind: str, model: Backend | None = None, max_nodes: int = 64,
                      scheme: str = "without-replacement", width: int | None = None,
                      assumed: AssumedCosts | None = None, suffix_cache: SuffixCache | None = None,
                      lookahead_shape: tuple[int, int, int] | None = None, max_depth: int = 5):
    """A tree drafter by name (see TREES), sized by measured cost (`TreeCost`) up to `max_nodes`
    and `max_depth`, or by `assumed` costs (sized for another machine, see `AssumedCosts`).
    `suffix_cache`: earlier outputs the suffix trees also draft from (shared by the drafters of
    one run or server). `lookahead_shape`: lookahead's (W, N, G), in place of the one sized by cost."""
    check_tree_options(kind, max_nodes, scheme)
    policy = TreeCost(max_depth=max_depth, max_nodes=max_nodes, assumed=assumed)
    if kind == "lookup":
        return LookupTreeDrafter(policy=policy)
    if kind == "suffix":
        return SuffixTreeDrafter(suffix_cache, policy=policy)
    if kind == "lookahead":
        return LookaheadDrafter(*(lookahead_shape or (None, None, None)), policy=policy)
    if model is None:
        raise SpecdecError(f"the '{kind}' tree needs a drafter model")
    if kind == "sides":
        return SidesDrafter(model, width or 3, scheme=scheme, policy=policy)
    if kind == "mixed":
        return MixedDrafter(model, width or 2, scheme=scheme, policy=policy)
    if kind == "mixed-suffix":
        return MixedDrafter(model, width or 2, scheme=scheme, policy=policy,
                            lookup=SuffixTreeDrafter(suffix_cache, policy=policy))
    if kind == "eagle2":
        return Eagle2Drafter(model, width or 4, policy=policy)
    return SequoiaDrafter(model, policy=policy)
