"""Many sequences at once: requests admitted up to a batch size, each decoded step by step
(`generate.Decoding`), all running sequences' tokens scored in one target pass per step
(`BatchedBackend.forward_batch`)."""

from .engine import Engine, Request, generate_many

__all__ = ["Engine", "Request", "generate_many"]
