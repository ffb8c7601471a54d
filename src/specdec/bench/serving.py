"""`specdec bench-serve`: load on any OpenAI-compatible server, with the figures `vllm bench serve`
reports: completed and failed requests, request and output token throughput, time to first token,
time per output token, inter-token latency and end-to-end latency (mean, p50, p90, p99), and the
speculation the server's `/metrics` counted over the run (vLLM's `spec_decode_*` counters, ours
under `specdec:`). The same tool measures the peers, so their figures come from one client.

Every level sends a bounded number of requests, each with a timeout: a run stops by itself.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from ..errors import SpecdecError
from .concurrency import percentile

FIGURES = ("ttft", "tpot", "itl", "e2e")


@dataclass
class Record:
    """One request as the client saw it (seconds on the client's clock)."""

    ok: bool
    start: float
    end: float
    first: float | None = None  # the first chunk with text
    chunks: list[float] = field(default_factory=list)  # arrival of every chunk with text
    tokens: int = 0  # output tokens (the server's usage, else chunks with text)
    error: str | None = None


def spec_counters(metrics_text: str) -> dict[str, float]:
    """{"drafts", "draft_tokens", "accepted_tokens"} summed over a Prometheus text's
    `*spec_decode_num_*_total` samples, whatever their prefix (vllm:, specdec:, ...)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0}
    names = {"spec_decode_num_drafts_total": "drafts", "spec_decode_num_draft_tokens_total": "draft_tokens",
             "spec_decode_num_accepted_tokens_total": "accepted_tokens"}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            for suffix, key in names.items():
                if sample.name.split(":")[-1] == suffix:
                    totals[key] += sample.value
    return totals


def summarize(records: list[Record], duration: float) -> dict:
    """The level's figures from its records (ms for latencies)."""
    done = [r for r in records if r.ok]
    tokens = sum(r.tokens for r in done)
    series = {
        "ttft": [r.first - r.start for r in done if r.first is not None],
        "tpot": [(r.end - r.first) / (r.tokens - 1) for r in done if r.first is not None and r.tokens > 1],
        "itl": [b - a for r in done for a, b in zip(r.chunks, r.chunks[1:])],
        "e2e": [r.end - r.start for r in done],
    }
    out = {"completed": len(done), "failed": len(records) - len(done), "duration_s": duration,
           "request_throughput": len(done) / duration if duration else 0.0,
           "output_throughput": tokens / duration if duration else 0.0, "output_tokens": tokens}
    for name, values in series.items():
        out[f"{name}_ms"] = {"mean": 1e3 * sum(values) / len(values) if values else None,
                             **{f"p{q}": (1e3 * v if (v := percentile(values, q)) is not None else None)
                                for q in (50, 90, 99)}}
    errors = [r.error for r in records if r.error]
    if errors:
        out["first_error"] = errors[0]
    return out


async def _one(client, url: str, body: dict, chat: bool, timeout: float) -> Record:
    record = Record(ok=False, start=time.perf_counter(), end=0.0)
    try:
        await asyncio.wait_for(_stream(client, url, body, chat, record), timeout)
    except Exception as error:  # a timeout, httpx's transport errors, a server that hung up, bad JSON
        record.ok, record.error = False, f"{type(error).__name__}: {error}"[:200]
    finally:
        record.end = time.perf_counter()
    return record


async def _stream(client, url: str, body: dict, chat: bool, record: Record) -> None:
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                record.error = str(event["error"])[:200]
                return
            if event.get("usage"):
                record.tokens = event["usage"].get("completion_tokens") or record.tokens
            for choice in event.get("choices") or []:
                text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                if text:
                    now = time.perf_counter()
                    record.first = record.first or now
                    record.chunks.append(now)
    record.ok = True
    record.tokens = record.tokens or len(record.chunks)


async def run_level(base_url: str, prompts: list[tuple[str, bool]], concurrency: int, requests: int,
                    settings: dict, api_key: str | None = None, timeout: float = 600.0) -> tuple[list[Record], float]:
    """`requests` requests (prompts in turn), at most `concurrency` in flight -> (records, seconds)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # a fresh connection per request: reusing one a server closes after a streamed response (llama-server
    # did, now and then) fails the next request with "Server disconnected" before it is sent
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=httpx.Timeout(timeout)) as client:
        async def send(i: int) -> Record:
            text, chat = prompts[i % len(prompts)]
            body = {**settings, "stream": True, "stream_options": {"include_usage": True}}
            body.update({"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text})
            path = "/v1/chat/completions" if chat else "/v1/completions"
            async with gate:
                return await _one(client, base_url + path, body, chat, timeout)

        began = time.perf_counter()
        records = await asyncio.gather(*(send(i) for i in range(requests)))
        return list(records), time.perf_counter() - began


def _metrics(base_url: str, api_key: str | None) -> str | None:
    import httpx

    try:
        response = httpx.get(base_url + "/metrics", timeout=10,
                             headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        return response.text if response.status_code == 200 else None
    except httpx.HTTPError:
        return None


@dataclass
class Server:
    """One server a run loads: a name for the tables (None alone), its base URL, and the fields
    every request to it carries (model, max_tokens, ... and any of its own, e.g. speculative)."""

    name: str | None
    url: str
    settings: dict


def bench_serve(base_url: str, prompts: list[tuple[str, bool]], levels: list[int], requests: int, settings: dict,
                api_key: str | None = None, timeout: float = 600.0, say=lambda message: None,
                variants: dict[str, dict] | None = None, repeats: int = 1) -> list[dict]:
    """One server: `bench_servers` with it alone."""
    return bench_servers([Server(None, base_url, settings)], prompts, levels, requests, api_key, timeout, say,
                         variants, repeats=repeats)


def bench_servers(servers: list[Server], prompts: list[tuple[str, bool]], levels: list[int], requests: int,
                  api_key: str | None = None, timeout: float = 600.0, say=lambda message: None,
                  variants: dict[str, dict] | None = None, warmups: int = 0, repeats: int = 1) -> list[dict]:
    """Every level in turn; at each level every server with every variant (a name -> fields merged
    into the request bodies, e.g. {"ar": {"speculative": False}}; None: the settings alone), one
    after another in a counterbalanced order (`run.method_orders`: over the levels each runs first
    and after each other equally often; on one server the first to run at a level also pays its
    batch policy's learning of the new batch sizes). Servers that run side by side are thus
    measured interleaved, each level of each under the same machine load, as ratios need.
    repeats: rounds of every server and variant at each level, each round in the next order; a
    summary pools a server's rounds (their requests, their seconds summed) and lists each round's
    output throughput (`repeat_output_throughput`): on a machine whose pace drifts within minutes,
    a level run once is one draw of that drift.
    warmups: requests sent to each server first, one at a time, not measured (a server's first
    requests page in its weights). -> one summary per level, server and variant (in the order
    given), with the speculation its /metrics counted meanwhile."""
    from .run import method_orders

    if not prompts:
        raise SpecdecError("bench-serve needs at least one prompt")
    if not isinstance(repeats, int) or repeats < 1:
        raise SpecdecError(f"repeats must be an integer >= 1, got {repeats!r}")
    for server in servers if warmups > 0 else ():
        records, _ = asyncio.run(run_level(server.url, prompts, 1, warmups, server.settings, api_key, timeout))
        say(f"warm-up {server.name or server.url}: {sum(r.ok for r in records)} of {warmups} completed")
    runs = [(server, name, extra) for server in servers for name, extra in (variants or {None: {}}).items()]
    orders = method_orders(list(range(len(runs))))
    summaries = []
    for level in levels:
        rounds: dict[int, list[_Round]] = {i: [] for i in range(len(runs))}
        for repeat in range(repeats):
            for i in next(orders):
                server, variant, extra = runs[i]
                done = _measure(server, prompts, level, requests, extra, api_key, timeout)
                rounds[i].append(done)
                label = " ".join(x for x in (server.name, variant) if x)
                again = f" (repeat {repeat + 1}/{repeats})" if repeats > 1 else ""
                alone = summarize(done.records, done.seconds)
                say(f"concurrency {level}{f' {label}' if label else ''}{again}: {alone['completed']} completed, "
                    f"{alone['failed']} failed, {alone['output_throughput']:.2f} output tok/s" +
                    (f" (first error: {alone['first_error']})" if alone.get("first_error") else ""))
        summaries += [_pooled(level, runs[i][0], runs[i][1], rounds[i]) for i in range(len(runs))]
    return summaries


@dataclass
class _Round:
    """One level of one server and variant, once: its requests, its seconds, and the growth of the
    server's speculation counters meanwhile (None without /metrics)."""

    records: list[Record]
    seconds: float
    speculation: dict[str, float] | None


def _measure(server: Server, prompts, level: int, requests: int, extra: dict, api_key: str | None,
             timeout: float) -> _Round:
    """One level of one server and variant, once."""
    before = _metrics(server.url, api_key)
    records, seconds = asyncio.run(run_level(server.url, prompts, level, requests, {**server.settings, **extra},
                                             api_key, timeout))
    after = _metrics(server.url, api_key)
    grown = None
    if before is not None and after is not None:
        start, end = spec_counters(before), spec_counters(after)
        grown = {k: end[k] - start[k] for k in end}
    return _Round(records, seconds, grown)


def _pooled(level: int, server: Server, variant: str | None, rounds: list[_Round]) -> dict:
    """A level's summary for one server and variant over its rounds."""
    summary = {"concurrency": level, **({"server": server.name} if server.name is not None else {}),
               **({"variant": variant} if variant is not None else {}),
               **summarize([r for one in rounds for r in one.records], sum(one.seconds for one in rounds))}
    if all(one.speculation is not None for one in rounds):
        grown = {k: sum(one.speculation[k] for one in rounds) for k in rounds[0].speculation}
        summary["speculation"] = {**grown, "acceptance_rate": grown["accepted_tokens"] / grown["draft_tokens"]
                                  if grown["draft_tokens"] else None}
    if len(rounds) > 1:
        summary["repeat_output_throughput"] = [summarize(one.records, one.seconds)["output_throughput"]
                                               for one in rounds]
    return summary


def render(summaries: list[dict]) -> str:
    """A markdown table of the levels."""
    def ms(figure: dict, q: str) -> str:
        value = figure[q]
        return "–" if value is None else f"{value:.0f}"

    labels = [key for key in ("server", "variant") if any(key in s for s in summaries)]
    lines = ["| concurrency | " + "".join(f"{key} | " for key in labels) + "completed | failed | req/s | "
             "output tok/s | TTFT p50 / p90 / p99 (ms) | TPOT p50 / p99 (ms) | ITL p50 / p99 (ms) | "
             "E2E p50 / p99 (ms) | acceptance |",
             "|---|" + "---|" * len(labels) + "---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        spec = s.get("speculation") or {}
        rate = spec.get("acceptance_rate")
        named = "".join(f"{s.get(key) or ''} | " for key in labels)
        lines.append(
            f"| {s['concurrency']} | {named}{s['completed']} | {s['failed']} | {s['request_throughput']:.2f} | "
            f"{s['output_throughput']:.2f}{_spread(s)} | {ms(s['ttft_ms'], 'p50')} / {ms(s['ttft_ms'], 'p90')} / "
            f"{ms(s['ttft_ms'], 'p99')} | {ms(s['tpot_ms'], 'p50')} / {ms(s['tpot_ms'], 'p99')} | "
            f"{ms(s['itl_ms'], 'p50')} / {ms(s['itl_ms'], 'p99')} | {ms(s['e2e_ms'], 'p50')} / "
            f"{ms(s['e2e_ms'], 'p99')} | {'–' if rate is None else f'{rate:.2f}'} |")
    return "\n".join(lines)


def _spread(summary: dict) -> str:
    """The repeats' lowest and highest output throughput, " (low–high)", after a pooled one; "" for one round."""
    each = summary.get("repeat_output_throughput")
    return f" ({min(each):.2f}–{max(each):.2f})" if each else ""

