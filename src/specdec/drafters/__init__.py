"""Drafters: whatever proposes tokens for the target to verify, behind one small protocol.

A drafter proposes up to n tokens after a context, with the distribution q each was drawn
from (or None when the proposal is deterministic: q is then one-hot at each token, which keeps
rejection sampling exact). The loop in `generate.py` knows nothing else about it.
"""

from .base import Draft, Drafter, KeepGoing
from .dynamic import Eagle2Drafter, SequoiaDrafter, sequoia_shape
from .lookup import LookupDrafter
from .model import ModelDrafter
from .ngram import NgramDrafter
from .tree import TREES, LookupTreeDrafter, MixedDrafter, SidesDrafter, make_tree_drafter

__all__ = ["Draft", "Drafter", "Eagle2Drafter", "KeepGoing", "SequoiaDrafter", "sequoia_shape", "LookupDrafter", "LookupTreeDrafter", "MixedDrafter", "ModelDrafter",
           "NgramDrafter", "SidesDrafter", "TREES", "make_tree_drafter"]
