"""Structured output on `specdec serve`: `response_format` (json_object, json_schema) and tool
calls (`tools`, `tool_choice`), driven by the real `openai` client. Constrained greedy output is
the constrained AR output whatever drafted; a required call's arguments validate against its
function's parameters, streamed and whole alike; bad schemas and unsupported combinations are 400s
naming the field. A tiny random model with a byte-level tokenizer and a Qwen-like chat template
built here; Qwen2.5-Coder 0.5B at the end (`real`)."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import pytest
from pydantic import BaseModel, ConfigDict, Field
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from specdec.decoding.loop import autoregressive_generate
from specdec.core.grammar import Grammar
from specdec.sizing.schedules import AssumedCosts
from specdec.decoding.config import SpecConfig
from specdec.server.schema import parse_job
from specdec.server.service import Limits, Service
from specdec.server.tools import CallParser, call_grammar

from conftest import tiny_model
from test_server import _client, serving

NAME = "tiny"
# as Qwen2.5's: tools listed in the system turn, calls as <tool_call> JSON, results as <tool_response>
TEMPLATE = (
    "{%- if tools %}<|system|>Tools:{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n"
    'Call as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call><|end|>{% endif %}'
    "{%- for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{%- for call in m.tool_calls or [] %}\n<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}{% if m.role == 'tool' %}\n<tool_response>{% endif %}<|end|>{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}")


class Weather(BaseModel):
    """A tool's parameters (bounded, no other keys, so that a random model's call ends)."""

    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=6)
    unit: Literal["c", "f"]


class Timer(BaseModel):
    model_config = ConfigDict(extra="forbid")
    minutes: Literal[1, 5, 10]


class Reading(BaseModel):
    ok: bool
    unit: Literal["c", "f"]
    note: str = Field(max_length=5)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": Weather.model_json_schema()}},
         {"type": "function", "function": {"name": "set_timer", "parameters": Timer.model_json_schema()}}]
PARAMETERS = {"get_weather": Weather, "set_timer": Timer}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "unit": {"enum": ["c", "f"]},
                                           "note": {"type": "string", "maxLength": 4}},
          "required": ["ok", "unit", "note"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def _tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE without merges (every byte a token), an end token (id 1, the tiny model's
    eos) and Qwen's tool tags as added tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=ord)
    vocab = {"<s>": 0, "<|end|>": 1, **{ch: 2 + k for k, ch in enumerate(alphabet)}}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="<|end|>",
                                        chat_template=TEMPLATE)
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    return tokenizer


@pytest.fixture(scope="module")
def pair():
    tokenizer = _tokenizer()
    target = tiny_model(0, vocab=len(tokenizer), max_positions=2048, exact_rows=True, name=NAME)
    drafter = tiny_model(1, vocab=len(tokenizer), layers=1, max_positions=2048, exact_rows=True, name="tiny-drafter")
    target.tokenizer = drafter.tokenizer = tokenizer
    return target, drafter


@pytest.fixture(scope="module")
def service(pair):
    # drafts sized by costs taken as given, not timed: every run drafts the same on any machine
    return Service(pair[0], pair[1], limits=Limits(max_tokens=120), assumed=AssumedCosts(drafter=0.05, slope=0.0))


@pytest.fixture(scope="module")
def server(service):
    with serving(lambda: service, max_batch=4, steer=False) as (url, app):
        yield url


def _post(url: str, body: dict, chat: bool = True) -> httpx.Response:
    return httpx.post(url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body, timeout=60)


def _error(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text[:300]
    return response.json()["error"]


def _reassembled(chunks) -> list[dict]:
    """Streamed chat chunks -> per choice {content, tool_calls, finish_reason}, as a client
    joins them (a call's pieces by their index)."""
    choices: dict[int, dict] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            out = choices.setdefault(choice.index, {"content": None, "tool_calls": {}, "finish_reason": None})
            if choice.delta.content:
                out["content"] = (out["content"] or "") + choice.delta.content
            for call in choice.delta.tool_calls or []:
                whole = out["tool_calls"].setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                whole["id"] = call.id or whole["id"]
                whole["name"] += call.function.name or ""
                whole["arguments"] += call.function.arguments or ""
            out["finish_reason"] = choice.finish_reason or out["finish_reason"]
    return [{**c, "tool_calls": [c["tool_calls"][k] for k in sorted(c["tool_calls"])]}
            for _, c in sorted(choices.items())]


def _whole(choice) -> dict:
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
             for c in choice.message.tool_calls or []]
    return {"content": choice.message.content, "tool_calls": calls, "finish_reason": choice.finish_reason}


