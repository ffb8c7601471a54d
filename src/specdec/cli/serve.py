"""`specdec serve` and `specdec bench-serve`: the OpenAI-compatible server and its load test."""

from __future__ import annotations

import json
import sys
import time
from functools import partial
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from ..models import catalogue as registry
from ..errors import SpecdecError
from .common import (app, err, _fail, _drafter_weights, DRAFTER_DTYPE_HELP, parse_bytes, _csv)


@app.command()
def serve(
    target: str = typer.Option(registry.DEFAULT_TARGET, help="Target model: registry name, HF directory or .gguf."),
    drafter: str = typer.Option(registry.DEFAULT_DRAFTER, help="Drafter model (same vocabulary), 'none', or a "
                                "model-free drafter as generate's (ngram, lookup, suffix, retrieval:DIR), or a "
                                "parallel drafter (parallel:DIR), which then is the default method."),
    method: str = typer.Option("default", help="Requests' speculation unless they say: any method or preset of "
                               "`specdec methods` but the self-drafting ones (default: the drafter model's chain, "
                               "cost-aware; lookup; suffix, over the request's text and earlier outputs; retrieval, "
                               "--datastore; tree, the mixed tree; lookahead; ar; tree-sides; sd; ...)."),
    gamma_max: Optional[int] = typer.Option(None, "--gamma-max", help="Longest draft (chains) or deepest tree (at "
                                            "most 64; default 20, egag's γ)."),
    tree_nodes: int = typer.Option(64, "--tree-nodes", help="Most nodes in a tree (methods tree, lookahead; "
                                   "at most 64)."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on (loopback unless told otherwise)."),
    port: int = typer.Option(8000, help="Port to listen on."),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="Require 'Authorization: Bearer KEY' on /v1/* "
                                          "(visible in the process list: prefer --api-key-file or SPECDEC_API_KEY)."),
    api_key_file: Optional[Path] = typer.Option(None, "--api-key-file", help="Read the keys from this file, one "
                                                "per line: each client's key is a tenant of its own (cache_salt)."),
    metrics_public: bool = typer.Option(False, "--metrics-public", help="Serve /metrics without a key where "
                                        "keys are set (a Prometheus scraper on a private network)."),
    cors_origin: Optional[List[str]] = typer.Option(None, "--cors-origin", help="A web origin whose pages may "
                                                    "call the API (repeatable); requests from other pages: 403."),
    max_batch: int = typer.Option(8, "--max-batch", help="Most sequences decoded at once."),
    kv_memory: str = typer.Option("auto", "--kv-memory", help="A budget for the running sequences' KV caches "
                                  "(e.g. 2GiB; requests beyond it wait, one that can never fit is a 400): auto "
                                  "(80% of the memory free once the models are in, less the prompt caches), "
                                  "or none."),
    prefill_tokens: Optional[int] = typer.Option(None, "--prefill-tokens", help="About how many prompt tokens a "
                                                 "step feeds, in one pass shared by the arriving prompts (default "
                                                 "1024): more takes a burst of requests in fewer passes, while the "
                                                 "running ones wait longer for that step's token."),
    max_waiting: int = typer.Option(64, "--max-waiting", help="Most requests queued; beyond it, 429."),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Output bound of a chat request that sets none."),
    max_prompt_tokens: Optional[int] = typer.Option(None, "--max-prompt-tokens", help="Longest prompt taken "
                                                    "(default: the model's context)."),
    max_body: str = typer.Option("1MiB", "--max-body", help="Largest request body."),
    request_timeout: float = typer.Option(600.0, "--request-timeout", help="Seconds a request may run (then 504)."),
    stall_timeout: float = typer.Option(120.0, "--stall-timeout", help="Seconds without a completed engine step, "
                                        "while requests wait, after which /health answers 503."),
    grace: float = typer.Option(30.0, "--grace", help="On SIGTERM, seconds in-flight requests get to finish."),
    body_timeout: float = typer.Option(60.0, "--body-timeout", help="Seconds a request's whole body may take to "
                                       "arrive (then 408)."),
    write_timeout: float = typer.Option(60.0, "--write-timeout", help="Seconds a response may wait on a client that "
                                        "reads nothing (then the request is cancelled, its connection dropped)."),
    max_connections: int = typer.Option(1000, "--max-connections", help="Most connections and requests at once; "
                                        "beyond it, 503."),
    suffix_cache_tokens: int = typer.Option(100_000, "--suffix-cache-tokens", help="Most tokens of earlier "
                                            "outputs the suffix method drafts from, per cache (one per API key and "
                                            "cache_salt; 0: none)."),
    datastore_dir: Optional[str] = typer.Option(None, "--datastore", help="A datastore (specdec datastore build) "
                                                "the retrieval method drafts from."),
    dtype: str = typer.Option("auto", "--dtype", "--weights", help="Target weights: auto, fp32 or bf16 "
                              "(transformers' weights), or gguf (the GGUF file's own weights on llama.cpp's "
                              "backend, chains only); the batched engine runs either."),
    drafter_dtype: str = typer.Option("auto", help=DRAFTER_DTYPE_HELP),
    device: str = typer.Option("auto", help="auto, cpu or cuda."),
    online: bool = typer.Option(False, "--online", help="The drafter learns from its rejected drafts (OSD): a "
                                "small adapter updated whenever no request is running. Outputs stay exact."),
    prompt_cache: bool = typer.Option(True, "--prompt-cache/--no-prompt-cache", help="A finished request's prompt "
                                      "serves later prompts that start alike (whole 256-token chunks; outputs stay "
                                      "exact): kept in its KV stream on --dtype gguf, copied on transformers' weights."),
    prompt_cache_memory: str = typer.Option("256MiB", "--prompt-cache-memory", help="On transformers' weights: the "
                                            "most memory kept prompts take in the target, and again in a drafter model; "
                                            "the least recently used dropped first."),
    costs_first: bool = typer.Option(False, "--costs-first", help="Take the pass costs that size drafts (from "
                                     "the cache, or timed: minutes on a first start on a CPU) before serving, "
                                     "/health answering 503 meanwhile, instead of between the first requests: "
                                     "where other work will share the cores once it serves, so that it times them "
                                     "alone."),
):
    """An OpenAI-compatible server (/v1/completions, /v1/chat/completions, /v1/models, /health,
    /metrics) on the batched engine."""
    from ..drafters.datastore import Datastore
    from ..models.loading import GGUF_WEIGHTS
    from ..server.app import api_key_from, create_app
    from ..server.service import Limits

    try:
        method, no_drafter, datastore_dir = _served_method(method, drafter, datastore_dir, dtype)
        _check_bounds(gamma_max=gamma_max, tree_nodes=tree_nodes, max_batch=max_batch, max_waiting=max_waiting,
                      max_tokens=max_tokens, port=port, max_prompt_tokens=max_prompt_tokens,
                      suffix_cache_tokens=suffix_cache_tokens, max_connections=max_connections, prefill_tokens=prefill_tokens,
                      request_timeout=request_timeout, grace=grace, stall_timeout=stall_timeout,
                      body_timeout=body_timeout, write_timeout=write_timeout)
        datastore = Datastore(datastore_dir) if datastore_dir is not None else None  # before minutes of loading
        budget = _kv_budget(kv_memory)
        if prompt_cache and dtype not in GGUF_WEIGHTS:
            prompt_cache = parse_bytes(prompt_cache_memory, "--prompt-cache-memory")
        limits = Limits(max_tokens=max_tokens, max_prompt_tokens=max_prompt_tokens,
                        max_body=parse_bytes(max_body, "--max-body"), request_timeout=request_timeout,
                        max_waiting=max_waiting, body_timeout=body_timeout, write_timeout=write_timeout)
        api_key = api_key_from(api_key, api_key_file)
        if online:
            _check_online(no_drafter or _drafter_weights(dtype, drafter, drafter_dtype, False) in GGUF_WEIGHTS,
                          api_key)
    except SpecdecError as exc:
        _fail(str(exc))
    progress = {"phase": None}  # what the load is doing, for /health meanwhile
    load = _service_loader(target, None if no_drafter else drafter, method, dtype, drafter_dtype, device, max_batch,
                           prompt_cache, online, gamma_max, tree_nodes, limits, suffix_cache_tokens, datastore,
                           f"http://{host}:{port}/v1", progress, costs_first)
    if host not in ("127.0.0.1", "localhost", "::1"):
        err.print(f"[yellow]listening on {host}: reachable beyond this machine"
                  f"{'' if api_key else ' and without --api-key'}[/]")
    if budget == "auto":  # once the models are in, less what the prompt caches may fill
        budget = partial(_auto_budget, reserved=prompt_cache * (1 if no_drafter else 2)
                         if type(prompt_cache) is int else 0)
    prefill = {} if prefill_tokens is None else {"prefill_tokens": prefill_tokens}
    _run_until_stopped(lambda stop: create_app(load, max_batch, budget, api_key, on_load_error=stop,
                                               cors_origins=cors_origin, host=host, metrics_public=metrics_public,
                                               stall_timeout=stall_timeout, loading=lambda: progress["phase"], **prefill),
                       host, port, grace, max_connections)


