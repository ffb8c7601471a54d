"""The engine on a thread of its own: requests join at the next step boundary and leave as they
end or are cancelled; each one's tokens go to its `Sink` as they are committed.

HTTP handlers never touch the engine: they put adds and cancels in an inbox that the engine's
thread drains between steps, so a step (hundreds of ms on a CPU) never blocks the event loop,
and a client that goes away frees its sequence within one step.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Protocol

from ..engine import Engine, Request, StepFailed, StepOutput
from ..errors import ModelFault, SpecdecError
from ..decoding.results import GenerationResult

log = logging.getLogger("specdec.server")

FAILED_STEPS = 3  # engine steps failed in a row after which /health says the engine is failing
STALL_TIMEOUT = 120.0  # seconds without a completed step, while work waits, after which /health says stalled
RECENT = 100  # steps the recent failure rate counts


class QueueFull(Exception):
    """More requests wait than the server takes (it answers 429 with Retry-After)."""


class EngineStopped(Exception):
    """The engine's thread has ended on an error of its own: nothing more is served (503)."""


class Sink(Protocol):
    """Where one request's output goes; called from the engine's thread."""

    def tokens(self, ids: list[int], logprobs: list | None) -> None:
        """The tokens a step committed, and their `TokenLogprob`s where the request asked."""

    def done(self, result: GenerationResult) -> None: ...

    def failed(self, error: Exception) -> None: ...


