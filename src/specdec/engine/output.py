"""What one engine step hands out (`StepOutput`): the only way results and failures leave the
engine, each once, so that a caller (the server's worker, `Engine.run`) never reads or clears the
engine's own state."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..core.logprobs import TokenLogprob
from ..decoding.results import GenerationResult
from ..errors import ModelFault, SpecdecError

log = logging.getLogger("specdec.engine")


@dataclass
class StepOutput:
    """One step's outcome, by request id.

    emitted: the tokens each running request emitted this step (in order; the last of a finished
        request's tokens among them).
    logprobs: their `TokenLogprob`s, one per emitted token, for the requests that asked for them.
    finished: the requests that ended this step, with their whole `GenerationResult`.
    failed: the requests that ended this step on an error of their own (the others go on).
    started: the requests taken off the queue this step (admitted, or failed while starting).
    """

    emitted: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)
    finished: dict[int, GenerationResult] = field(default_factory=dict)
    failed: dict[int, Exception] = field(default_factory=dict)
    started: list[int] = field(default_factory=list)

    def fail(self, request_id: int, error: Exception, where: str) -> None:
        """Record that one request ended on an error of its own at `where` (logged as it
        deserves: a model's fault as a warning, a bug with its trace, a bad input not at all)."""
        if isinstance(error, ModelFault):
            log.warning("%s failed for request %s; it alone ends: %s", where, request_id, error)
        elif not isinstance(error, SpecdecError):
            log.exception("%s failed for request %s; it alone ends", where, request_id, exc_info=error)
        self.failed[request_id] = error

    def merge(self, later: StepOutput) -> None:
        """Add a later step's outcome to this one (a run's outcome over its steps)."""
        for request_id, tokens in later.emitted.items():
            self.emitted.setdefault(request_id, []).extend(tokens)
        for request_id, logprobs in later.logprobs.items():
            self.logprobs.setdefault(request_id, []).extend(logprobs)
        self.finished.update(later.finished)
        self.failed.update(later.failed)
        self.started += later.started


class StepFailed(Exception):
    """A step failed outside every request's own guard (`error`); `output` holds what it had
    emitted, finished and failed before it broke, so that those are still handed out once."""

    def __init__(self, error: Exception, output: StepOutput):
        super().__init__(f"an engine step failed: {error}")
        self.error, self.output = error, output