def _check_bounds(**values) -> None:
    """serve's numeric options, checked before minutes of loading (a SpecdecError naming the flag)."""
    from ..decoding.sequence import DRAFT_ROOM

    lows = {"gamma_max": 1, "tree_nodes": 1, "max_batch": 1, "max_waiting": 1, "max_tokens": 1, "port": 0,
            "max_prompt_tokens": 1, "suffix_cache_tokens": 0, "max_connections": 1, "prefill_tokens": 1}
    for name, low in lows.items():
        if values[name] is not None and values[name] < low:
            raise SpecdecError(f"--{name.replace('_', '-')} must be >= {low}, got {values[name]}")
    for name in ("gamma_max", "tree_nodes"):
        if values[name] is not None and values[name] > DRAFT_ROOM:  # a wider draft would write past the room its KV charge keeps
            raise SpecdecError(f"--{name.replace('_', '-')} must be <= {DRAFT_ROOM}, got {values[name]}")
    if not (values["request_timeout"] > 0 and values["grace"] >= 0 and values["stall_timeout"] > 0):  # nan too
        raise SpecdecError("--request-timeout and --stall-timeout must be > 0, --grace >= 0")
    for name in ("body_timeout", "write_timeout"):
        if not values[name] > 0:
            raise SpecdecError(f"--{name.replace('_', '-')} must be > 0 seconds, got {values[name]:g}")


