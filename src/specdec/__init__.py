"""specdec: lossless speculative decoding for Hugging Face language models."""

import os as _os

# Before torch loads its OpenMP runtime (libgomp reads this once, at load): its threads spin this
# long at each barrier, not libgomp's default, before they sleep. A pass has hundreds of parallel
# regions; where other processes share the cores, a longer spin burns the time slices the
# descheduled thread needs (docs/kernels.md#threads-on-a-shared-machine). A user's
# own GOMP_SPINCOUNT or OMP_WAIT_POLICY is left alone; importing torch before specdec keeps its own.
OWN_ENV = {} if {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & set(_os.environ) else {"GOMP_SPINCOUNT": "20000"}
_os.environ.update(OWN_ENV)

from .engine import Engine, Request, generate_many
from .errors import SpecdecError
from .decoding.loop import autoregressive_generate, speculative_generate, speculative_generate_encoder_decoder
from .decoding.results import GenerationResult, GenerationStats, Step
from .decoding.beam import beam_search_generate, speculative_beam_search
from .backends import Backend
from .backends.seq2seq import Seq2SeqModel
from .backends.transformers import TransformersModel
from .models.loading import load
from .core.penalties import LogitRules
from .core.samplers import GREEDY, Sampler, logits_to_probs, sample
from .backends.text import check_pair
from .core.verify import (sibling_laws, verify_coupled, verify_draft, verify_greedy, verify_tree, verify_tree_coupled,
                     verify_tree_greedy)
from .drafters import (Eagle2Drafter, LookaheadDrafter, LookupDrafter, LookupTreeDrafter, MixedDrafter, ModelDrafter, NgramDrafter,
                       SequoiaDrafter, SidesDrafter, make_tree_drafter)
from .sizing.schedules import TreeCost, make_schedule
from .decoding.config import SpecConfig
from .decoding.speculation import Parts, Speculation, build, resolve
from .decoding.sequence import Limits
from .core.trees import Tree

__all__ = [
    "GREEDY", "GenerationResult", "LogitRules", "GenerationStats", "Backend", "TransformersModel", "Engine", "Request", "generate_many", "Sampler", "SpecdecError", "Step",
    "autoregressive_generate", "beam_search_generate", "check_pair", "load", "logits_to_probs", "sample", "speculative_generate",
    "speculative_generate_encoder_decoder", "Seq2SeqModel", "LookaheadDrafter", "speculative_beam_search",
    "verify_draft", "verify_greedy", "verify_coupled", "verify_tree_coupled", "LookupDrafter", "ModelDrafter", "NgramDrafter", "make_schedule",
    "Tree", "TreeCost", "sibling_laws", "verify_tree", "verify_tree_greedy", "Eagle2Drafter", "LookupTreeDrafter",
    "MixedDrafter", "SequoiaDrafter", "SidesDrafter", "make_tree_drafter", "SpecConfig", "Parts", "Speculation",
    "build", "resolve", "Limits",
]
__version__ = "0.1.0"