class Worker:
    """Runs `engine` step by step on its own thread.

    max_waiting: the most requests queued (not yet running) before `submit` raises QueueFull.
    on_step: called after each step with the engine (metrics), on the engine's thread.
    between: called on the engine's thread whenever no request is in the engine (an online
        distiller's update: `lora.OnlineDistiller.update`), so it never runs during a request.
    stall_timeout: seconds without a completed step, while requests wait or run, after which
        `trouble` reports the engine stalled.
    """

    def __init__(self, engine: Engine, max_waiting: int = 64, on_step=None, between=None,
                 stall_timeout: float = STALL_TIMEOUT):
        self.engine, self.max_waiting, self.on_step, self.between = engine, max_waiting, on_step, between
        self.stall_timeout = stall_timeout
        self.dead: BaseException | None = None  # what ended the engine's thread, if anything did
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[int, Sink] = {}
        self._ids: dict[int, int] = {}  # id(sink) -> engine request id
        self._waiting: set[int] = set()  # engine request ids queued there, not yet taken off the queue
        self.last_step = time.monotonic()  # when a step last completed, or the engine last sat idle
        self.failed_in_a_row = 0  # steps that failed since the last one that did not
        self.last_failure = 0.0  # when a step last failed: a failing streak is reported for stall_timeout after it
        self.busy_between = False  # whether `between` runs now (work then waits on it, not on a stalled step)
        self._recent: deque[bool] = deque(maxlen=RECENT)  # recent steps: whether each failed
        self._queued = 0  # submitted, not yet running or ended (read from other threads)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop stepping (in-flight requests are left as they are) and join the thread."""
        self._stopping.set()
        self._wake.set()
        if self.thread.is_alive():
            self.thread.join(timeout)

    @property
    def waiting(self) -> int:
        """Requests submitted that are not running yet."""
        return self._queued

    @property
    def work_waiting(self) -> bool:
        """Whether adds or cancels wait in the inbox (what the update between requests yields to)."""
        return not self._inbox.empty()

    @property
    def running(self) -> int:
        """Requests in the engine that are past its queue (their prompts fed, or decoding)."""
        return len(self._sinks) - len(self._waiting)

    def trouble(self) -> str | None:
        """Why the engine cannot be trusted to serve (steps failing in a row, or none completing
        while work waits), in words for /health; None when it is well."""
        if self.failed_in_a_row >= FAILED_STEPS and time.monotonic() - self.last_failure < self.stall_timeout:
            return f"the last {self.failed_in_a_row} engine steps failed (see the server's log)"
        age = time.monotonic() - self.last_step
        if age > self.stall_timeout and (self._queued or self.running) and not self.busy_between:
            return (f"no engine step has completed for {age:.0f} s while {self._queued + self.running} request(s) "
                    "wait or run")
        return None

    def health(self) -> dict:
        """The age of the last completed step and the recent failure rate, for /health."""
        return {"last_step_seconds_ago": round(time.monotonic() - self.last_step, 3),
                "recent_steps": len(self._recent), "recent_failed_steps": sum(self._recent),
                "waiting": self._queued, "running": self.running}

    def submit(self, request: Request, sink: Sink) -> None:
        """Queue a request; raises QueueFull when `max_waiting` already wait. An invalid request
        reaches `sink.failed` (its SpecdecError) from the engine's thread."""
        with self._lock:
            if self.dead is not None:
                raise EngineStopped(STOPPED)
            if self._queued >= self.max_waiting:
                raise QueueFull(f"{self._queued} requests are waiting, this server's limit")
            self._queued += 1
        self._inbox.put(("add", request, sink))
        self._wake.set()

    def cancel(self, sink: Sink) -> None:
        """Drop the request feeding `sink` (a client that went away); its cache is freed at the
        next step boundary."""
        self._inbox.put(("cancel", None, sink))
        self._wake.set()

    def _drain(self) -> None:
        while True:
            try:
                action, request, sink = self._inbox.get_nowait()
            except queue.Empty:
                return
            if action == "add":
                try:
                    request_id = self.engine.add(request)
                except Exception as error:  # a bad request fails alone
                    if not is_clients(error):
                        log.exception("taking in a request failed; it alone ends")
                    self._settle(1)
                    sink.failed(error)
                    continue
                self._sinks[request_id], self._ids[id(sink)] = sink, request_id
                self._waiting.add(request_id)
            else:
                request_id = self._ids.get(id(sink))
                waiting = request_id in self._waiting
                if request_id is not None and self._forget(request_id) is not None:
                    if waiting:
                        self._settle(1)
                    self.engine.cancel(request_id)

    def _settle(self, count: int) -> None:
        with self._lock:
            self._queued -= count

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                try:
                    self._turn()
                except Exception:  # outside every request's own guard: logged, and the engine goes on
                    log.exception("the engine's loop hit an error outside any request; serving goes on")
        except BaseException as error:  # the thread ends: say so to every request and to /health
            log.critical("the engine's thread stopped; this server serves no more", exc_info=True)
            self._die(error)

    def _die(self, error: BaseException) -> None:
        with self._lock:
            self.dead = error
        stopped = EngineStopped(STOPPED)
        try:
            self._drain()  # requests still in the inbox are told too
        except Exception:
            log.exception("taking in the last requests failed")
        for sink in list(self._sinks.values()):
            sink.failed(stopped)
        self._sinks.clear()
        self._ids.clear()
        self._waiting.clear()

    def _idle(self) -> None:
        """No request in the engine: the update between requests, if any, then wait for work."""
        self.last_step = time.monotonic()  # idle, or busy between requests, is no stall
        if self.between is not None:
            self.busy_between = True
            try:
                self.between()
            except Exception:  # the learner's trouble is not the requests': it stops, serving goes on
                log.exception("the update between requests failed; it is turned off, serving goes on")
                self.between = None
            finally:
                self.busy_between = False
            self.last_step = time.monotonic()
            self._drain()
            if self.engine.busy:
                return
        self._wake.wait(0.1)
        self._wake.clear()

    def _turn(self) -> None:
        """Take in adds and cancels, then one engine step and what every request has committed
        since handed out (or wait idle). A step that fails outside every request's own guard ends
        the requests still running, after what finished in it has been handed out."""
        self._drain()
        if not self.engine.busy:
            self._idle()
            return
        output, failure = StepOutput(), None
        try:
            output = self.engine.step()
        except StepFailed as failed:  # what the step handed out before it broke still goes out
            log.exception("an engine step failed outside any one request; the requests still running end with it")
            output, failure = failed.output, failed.error
        except Exception as error:
            log.exception("an engine step failed outside any one request; the requests still running end with it")
            failure = error
        handed, faults = self._hand_out(output)
        if failure is not None:
            self._fail_running(failure)
        self._count(failure is not None or (faults and not handed))
        if failure is not None and self.failed_in_a_row >= FAILED_STEPS:  # it fails before admitting anyone:
            self._fail_waiting(failure)  # those waiting would wait on it for ever
        if self.on_step is not None:
            self.on_step(self.engine)

    def _hand_out(self, output: StepOutput) -> tuple[int, int]:
        """A step's output to the sinks: the requests taken off the engine's queue, each one's
        error if it ended on one, the tokens it committed, its result if it finished -> (tokens
        handed out, requests ended on a fault not theirs). Cancelled requests' are nobody's."""
        handed, faults = 0, 0
        started = self._waiting.intersection(output.started)
        self._waiting -= started
        self._settle(len(started))
        for request_id, error in output.failed.items():  # one sequence's own error
            sink = self._forget(request_id)
            if sink is not None:
                sink.failed(error)
                faults += not is_clients(error)
        for request_id, tokens in output.emitted.items():
            sink = self._sinks.get(request_id)
            if sink is not None and tokens:
                sink.tokens(tokens, output.logprobs.get(request_id))
                handed += len(tokens)
        for request_id, result in output.finished.items():
            sink = self._forget(request_id)
            if sink is not None:
                sink.done(result)
        return handed, faults

    def _count(self, failed: bool) -> None:
        self._recent.append(failed)
        self.failed_in_a_row = self.failed_in_a_row + 1 if failed else 0
        if failed:
            self.last_failure = time.monotonic()
        else:
            self.last_step = time.monotonic()

    def _forget(self, request_id: int) -> Sink | None:
        """Stop feeding a request's sink -> the sink (None if it had none)."""
        self._waiting.discard(request_id)  # first: `running`, read from other threads, never dips below 0
        sink = self._sinks.pop(request_id, None)
        if sink is not None:
            self._ids.pop(id(sink), None)
        return sink

    def _fail_running(self, error: Exception) -> None:
        for request_id in [r for r in self._sinks if r not in self._waiting]:
            self.engine.cancel(request_id)
            sink = self._forget(request_id)
            if sink is not None:
                sink.failed(error)

    def _fail_waiting(self, error: Exception) -> None:
        for request_id in sorted(self._waiting):  # in the order they came
            self.engine.cancel(request_id)
            self._settle(1)
            sink = self._forget(request_id)
            if sink is not None:
                sink.failed(error)


STOPPED = "the engine stopped on an internal error (see the server's log); this server serves no more: restart it"


def is_clients(error: Exception) -> bool:
    """Whether a request's error is the client's own (a 400), not the model's or the server's (5xx)."""
    return isinstance(error, SpecdecError) and not isinstance(error, ModelFault)
