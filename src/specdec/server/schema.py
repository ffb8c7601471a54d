"""OpenAI request bodies to what the engine takes, checked field by field: a bad field is a
`BadRequest` naming it (the server answers 400 with an OpenAI-style error body), never a stack
trace and never a silently ignored option. Pure functions, no model: tested alone.
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import re
from dataclasses import dataclass, field

from ..core.penalties import LogitRules
from ..decoding.config import SpecConfig
from ..errors import SpecdecError

MAX_STOP = 4  # stop strings per request (OpenAI's limit)
MAX_N = 16  # choices per prompt
MAX_PROMPTS = 16  # prompts per completions request
MAX_CHOICES = 64  # prompts × n
MAX_TOP_LOGPROBS = 20  # alternatives per token (OpenAI's chat limit; vLLM's default)
MAX_SALT = 1024  # characters of a cache_salt
MAX_BIAS = 1024  # token ids in a logit_bias or stop_token_ids (vLLM takes any number; OpenAI's bias 300)
MAX_STOP_CHARS = 1000  # characters of one stop string: a stream holds back as many, less one, until it cannot match
MAX_TOOLS = 128  # tools per request (OpenAI's limit)
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a function's or a JSON schema's name (OpenAI's rule)

HONOURED, IGNORED = "honoured", "ignored"  # how a field is taken; else a tuple of the values that change nothing
ENDPOINTS = ("completions", "chat")


def _field_table() -> dict[str, dict[str, str | tuple]]:
    """Every top-level field each endpoint knows (OpenAI's, and the vLLM and llama-server extras)
    -> {endpoint: how it is taken}: `HONOURED`; `IGNORED` (accepted, and it changes no output);
    or the values that change nothing, the only ones accepted (any other is a 400 naming the
    field). A field an endpoint does not list is a 400 too: a misspelt option never passes."""
    both, table = ENDPOINTS, {}

    def add(names: str, taken, endpoints=both):
        for name in names.split():
            table.setdefault(name, {}).update({endpoint: taken for endpoint in endpoints})

    add("model max_tokens temperature top_p top_k seed stop n stream stream_options logprobs presence_penalty "
        "frequency_penalty repetition_penalty logit_bias min_tokens min_p ignore_eos stop_token_ids cache_salt "
        "speculative include_stop_str_in_output allowed_token_ids response_format", HONOURED)
    add("prompt", HONOURED, ["completions"])
    add("messages max_completion_tokens top_logprobs tools tool_choice parallel_tool_calls", HONOURED, ["chat"])
    add("max_completion_tokens top_logprobs suffix", (None,), ["completions"])
    add("user", IGNORED)  # OpenAI's bookkeeping and routing hints: nothing generated depends on them
    add("metadata safety_identifier prompt_cache_key service_tier", IGNORED, ["chat"])
    add("best_of", (None, 1))
    add("echo use_beam_search return_tokens_as_token_ids", (None, False))
    add("skip_special_tokens spaces_between_special_tokens", (None, True))
    add("length_penalty", (None, 1))
    add("guided_json guided_regex guided_choice guided_grammar guided_decoding_backend guided_whitespace_pattern "
        "structured_outputs grammar json_schema bad_words truncate_prompt_tokens prompt_logprobs "
        "add_special_tokens logits_processors priority request_id", (None,))
    add("store continue_final_message", (None, False), ["chat"])
    add("add_generation_prompt", (None, True), ["chat"])
    add("modalities", (None, ["text"]), ["chat"])
    add("functions function_call audio prediction reasoning_effort web_search_options verbosity chat_template "
        "chat_template_kwargs documents", (None,), ["chat"])
    return table


FIELDS = _field_table()


def _no_op(value, values: tuple) -> bool:
    """Whether `value` is one of `values` (True is not 1 here, nor 1.0 different from 1)."""
    return any(value is v or (value == v and isinstance(value, bool) == isinstance(v, bool)) for v in values)


def _check_fields(body: dict, endpoint: str) -> None:
    """A 400 for a field `endpoint` does not know (naming a close match) or does not honour at
    the value given."""
    known = [name for name, ways in FIELDS.items() if endpoint in ways]
    for name, value in body.items():
        taken = FIELDS.get(name, {}).get(endpoint)
        if taken is None:
            close = difflib.get_close_matches(name, known, n=1) if isinstance(name, str) else []
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise BadRequest(f"unknown field {name[:100]!r}{hint}", name[:100], code="unknown_field")
        if isinstance(taken, tuple) and not _no_op(value, taken):
            shown = " or ".join(json.dumps(v) for v in taken)
            raise BadRequest(f"{name} is not supported by this server yet (only {shown} is taken)", name,
                             code="unsupported")


@functools.cache
def served_methods() -> tuple[str, ...]:
    """The names a request's `speculative.method` takes: every method and preset of the registry
    (`specdec methods`) but those where the target drafts for itself, which run one sequence at a
    time (the engine's batched passes keep no hidden states), and the lossy presets (`sd-typical`):
    whatever drafts, a served output is the target's own (greedy, or its seeded law)."""
    from ..decoding.speculation import METHODS as REGISTRY, names, preset

    return tuple(name for name in names()
                 if not REGISTRY[preset(name).method].self_drafting and preset(name).acceptance == "exact")


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
    # the request's speculation: the server's default config with the `speculative` block's changes
    # (`replace()`), validated; `method` the name it asked for (None: plain decoding)
    speculation: SpecConfig = field(default_factory=SpecConfig)
    method: str | None = "default"
    built: object = None  # the `Speculation` built from it, once a job (`Service.speculation`)
    logprobs: int | None = None  # None: off; k: each token's log-probability and its k most likely
    cache_salt: str = ""  # the tenant: shared caches (prompts, suffix drafting) only within one salt
    tenant: str = ""  # the API key's tenant where several keys are set (the app's, never the body's)
    min_p: float = 0.0
    rules: LogitRules = field(default_factory=LogitRules)  # penalties, logit_bias, min_tokens
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop: bool = False  # include_stop_str_in_output: the stop string kept at the end of the text
    include_usage: bool = False  # stream_options.include_usage: a last chunk with `usage`
    # what the output must match (`grammar.Grammar`): response_format's; a required tool call's is
    # added by `Service.constrain`, which also checks either against the model
    grammar: object = None
    tools: list[dict] | None = None  # the tools offered (None: none, or tool_choice "none")
    tool_choice: str | dict = "none"  # "auto", "required", {"type": "function", "function": {"name"}}
    parallel_tool_calls: bool = True  # False: at most one call


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


def _speculation(value, default: SpecConfig, default_method: str | None) -> tuple[str | None, SpecConfig]:
    """The request's `speculative` block as a change to the server's `default` config (named
    `default_method`; None: plain decoding) -> (the method name asked for, None for plain decoding;
    the config, validated). A request names no model, datastore or checkpoint: those are the
    server's."""
    from ..decoding.sequence import DRAFT_ROOM  # a tree's nodes must fit the draft's room in the KV charge
    from ..decoding.speculation import gamma_means_fixed, preset

    if value is None or value is True:
        return default_method, default
    if value is False:
        return None, SpecConfig("ar")
    if not isinstance(value, dict):
        raise BadRequest(f"speculative must be false or an object with {', '.join(SPECULATIVE_FIELDS)}; got {value!r}",
                         "speculative")
    unknown = set(value) - set(SPECULATIVE_FIELDS)
    if unknown:
        raise BadRequest(f"speculative takes {', '.join(SPECULATIVE_FIELDS)}, not {sorted(unknown)}", "speculative")
    method = value.get("method", default_method or "default")
    served = served_methods()
    if method not in served:
        raise BadRequest(f"speculative.method must be one of {', '.join(served)} (`specdec methods`); got {method!r}",
                         "speculative.method")
    kind = preset(method).method if method != "ar" else "ar"
    if "tree_nodes" in value and kind not in ("tree", "lookahead"):
        raise BadRequest("speculative.tree_nodes applies to methods tree and lookahead", "speculative.tree_nodes")
    if "tree" in value and kind != "tree":
        raise BadRequest("speculative.tree applies to the tree method", "speculative.tree")
    if ("schedule" in value or "gamma" in value) and kind in ("tree", "lookahead", "ar"):
        raise BadRequest("speculative.schedule and gamma size chains; trees are sized by cost", "speculative.schedule")
    if method == "ar":
        return None, SpecConfig("ar")
    changes = {}
    for name in ("tree", "schedule"):
        if value.get(name) is not None:
            if not isinstance(value[name], str):
                raise BadRequest(f"speculative.{name} must be a {name}'s name, got {value[name]!r}",
                                 f"speculative.{name}")
            changes[name] = value[name]
    for name, high in (("gamma_max", 32), ("tree_nodes", DRAFT_ROOM), ("gamma", 32)):
        number = _number(value, name, None, 1, high, integer=True, within="speculative.")
        if number is not None:
            changes[name] = number
    # "default" is the server's own config; another name is its preset, with the server's sizing
    if method == "default" and default.speculative:
        name, base = default_method or "default", default
    else:
        name = method
        base = preset(method).replace(gamma_max=default.gamma_max, tree_nodes=default.tree_nodes,
                                      assumed=default.assumed)
    if "gamma" in changes and "schedule" not in changes and gamma_means_fixed(name, base):
        changes["schedule"] = "fixed"  # gamma alone: a fixed γ, as `specdec generate --gamma N`
    try:
        return method, base.replace(**changes).validate()
    except SpecdecError as error:
        raise BadRequest(str(error), "speculative") from None


def _stop(value) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP:
        raise BadRequest(f"stop must be a non-empty string or a list of at most {MAX_STOP} of them, "
                         f"got {value!r}"[:300], "stop")
    for stop in stops:
        if len(stop) > MAX_STOP_CHARS:
            raise BadRequest(f"a stop string is {len(stop)} characters; this server takes at most {MAX_STOP_CHARS}",
                             "stop")
        _unicode(stop, "stop")
    return stops


def _unicode(text: str, name: str) -> None:
    """A 400 for text holding a lone surrogate ("\\ud800" in JSON): it has no UTF-8 form, so
    neither a tokenizer nor a generated text can hold it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise BadRequest(f"{name} holds a lone surrogate (U+{ord(error.object[error.start]):04X}), which is not "
                         "valid Unicode", name) from None


def _stream_options(value, stream: bool) -> bool:
    """`stream_options` (streaming only, as vLLM has it) -> include_usage."""
    if value is None:
        return False
    if not stream:
        raise BadRequest("stream_options applies to streamed requests only (stream: true)", "stream_options")
    if not isinstance(value, dict) or set(value) - {"include_usage"}:
        raise BadRequest(f"stream_options takes include_usage only, got {value!r}"[:300], "stream_options")
    return _flag(value, "include_usage")


MESSAGE_FIELDS = {"role", "content", "name", "tool_calls", "tool_call_id", "function_call", "refusal", "audio",
                  "annotations", "reasoning_content"}  # OpenAI's; those a role does not take, only as null
ROLE_FIELDS = {"assistant": {"tool_calls"}, "tool": {"tool_call_id"}}  # taken beyond role and content


def _messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise BadRequest("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or \
                message.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise BadRequest(f"{where} must be an object with role system, developer, user, assistant or tool and a "
                             f"content, got {message!r}"[:300], where)
        taken = {"role", "content"} | ROLE_FIELDS.get(message["role"], set())
        for name, item in message.items():
            if name not in MESSAGE_FIELDS:
                raise BadRequest(f"{where} has an unknown field {str(name)[:100]!r}", where, code="unknown_field")
            if name not in taken and item is not None and item != []:
                raise BadRequest(f"{where}.{name} is not supported by this server yet", f"{where}.{name}",
                                 code="unsupported")
        # developer: OpenAI's newer name for system, which chat templates know
        role = "system" if message["role"] == "developer" else message["role"]
        calls = _message_calls(message.get("tool_calls"), where) if role == "assistant" else []
        # an assistant's turn that only called tools has no content (null, as OpenAI returns it)
        content = "" if calls and message.get("content") is None else _content(message.get("content"), where)
        entry = {"role": role, "content": content}
        if calls:
            entry["tool_calls"] = calls
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise BadRequest(f"{where} is a tool result: it needs the tool_call_id of the call it answers",
                                 f"{where}.tool_call_id")
            entry["tool_call_id"] = call_id
        out.append(entry)
    if not any(m["content"] or m.get("tool_calls") for m in out):
        raise BadRequest("messages are all empty", "messages")
    return out


def _message_calls(value, where: str) -> list[dict]:
    """An assistant message's `tool_calls` (as a response gave them) -> the calls, checked."""
    if value is None or value == []:
        return []
    if not isinstance(value, list):
        raise BadRequest(f"{where}.tool_calls must be a list of calls", f"{where}.tool_calls")
    calls = []
    for k, call in enumerate(value):
        at = f"{where}.tool_calls[{k}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function" or \
                set(call) - {"id", "type", "function"} or set(function) - {"name", "arguments"} or \
                not isinstance(function.get("name"), str) or not isinstance(call.get("id", ""), str):
            raise BadRequest(f'{at} must be {{"id": ID, "type": "function", "function": {{"name": NAME, '
                             f'"arguments": JSON}}}}, got {call!r}'[:300], at)
        arguments = function.get("arguments")
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else None
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise BadRequest(f"{at}.function.arguments must be a JSON object in a string, got {arguments!r}"[:300],
                             f"{at}.function.arguments")
        calls.append({"id": call.get("id", ""), "type": "function",
                      "function": {"name": function["name"], "arguments": arguments}})
    return calls


def _response_format(value):
    """`response_format` -> the output's grammar (`grammar.Grammar`; None: free text). Its
    structure is checked here; the schema itself against the model (`Service.constrain`)."""
    from ..core.grammar import Grammar

    kinds = ("text", "json_object", "json_schema")
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in kinds:
        raise BadRequest(f'response_format must be {{"type": "text"}}, {{"type": "json_object"}} or {{"type": '
                         f'"json_schema", "json_schema": {{"name", "schema", "strict", "description"}}}}, '
                         f"got {value!r}"[:300], "response_format")
    kind = value["type"]
    extra = set(value) - {"type"} - ({"json_schema"} if kind == "json_schema" else set())
    if extra:
        raise BadRequest(f"response_format of type {kind!r} takes no {', '.join(map(str, sorted(extra)))}"[:300],
                         "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json()
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or set(spec) - {"name", "schema", "strict", "description"}:
        raise BadRequest(f"response_format.json_schema must be an object with name, schema, strict and description, "
                         f"got {spec!r}"[:300], "response_format")
    if not isinstance(spec.get("name"), str) or not NAME.fullmatch(spec["name"]):
        raise BadRequest(f"response_format.json_schema.name must be 1 to 64 letters, digits, _ or -, got "
                         f"{spec.get('name')!r}"[:300], "response_format")
    if not isinstance(spec.get("strict", False), (bool, type(None))) or \
            not isinstance(spec.get("description", ""), (str, type(None))):
        raise BadRequest("response_format.json_schema.strict must be true or false, and description a string",
                         "response_format")
    if not isinstance(spec.get("schema"), dict):
        raise BadRequest(f"response_format.json_schema.schema must be a JSON Schema (an object), got "
                         f"{spec.get('schema')!r}"[:300], "response_format")
    return Grammar.json_schema(spec["schema"])


def _tools(value) -> list[dict] | None:
    """`tools` -> OpenAI's function tools, checked (None: no tools)."""
    if value is None:
        return None
    if not isinstance(value, list) or not value or len(value) > MAX_TOOLS:
        raise BadRequest(f'tools must be a list of 1 to {MAX_TOOLS} {{"type": "function", "function": {{"name", '
                         f'"description", "parameters"}}}} objects', "tools")
    tools, names = [], set()
    for k, tool in enumerate(value):
        where = f"tools[{k}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function" or set(tool) - {"type", "function"}:
            raise BadRequest(f'{where} must be {{"type": "function", "function": {{...}}}} (function tools only), '
                             f"got {tool!r}"[:300], where)
        unknown = set(function) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise BadRequest(f"{where}.function takes name, description, parameters and strict, not "
                             f"{sorted(map(str, unknown))}"[:300], f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise BadRequest(f"{where}.function.name must be 1 to 64 letters, digits, _ or -, got {name!r}"[:300],
                             f"{where}.function.name")
        if name in names:
            raise BadRequest(f"tools name the function {name!r} twice", f"{where}.function.name")
        names.add(name)
        if not isinstance(function.get("parameters", {}), (dict, type(None))):
            raise BadRequest(f"{where}.function.parameters must be a JSON Schema (an object)",
                             f"{where}.function.parameters")
        if not isinstance(function.get("description", ""), (str, type(None))) or \
                not isinstance(function.get("strict", False), (bool, type(None))):
            raise BadRequest(f"{where}.function's description must be a string and strict true or false",
                             f"{where}.function")
        tools.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
    return tools


def _tool_choice(value, tools: list[dict] | None):
    """`tool_choice` -> "none", "auto", "required" or {"type": "function", "function": {"name"}}
    (default: "auto" with tools, else "none")."""
    if value is None:
        return "auto" if tools else "none"
    names = [tool["function"]["name"] for tool in tools or []]
    if isinstance(value, str) and value in ("none", "auto", "required"):
        if value != "none" and not tools:
            raise BadRequest(f"tool_choice {value!r} needs tools", "tool_choice")
        return value
    function = value.get("function") if isinstance(value, dict) else None
    if isinstance(function, dict) and value.get("type") == "function" and set(value) == {"type", "function"} \
            and set(function) == {"name"} and isinstance(function["name"], str):
        if function["name"] not in names:
            raise BadRequest(f"tool_choice names the function {function['name'][:100]!r}, which tools do not hold"
                             + (f" (they hold {', '.join(names)})" if names else ""), "tool_choice")
        return {"type": "function", "function": {"name": function["name"]}}
    raise BadRequest(f'tool_choice must be "none", "auto", "required" or {{"type": "function", "function": '
                     f'{{"name": NAME}}}}, got {value!r}'[:300], "tool_choice")


def _content(value, where: str) -> str:
    """A message's content: a string, or a list of text parts, joined by newlines as vLLM joins
    them for a text-only model. Other parts (images, audio, files) are refused by type."""
    if isinstance(value, str):
        _unicode(value, f"{where}.content")
        return value
    if not isinstance(value, list):
        raise BadRequest(f"{where}.content must be a string or a list of text parts, got {value!r}"[:300],
                         f"{where}.content")
    texts = []
    for k, part in enumerate(value):
        at = f"{where}.content[{k}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            what = f"a {kind!r} part" if isinstance(kind, str) else f"{part!r}"[:100]
            raise BadRequest(f"{at} is {what}; this server takes text parts only ({{\"type\": \"text\", "
                             f"\"text\": ...}})", at, code="unsupported" if isinstance(kind, str) else None)
        if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
            raise BadRequest(f"{at} must be {{\"type\": \"text\", \"text\": STRING}}", at)
        _unicode(part["text"], at)
        texts.append(part["text"])
    return "\n".join(texts)


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
        if isinstance(prompt, str):
            _unicode(prompt, "prompt")
    return [p if isinstance(p, str) else list(p) for p in prompts]


def parse_job(body: dict, chat: bool, model_name: str, default: SpecConfig,
              default_method: str | None = "default") -> Job:
    """Check a /v1/completions (chat=False) or /v1/chat/completions body -> a `Job`. default: the
    server's speculation (`Service.default`), named `default_method` (None: plain decoding); a
    request's `speculative` block changes it (`_speculation`)."""
    model = body.get("model")
    if model is not None and model != model_name:
        raise BadRequest(f"the model {model!r} does not exist; this server serves {model_name!r}", "model",
                         status=404, code="model_not_found")
    _check_fields(body, "chat" if chat else "completions")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"stream must be true or false, got {stream!r}", "stream")
    include_usage = _stream_options(body.get("stream_options"), stream)
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
        speculation=(asked := _speculation(body.get("speculative"), default, default_method))[1],
        method=asked[0],
        logprobs=_logprobs(body, chat),
        cache_salt=_cache_salt(body.get("cache_salt")),
        min_p=_number(body, "min_p", 0.0, 0, 1),
        rules=_rules(body),
        ignore_eos=_flag(body, "ignore_eos"),
        stop_token_ids=_id_list(body.get("stop_token_ids"), "stop_token_ids"),
        include_stop=_flag(body, "include_stop_str_in_output"),
        include_usage=include_usage,
        grammar=_response_format(body.get("response_format")),
    )
    if chat:
        tools = _tools(body.get("tools"))
        job.tool_choice = _tool_choice(body.get("tool_choice"), tools)
        job.tools = tools if job.tool_choice != "none" else None
        parallel = body.get("parallel_tool_calls")
        if parallel is not None and not isinstance(parallel, bool):
            raise BadRequest(f"parallel_tool_calls must be true or false, got {parallel!r}", "parallel_tool_calls")
        job.parallel_tool_calls = parallel is not False
        if job.tools and job.grammar is not None:
            raise BadRequest("response_format constrains the whole output, which leaves no room for tool calls: "
                             'send tools with tool_choice "none", or no response_format', "response_format")
    if job.max_tokens is not None and job.rules.min_tokens > job.max_tokens:
        raise BadRequest(f"min_tokens is {job.rules.min_tokens}, more than max_tokens ({job.max_tokens})",
                         "min_tokens")
    if job.n > 1 and job.temperature == 0:  # greedy choices are all the same text (vLLM refuses them too)
        raise BadRequest(f"n is {job.n}, but temperature 0 (greedy) makes every choice the same: ask n = 1, "
                         "or sample (temperature > 0)", "n")
    if job.n * len(job.prompts or [None]) > MAX_CHOICES:
        raise BadRequest(f"prompts × n is {job.n * len(job.prompts)}; a request takes at most {MAX_CHOICES} choices",
                         "n")
    return job


def _rules(body: dict) -> LogitRules:
    """presence_penalty, frequency_penalty, repetition_penalty, logit_bias, min_tokens and allowed_token_ids ->
    `LogitRules` (applied to every position's logits, drafts included: core/penalties.py)."""
    bias = body.get("logit_bias")
    if bias is None:
        bias = {}
    if not isinstance(bias, dict) or len(bias) > MAX_BIAS:
        raise BadRequest(f"logit_bias must be an object of at most {MAX_BIAS} token ids to numbers", "logit_bias")
    pairs, keys = [], {}
    for key, value in bias.items():
        token = _token_id(key, "logit_bias")
        if token in keys:  # "1" and "01": which value would count is anyone's guess
            raise BadRequest(f"logit_bias names token {token} twice: {keys[token]!r} and {key!r}", "logit_bias")
        keys[token] = key
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise BadRequest(f"logit_bias values must be numbers in [-100, 100], got {value!r} for {key!r}",
                             "logit_bias")
        pairs.append((token, float(value)))
    return LogitRules(presence=_number(body, "presence_penalty", 0.0, -2, 2),
                      frequency=_number(body, "frequency_penalty", 0.0, -2, 2),
                      repetition=_number(body, "repetition_penalty", 1.0, 0, 10, low_open=True),
                      bias=tuple(sorted(pairs)),
                      min_tokens=_number(body, "min_tokens", 0, 0, 2 ** 31, integer=True),
                      allowed=_allowed(body.get("allowed_token_ids")))


def _allowed(value) -> tuple[int, ...]:
    """vLLM's `allowed_token_ids`: the only tokens that may come (None: every token)."""
    ids = _id_list(value, "allowed_token_ids")
    if value is not None and not ids:
        raise BadRequest("allowed_token_ids must name at least one token", "allowed_token_ids")
    return tuple(sorted(set(ids)))


def _token_id(value, name: str) -> int:
    """A token id given as an integer or a string of digits (JSON object keys are strings)."""
    # ASCII digits only ("²".isdigit() too), and few of them: int() refuses over 4,300 digits
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 10:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2 ** 31:
        raise BadRequest(f"{name} takes token ids (integers >= 0), got {value!r}"[:200], name)
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