def _check_online(no_trainable_drafter: bool, api_key: list[str] | None) -> None:
    if no_trainable_drafter:
        raise SpecdecError("--online trains the drafter model's adapter: it needs --drafter MODEL on transformers' "
                           "weights (not --drafter none, not gguf)")
    if api_key is not None and len(api_key) > 1:
        raise SpecdecError("--online trains one drafter on every request's rejections, so its acceptance would "
                           "tell one key's clients about another's text: not with several API keys")


def _served_method(method: str, drafter: str, datastore_dir: str | None, dtype: str):
    """The server's default method, checked: a --drafter that names no model (lookup, suffix,
    ngram, retrieval:DIR) or one that drafts its own way (parallel:DIR) is that method ->
    (method, whether no drafter model loads, datastore)."""
    from ..decoding.speculation import METHODS as REGISTRY, preset
    from ..server.schema import served_methods
    from ..decoding.config import from_flags, weights_run_trees

    no_drafter = drafter in ("none", "")
    if not no_drafter and from_flags(drafter)["method"] != "chain":  # a drafter that is no model
        named = from_flags(drafter)
        if REGISTRY[named["method"]].self_drafting:
            raise SpecdecError(f"--drafter {drafter}: the target drafting for itself runs one sequence at a "
                               "time; the server's engine batches sequences (use generate or chat)")
        if method not in ("default", named["method"]):
            raise SpecdecError(f"--drafter {drafter} names the {named['method']} method; --method {method} "
                               "would draft otherwise (give one of them)")
        method = named["method"]
        no_drafter = "drafter" not in named  # parallel:DIR is a drafter model that drafts its own way
        datastore_dir = named.get("datastore", datastore_dir)
    if method not in served_methods():
        raise SpecdecError(f"--method must be one of {', '.join(served_methods())}, got {method!r}")
    kind = preset(method).method if method != "ar" else "ar"
    if not weights_run_trees(dtype) and kind != "ar" and REGISTRY[kind].trees:
        raise SpecdecError(f"--method {method} scores token trees, which need transformers' weights; on --dtype gguf "
                           "use --method default, chain, lookup, suffix or ar")
    if no_drafter and kind != "ar" and preset(method).needs_drafter_model():
        raise SpecdecError(f"--method {method} drafts with a drafter model; give --drafter, or use "
                           "--method lookup, suffix or ar")
    if kind == "retrieval" and datastore_dir is None:
        raise SpecdecError("--method retrieval drafts from a datastore: give --datastore DIR")
    return method, no_drafter, datastore_dir


