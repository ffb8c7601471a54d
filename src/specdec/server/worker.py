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
from typing import Protocol

from ..engine import Engine, Request
from ..generate import GenerationResult

log = logging.getLogger("specdec.server")


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
        distiller's update: `adapter.OnlineDistiller.update`), so it never runs during a request.
    """

    def __init__(self, engine: Engine, max_waiting: int = 64, on_step=None, between=None):
        self.engine, self.max_waiting, self.on_step, self.between = engine, max_waiting, on_step, between
        self.dead: BaseException | None = None  # what ended the engine's thread, if anything did
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[int, Sink] = {}
        self._ids: dict[int, int] = {}  # id(sink) -> engine request id
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
    def running(self) -> int:
        return len(self.engine.running) + len(self.engine.prefilling)

    def submit(self, request: Request, sink: Sink) -> None:
        """Queue a request; raises QueueFull when `max_waiting` already wait. An invalid request
        reaches `sink.failed` (its SpecdecError) from the engine's thread."""
        with self._lock:
            if self.dead is not None:
                raise EngineStopped(f"the engine stopped on an error ({self.dead!r}); this server serves no more")
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
                    self._settle(1)
                    sink.failed(error)
                    continue
                self._sinks[request_id], self._ids[id(sink)] = sink, request_id
            else:
                request_id = self._ids.pop(id(sink), None)
                if request_id is not None and self._sinks.pop(request_id, None) is not None:
                    if any(r.id == request_id for r in self.engine.waiting):
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
        stopped = EngineStopped(f"the engine stopped on an error ({error!r}); this server serves no more")
        try:
            self._drain()  # requests still in the inbox are told too
        except Exception:
            log.exception("taking in the last requests failed")
        for sink in list(self._sinks.values()):
            sink.failed(stopped)
        self._sinks.clear()
        self._ids.clear()

    def _idle(self) -> None:
        """No request in the engine: the update between requests, if any, then wait for work."""
        if self.between is not None:
            try:
                self.between()
            except Exception:  # the learner's trouble is not the requests': it stops, serving goes on
                log.exception("the update between requests failed; it is turned off, serving goes on")
                self.between = None
            self._drain()
            if self.engine.busy:
                return
        self._wake.wait(0.1)
        self._wake.clear()

    def _turn(self) -> None:
        """Take in adds and cancels, then one engine step and its tokens handed out (or wait idle)."""
        self._drain()
        if not self.engine.busy:
            self._idle()
            return
        waiting = len(self.engine.waiting)
        try:
            emitted = self.engine.step()
        except Exception as error:  # a pass shared by every running sequence failed: they fail, the server goes on
            log.exception("an engine step failed; the requests in it end with the error")
            self._fail_running(error)
            return
        finally:
            self._settle(waiting - len(self.engine.waiting))
        for request_id, error in self.engine.failed.items():  # one sequence's own error
            sink = self._sinks.pop(request_id, None)
            if sink is not None:
                self._ids.pop(id(sink), None)
                sink.failed(error)
        self.engine.failed.clear()
        for request_id, ids in emitted.items():
            sink = self._sinks.get(request_id)
            if sink is not None and ids:
                logprobs = self.engine.logprobs(request_id)
                sink.tokens(ids, None if logprobs is None else logprobs[len(logprobs) - len(ids):])
        for request_id in [r for r in self.engine.results if r in self._sinks]:
            sink = self._sinks.pop(request_id)
            self._ids.pop(id(sink), None)
            sink.done(self.engine.results.pop(request_id))
        self.engine.results.clear()  # cancelled ones' results are nobody's
        if self.on_step is not None:
            self.on_step(self.engine)

    def _fail_running(self, error: Exception) -> None:
        for request_id in list(self.engine.running) + list(self.engine.prefilling):
            self.engine.cancel(request_id)
            sink = self._sinks.pop(request_id, None)
            if sink is not None:
                self._ids.pop(id(sink), None)
                sink.failed(error)
