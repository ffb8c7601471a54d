"""`specdec serve`: OpenAI's completions and chat completions API over the engine.

Each request is checked (`schema`), turned into the engine's requests (`service`), and fed to the
engine's thread (`worker`); its tokens come back as they are committed, are detokenized
incrementally, cut at stop strings, and streamed as server-sent events or returned whole. A
client that disconnects cancels its sequences; a request's own error ends it alone.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
import uuid
from typing import Callable

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from ..backends import features
from ..backends.prompts import PREFILL_TOKENS
from ..errors import ModelFault, SpecdecError
from ..decoding.results import GenerationResult
from .metrics import Metrics, speculation_usage
from .schema import BadRequest, Job, parse_body, parse_job
from .service import Service
from .tools import CallParser
from .worker import STALL_TIMEOUT, STOPPED, EngineStopped, QueueFull, Worker, is_clients

log = logging.getLogger("specdec.server")

POLL = 0.25  # seconds between checks for a vanished client while a request runs


class _Choice:
    """One choice's stream, filled from the engine's thread: ("tokens", (ids, logprobs)), ("done",
    result) or ("failed", error) items on an asyncio queue of the server's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()
        self.first: float | None = None

    def _put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def tokens(self, ids: list[int], logprobs: list | None = None) -> None:
        if self.first is None:
            self.first = time.perf_counter()
        self._put(("tokens", (ids, logprobs)))

    def done(self, result: GenerationResult) -> None:
        self._put(("done", result))

    def failed(self, error: Exception) -> None:
        self._put(("failed", error))


class _Text:
    """Token ids to text as they come: text that may still change (an incomplete UTF-8 sequence)
    or may begin a stop string is held back until it cannot. With `offsets`, also where each
    token's text ends (`ends`), to say which tokens a piece of text carries (`released`).

    Decoded incrementally: each new token decodes with at most SEAM + 2 * STABLE ids before it,
    so a long answer costs linear time, not a decode of the whole output per token (a tokenizer may
    merge or strip at the seam: the tail is read as the difference of two decodes of a window
    that starts SEAM tokens before the text taken as settled). Text STABLE tokens back settles
    whatever it decodes to, U+FFFD included: UTF-8 completes a character within 4 bytes, so bytes
    that far back either joined one or never will (a client can ask for lone-byte tokens with
    `logit_bias`; waiting for them to decode cleanly would re-decode the whole output per token)."""

    SEAM, STABLE = 4, 8
    PARTIAL = 3  # the most U+FFFD an incomplete character at the end shows (one per byte at most)

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str], offsets: bool = False,
                 min_tokens: int = 0, include_stop: bool = False):
        self.decode, self.stops, self.ids, self.sent = decode, stops, [], 0
        # as vLLM: a stop string counts only where it ends past the first min_tokens tokens' text
        self.min_tokens, self.floor, self.include_stop = min_tokens, 0 if min_tokens == 0 else None, include_stop
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.stopped = False
        self.ends: list[int] | None = [] if offsets else None
        self.final = False
        self.text = ""
        self._released = 0  # tokens counted as sent by `released`, advanced as `sent` grows
        self._settled, self._settled_text = 0, ""  # ids[:_settled] decode to _settled_text, for good
        self._head = ""  # the decode of the SEAM ids before _settled: changes only when the text settles

    def _push(self, token: int) -> None:
        self.ids.append(token)
        start, head = max(0, self._settled - self.SEAM), self._head
        window = self.decode(self.ids[start:])
        tail = window[len(head):] if window.startswith(head) else self.decode(self.ids)[len(self._settled_text):]
        self.text = self._settled_text + tail
        if self.ends is not None:
            end, ends = len(self.text), self.ends
            # a character completed shortens the text (its bytes' U+FFFD become one character): the
            # tokens that held its first bytes end where it does, so that `ends` never decreases
            k = len(ends) - 1
            while k >= 0 and ends[k] > end:
                ends[k], k = end, k - 1
            ends.append(end)
        if len(self.ids) - self._settled >= 2 * self.STABLE:
            settle = len(self.ids) - self.STABLE  # the window's first ids can no longer change
            settled = self.decode(self.ids[start:settle])
            # the cut at `settle` splits no character the ids after it complete: the text so far
            # (STABLE tokens on, so at least as many bytes) goes on from what is settled
            if settled.startswith(head) and tail.startswith(settled[len(head):]):
                self._settled, self._settled_text = settle, self._settled_text + settled[len(head):]
                self._head = self.decode(self.ids[max(0, settle - self.SEAM):settle])

    def add(self, ids: list[int], final: bool = False) -> str:
        """The next piece of text to send; after a stop string, `stopped` and nothing more."""
        for token in ids:
            self._push(token)
            if self.floor is None and len(self.ids) == self.min_tokens:
                self.floor = len(self.text)
        self.final = final
        text = self.text
        found = [] if self.floor is None else [  # (where, -length): the earliest, then the longest
            (i, -len(s)) for s in self.stops
            for i in [text.find(s, max(0, self.sent - self.hold, self.floor - len(s) + 1))] if i >= 0]
        cut, longest = min(found, default=(-1, 0))
        if cut >= 0:
            self.stopped = True
            end = cut - longest if self.include_stop else cut
        elif final:
            end = len(text)
        else:
            end, partial = len(text) - self.hold, 0
            # a character still incomplete shows as U+FFFD at the end; earlier ones are final
            while end > self.sent and partial < self.PARTIAL and text[end - 1] == "\ufffd":
                end, partial = end - 1, partial + 1
        piece = text[self.sent:max(end, self.sent)]
        self.sent = max(end, self.sent)
        return piece

    def released(self) -> int:
        """How many tokens the text sent so far carries: those whose text it holds whole; at a stop
        string, those whose text begins before it; once final, all."""
        if self.final:
            return len(self.ids)
        if self.stopped:
            return sum(1 for start in [0] + self.ends[:-1] if start < self.sent)
        ends = self.ends  # never decreasing (`_push`): counted on from the last call, not from 0
        while self._released < len(ends) and ends[self._released] <= self.sent:
            self._released += 1
        return self._released


