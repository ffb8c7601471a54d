"""specdec: lossless speculative decoding for Hugging Face language models."""

from .errors import SpecdecError
from .generate import (GenerationResult, GenerationStats, Step, autoregressive_generate, beam_search_generate,
                       speculative_generate)
from .models import LanguageModel, check_pair, load
from .samplers import GREEDY, Sampler, logits_to_probs, sample
from .verify import verify_draft, verify_greedy
from .drafters import LookupDrafter, ModelDrafter, NgramDrafter
from .schedules import make_schedule

__all__ = [
    "GREEDY", "GenerationResult", "GenerationStats", "LanguageModel", "Sampler", "SpecdecError", "Step",
    "autoregressive_generate", "beam_search_generate", "check_pair", "load", "logits_to_probs", "sample", "speculative_generate",
    "verify_draft", "verify_greedy", "LookupDrafter", "ModelDrafter", "NgramDrafter", "make_schedule",
]
__version__ = "0.1.0"