def _service_loader(target: str, drafter: str | None, method: str, dtype: str, drafter_dtype: str, device: str,
                    max_batch: int, prompt_cache, online: bool, gamma_max: int, tree_nodes: int, limits,
                    suffix_cache_tokens: int, datastore, url: str, progress: dict | None = None,
                    costs_first: bool = False):
    """What the server's worker calls to load the models (after the port is open: /health says
    loading meanwhile) -> the `Service`, its pass costs pending (`Service.pending_costs`: taken
    from the cache or timed between requests), or with `costs_first` already taken.
    progress["phase"]: what it is doing, for /health."""
    progress = {} if progress is None else progress

    def load():
        from ..models.loading import load as load_model
        from ..sizing.pass_costs import cache_path
        from ..decoding.speculation import preset
        from ..server.service import Service

        say = lambda m: err.print(f"[dim]{m}[/]", highlight=False)  # noqa: E731
        progress["phase"] = "loading the models"
        common = dict(device=device, exact_rows=True, say=say, sequences=max_batch, prompt_cache=prompt_cache)
        target_model = load_model(target, dtype=dtype, role="target", **common)
        drafter_model = None if drafter is None else load_model(
            drafter, dtype=_drafter_weights(dtype, drafter, drafter_dtype, False), role="drafter", **common)
        if online:
            from ..adapters.lora import OnlineDistiller

            OnlineDistiller(drafter_model)  # the drafter records its rejections; the worker updates it when idle
        # (`ar` too: a request's own method is sized by the server's --gamma-max and --tree-nodes)
        default = preset(method).replace(gamma_max=gamma_max, tree_nodes=tree_nodes)
        service = Service(target_model, drafter_model, default=default, default_method=method,
                          limits=limits, suffix_cache_tokens=suffix_cache_tokens, datastore=datastore)
        # the costs, each from the cache or timed (on a first start, minutes on a CPU), are taken by
        # the engine's thread between requests: it serves at once, sized conservatively meanwhile
        steps = _cost_steps(target_model, drafter_model, method, max_batch, say)
        when = "before serving" if costs_first else "between requests"
        service.pending_costs = {name: _announced(measure, say, f"pass costs ({k} of {len(steps)}), {when}")
                                 for k, (name, measure) in enumerate(steps.items(), 1)}
        while costs_first and service.pending_costs:
            progress["phase"] = f"taking {service.measuring()}"
            service.measure_next()
        progress["phase"] = None
        err.print(f"serving {service.name} on {url} (speculation: {method}, max batch {max_batch}; pass costs "
                  f"cached in {cache_path()}, {'taken' if costs_first else 'measured between requests where not yet'})",
                  highlight=False, soft_wrap=True)
        return service

    return load