def _error(error: BadRequest) -> JSONResponse:
    headers = {"Retry-After": "1"} if error.status == 429 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


class _SameMachineOnly:
    """ASGI middleware: a page in the user's browser can POST to a keyless loopback server, and
    DNS rebinding lets it read the answer too. Browsers say where a request comes from (`Origin`)
    and whom they think they ask (`Host`): a request from a page not in `origins` is refused, and
    so, on a loopback `host`, is one addressed to another name (403, OpenAI's error body)."""

    def __init__(self, app, origins: list[str], host: str | None):
        self.app, self.origins, self.host = app, set(origins), host

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            origin, asked = headers.get("origin"), headers.get("host", "")
            error = None
            if origin is not None and origin not in self.origins:
                error = BadRequest(f"requests from web pages are refused unless --cors-origin allows them; "
                                   f"{origin!r} is not allowed", status=403, code="origin_not_allowed")
            elif self.host in LOOPBACK and _host_name(asked) not in LOOPBACK:
                error = BadRequest(f"this server listens on {self.host} and answers only requests addressed to "
                                   f"it, not to {asked!r}", status=403, code="host_not_allowed")
            if error is not None:
                await _error(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Stalled(Exception):
    """A send to the client stayed blocked past the write timeout."""


class _BoundedSends:
    """ASGI middleware, outside all others (it sees the server's own `send`): a client that stops
    reading makes `send` wait (uvicorn holds back once its buffer is full), which would hold the
    request's sequences forever. A send blocked past the service's `limits.write_timeout` ends the
    request: the connection is dropped, and the response's generator closed, which cancels its
    sequences."""

    def __init__(self, app, state: dict):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        service = self.state["service"]
        if scope["type"] != "http" or service is None:
            await self.app(scope, receive, send)
            return
        limit = service.limits.write_timeout

        async def bounded(message):
            try:
                await asyncio.wait_for(send(message), limit)
            except asyncio.TimeoutError:
                raise _Stalled from None

        try:
            await self.app(scope, receive, bounded)
        except _Stalled:
            client = scope.get("client") or ("?", 0)
            log.warning("a client (%s) read nothing for %g s (--write-timeout): its request is cancelled and its "
                        "connection dropped", client[0], limit)
            # uvicorn's own send is its request cycle's; its transport, aborted, drops what the
            # client never read (a plain close would wait for it to be read first)
            transport = getattr(getattr(send, "__self__", None), "transport", None)
            if transport is None:  # another server than uvicorn, or another uvicorn: let it close the connection
                raise
            transport.abort()
            await asyncio.sleep(0)  # uvicorn hears of it: a client gone, not an answer left unfinished


class _App(FastAPI):
    def build_middleware_stack(self):
        return _BoundedSends(super().build_middleware_stack(), self.state.specdec)


class _Stream(StreamingResponse):
    """A stream whose generator is closed however the sending ends (a stalled client's send timed
    out, say), so that its sequences are cancelled at once rather than when it is collected."""

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()


def _host_name(host: str) -> str:
    """The name in a Host header, its port left out ('[::1]:8000' -> '::1')."""
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _sse(payload: dict | str) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n".encode()


LOOPBACK = ("127.0.0.1", "localhost", "::1")
API_KEY_VARIABLE = "SPECDEC_API_KEY"


def api_key_from(flag: str | None, path=None) -> list[str] | None:
    """The API keys: `--api-key`, else every non-empty line of `--api-key-file` but `#` comments
    (one key per client: each key is a tenant of its own, `cache_salt`), else $SPECDEC_API_KEY,
    else None (no key). Raises SpecdecError for two sources at once, an unreadable or empty file,
    or a key that is not printable ASCII (an HTTP header carries no other). A key file that others
    than its owner may read is warned about."""
    import os
    from pathlib import Path

    if flag is not None and path is not None:
        raise SpecdecError("give the key once: --api-key or --api-key-file, not both")
    if path is not None:
        try:
            lines = Path(path).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise SpecdecError(f"--api-key-file {path}: cannot read it ({exc.__class__.__name__})") from None
        keys = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
        if not keys:
            raise SpecdecError(f"--api-key-file {path} is empty")
        if os.name == "posix" and Path(path).stat().st_mode & 0o077:
            log.warning("--api-key-file %s is readable by other users; chmod 600 %s", path, path)
        return _ascii_keys(keys, f"--api-key-file {path}")
    if flag is not None:
        if not flag.strip():
            raise SpecdecError("--api-key is empty")
        return _ascii_keys([flag], "--api-key")
    key = os.environ.get(API_KEY_VARIABLE)
    return _ascii_keys([key], f"${API_KEY_VARIABLE}") if key else None


def _ascii_keys(keys: list[str], source: str) -> list[str]:
    """The keys, refused where one could never match: a header's bytes are ASCII (clients send
    nothing else), so a key with other characters would lock every client out."""
    for number, key in enumerate(keys, 1):
        if not all(" " < c < "\x7f" for c in key):
            where = f" (key {number})" if len(keys) > 1 else ""
            raise SpecdecError(f"{source}{where}: a key must be printable ASCII without spaces, as HTTP headers carry")
    return keys


def create_app(load: Callable[[], Service], max_batch: int = 8, kv_memory: int | Callable | None = None,
               api_key: str | list[str] | None = None, on_load_error: Callable[[Exception], None] | None = None,
               steer: bool = True, cors_origins: list[str] | None = None, host: str | None = None,
               stall_timeout: float = STALL_TIMEOUT, metrics_public: bool = False,
               loading: Callable[[], str | None] | None = None, prefill_tokens: int = PREFILL_TOKENS) -> FastAPI:
    """The ASGI app. `load` runs on a thread at startup (`/health` answers 503 until it returns)
    and gives the service; the engine's worker starts then and stops at shutdown. kv_memory: the
    running sequences' KV budget in bytes, or a function of the loaded service giving it (None: no
    budget; `service.auto_kv_budget`, the CLI's default). A load that
    fails goes to `on_load_error` (the CLI stops the server), and /health says why. steer: the
    engine sizes drafts from the batch's measured costs (`Engine`; False: each request's own schedule).
    cors_origins: the web origins whose pages may call the API (a request from any other page,
    one with an `Origin` header, is refused: 403). host: the address listened on; on a loopback
    address, a request naming another host (`Host`: a DNS-rebinding page) is refused (403).
    stall_timeout: seconds without a completed engine step, while requests wait, after which
    /health answers 503 (as it does after `worker.FAILED_STEPS` failed steps in a row).
    metrics_public: /metrics answers without a key even where keys are set (a scraper on a private
    network); otherwise it asks for one, as it shows every tenant's load.
    loading: what the load is doing meanwhile (e.g. "loading the models"), which /health's 503
    says. Costs the service still has to measure (`Service.pending_costs`) are taken between
    requests, one at a time, while it serves (/health's "measuring" says how far).
    `app.state.specdec` holds "service", "worker" and "error"."""
    state: dict = {"service": None, "worker": None, "error": None}
    metrics = Metrics(waiting=lambda: state["worker"].waiting if state["worker"] else 0,
                      running=lambda: state["worker"].running if state["worker"] else 0)

    def start() -> None:
        try:
            from ..engine import Engine

            service = load()
            budget = kv_memory(service) if callable(kv_memory) else kv_memory
            engine = Engine(service.target, max_batch, budget, steer, service.load_costs, prefill_tokens)
            worker = Worker(engine, service.limits.max_waiting, between=_between_requests(service, engine, state),
                            stall_timeout=stall_timeout)
            worker.start()
            state["service"], state["worker"] = service, worker
        except Exception as error:  # reported by /health and every request, in words without internals
            if not isinstance(error, SpecdecError):  # ours say all in one line (the CLI's exit line)
                log.exception("the model failed to load")
            state["error"] = error
            if on_load_error is not None:
                on_load_error(error)

    async def lifespan(app):
        threading.Thread(target=start, name="specdec-load", daemon=True).start()
        yield
        if state["worker"] is not None:
            state["worker"].stop(timeout=10)

    app = _App(title="specdec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.specdec = state
    allowed_origins = sorted(set(cors_origins or []))
    app.add_middleware(_SameMachineOnly, origins=allowed_origins, host=host)
    if allowed_origins:  # outermost: answers those origins' preflights and marks their answers readable
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"])

    def ready() -> Service:
        if state["error"] is not None:
            raise BadRequest("the model failed to load (the server's log says why)", status=503, type="server_error")
        if state["service"] is None:
            doing = loading() if loading is not None else None
            raise BadRequest(f"the model is loading{f': {doing}' if doing else ''}; retry shortly", status=503,
                             type="server_error")
        if state["worker"] is not None and state["worker"].dead is not None:
            raise BadRequest(STOPPED, status=503, type="server_error", code="engine_stopped")
        return state["service"]

    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])

    def authorize(request: HttpRequest) -> str:
        """Check the request's key -> its tenant ("" without keys; with several keys, each its own)."""
        if not keys:
            return ""
        scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
        # the scheme's name is case-insensitive (RFC 7235); headers arrive as latin-1, keys are ASCII
        given = token.strip().encode("latin-1") if scheme.lower() == "bearer" else b""
        # every key compared, so the time taken does not tell which one nearly matched
        matches = [hmac.compare_digest(given, key.encode()) for key in keys]
        if not any(matches):
            raise BadRequest("invalid or missing API key (Authorization: Bearer KEY)", status=401,
                             type="authentication_error", code="invalid_api_key")
        return f"key{matches.index(True)}" if len(keys) > 1 else ""

    @app.get("/health")
    async def health():
        """200 {"status": "ok", ...} while the engine serves; 503 while loading, after it stopped,
        while its steps keep failing, or when none completes while work waits."""
        try:
            ready()
            trouble = state["worker"].trouble()
            if trouble is not None:
                raise BadRequest(trouble, status=503, type="server_error", code="engine_unhealthy")
        except BadRequest as error:
            return _error(error)
        return {"status": "ok", **state["worker"].health(), "measuring": state["service"].measuring()}

    @app.get("/metrics")
    async def prometheus(request: HttpRequest):
        if not metrics_public:
            try:
                authorize(request)
            except BadRequest as error:
                return _error(error)
        return Response(metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: HttpRequest):
        try:
            authorize(request)
            service = ready()
        except BadRequest as error:
            return _error(error)
        return {"object": "list", "data": [{"id": service.name, "object": "model", "created": 0,
                                            "owned_by": "specdec", "max_model_len": service.target.max_context}]}

    async def complete(request: HttpRequest, chat: bool):
        arrival = time.perf_counter()
        try:
            tenant = authorize(request)
            service = ready()
            _check_json(request.headers.get("content-type"))
            declared = request.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > service.limits.max_body:  # refused before it is read
                raise BadRequest(f"the request body is {declared} bytes, over this server's limit of "
                                 f"{service.limits.max_body}", status=413, code="body_too_large")
            try:  # a body trickled in holds its connection: it gets --body-timeout for all of it
                raw = await asyncio.wait_for(_read_body(request, service.limits.max_body), service.limits.body_timeout)
            except asyncio.TimeoutError:
                raise BadRequest(f"the request body did not arrive within this server's limit of "
                                 f"{service.limits.body_timeout:g} s", status=408, code="body_timeout") from None
            body = parse_body(raw, service.limits.max_body)
            job = parse_job(body, chat, service.name, service.default, service.default_method)
            # each key its own tenant, its clients' salts apart within it; always prefixed, so that a
            # client's own salt ("a/b") never names a tenant
            job.cache_salt, job.tenant = f"{tenant}/{job.cache_salt}", tenant
            # tokenising up to --max-body of text, chat template and all, is CPU work: off the event
            # loop, so that other streams, their disconnect checks and timeouts go on meanwhile
            await asyncio.to_thread(service.constrain, job)  # compiling a schema is CPU work too
            prompts = await asyncio.to_thread(service.prompt_ids, job)
            bounds = [service.max_new_tokens(job, len(ids)) for ids in prompts]
            for ids, bound in zip(prompts, bounds):
                service.check_fits(job, len(ids), bound, state["worker"].engine.kv_memory)
            engine_requests = [r for ids, bound in zip(prompts, bounds)  # choice k: prompt k // n, its choice k % n
                               for r in service.requests(job, ids, bound)]
            share = max(1, service.limits.max_waiting // 2)  # one request never fills the whole queue
            if len(engine_requests) > share:  # could never be queued: no retry helps
                raise BadRequest(f"{len(prompts)} prompt(s) × n = {job.n} make {len(engine_requests)} choices, over "
                                 f"this server's limit of {share} a request (half of the "
                                 f"{service.limits.max_waiting} it queues at once)", "n")
        except BadRequest as error:
            metrics.requests.labels(status="rejected").inc()
            return _error(error)
        except ClientDisconnect:  # gone while its body was read: no one to answer
            metrics.requests.labels(status="cancelled").inc()
            return Response(status_code=499)
        loop = asyncio.get_running_loop()
        choices = [_Choice(loop) for _ in engine_requests]
        worker: Worker = state["worker"]
        try:
            for engine_request, choice in zip(engine_requests, choices):
                worker.submit(engine_request, choice)
        except QueueFull as full:
            for choice in choices:
                worker.cancel(choice)
            metrics.requests.labels(status="rejected").inc()
            return _error(BadRequest(f"the server is busy: {full}; retry later", status=429, type="server_error",
                                     code="queue_full"))
        except EngineStopped as stopped:
            metrics.requests.labels(status="error").inc()
            return _error(BadRequest(str(stopped), status=503, type="server_error", code="engine_stopped"))
        run = _Run(service, job, chat, prompts, choices, worker, metrics, arrival, request)
        if job.stream:
            return _Stream(run.events(job.include_usage), media_type="text/event-stream",
                           headers={"Cache-Control": "no-cache"})
        return await run.whole()

    @app.post("/v1/completions")
    async def completions(request: HttpRequest):
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HttpRequest):
        return await complete(request, chat=True)

    return app