def _same_but_ids(a: dict, b: dict) -> bool:
    strip = lambda c: {**c, "tool_calls": [{**t, "id": None} for t in c["tool_calls"]]}  # noqa: E731
    return strip(a) == strip(b)


def test_parse_with_a_pydantic_model_returns_the_parsed_object(server):
    client = _client(server)
    reply = client.beta.chat.completions.parse(model=NAME, messages=MESSAGES, response_format=Reading,
                                               temperature=0, max_tokens=80)
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, Reading), reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    # any JSON object, as OpenAI's json_object mode
    text = client.chat.completions.create(model=NAME, messages=MESSAGES, response_format={"type": "json_object"},
                                          temperature=0, max_tokens=100).choices[0].message.content
    assert isinstance(json.loads(text), dict) or text == ""


@pytest.mark.parametrize("speculative", [False, None, {"method": "lookup"}, {"method": "forced"},
                                         {"method": "chain", "gamma": 3}],
                         ids=["ar", "default", "lookup", "forced", "chain"])
def test_greedy_constrained_output_is_the_constrained_ar_output(server, service, pair, speculative):
    """Completions and chat (a required call): the served text is `autoregressive_generate` under
    the same grammar on the same prompt ids, whichever method drafted."""
    target = pair[0]
    prompt = [40, 41, 42, 43, 44]
    extra = {} if speculative is None else {"speculative": speculative}
    format = {"type": "json_schema", "json_schema": {"name": "reading", "schema": SCHEMA, "strict": True}}
    reply = _post(server, {"prompt": prompt, "max_tokens": 60, "temperature": 0, "response_format": format, **extra},
                  chat=False).json()
    alone = autoregressive_generate(prompt, target, max_new_tokens=60, grammar=Grammar.json_schema(SCHEMA))
    assert alone.stop_reason == "eos" and json.loads(target.decode(alone.tokens)).keys() == SCHEMA["properties"].keys()
    assert reply["choices"][0]["text"] == target.decode(alone.tokens)
    if speculative is None:
        assert reply["usage"]["speculative"]["drafted_tokens"] > 0

    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 120, "temperature": 0,
            **extra}
    reply = _post(server, body).json()
    job = parse_job(body, True, NAME, SpecConfig())
    service.constrain(job)
    ids = service.prompt_ids(job)[0]
    alone = autoregressive_generate(ids, target, max_new_tokens=120, grammar=job.grammar)
    assert alone.stop_reason == "eos"
    calls = reply["choices"][0]["message"]["tool_calls"]
    expected = target.decode(alone.tokens).split("</tool_call>")[:-1]
    assert [json.loads(piece.split("<tool_call>\n")[1]) for piece in expected] == \
        [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])} for c in calls]


@pytest.mark.parametrize("parallel", [False, True])
def test_required_tool_calls_validate_and_stream_as_they_return_whole(server, parallel):
    client = _client(server)
    options = dict(model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=120,
                   temperature=0, parallel_tool_calls=parallel)
    reply = client.chat.completions.create(**options)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and (parallel or len(calls) == 1)
    assert len({c.id for c in calls}) == len(calls) and all(c.id.startswith("call_") for c in calls)
    for call in calls:
        assert call.type == "function"
        PARAMETERS[call.function.name].model_validate_json(call.function.arguments)
    streamed = _reassembled(client.chat.completions.create(**options, stream=True))
    assert len(streamed) == 1 and _same_but_ids(streamed[0], _whole(choice))
    assert all(c["id"].startswith("call_") for c in streamed[0]["tool_calls"])


