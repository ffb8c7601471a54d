"""Many sequences at once: requests admitted up to a batch size, each decoded step by step
(`sequence.Decoding`), all running sequences' tokens scored in one target pass per step
(`BatchedBackend.forward_batch`)."""

from .batch import generate_many
from .engine import Engine
from .request import Request
from .output import StepFailed, StepOutput

__all__ = ["Engine", "Request", "StepFailed", "StepOutput", "generate_many"]