def _check_json(content_type: str | None) -> None:
    """A 415 unless the body is declared JSON (in UTF-8): a web page can send a form or plain text
    to any address without asking first (no CORS preflight), but not application/json."""
    media, *params = (content_type or "").split(";")
    charset = next((p.split("=", 1)[1].strip().strip('"').lower() for p in params if p.strip().lower()
                    .startswith("charset=")), "utf-8")
    if media.strip().lower() != "application/json" or charset not in ("utf-8", "utf8"):
        raise BadRequest(f"the request body must be JSON (Content-Type: application/json), not "
                         f"{(content_type or 'undeclared')[:100]!r}", status=415, code="unsupported_media_type")


def _between_requests(service: Service, engine, state: dict) -> Callable[[], None] | None:
    """What the engine's thread does whenever no request is in the engine: the next cost still to
    measure, yielding between sizes to requests that arrive (the batched profile then becomes the
    engine's prior), else an `--online` drafter's update; None where there is neither."""
    online = features(service.drafter).online if service.drafter is not None else None  # --online's learner
    if not service.pending_costs and online is None:
        return None

    def between() -> None:
        if service.pending_costs:
            arrived = lambda: state["worker"] is not None and state["worker"].work_waiting  # noqa: E731
            if service.measure_next(arrived) == "load_costs" and engine.costs is not None:
                engine.costs.prior = service.load_costs
        elif online is not None:
            online.update()
    return between


