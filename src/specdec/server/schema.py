"""OpenAI request bodies to what the engine takes, checked field by field: a bad field is a
`BadRequest` naming it (the server answers 400 with an OpenAI-style error body), never a stack
trace and never a silently ignored option. Pure functions, no model: tested alone.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from ..penalties import LogitRules

MAX_STOP = 4  # stop strings per request (OpenAI's limit)
MAX_N = 16  # choices per prompt
MAX_PROMPTS = 16  # prompts per completions request
MAX_CHOICES = 64  # prompts × n
MAX_TOP_LOGPROBS = 20  # alternatives per token (OpenAI's chat limit; vLLM's default)
MAX_SALT = 1024  # characters of a cache_salt
MAX_BIAS = 1024  # token ids in a logit_bias or stop_token_ids (vLLM takes any number; OpenAI's bias 300)


def _served_methods() -> tuple[str, ...]:
    """The names a request's `speculative.method` takes: every method and preset of the registry
    (`specdec methods`) but those where the target drafts for itself, which run one sequence at a
    time (the engine's batched passes keep no hidden states)."""
    from ..methods import METHODS as REGISTRY, names, preset

    return tuple(name for name in names() if not REGISTRY[preset(name).method].self_drafting)


METHODS = _served_methods()
SPECULATIVE_FIELDS = ("method", "gamma_max", "tree_nodes", "tree", "schedule", "gamma")


class BadRequest(Exception):
    """A client error: HTTP `status`, OpenAI's error `type`, the offending `param` and a `code`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Speculation:
    """The request's `speculative` block: which method or preset drafts (None: plain decoding),
    and the `SpecConfig` fields a request may set (None: the server's). A request names no model,
    datastore or checkpoint: those are the server's (`service.Service.config`)."""

    method: str | None = "default"
    gamma_max: int | None = None
    tree_nodes: int | None = None
    tree: str | None = None
    schedule: str | None = None
    gamma: int | None = None


@dataclass
class Job:
    """A checked request: prompts (each text or ids) or chat messages, and how to generate."""

    prompts: list[str | list[int]] | None
    messages: list[dict] | None
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    n: int
    stream: bool
    speculation: Speculation = field(default_factory=Speculation)
    logprobs: int | None = None  # None: off; k: each token's log-probability and its k most likely
    cache_salt: str = ""  # the tenant: shared caches (prompts, suffix drafting) only within one salt
    tenant: str = ""  # the API key's tenant where several keys are set (the app's, never the body's)
    min_p: float = 0.0
    rules: LogitRules = field(default_factory=LogitRules)  # penalties, logit_bias, min_tokens
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)


def parse_body(raw: bytes, limit: int) -> dict:
    """The JSON object of a request body, at most `limit` bytes."""
    if len(raw) > limit:
        raise BadRequest(f"the request body is {len(raw)} bytes, over this server's limit of {limit}",
                         status=413, code="body_too_large")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:  # json's parser recurses once per level: thousands of [ or { overflow it
        raise BadRequest("the request body is nested too deeply to parse", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object", code="invalid_json")
    return body


def _number(body: dict, name: str, default, low: float, high: float, low_open: bool = False, integer: bool = False,
            within: str = ""):
    value = body.get(name)
    if value is None:
        return default
    param = within + name  # a nested field named by its path (speculative.tree_nodes)
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or (not integer and not math.isfinite(value)):
        raise BadRequest(f"{param} must be {'an integer' if integer else 'a number'}, got {value!r}", param)
    if value < low or (low_open and value == low) or value > high:
        bounds = f"{'(' if low_open else '['}{low}, {high}]"
        raise BadRequest(f"{param} must be in {bounds}, got {value!r}", param)
    return value


def _speculation(value, default: Speculation) -> Speculation:
    from ..generate import DRAFT_ROOM  # a tree's nodes must fit the draft's room in the KV charge
    from ..methods import preset

    if value is None:
        return default
    if value is False:
        return Speculation(method=None)
    if value is True:
        return default
    if not isinstance(value, dict):
        raise BadRequest(f"speculative must be false or an object with {', '.join(SPECULATIVE_FIELDS)}; got {value!r}",
                         "speculative")
    unknown = set(value) - set(SPECULATIVE_FIELDS)
    if unknown:
        raise BadRequest(f"speculative takes {', '.join(SPECULATIVE_FIELDS)}, not {sorted(unknown)}", "speculative")
    method = value.get("method", default.method or "default")
    if method not in METHODS:
        raise BadRequest(f"speculative.method must be one of {', '.join(METHODS)} (`specdec methods`); got {method!r}",
                         "speculative.method")
    kind = preset(method).method if method != "ar" else "ar"
    if "tree_nodes" in value and kind not in ("tree", "lookahead"):
        raise BadRequest("speculative.tree_nodes applies to methods tree and lookahead", "speculative.tree_nodes")
    if "tree" in value and kind != "tree":
        raise BadRequest("speculative.tree applies to the tree method", "speculative.tree")
    if ("schedule" in value or "gamma" in value) and kind in ("tree", "lookahead", "ar"):
        raise BadRequest("speculative.schedule and gamma size chains; trees are sized by cost", "speculative.schedule")
    tree = value.get("tree", default.tree if kind == "tree" else None)
    if tree is not None and not isinstance(tree, str):
        raise BadRequest(f"speculative.tree must be a shape's name, got {tree!r}", "speculative.tree")
    schedule = value.get("schedule", default.schedule if kind not in ("tree", "lookahead") else None)
    if schedule is not None and not isinstance(schedule, str):
        raise BadRequest(f"speculative.schedule must be a schedule's name, got {schedule!r}", "speculative.schedule")
    gamma_max = _number(value, "gamma_max", default.gamma_max, 1, 32, integer=True, within="speculative.")
    nodes = _number(value, "tree_nodes", default.tree_nodes, 1, DRAFT_ROOM, integer=True, within="speculative.")
    gamma = _number(value, "gamma", default.gamma, 1, 32, integer=True, within="speculative.")
    return Speculation(None if method == "ar" else method, gamma_max, nodes, tree, schedule, gamma)


def _stop(value) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP:
        raise BadRequest(f"stop must be a non-empty string or a list of at most {MAX_STOP} of them, got {value!r}",
                         "stop")
    return stops


def _messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise BadRequest("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant") or \
                not isinstance(message.get("content"), str):
            raise BadRequest(f"messages[{i}] must be an object with role system, user or assistant and a string "
                             f"content, got {message!r}", f"messages[{i}]")
        out.append({"role": message["role"], "content": message["content"]})
    if not any(m["content"] for m in out):
        raise BadRequest("messages are all empty", "messages")
    return out


def _token_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                            for t in value)


def _prompts(value) -> list[str | list[int]]:
    """completions' `prompt`: a string, a list of token ids, or a list of several of either."""
    single = isinstance(value, str) or _token_ids(value)
    prompts = [value] if single else value
    if not isinstance(prompts, list) or not prompts or \
            not all(isinstance(p, str) or _token_ids(p) for p in prompts):
        raise BadRequest("prompt must be a non-empty string, a list of token ids, or a list of several of either, "
                         f"got {value!r}"[:300], "prompt")
    if len(prompts) > MAX_PROMPTS:
        raise BadRequest(f"a request takes at most {MAX_PROMPTS} prompts, got {len(prompts)}", "prompt")
    for i, prompt in enumerate(prompts):
        if prompt == "":
            raise BadRequest("prompt is empty" if single else f"prompt[{i}] is empty", "prompt")
    return [p if isinstance(p, str) else list(p) for p in prompts]


def parse_job(body: dict, chat: bool, model_name: str, default: Speculation) -> Job:
    """Check a /v1/completions (chat=False) or /v1/chat/completions body -> a `Job`."""
    model = body.get("model")
    if model is not None and model != model_name:
        raise BadRequest(f"the model {model!r} does not exist; this server serves {model_name!r}", "model",
                         status=404, code="model_not_found")
    # fields this server does not honour: taken only at the value that changes nothing, else refused
    # by name (never ignored: an answer that silently leaves out a penalty is a wrong answer)
    allowed = {"best_of": (None, 1), "echo": (None, False),
               "suffix": (None,), "tools": (None,), "functions": (None,), "response_format": (None,)}
    if not chat:
        allowed.update(top_logprobs=(None,), max_completion_tokens=(None,))  # chat's fields
    for name, values in allowed.items():
        if not any(body.get(name) is v or body.get(name) == v and type(body.get(name)) is type(v) for v in values):
            raise BadRequest(f"{name} is not supported by this server yet", name, code="unsupported")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"stream must be true or false, got {stream!r}", "stream")
    limit = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    job = Job(
        prompts=None if chat else _prompts(body.get("prompt")),
        messages=_messages(body.get("messages")) if chat else None,
        max_tokens=_number(body, limit, None if chat else 16, 1, 2 ** 31, integer=True),
        temperature=_number(body, "temperature", 1.0, 0, 2),
        top_p=_number(body, "top_p", 1.0, 0, 1, low_open=True),
        top_k=_number(body, "top_k", 0, -1, 2 ** 31, integer=True),
        seed=_number(body, "seed", None, -2 ** 63, 2 ** 63 - 1, integer=True),
        stop=_stop(body.get("stop")),
        n=_number(body, "n", 1, 1, MAX_N, integer=True),
        stream=stream,
        speculation=_speculation(body.get("speculative"), default),
        logprobs=_logprobs(body, chat),
        cache_salt=_cache_salt(body.get("cache_salt")),
        min_p=_number(body, "min_p", 0.0, 0, 1),
        rules=_rules(body),
        ignore_eos=_flag(body, "ignore_eos"),
        stop_token_ids=_id_list(body.get("stop_token_ids"), "stop_token_ids"),
    )
    if job.n * len(job.prompts or [None]) > MAX_CHOICES:
        raise BadRequest(f"prompts × n is {job.n * len(job.prompts)}; a request takes at most {MAX_CHOICES} choices",
                         "n")
    return job


