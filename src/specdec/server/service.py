"""What the server serves: the loaded models, how a checked request (`schema.Job`) becomes the
engine's requests, and the limits. Nothing a request says can load a model or name a file: the
models are the ones given on the command line, and a request picks only among their methods.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from ..backends import features
from ..drafters.suffix import SuffixCache
from ..engine import Request
from ..errors import SpecdecError
from ..core.grammar import Grammar
from ..decoding.config import runs_trees
from ..decoding.sequence import Limits as Stops
from ..decoding.speculation import METHODS, Parts, Speculation, build, preset
from ..core.samplers import Sampler
from ..decoding.config import SpecConfig
from ..backends.text import token_bytes_reader
from .schema import BadRequest, Job
from .tools import call_grammar, template_message, template_offers_tools

log = logging.getLogger("specdec.server")

MAX_SALTS = 32  # cache salts of one API key whose suffix caches are kept (its least recently used dropped first)
PENDING_LOOKAHEAD_ROWS = 8  # lookahead's rows until the machine's are measured: wide passes cost little more anywhere
MAX_SUFFIX_CACHES = 128  # suffix caches kept in all (memory): past it, the key holding the most loses its oldest


KV_SHARE = 0.8  # of the memory free once the models are in, what the running sequences' KV caches may take


def free_memory(device) -> int | None:
    """Bytes free for new tensors on `device` now: the GPU's free memory on CUDA, the kernel's
    MemAvailable on a Linux CPU; None where it cannot be read."""
    import torch

    if torch.device(device).type == "cuda":
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def auto_kv_budget(service: "Service", reserved: int = 0) -> tuple[int | None, str]:
    """The KV budget a server takes by default: KV_SHARE of the memory free once its models are
    loaded, less `reserved` (prompt caches still to fill) -> (bytes or None, a phrase for the
    startup line). None where the backend allocates its caches up front (llama.cpp's streams) or
    the free memory cannot be read."""
    from ..backends import features

    if features(service.target).kv_bytes_per_token is None:
        return None, "KV caches allocated at load"
    free = free_memory(service.target.device)
    if free is None:
        return None, "no KV budget (free memory unknown: give --kv-memory)"
    budget = int(KV_SHARE * max(0, free - reserved))
    return max(budget, 1), (f"KV budget {budget / 2**30:.1f} GiB: {KV_SHARE:.0%} of the {free / 2**30:.1f} GiB "
                            "free after loading" + (" less the prompt caches" if reserved else ""))


@dataclass
class Limits:
    """max_tokens: the output bound of a chat request that names none; max_prompt_tokens: the
    longest prompt taken (None: the model's context); max_body: request body bytes;
    request_timeout: seconds a request may run before it is cancelled (504); body_timeout: seconds
    a request's whole body may take to arrive (408); write_timeout: seconds a send to a client that
    reads nothing may stay blocked before its request is cancelled and its connection dropped."""

    max_tokens: int = 256
    max_prompt_tokens: int | None = None
    max_body: int = 1 << 20
    request_timeout: float = 600.0
    max_waiting: int = 64
    body_timeout: float = 60.0
    write_timeout: float = 60.0


class Service:
    """A target, an optional drafter model, and the default speculation of requests.

    costs: the pass costs (`pass_costs.pass_costs`) of (target, drafter model) and of (target,
    model-free drafter), measured once at start, for the cost-aware schedule.
    load_costs: the batched pass costs (`pass_costs.load_costs`) of the target with the default
    method's drafter, for the engine's batch policy (`Engine`); None: it learns from steps alone.
    assumed: costs taken as given instead of timed (`schedules.AssumedCosts`): drafts and trees
    sized as on a machine with those costs, the same on every run (tests).
    suffix_cache_tokens: the most tokens of earlier outputs the `suffix` method drafts from
    (`SuffixCache`, shared by all requests; 0: none, each request drafts from its own text).
    datastore: a `datastore.Datastore` the `retrieval` method drafts from (the operator's, opened
    at start; no request names one), checked against the target's tokenizer.
    lookahead_rows: the rows a pass of the target takes at little more than a one-token pass's
    cost (`pass_costs.flat_rows`, measured at start), which shape the `lookahead` method; None:
    from `assumed`, or measured by the first lookahead request.
    """

    def __init__(self, target, drafter=None, name: str | None = None, default: str | SpecConfig | None = None,
                 limits: Limits | None = None, costs=None, lookup_costs=None, assumed=None,
                 suffix_cache_tokens: int = 100_000, datastore=None, lookahead_rows: int | None = None,
                 load_costs=None, default_method: str | None = None):
        self.target, self.drafter, self.name = target, drafter, name or target.name
        if default is None:
            default = "default" if drafter is not None else "ar"
        if isinstance(default, str):  # a method or preset's name
            default_method, default = default, preset(default) if default != "ar" else SpecConfig("ar")
        # the requests' default config (what a request's `speculative` block changes), and the name
        # responses report it by (None: plain decoding)
        self.default = default.replace(assumed=assumed is not None)
        self.default_method = (default_method or default.method) if default.speculative else None
        if self.default.speculative and self.default.needs_drafter_model() and drafter is None:
            raise BadRequest(f"speculation {self.default_method!r} needs a drafter model")
        self.limits = limits or Limits()
        self.costs, self.lookup_costs, self.assumed, self.load_costs = costs, lookup_costs, assumed, load_costs
        self.lookahead_rows = lookahead_rows
        self.suffix_cache_tokens = suffix_cache_tokens
        self._suffix_caches: dict[str, OrderedDict[str, SuffixCache]] = {}  # by API key, then cache_salt (LRU)
        if datastore is not None:
            datastore.check_tokenizer(target.tokenizer, target.vocab_size)
        elif self.default.method == "retrieval":
            raise BadRequest("speculation 'retrieval' needs a datastore")
        self.datastore = datastore
        # costs still to take (from the cache, or timed) between requests, by the field each fills;
        # until then requests are sized conservatively (schedules that time their own passes)
        self.pending_costs: dict[str, Callable[[Callable[[], bool]], object]] = {}  # each given should_stop
        self._measured = 0
        self._token_texts: dict[int, str] = {}
        self._token_bytes: dict[int, bytes] = {}
        self._read_bytes = None  # `text.token_bytes_reader` of the target's tokenizer, made on first use

    def measure_next(self, should_stop: Callable[[], bool] | None = None) -> str | None:
        """Take the next of `pending_costs` (the engine's thread calls it between requests, so that
        timing and serving never share the machine) -> the field it filled, or None when none was
        pending or it stopped early. should_stop: asked between the sizes of a long measurement,
        which then yields (`pass_costs.Interrupted`) and goes on from there at the next call. A
        measurement that fails is logged and left out: its field keeps its default."""
        from ..sizing.pass_costs import Interrupted

        if not self.pending_costs:
            return None
        name, measure = next(iter(self.pending_costs.items()))
        try:
            setattr(self, name, measure(should_stop or (lambda: False)))
        except Interrupted:
            return None
        except Exception:
            log.exception("measuring %s failed; requests go on sized without it", name)
        del self.pending_costs[name]
        self._measured += 1
        return name

    def _lookahead_rows(self) -> int | None:
        """`lookahead_rows`, or while it waits to be measured a small shape's (a lookahead drafter
        left to size itself would time passes on the engine's thread, mid-serving)."""
        if self.lookahead_rows is None and "lookahead_rows" in self.pending_costs:
            return PENDING_LOOKAHEAD_ROWS
        return self.lookahead_rows

    def measuring(self) -> str | None:
        """How far the costs measured between requests have come ("pass costs (2 of 4)"), or None."""
        if not self.pending_costs:
            return None
        return f"pass costs ({self._measured + 1} of {self._measured + len(self.pending_costs)})"

    def suffix_cache(self, salt: str = "", key: str = "") -> SuffixCache | None:
        """The earlier outputs that suffix drafting draws on for the tenant `salt` (None where the
        server keeps none): tenants never draft from each other's outputs. Each API key (`key`,
        `Job.tenant`) keeps the suffix caches of its MAX_SALTS most recently used salts, each up
        to `suffix_cache_tokens`, and MAX_SUFFIX_CACHES bound them all (the key holding the most
        loses its oldest first): one key's clients cannot evict another key's below its share."""
        if not self.suffix_cache_tokens:
            return None
        caches = self._suffix_caches.setdefault(key, OrderedDict())
        if salt not in caches:
            caches[salt] = SuffixCache(self.suffix_cache_tokens)
            while len(caches) > MAX_SALTS:
                caches.popitem(last=False)
            while sum(map(len, self._suffix_caches.values())) > MAX_SUFFIX_CACHES:
                heaviest = max(self._suffix_caches.values(), key=len)
                if len(heaviest) <= 1:  # more keys than caches: each keeps its newest
                    break
                heaviest.popitem(last=False)
        caches.move_to_end(salt)
        return caches[salt]

    def token_text(self, token: int) -> str:
        """One token's text as `logprobs` shows it (special tokens by name; a token that is part
        of a character shows as U+FFFD)."""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.target.decode([token], skip_special_tokens=False)
        return text

    def token_bytes(self, token: int) -> bytes:
        """One token's own bytes as chat `logprobs` show them: a character's bytes split across
        tokens are each token's part of them, not U+FFFD's (`text.token_bytes_reader`)."""
        data = self._token_bytes.get(token)
        if data is None:
            if self._read_bytes is None:
                self._read_bytes = token_bytes_reader(self.target.tokenizer)
            data = self._token_bytes[token] = self._read_bytes(token)
        return data

    def constrain(self, job: Job) -> None:
        """Set `job.grammar` to what its output must match: a required or named tool call's
        grammar, or its response_format's; a 400 naming the field where the model cannot take it
        (a schema that does not compile, a keyword llguidance does not support). CPU work of
        milliseconds (the first grammar on a model also reads its vocabulary, seconds)."""
        if job.tools and job.tool_choice not in ("none", "auto"):
            named = job.tool_choice["function"]["name"] if isinstance(job.tool_choice, dict) else None
            for k, tool in enumerate(job.tools):
                parameters = tool["function"].get("parameters")
                if parameters is None or named not in (None, tool["function"]["name"]):
                    continue
                if parameters.get("type", "object") != "object":  # arguments are an object: no call could pass
                    raise BadRequest(f"tools[{k}].function.parameters is not valid: a call's arguments are an object",
                                     f"tools[{k}].function.parameters")
                self._check(Grammar.json_schema(parameters), f"tools[{k}].function.parameters")
            job.grammar = call_grammar(job.tools, job.tool_choice, job.parallel_tool_calls, self.target.tokenizer)
            self._check(job.grammar, "tools")
        elif job.grammar is not None:
            self._check(job.grammar, "response_format")
        if job.grammar is not None:
            for name, on in (("min_tokens", job.rules.min_tokens), ("allowed_token_ids", job.rules.allowed)):
                if on:  # the grammar decides where the output ends and what may come: these could leave nothing
                    raise BadRequest(f"{name} does not combine with response_format or a required tool call", name)

    def _check(self, grammar: Grammar, param: str) -> None:
        try:
            grammar.check(self.target)
        except SpecdecError as error:
            raise BadRequest(f"{param}: {error}", param) from None

    def prompt_ids(self, job: Job) -> list[list[int]]:
        """The job's prompts as token ids (chat messages through the model's chat template, with
        the tools it offers: one)."""
        if job.messages is not None:
            return [self._prompt_ids(job.messages, None, job.tools)]
        return [self._prompt_ids(None, prompt) for prompt in job.prompts]

    def _prompt_ids(self, messages: list[dict] | None, prompt: str | list[int] | None,
                    tools: list[dict] | None = None) -> list[int]:
        tokenizer = self.target.tokenizer
        if messages is not None:
            if tokenizer is None or not getattr(tokenizer, "chat_template", None):
                raise BadRequest(f"{self.name} has no chat template; use /v1/completions", "messages")
            # the template writes the tools and the calls; another syntax would never be parsed back
            called = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
            if (tools or called) and not template_offers_tools(tokenizer):
                raise BadRequest(f"the chat template of {self.name} does not offer tools in the syntax this server "
                                 f"parses (<tool_call> JSON, as Qwen2.5's)", "tools" if tools else "messages")
            extra = {"tools": tools} if tools else {}
            try:
                ids = tokenizer.apply_chat_template([template_message(m) for m in messages],
                                                    add_generation_prompt=True, tokenize=True, **extra)
            except Exception as error:  # the template's own rules (e.g. roles that must alternate)
                raise BadRequest(f"the chat template of {self.name} refused these messages: {error}",
                                 "messages") from None
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        elif isinstance(prompt, str):
            if tokenizer is None:
                raise BadRequest(f"{self.name} has no tokenizer; send the prompt as token ids", "prompt")
            ids = self.target.encode(prompt)
        else:
            ids = prompt
            vocab = self.target.vocab_size
            if max(ids) >= vocab:
                raise BadRequest(f"prompt token id {max(ids)} is outside the vocabulary (0..{vocab - 1})", "prompt")
        if not ids:
            raise BadRequest("the prompt encodes to no tokens", "prompt")
        return ids

    def max_new_tokens(self, job: Job, prompt_length: int) -> int:
        """The job's output bound, checked against the context: a prompt or max_tokens that does
        not fit is a 400 naming it, never a silently shorter answer."""
        context = self.target.max_context
        most_prompt = min(context - 1, self.limits.max_prompt_tokens or context)
        if prompt_length > most_prompt:
            raise BadRequest(f"the prompt is {prompt_length} tokens; this server takes at most {most_prompt}",
                             "messages" if job.messages is not None else "prompt", code="context_length_exceeded")
        room = context - prompt_length
        if job.max_tokens is None:
            bound = min(self.limits.max_tokens, room, self._drafter_room(job, prompt_length) or room)
            if job.rules.min_tokens > bound:  # max_tokens given is checked with the body (schema)
                raise BadRequest(f"min_tokens is {job.rules.min_tokens}, more than this request's output bound of "
                                 f"{bound} tokens (give max_tokens)", "min_tokens")
            return bound
        if job.max_tokens > room:
            raise BadRequest(f"max_tokens is {job.max_tokens}, but the context of {context} tokens leaves "
                             f"{room} after the prompt's {prompt_length}", "max_tokens",
                             code="context_length_exceeded")
        drafter_room = self._drafter_room(job, prompt_length)
        if drafter_room is not None and job.max_tokens > drafter_room:  # its answer would end there, cut
            raise BadRequest(f"max_tokens is {job.max_tokens}, but the drafter model's context of "
                             f"{self.drafter.max_context} tokens leaves {max(drafter_room, 0)} after the prompt; "
                             "ask with speculative: false (or another method) for the target's whole context",
                             "max_tokens", code="context_length_exceeded")
        return job.max_tokens

    def _drafter_room(self, job: Job, prompt_length: int) -> int | None:
        """Tokens the drafter model's context leaves after the prompt where the job's method drafts
        with one whose context is shorter than the target's (a generation stops at the shorter
        context); None otherwise."""
        config = self.speculation(job).config
        if not config.speculative or not config.needs_drafter_model() or \
                self.drafter.max_context >= self.target.max_context:
            return None
        return self.drafter.max_context - prompt_length

    def check_fits(self, job: Job, prompt_length: int, max_new_tokens: int, budget: int | None) -> None:
        """A 400 before the answer starts where a choice's KV caches could never fit the engine's
        budget (they would wait forever): its prompt, its output and the widest draft, in the
        target's cache and a drafter model's."""
        from ..engine.scheduler import kv_need, kv_positions

        if budget is None:
            return
        config = self.speculation(job).config
        model = self.drafter if config.speculative and config.needs_drafter_model() else None
        need = kv_need(kv_positions(prompt_length, max_new_tokens, config.speculative), [self.target, model])
        if need > budget:
            raise BadRequest(f"this request's KV caches would take {need / 2**20:.1f} MiB, more than this server's "
                             f"whole budget of {budget / 2**20:.1f} MiB; send a shorter prompt or lower max_tokens",
                             "max_tokens", code="context_length_exceeded")

    def requests(self, job: Job, prompt_ids: list[int], max_new_tokens: int) -> list[Request]:
        """The engine's requests of a job: its `n` choices, choice i seeded seed + i."""
        sampler = Sampler(temperature=job.temperature, top_k=max(job.top_k, 0), top_p=job.top_p, min_p=job.min_p)
        vocab = self.target.vocab_size
        for name, ids in (("logit_bias", [t for t, _ in job.rules.bias]), ("stop_token_ids", job.stop_token_ids),
                          ("allowed_token_ids", job.rules.allowed)):
            if any(t >= vocab for t in ids):
                raise BadRequest(f"{name} names a token id past this model's vocabulary of {vocab}", name)
        ends = None
        if job.ignore_eos or job.stop_token_ids:  # vLLM: stop_token_ids end a choice with or without ignore_eos
            ends = ([] if job.ignore_eos else list(self.target.eos_token_ids)) + job.stop_token_ids
        if job.grammar is not None and ends == []:
            raise BadRequest("a constrained output ends with an end token where its grammar is complete, and "
                             "ignore_eos leaves none: give stop_token_ids, or leave ignore_eos", "ignore_eos")
        if job.rules.allowed and job.rules.min_tokens and \
                set(job.rules.allowed) <= set(self.target.eos_token_ids if ends is None else ends):
            raise BadRequest("allowed_token_ids holds only end tokens, which min_tokens rules out: no token could "
                             "come", "allowed_token_ids")
        speculation = self.speculation(job)  # built once a job: every prompt's every choice carries it
        stops = Stops(max_new_tokens, ends)
        return [Request(prompt_ids, speculation, sampler, stops, seed=None if job.seed is None else job.seed + i,
                        logprobs=job.logprobs, cache_salt=job.cache_salt, rules=job.rules, grammar=job.grammar)
                for i in range(job.n)]

    def speculation(self, job: Job) -> Speculation:
        """The job's `Speculation`, built from its config once (the first call; later ones return it):
        BadRequest where this server cannot run the config (a drafter model, a datastore, trees
        on its backend) or the job's constraints do not combine with it."""
        if job.built is None:
            self._check_speculation(job)
            config = job.speculation
            if not config.speculative:
                job.built = build(config, Parts(self.target))
            else:  # measured costs even under a seed: a seeded output is coupled to (seed, position), not to drafts
                job.built = build(config, Parts(self.target, self.drafter if config.needs_drafter_model() else None,
                                                costs=lambda model: self.costs if model is not None else
                                                self.lookup_costs, assumed=self.assumed,
                                                suffix_cache=self.suffix_cache(job.cache_salt, job.tenant),
                                                datastore=self.datastore, lookahead_rows=self._lookahead_rows()))
        return job.built

    def _check_speculation(self, job: Job) -> None:
        """What this server's models and the job's other options ask of its speculation."""
        config, name, param = job.speculation, job.method, "speculative.method"
        if not config.speculative:
            return
        if config.needs_drafter_model() and self.drafter is None:
            raise BadRequest(f"speculative.method {name!r} needs a drafter model, and this server has none; "
                             "use lookup, suffix or false", param)
        if config.method == "parallel" and (self.drafter is None or not features(self.drafter).parallel_k):
            raise BadRequest(f"speculative.method {name!r} drafts with a parallel drafter, and this server's drafter "
                             "is none (serve --drafter parallel:DIR); use chain, lookup, suffix or false", param)
        if config.method == "retrieval" and self.datastore is None:
            raise BadRequest(f"speculative.method {name!r} needs a datastore, and this server has none; "
                             "use lookup, suffix or false", param)
        trees = METHODS[config.method].trees
        if trees and not runs_trees(self.target):
            raise BadRequest(f"speculative.method {name!r} scores token trees, which this server's backend "
                             f"({self.target.kernels}) does not; use chain, lookup, suffix or false", param)
        if trees and job.rules is not None and job.rules.active:
            raise BadRequest(f"penalties, logit_bias and min_tokens apply to chain drafts; speculative.method "
                             f"{config.method!r} drafts token trees: use chain, lookup, suffix or false", param)
        if trees and job.grammar is not None:
            raise BadRequest(f"response_format and required tool calls constrain chain drafts; speculative.method "
                             f"{config.method!r} drafts token trees: use chain, lookup, suffix, forced or false", param)