def _cost_steps(target_model, drafter_model, method: str, max_batch: int, say) -> dict:
    """The service's costs to take from the cache or measure, by the `Service` field each fills ->
    {field: a function measuring it}."""
    from ..drafters.lookahead import OVERHEAD as LOOKAHEAD_OVERHEAD
    from ..decoding.config import runs_trees
    from ..decoding.speculation import preset
    from ..sizing.pass_costs import flat_rows, load_costs, pass_costs

    steps = {}  # each takes `should_stop` (`Service.measure_next`); only the long batched profile heeds it
    if drafter_model is not None:
        steps["costs"] = lambda stop: pass_costs(target_model, drafter_model, say)
    steps["lookup_costs"] = lambda stop: pass_costs(target_model, None, say)
    if runs_trees(target_model):
        steps["lookahead_rows"] = lambda stop: flat_rows(target_model, LOOKAHEAD_OVERHEAD, say)
    if max_batch > 1 and method != "ar":  # the batch policy's profile, with the default method's drafter
        uses_model = preset(method).needs_drafter_model()
        steps["load_costs"] = lambda stop: load_costs(target_model, drafter_model if uses_model else None, say, stop)
    return steps


def _announced(measure, say, what: str):
    """`measure`, saying `what` it takes before it starts."""
    said = []

    def announced(should_stop):
        if not said:  # once: a measurement that yielded to requests goes on later
            said.append(say(f"taking {what}"))
        return measure(should_stop)
    return announced


def _kv_budget(text: str):
    """--kv-memory: bytes, None for none, or "auto" (`_auto_budget`, once the models are in)."""
    return None if text == "none" else "auto" if text == "auto" else parse_bytes(text, "--kv-memory")


def _auto_budget(service, reserved: int) -> int | None:
    """--kv-memory auto: the budget from the memory free once the models are in, said at start."""
    from ..server.service import auto_kv_budget

    budget, phrase = auto_kv_budget(service, reserved)
    err.print(f"[dim]{phrase}[/]", highlight=False)
    return budget


def _run_until_stopped(make_app, host: str, port: int, grace: float, max_connections: int | None = None) -> None:
    """Serve until SIGINT or SIGTERM (in-flight requests get `grace` seconds), or until the models
    fail to load, whose error is then the exit line. Past `max_connections` connections or
    requests at once, uvicorn answers 503."""
    import os
    import signal

    import uvicorn

    def stop(error: Exception) -> None:  # a model that cannot load: the server stops
        os.kill(os.getpid(), signal.SIGINT)

    server = make_app(stop)
    for sig in (signal.SIGINT, signal.SIGTERM):  # uvicorn shuts down gracefully, then raises the signal
        signal.signal(sig, lambda *_: None)    # again for the handler it found: that ends in exit 0
    # uvicorn counts the connection whose request it is admitting: one more lets `max_connections` in
    uvicorn.run(server, host=host, port=port, log_level="warning", timeout_graceful_shutdown=grace,
                limit_concurrency=None if max_connections is None else max_connections + 1)
    error = server.state.specdec["error"]
    if error is not None:
        _fail(str(error) if isinstance(error, SpecdecError) else f"loading failed: {error!r}")