def test_named_calls_seeded_choices_and_logprobs_stream_as_they_return_whole(server):
    client = _client(server)
    options = dict(model=NAME, messages=MESSAGES, tools=TOOLS, max_tokens=120, temperature=1, seed=7, n=3,
                   tool_choice={"type": "function", "function": {"name": "set_timer"}}, logprobs=True,
                   extra_body={"speculative": {"method": "default"}})
    reply = client.chat.completions.create(**options)
    for choice in reply.choices:
        assert [c.function.name for c in choice.message.tool_calls] == ["set_timer"]
        Timer.model_validate_json(choice.message.tool_calls[0].function.arguments)
        assert choice.finish_reason == "tool_calls" and choice.logprobs.content
    chunks = list(client.chat.completions.create(**options, stream=True))
    streamed = _reassembled(chunks)
    assert all(_same_but_ids(s, _whole(c)) for s, c in zip(streamed, reply.choices)) and len(streamed) == 3
    tokens = [sum(len(ch.choices[0].logprobs.content) for ch in chunks
                  if ch.choices and ch.choices[0].index == i and ch.choices[0].logprobs) for i in range(3)]
    assert tokens == [len(c.logprobs.content) for c in reply.choices]


def test_tool_results_go_back_through_the_chat_template(server, service):
    client = _client(server)
    first = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           max_tokens=120, temperature=0, parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    messages = MESSAGES + [first.choices[0].message.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    again = client.chat.completions.create(model=NAME, messages=messages, tools=TOOLS, max_tokens=8, temperature=0)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
    job = parse_job({"messages": messages, "tools": TOOLS}, True, NAME, SpecConfig())
    rendered = service.target.tokenizer.decode(service.prompt_ids(job)[0])
    assert f'"name": "{call.function.name}", "arguments": {call.function.arguments}' in rendered
    assert "<|tool|>sunny, 21 C<tool_response>" in rendered and "Tools:" in rendered
    # tool_choice "none": tools not offered
    job = parse_job({"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none"}, True, NAME, SpecConfig())
    assert "Tools:" not in service.target.tokenizer.decode(service.prompt_ids(job)[0]) and job.tools is None


def test_calls_parse_the_same_in_any_pieces():
    text = ('Let me see.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>\nnot json\n</tool_call>\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>\n<tool')

    def parse(pieces, one=False):
        parser, content, calls = CallParser({"f", "g"}, one), "", []
        for piece in pieces:
            text_, new = parser.feed(piece)
            content, calls = content + text_, calls + new
        content += parser.finish()
        return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]

    whole = parse([text])
    assert whole == ("Let me see.<tool_call>\nnot json\n</tool_call><tool", [("f", {"x": 1}), ("g", {})])
    assert parse(["a <tool_call>\n", '{"name": "f", "arguments": {}}\n</tool_call> b \n']) == ("ab \n", [("f", {})])
    assert parse(list(text)) == whole and parse([text[:30], text[30:77], text[77:]]) == whole
    assert parse(list(text), one=True) == ("Let me see.", [("f", {"x": 1})])
    assert parse(["no calls here \n"]) == ("no calls here \n", [])


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format", "not valid"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "format": "no-such-format"}}}}}},
     "response_format", "not valid"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x y", "schema": {}}}},
     "response_format", "name"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters", "not valid"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools[2].function.name", "twice"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]", "function tools only"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format", "no room"),
    ({"response_format": {"type": "json_object"}, "speculative": {"method": "tree"}}, "speculative.method", "chain"),
    ({"tools": TOOLS, "tool_choice": "required", "ignore_eos": True}, "ignore_eos", "end token"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "tool_call_id"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "JSON object"),
]


@pytest.mark.parametrize("extra, param, needle", BAD, ids=[b[1] + f"-{k}" for k, b in enumerate(BAD)])
def test_bad_schemas_and_combinations_are_400s_naming_the_field(server, extra, param, needle):
    error = _error(_post(server, {"messages": MESSAGES, "max_tokens": 4, **extra}))
    assert error["param"] == param and needle in error["message"], error


def test_completions_take_response_format(server, pair):
    reply = _post(server, {"prompt": "x", "max_tokens": 100, "temperature": 0,
                           "response_format": {"type": "json_object"}}, chat=False).json()
    assert reply["choices"][0]["finish_reason"] == "stop" and isinstance(json.loads(reply["choices"][0]["text"]), dict)
    error = _error(_post(server, {"prompt": "x", "tools": TOOLS}, chat=False))
    assert error["param"] == "tools" and error["code"] == "unknown_field"


def test_a_grammar_for_tool_tags_that_are_plain_text():
    """Where the tokenizer has no token of its own for a tag, the grammar writes the tag as text."""
    class Plain:
        def get_added_vocab(self):
            return {}

    grammar = call_grammar(TOOLS, "required", True, Plain())
    assert 'call: "<tool_call>" "\\n" body "\\n" "</tool_call>"' in grammar.source
    assert "call: <tool_call>" in call_grammar(TOOLS, "required", True, _tokenizer()).source