def _rules(body: dict) -> LogitRules:
    """presence_penalty, frequency_penalty, repetition_penalty, logit_bias and min_tokens ->
    `LogitRules` (applied to every position's logits, drafts included: penalties.py)."""
    bias = body.get("logit_bias")
    if bias is None:
        bias = {}
    if not isinstance(bias, dict) or len(bias) > MAX_BIAS:
        raise BadRequest(f"logit_bias must be an object of at most {MAX_BIAS} token ids to numbers", "logit_bias")
    pairs = []
    for key, value in bias.items():
        token = _token_id(key, "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise BadRequest(f"logit_bias values must be numbers in [-100, 100], got {value!r} for {key!r}",
                             "logit_bias")
        pairs.append((token, float(value)))
    return LogitRules(presence=_number(body, "presence_penalty", 0.0, -2, 2),
                      frequency=_number(body, "frequency_penalty", 0.0, -2, 2),
                      repetition=_number(body, "repetition_penalty", 1.0, 0, 10, low_open=True),
                      bias=tuple(sorted(pairs)),
                      min_tokens=_number(body, "min_tokens", 0, 0, 2 ** 31, integer=True))


def _token_id(value, name: str) -> int:
    """A token id given as an integer or a string of digits (JSON object keys are strings)."""
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2 ** 31:
        raise BadRequest(f"{name} takes token ids (integers >= 0), got {value!r}", name)
    return value