async def _read_body(request: HttpRequest, limit: int) -> bytes:
    """The request's body, read as it arrives and refused (413) as soon as it passes `limit` bytes:
    a chunked body declares no length, and reading it whole first would hold all of it in memory."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BadRequest(f"the request body is over this server's limit of {limit} bytes", status=413,
                             code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


class _Run:
    """One request's choices in flight: gathered whole, or streamed as events."""

    def __init__(self, service: Service, job: Job, chat: bool, prompts: list[list[int]], choices: list[_Choice],
                 worker: Worker, metrics: Metrics, arrival: float, request: HttpRequest):
        self.service, self.job, self.chat, self.prompts = service, job, chat, prompts
        self.choices, self.worker, self.metrics, self.arrival, self.request = choices, worker, metrics, arrival, request
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        decode = service.target.decode
        self.texts = [_Text(decode, job.stop, offsets=job.logprobs is not None, min_tokens=job.rules.min_tokens,
                            include_stop=job.include_stop) for _ in choices]
        self.logprobs: list[list] = [[] for _ in choices]  # TokenLogprobs received, per choice
        self.reported = [0] * len(choices)  # of them, how many a response has carried
        self.results: list[GenerationResult | None] = [None] * len(choices)
        self.reasons: list[str | None] = [None] * len(choices)
        self.status = "ok"
        # the tool calls in each choice's text, where tools are offered
        names = {tool["function"]["name"] for tool in job.tools or []}
        one = not job.parallel_tool_calls or isinstance(job.tool_choice, dict)
        self.calls = [CallParser(names, one) for _ in choices] if job.tools else None
        self.call_counts = [0] * len(choices)

    async def _items(self):
        """(choice index, text piece, finish reason or None) as the engine commits tokens; cancels
        every choice left if the client goes away or the request runs out of time."""
        pending = {asyncio.ensure_future(c.queue.get()): i for i, c in enumerate(self.choices)}
        deadline = self.arrival + self.service.limits.request_timeout
        checked = time.perf_counter()
        try:
            while pending:
                done, _ = await asyncio.wait(pending, timeout=POLL, return_when=asyncio.FIRST_COMPLETED)
                if time.perf_counter() - checked >= POLL:  # tokens may flow all the while
                    checked = time.perf_counter()
                    if await self.request.is_disconnected():
                        self.status = "cancelled"
                        return
                    if checked > deadline:
                        self.status = "timeout"
                        raise BadRequest(f"the request ran past this server's limit of "
                                         f"{self.service.limits.request_timeout:g} s", status=504,
                                         type="server_error", code="timeout")
                for future in done:
                    i = pending.pop(future)
                    kind, value = future.result()
                    text = self.texts[i]
                    if kind == "failed":
                        self.status = "error"
                        if isinstance(value, EngineStopped):
                            raise BadRequest(str(value), status=503, type="server_error", code="engine_stopped")
                        # the request's own trouble is a 400; the model's a 500 in our words; anything
                        # else a 500 that says no more than where to look (its text may hold internals)
                        if is_clients(value):
                            raise BadRequest(f"generation failed: {value}")
                        if isinstance(value, ModelFault):
                            raise BadRequest(f"generation failed: {value}", status=500, type="server_error")
                        raise BadRequest("generation failed on an internal error (the server's log has it)",
                                         status=500, type="server_error", code="internal_error")
                    if kind == "tokens":
                        ids, logprobs = value
                        self.logprobs[i] += logprobs or []
                        piece = text.add(ids)
                        if text.stopped:
                            self.worker.cancel(self.choices[i])
                            self.reasons[i] = "stop"
                            self._settle(i, None)
                            yield i, piece, "stop"
                            continue
                        pending[asyncio.ensure_future(self.choices[i].queue.get())] = i
                        if piece:
                            yield i, piece, None
                    else:  # done
                        piece = text.add([], final=True)
                        self.reasons[i] = "length" if value.stop_reason in ("max_new_tokens", "context") else "stop"
                        self._settle(i, value)
                        yield i, piece, self.reasons[i]
        finally:
            for future in pending:
                future.cancel()
            for i, choice in enumerate(self.choices):
                if self.reasons[i] is None:
                    self.worker.cancel(choice)

    def _settle(self, i: int, result: GenerationResult | None) -> None:
        """A choice ended (result None: cut at a stop string; its tokens so far count)."""
        if result is None:
            from ..decoding.results import GenerationStats

            result = GenerationResult(self.texts[i].ids, [], GenerationStats(), "stop")
        self.results[i] = result
        end = time.perf_counter()
        prompt = i // self.job.n
        counted = any(r is not None for r in self.results[prompt * self.job.n:(prompt + 1) * self.job.n]
                      if r is not result)  # a prompt's tokens count once, as in `usage`
        self.metrics.finished(result, 0 if counted else len(self.prompts[prompt]), self.arrival,
                              self.choices[i].first or end, end)

    def usage(self) -> dict:
        done = [r for r in self.results if r is not None]
        completion = sum(len(r.tokens) for r in done)
        passes = sum(r.stats.target_passes for r in done)
        spec = [speculation_usage(r) for r in done]
        prompt = sum(map(len, self.prompts))
        n = self.job.n
        # a prompt's entries taken from the prompt cache: its choices each have a cache of their own
        cached = sum(max((r.stats.cached_prompt_tokens for r in self.results[p * n:(p + 1) * n] if r is not None),
                         default=0) for p in range(len(self.prompts)))
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached},
                "speculative": {"method": self.job.method or "off",
                                "drafted_tokens": sum(s["draft_tokens"] for s in spec),
                                "accepted_tokens": sum(s["accepted_tokens"] for s in spec),
                                "target_passes": passes,
                                "tokens_per_target_pass": round(completion / passes, 3) if passes else None}}

    def _choice(self, i: int, text: str, reason: str | None, delta: bool = False) -> dict | None:
        """Choice i's part of a response (delta: of a chunk; None where a chunk would carry nothing)."""
        calls = []
        if self.calls is not None:  # the text is parsed for tool calls: it is content only outside them
            parser = self.calls[i]
            text, calls = parser.feed(text)
            if reason is not None:
                text += parser.finish()
            for call in calls:
                call["index"], self.call_counts[i] = self.call_counts[i], self.call_counts[i] + 1
            if reason == "stop" and self.call_counts[i]:
                reason = "tool_calls"
        logprobs = self._logprobs(i)
        if not self.chat:
            return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}
        if delta:
            if not text and not calls and reason is None and not (logprobs or {}).get("content"):
                return None
            message = {"content": text} if text else {}
            if calls:
                message["tool_calls"] = calls
            return {"index": i, "delta": message, "logprobs": logprobs, "finish_reason": reason}
        message = {"role": "assistant", "content": text, "refusal": None}
        if calls:
            message["content"] = text or None
            message["tool_calls"] = [{key: value for key, value in call.items() if key != "index"} for call in calls]
        return {"index": i, "message": message, "logprobs": logprobs, "finish_reason": reason}

    def _logprobs(self, i: int) -> dict | None:
        """The `logprobs` of choice i's tokens that its text sent so far carries and no earlier
        response did, in OpenAI's chat or completions layout (None where not asked for)."""
        if self.job.logprobs is None:
            return None
        text = self.texts[i]
        first, last = self.reported[i], min(text.released(), len(self.logprobs[i]))
        self.reported[i] = max(first, last)
        entries = self.logprobs[i][first:last]
        name = self.service.token_text
        if self.chat:
            def item(token: int, logprob: float) -> dict:
                return {"token": name(token), "logprob": logprob, "bytes": list(self.service.token_bytes(token))}
            return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, v) for t, v in e.top]}
                                for e in entries], "refusal": None}
        return {"tokens": [name(e.token) for e in entries], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{name(t): v for t, v in e.top} for e in entries],
                "text_offset": [text.ends[k - 1] if k else 0 for k in range(first, first + len(entries))]}

    def _envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.service.name,
                "choices": choices}

    async def whole(self):
        pieces = [[] for _ in self.choices]
        try:
            async for i, piece, _ in self._items():
                pieces[i].append(piece)
        except BadRequest as error:
            self.metrics.requests.labels(status=self.status).inc()
            return _error(error)
        self.metrics.requests.labels(status=self.status).inc()
        if self.status != "ok":
            return Response(status_code=499)
        body = self._envelope([self._choice(i, "".join(p), self.reasons[i]) for i, p in enumerate(pieces)], False)
        body["usage"] = self.usage()
        return body

    async def events(self, include_usage: bool):
        try:
            if self.chat:
                yield _sse(self._envelope([{"index": i, "delta": {"role": "assistant", "content": "", "refusal": None},
                                            "logprobs": None, "finish_reason": None}
                                           for i in range(len(self.choices))], True))
            async for i, piece, reason in self._items():
                choice = self._choice(i, piece, reason, delta=True)
                if choice is not None:
                    yield _sse(self._envelope([choice], True))
            if include_usage:
                yield _sse({**self._envelope([], True), "usage": self.usage()})
            yield _sse("[DONE]")
        except BadRequest as error:  # the status line is sent: the error goes as an event
            yield _sse(error.body())
            yield _sse("[DONE]")
        finally:  # also when the client went away (the generator is closed)
            if self.status == "ok" and any(r is None for r in self.reasons):
                self.status = "cancelled"
            self.metrics.requests.labels(status=self.status).inc()