@pytest.mark.real
def test_qwen_calls_a_tool_and_answers_a_pydantic_model():
    """Qwen2.5-Coder 0.5B's own template and tool tags: a required call parses into tool_calls
    whose arguments validate, the same streamed; parse() returns the object. (One call: left to
    call on, this small model goes on calling until max_tokens.)"""
    from specdec.models import loading as models

    target = models.load("qwen2.5-coder-0.5b", role="target", exact_rows=True)
    service = Service(target, None, default="ar", limits=Limits(max_tokens=96))
    with serving(lambda: service, max_batch=2, steer=False) as (url, _):
        client = _client(url)
        options = dict(model=target.name, messages=[{"role": "user", "content": "Weather in Oslo, in celsius?"}],
                       tools=TOOLS, tool_choice="required", max_tokens=96, temperature=0, parallel_tool_calls=False,
                       extra_body={"speculative": {"method": "forced"}})
        reply = client.chat.completions.create(**options)
        calls = reply.choices[0].message.tool_calls
        assert reply.choices[0].finish_reason == "tool_calls" and calls
        for call in calls:
            PARAMETERS[call.function.name].model_validate_json(call.function.arguments)
        streamed = _reassembled(client.chat.completions.create(**options, stream=True))
        assert _same_but_ids(streamed[0], _whole(reply.choices[0]))
        parsed = client.beta.chat.completions.parse(
            model=target.name, messages=[{"role": "user", "content": "Is it warm (ok), unit c, note hi?"}],
            response_format=Reading, temperature=0, max_tokens=64).choices[0].message.parsed
        assert isinstance(parsed, Reading)


def test_tool_call_bodies_follow_openais_schema(server):
    from test_server_openai import check

    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 120, "temperature": 0}
    whole = _post(server, body).json()
    assert whole["choices"][0]["message"]["tool_calls"]
    check("CreateChatCompletionResponse", whole)
    with httpx.stream("POST", server + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert any(c["choices"] and c["choices"][0]["delta"].get("tool_calls") for c in chunks)
    for chunk in chunks:
        check("CreateChatCompletionStreamResponse", chunk)


def test_a_call_with_a_name_not_a_string_and_a_closing_tag_inside_an_argument_parse_as_they_should():
    parser = CallParser({"f"})
    content, calls = parser.feed('<tool_call>\n{"name": ["f"], "arguments": {}}\n</tool_call>')
    assert calls == [] and "name" in content  # not a call: given back as content, never a 500
    text = '<tool_call>\n{"name": "f", "arguments": {"a": "x</tool_call>y"}}\n</tool_call>'
    for pieces in ([text], list(text)):  # whole, and a character at a time
        parser, calls = CallParser({"f"}), []
        for piece in pieces:
            calls += parser.feed(piece)[1]
        assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"a": "x</tool_call>y"}]


def test_a_required_call_of_a_tool_whose_parameters_use_defs_is_taken(pair):
    """Pydantic writes nested models under $defs: each tool's arguments keep their own root."""
    from pydantic import BaseModel

    from specdec.server.tools import call_grammar

    class Place(BaseModel):
        city: str

    class Trip(BaseModel):
        start: Place
        end: Place

    tools = [{"type": "function", "function": {"name": "plan", "parameters": Trip.model_json_schema()}}] + TOOLS
    assert "$defs" in tools[0]["function"]["parameters"]
    grammar = call_grammar(tools, "required", True, pair[0].tokenizer)
    grammar.check(pair[0])
    constraint = grammar.constraint(pair[0], pair[0].eos_token_ids)
    call = '<tool_call>\n{"name": "plan", "arguments": {"start": {"city": "A"}, "end": {"city": "B"}}}\n</tool_call>'
    ids = pair[0].tokenizer.encode(call, add_special_tokens=False)
    assert constraint.valid(ids) == len(ids)


def test_min_tokens_and_allowed_ids_do_not_combine_with_a_grammar(server):
    for field, value in (("min_tokens", 50), ("allowed_token_ids", [5, 6])):
        body = {"model": NAME, "messages": MESSAGES, "max_tokens": 60, "temperature": 0, field: value,
                "response_format": {"type": "json_object"}}
        assert _error(_post(server, body))["param"] == field