def _id_list(value, name: str) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_BIAS:
        raise BadRequest(f"{name} must be a list of at most {MAX_BIAS} token ids", name)
    return [_token_id(v, name) for v in value]


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false, got {value!r}", name)
    return value


def _cache_salt(value) -> str:
    """vLLM's `cache_salt`: requests share cache entries (kept prompts, earlier outputs that suffix
    drafting copies) only with requests of the same salt, so that what one tenant sent cannot show
    in another's `cached_tokens` or drafting counts. None: the unsalted tenant."""
    if value is None:
        return ""
    if not isinstance(value, str) or not value or len(value) > MAX_SALT:
        raise BadRequest(f"cache_salt must be a non-empty string of at most {MAX_SALT} characters", "cache_salt")
    return value


def _logprobs(body: dict, chat: bool) -> int | None:
    """Chat: `logprobs` true/false and `top_logprobs` 0..20 (only with logprobs); completions:
    `logprobs` 0..20, the alternatives per token -> None (off) or the alternatives per token."""
    if not chat:
        return _number(body, "logprobs", None, 0, MAX_TOP_LOGPROBS, integer=True)
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise BadRequest(f"logprobs must be true or false, got {wanted!r}", "logprobs")
    if top is not None and not wanted:
        raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    return _number(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS, integer=True) if wanted else None