@app.command("bench-serve")
def bench_serve_command(
    url: Optional[List[str]] = typer.Option(None, help="The server's base URL (any OpenAI-compatible server; "
                                            "default http://127.0.0.1:8000). Repeat as NAME=URL to load "
                                            "several servers interleaved: each level of each in turn."),
    fields: Optional[List[str]] = typer.Option(None, help="NAME=JSON: request fields for server NAME alone, e.g. "
                                               "'ours-ar={\"speculative\": false}' (repeatable)."),
    concurrency: str = typer.Option("1,4,8,16", help="Requests in flight at each level, comma-separated."),
    requests: int = typer.Option(32, help="Requests sent at each level (prompts in turn)."),
    dataset: str = typer.Option("humaneval:16,spec-bench:1", help="Prompts: humaneval, spec-bench (chat) or a "
                                "JSONL file, each NAME[:LIMIT], comma-separated."),
    max_tokens: int = typer.Option(64, "--max-tokens", help="Output tokens asked of each request."),
    temperature: float = typer.Option(0.0, help="Sampling temperature sent (0: greedy)."),
    model: Optional[List[str]] = typer.Option(None, help="The model name sent (default: the server's first, "
                                              "/v1/models); NAME=MODEL for server NAME alone (repeatable)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="Sent as 'Authorization: Bearer KEY'."),
    timeout: float = typer.Option(600.0, help="Seconds one request may take before it counts as failed."),
    wait: float = typer.Option(0.0, help="Seconds to wait for each server to be ready (/health 200, as a "
                               "server still loading answers 503) before the run; 0: it must be up now."),
    warmups: int = typer.Option(1, help="Requests sent to each server before the run, not measured."),
    repeats: int = typer.Option(1, help="Rounds of every server at each level, each round in the next "
                                "counterbalanced order: the figures pool them, output tok/s with the rounds' "
                                "range (a machine whose pace drifts gives each round another draw)."),
    extra: Optional[str] = typer.Option(None, help="A JSON object merged into every request body, e.g. "
                                        '\'{"speculative": false}\'.'),
    variants: Optional[str] = typer.Option(None, help="A JSON object: name -> fields merged into the requests; "
                                           "at each level every variant runs in turn, e.g. "
                                           '\'{"default": {}, "ar": {"speculative": false}}\'.'),
    markdown: Optional[Path] = typer.Option(None, "--markdown", help="Also write the table to this file."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Also write the figures to this JSON file."),
):
    """Load a running server level by level and report what `vllm bench serve` reports: throughput,
    TTFT, TPOT, ITL and end-to-end latency percentiles, and acceptance from its /metrics. Several
    servers (--url NAME=URL ...) run interleaved, level by level."""
    from ..bench.concurrency import check_levels
    from ..bench.datasets import load_prompts, parse_dataset
    from ..bench.serving import Server, bench_servers, render

    try:
        try:
            levels = [int(c) for c in _csv(concurrency)]
        except ValueError:
            raise SpecdecError(f"--concurrency takes comma-separated integers >= 1, got {concurrency!r}") from None
        check_levels(levels)
        if requests < 1 or max_tokens < 1 or repeats < 1 or timeout <= 0 or temperature < 0 or wait < 0 \
                or warmups < 0:
            raise SpecdecError("--requests, --max-tokens and --repeats must be >= 1, --timeout > 0, --temperature, "
                               "--wait and --warmups >= 0")
        more = _json_object(extra, "--extra") if extra else {}
        named = _json_object(variants, "--variants") if variants else None
        if named is not None and (not named or not all(isinstance(v, dict) for v in named.values())):
            raise SpecdecError("--variants must be a JSON object of name -> object of request fields")
        urls = _named_urls(url or ["http://127.0.0.1:8000"])
        own = _per_server(fields, urls, _json_object)
        models = _per_server(model, urls)
        prompts = []
        for spec in _csv(dataset):
            name, count, _ = parse_dataset(spec, None, [temperature])
            prompts += [(p.text, p.chat) for p in load_prompts(name, count)]
        for base in dict.fromkeys(urls.values()):
            _wait_ready(base, api_key, wait)
        servers = [Server(name, base, {"model": _served_model(base, api_key, models.get(name)),
                                       "max_tokens": max_tokens, "temperature": temperature, **more, **own.get(name, {})})
                   for name, base in urls.items()]
    except SpecdecError as exc:
        _fail(str(exc))
    summaries = bench_servers(servers, prompts, levels, requests, api_key, timeout,
                              say=lambda m: err.print(f"[dim]{m}[/]", highlight=False), variants=named, warmups=warmups,
                              repeats=repeats)
    table = render(summaries)
    Console().print(table, highlight=False)
    _write_reports(servers, summaries, table, levels, requests, dataset, len(prompts), named, warmups, repeats,
                   markdown, json_path)


def _per_server(entries: list[str] | None, urls: dict, parse=None) -> dict:
    """--fields NAME=JSON (parse: each JSON read) or --model [NAME=]MODEL entries -> by server name;
    a model without a name applies to every server not named otherwise."""
    found = {}
    for entry in entries or []:
        name, _, rest = entry.partition("=")
        if parse is not None:
            if name not in urls:
                raise SpecdecError(f"--fields takes NAME=JSON for a server named with --url NAME=URL, got {entry!r}")
            found[name] = parse(rest, f"--fields {name}")
        elif rest and name in urls:
            found[name] = rest
        else:
            found.update((key, entry) for key in urls if key not in found)
    return found


def _write_reports(servers, summaries, table, levels, requests, dataset, prompts: int, variants, warmups, repeats,
                   markdown, json_path) -> None:
    """bench-serve's markdown and JSON reports, with the command, machine and date."""
    import datetime

    from ..bench.run import machine_description

    one = len(servers) == 1
    info = {"url": servers[0].url if one else {s.name: s.url for s in servers},
            "model": servers[0].settings["model"] if one else {s.name: s.settings["model"] for s in servers},
            "levels": levels, "requests": requests, "dataset": dataset, "prompts": prompts,
            "settings": servers[0].settings if one else {s.name: s.settings for s in servers},
            "variants": variants, "warmups": warmups, "repeats": repeats, "machine": machine_description(),
            "date": datetime.date.today().isoformat(), "command": "specdec " + " ".join(sys.argv[1:])}
    if markdown:
        served = ", ".join(f"{s.name + ': ' if s.name else ''}model {s.settings['model']}" for s in servers)
        markdown.write_text(_home_as_tilde(f"# bench-serve\n\n`{info['command']}`\n\n{info['machine']}, "
                                           f"{info['date']}, {served}\n\n{table}\n"))
        err.print(f"[dim]wrote {markdown}[/]", highlight=False)
    if json_path:
        json_path.write_text(_home_as_tilde(json.dumps({"info": info, "levels": summaries}, indent=1)))
        err.print(f"[dim]wrote {json_path}[/]", highlight=False)


def _home_as_tilde(text: str) -> str:
    """Results meant to be shared name the home directory `~` (a model path given as a server's
    model name would otherwise carry this machine's)."""
    home = str(Path.home())
    return text.replace(home + "/", "~/") if len(home) > 1 else text


def _json_object(text: str, option: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise SpecdecError(f"{option} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise SpecdecError(f"{option} must be a JSON object")
    return value


def _named_urls(entries: list[str]) -> dict:
    """--url values -> {name (None for a single unnamed URL): base URL without /v1}."""
    import re

    urls = {}
    for entry in entries:
        match = re.match(r"([A-Za-z0-9_.-]+)=(.+)", entry)
        name, address = (match.group(1), match.group(2)) if match else (None, entry)
        if name is None and len(entries) > 1:
            raise SpecdecError(f"name each of several servers: --url NAME=URL, got {entry!r}")
        if name in urls:
            raise SpecdecError(f"two servers named {name!r}")
        urls[name] = address.rstrip("/").removesuffix("/v1")
    return urls


def _wait_ready(base: str, api_key: str | None, seconds: float) -> None:
    """Return once `base` answers /health with 200 (or has no /health), polling for up to
    `seconds`; SpecdecError when it is still not ready (what it last answered)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline, last = time.monotonic() + seconds, "no answer"
    while True:
        try:
            status = httpx.get(base + "/health", headers=headers, timeout=10).status_code
            if status in (200, 404):
                return
            last = f"HTTP {status}"
        except httpx.HTTPError as exc:
            last = str(exc) or type(exc).__name__
        if time.monotonic() >= deadline:
            if seconds > 0:
                raise SpecdecError(f"{base} was not ready after {seconds:g} s ({last})")
            return  # not waiting: the model listing says what is wrong
        time.sleep(1.0)


def _served_model(base: str, api_key: str | None, wanted: str | None) -> str:
    """`wanted`, or the first model the server lists (/v1/models); SpecdecError where no server
    answers, or it lists none and none is wanted."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        listed = httpx.get(base + "/v1/models", headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        raise SpecdecError(f"no server answers at {base}: {exc}") from None
    if wanted:
        return wanted
    if listed.status_code != 200:  # some servers list models only from a hub cache: --model names it instead
        raise SpecdecError(f"{base}/v1/models answered HTTP {listed.status_code} ({listed.text[:200]}); "
                           "name the model with --model")
    return listed.json()["data"][0]["id"]
