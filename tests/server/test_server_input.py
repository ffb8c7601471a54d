"""What `specdec serve` takes from a request, as clients and attackers send it: every field is
honoured or refused by name (never silently ignored), bodies are JSON only, odd token ids and
lone surrogates are 400s rather than 500s, a client gone mid-body is counted as cancelled, chat
content may be a list of text parts, and stop strings follow vLLM's rules (after min_tokens,
optionally kept). Tiny random models on loopback."""

from __future__ import annotations

import logging
import re
import socket
import time
from pathlib import Path

import httpx
import openai
import pytest

from specdec.decoding.loop import autoregressive_generate
from specdec.core.penalties import LogitRules
from specdec.decoding.config import SpecConfig
from specdec.server.schema import FIELDS, HONOURED, IGNORED, BadRequest, parse_job
from specdec.server.service import Limits, Service

from conftest import tiny_model
from test_server import NAME, _client, _metric, _metrics, serving

DOCS = Path(__file__).resolve().parents[2] / "docs" / "server.md"


class _ByteTokenizer:
    """UTF-8 bytes folded into the tiny vocabulary, and a chat template that joins the contents:
    enough for text prompts and chat; it records the messages it was given."""

    chat_template = "joined"
    bos_token_id = None

    def __init__(self):
        self.seen: list[list[dict]] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [2 + b % 14 for b in text.encode("utf-8")]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = True):
        self.seen.append(messages)
        return self.encode("|".join(f"{m['role']}:{m['content']}" for m in messages))


@pytest.fixture(scope="module")
def tokenizer():
    return _ByteTokenizer()


@pytest.fixture(scope="module")
def target(tokenizer):
    model = tiny_model(0, exact_rows=True, name=NAME)
    model.tokenizer = tokenizer
    return model


@pytest.fixture(scope="module")
def server(target):
    with serving(lambda: Service(target, None, limits=Limits(max_tokens=16)), max_batch=4, steer=False) as (url, app):
        yield url, app


def _post(url: str, body: dict, chat: bool = False) -> httpx.Response:
    return httpx.post(url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body, timeout=60)


def _error(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text[:300]
    return response.json()["error"]


# item 4: plain 500s

@pytest.mark.parametrize("field", ["logit_bias", "stop_token_ids"])
@pytest.mark.parametrize("key", ["²", "9" * 5000, "٣"], ids=["superscript", "5000-digits", "arabic-digit"])
def test_token_ids_that_are_digits_but_not_numbers_are_a_400(server, field, key):
    url, _ = server
    value = {key: 5} if field == "logit_bias" else [key]
    error = _error(_post(url, {"prompt": [1, 2], "max_tokens": 2, field: value}))
    assert error["param"] == field and "token ids" in error["message"] and len(error["message"]) < 300


def test_a_token_named_twice_in_logit_bias_is_a_400_naming_both(server):
    url, _ = server
    error = _error(_post(url, {"prompt": [1, 2], "max_tokens": 2, "logit_bias": {"1": 5, "01": -5}}))
    assert error["param"] == "logit_bias" and "'1'" in error["message"] and "'01'" in error["message"]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_lone_surrogate_in_text_is_a_400_not_a_500(server, chat):
    url, _ = server
    text = b'"a\\ud800b"'
    body = b'{"messages": [{"role": "user", "content": %s}]}' % text if chat else b'{"prompt": %s}' % text
    response = httpx.post(url + ("/v1/chat/completions" if chat else "/v1/completions"), content=body,
                          headers={"content-type": "application/json"})
    error = _error(response)
    assert "surrogate" in error["message"] and error["param"] == ("messages[0].content" if chat else "prompt")
    assert _error(httpx.post(url + "/v1/completions", content=b'{"prompt": [1], "stop": "\\udfff"}',
                             headers={"content-type": "application/json"}))["param"] == "stop"
    assert _post(url, {"prompt": "ab", "max_tokens": 2}).status_code == 200  # the tokenizer takes text


def test_a_client_gone_while_its_body_is_read_is_counted_cancelled_and_logs_no_error(server):
    url, _ = server
    errors = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = errors.append
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    try:
        before = _metric(_metrics(url), "specdec:requests_total", status="cancelled")
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"prompt\": [1,")
        for _ in range(200):  # bounded: the server notices the closed socket
            if _metric(_metrics(url), "specdec:requests_total", status="cancelled") > before:
                break
            time.sleep(0.05)
        assert _metric(_metrics(url), "specdec:requests_total", status="cancelled") == before + 1
        assert _post(url, {"prompt": [1, 2], "max_tokens": 2}).status_code == 200
    finally:
        logger.removeHandler(handler)
    assert errors == []


# item 5: every field honoured or refused by name

@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_an_unknown_field_is_a_400_naming_it_and_its_close_match(server, chat):
    url, _ = server
    body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": [1, 2]}
    error = _error(_post(url, {**body, "max_tokens": 2, "temprature": 0}, chat))
    assert error["param"] == "temprature" and error["code"] == "unknown_field"
    assert "unknown field 'temprature'" in error["message"] and "did you mean 'temperature'" in error["message"]
    assert _error(_post(url, {**body, "suffix" if chat else "messages": None}, chat))["code"] == "unknown_field"


REFUSED = [("guided_json", {"type": "object"}), ("guided_regex", "a+"), ("grammar", "root ::= x"),
           ("json_schema", {}), ("bad_words", ["x"]),
           ("truncate_prompt_tokens", 3), ("include_stop_str_in_output", "yes"), ("prompt_logprobs", 1),
           ("echo", True), ("best_of", 2), ("top_logprobs", 2),
           ("max_completion_tokens", 5), ("skip_special_tokens", False), ("use_beam_search", True)]
CHAT_REFUSED = [("continue_final_message", True), ("add_generation_prompt", False), ("chat_template", "{{x}}"),
                ("functions", [{"name": "f"}]), ("modalities", ["audio"]),
                ("store", True), ("prediction", {"type": "content", "content": "x"}), ("reasoning_effort", "high")]


@pytest.mark.parametrize("field, value", REFUSED, ids=[f for f, _ in REFUSED])
def test_fields_not_honoured_are_refused_by_name_and_taken_at_their_no_op_value(server, field, value):
    url, _ = server
    body = {"prompt": [1, 2], "max_tokens": 2, "temperature": 0}
    error = _error(_post(url, {**body, field: value}))
    assert error["param"] == field
    taken = FIELDS[field]["completions"]
    for no_op in taken if isinstance(taken, tuple) else [None]:
        assert _post(url, {**body, field: no_op}).status_code == 200, (field, no_op)


@pytest.mark.parametrize("field, value", CHAT_REFUSED, ids=[f for f, _ in CHAT_REFUSED])
def test_chat_fields_not_honoured_are_refused_by_name(field, value):
    body = {"messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(BadRequest) as caught:
        parse_job({**body, field: value}, True, NAME, SpecConfig())
    assert caught.value.param == field and caught.value.code == "unsupported"
    for no_op in FIELDS[field]["chat"]:
        parse_job({**body, field: no_op}, True, NAME, SpecConfig())


def test_stream_options_need_stream_and_bookkeeping_fields_change_nothing(server):
    url, _ = server
    body = {"prompt": [1, 2], "max_tokens": 4, "temperature": 0}
    assert _error(_post(url, {**body, "stream_options": {"include_usage": True}}))["param"] == "stream_options"
    assert _error(_post(url, {**body, "stream": True, "stream_options": {"usage": True}}))["param"] == "stream_options"
    plain = _post(url, body).json()["choices"][0]["text"]
    assert _post(url, {**body, "user": "someone"}).json()["choices"][0]["text"] == plain
    chat = {"messages": [{"role": "user", "content": "x"}]}
    for field in ("metadata", "service_tier", "prompt_cache_key", "safety_identifier"):
        assert FIELDS[field]["chat"] == IGNORED
        parse_job({**chat, field: "anything"}, True, NAME, SpecConfig())


def test_the_docs_list_every_field_as_the_server_takes_it():
    """docs/server.md's field table is the code's table: each field, and per endpoint honoured,
    ignored, `null` only (or its no-op values), or not a field of it."""
    import json

    rows = {}
    for line in DOCS.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and re.fullmatch(r"`\w+`", cells[0]):
            rows[cells[0].strip("`")] = tuple(cells[1:])

    def cell(taken) -> str:
        if taken is None:
            return "—"
        if taken in (HONOURED, IGNORED):
            return taken
        return "only " + ", ".join(f"`{json.dumps(v)}`" for v in taken)

    expected = {name: tuple(cell(ways.get(e)) for e in ("completions", "chat")) for name, ways in FIELDS.items()}
    assert rows == expected


def test_allowed_token_ids_are_honoured_exactly_under_speculation(target):
    """allowed_token_ids masks every position's logits, drafts included: the served greedy text,
    with a drafter model drafting, is the AR text under the same mask, and holds no other token."""
    from specdec.sizing.schedules import AssumedCosts

    drafter = tiny_model(1, layers=1, exact_rows=True, name="tiny-drafter")
    prompt, allowed = [4, 9, 4, 2], [3, 5, 11]
    alone = autoregressive_generate(prompt, target, max_new_tokens=12, rules=LogitRules(allowed=tuple(allowed))).tokens
    assert set(alone) <= set(allowed) and alone != autoregressive_generate(prompt, target, max_new_tokens=12).tokens
    assumed = AssumedCosts(drafter=0.05, slope=0.0)  # drafts sized the same on any machine
    with serving(lambda: Service(target, drafter, limits=Limits(max_tokens=16), assumed=assumed), max_batch=4,
                 steer=False) as (url, _):
        reply = _post(url, {"prompt": prompt, "max_tokens": 12, "temperature": 0, "allowed_token_ids": allowed}).json()
        assert reply["choices"][0]["text"] == target.decode(alone)
        assert reply["usage"]["speculative"]["drafted_tokens"] > 0
        for value, needle in [([], "at least one"), ([16], "vocabulary of 16"), (["x"], "token ids")]:
            error = _error(_post(url, {"prompt": prompt, "max_tokens": 2, "allowed_token_ids": value}))
            assert error["param"] == "allowed_token_ids" and needle in error["message"], error
        error = _error(_post(url, {"prompt": prompt, "max_tokens": 4, "min_tokens": 2, "allowed_token_ids": [1]}))
        assert error["param"] == "allowed_token_ids" and "end tokens" in error["message"]


# item 6: JSON bodies only

@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", None,
                                          "application/json; charset=latin-1", "multipart/form-data; boundary=x"])
def test_a_body_not_declared_json_is_a_415(server, content_type):
    url, _ = server
    headers = {"content-type": content_type} if content_type else {}
    response = httpx.post(url + "/v1/completions", content=b'{"prompt": [1, 2], "max_tokens": 2}', headers=headers)
    error = _error(response, 415)
    assert error["code"] == "unsupported_media_type"


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON;charset=UTF-8"])
def test_json_bodies_are_taken_with_or_without_a_charset(server, content_type):
    url, _ = server
    response = httpx.post(url + "/v1/completions", content=b'{"prompt": [1, 2], "max_tokens": 2}',
                          headers={"content-type": content_type})
    assert response.status_code == 200, response.text


# item 7: semantics

def test_min_tokens_over_max_tokens_and_greedy_n_and_long_stops_are_400s(server):
    url, _ = server
    body = {"prompt": [1, 2], "max_tokens": 4}
    assert _error(_post(url, {**body, "min_tokens": 5}))["param"] == "min_tokens"
    assert _error(_post(url, {"prompt": [1, 2], "min_tokens": 17}))["param"] == "min_tokens"  # default bound 16
    assert "temperature 0" in _error(_post(url, {**body, "n": 2, "temperature": 0}))["message"]
    assert _post(url, {**body, "n": 2, "temperature": 1.0, "seed": 1}).status_code == 200
    error = _error(_post(url, {**body, "stop": ["x" * 1001]}))
    assert error["param"] == "stop" and "at most 1000" in error["message"]
    assert _post(url, {**body, "stop": ["x" * 1000]}).status_code == 200


def test_stop_strings_count_only_past_min_tokens_and_can_be_kept(server, target):
    """vLLM's rule: a stop string ending in the first min_tokens tokens' text does not end the
    choice; include_stop_str_in_output keeps the stop string at the end of the text."""
    url, _ = server
    prompt = [4, 9, 4, 2]
    rules = LogitRules(min_tokens=6)
    tokens = autoregressive_generate(prompt, target, max_new_tokens=16, rules=rules).tokens
    full = target.decode(tokens)
    stop = str(tokens[1])  # ends inside the first 6 tokens' text
    floor = len(target.decode(tokens[:6]))
    assert full.find(stop) + len(stop) <= floor
    later = full.find(stop, floor - len(stop) + 1)
    expected = full if later < 0 else full[:later]

    def ask(**fields):
        choice = _client(url).completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0, stop=[stop],
                                                 extra_body={"min_tokens": 6, **fields}).choices[0]
        return choice.text

    assert ask() == expected
    kept = ask(include_stop_str_in_output=True)
    assert kept == (full if later < 0 else full[:later + len(stop)])
    plain = _client(url).completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0, stop=[stop],
                                            extra_body={"include_stop_str_in_output": True}).choices[0]
    assert plain.text.endswith(stop) and plain.finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in _client(url).completions.create(
        model=NAME, prompt=prompt, max_tokens=16, temperature=0, stop=[stop], stream=True,
        extra_body={"min_tokens": 6, "include_stop_str_in_output": True}))
    assert streamed == kept


# item 13: chat content parts, developer role

def test_chat_takes_text_parts_and_the_developer_role(server, tokenizer):
    url, _ = server
    client = _client(url)
    tokenizer.seen.clear()
    parts = client.chat.completions.create(model=NAME, max_tokens=4, temperature=0, messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}])
    joined = client.chat.completions.create(model=NAME, max_tokens=4, temperature=0, messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "one\ntwo"}])
    assert tokenizer.seen[0] == tokenizer.seen[1] == [{"role": "system", "content": "be brief"},
                                                      {"role": "user", "content": "one\ntwo"}]
    assert parts.choices[0].message.content == joined.choices[0].message.content


@pytest.mark.parametrize("message, param, needle", [
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "messages[0].content[0]",
     "'image_url' part"),
    ({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio"}]}, "messages[0].content[1]",
     "'input_audio' part"),
    ({"role": "user", "content": [{"type": "text"}]}, "messages[0].content[0]", "STRING"),
    ({"role": "user", "content": "x", "name": "alice"}, "messages[0].name", "not supported"),
    ({"role": "user", "content": "x", "colour": "red"}, "messages[0]", "unknown field 'colour'"),
    ({"role": "function", "content": "x"}, "messages[0]", "role system, developer, user, assistant or tool"),
])
def test_chat_parts_other_than_text_and_message_fields_not_honoured_are_refused(message, param, needle):
    with pytest.raises(BadRequest) as caught:
        parse_job({"messages": [message]}, True, NAME, SpecConfig())
    assert caught.value.param == param and needle in caught.value.message, caught.value.message


def test_an_assistant_message_echoed_back_with_null_fields_is_taken():
    message = {"role": "assistant", "content": "hi", "refusal": None, "tool_calls": None, "function_call": None,
               "audio": None, "annotations": [], "name": None}
    job = parse_job({"messages": [{"role": "user", "content": "x"}, message]}, True, NAME, SpecConfig())
    assert job.messages[1] == {"role": "assistant", "content": "hi"}


def test_a_lossy_preset_is_refused_by_the_server_and_by_serve():
    """sd-typical accepts what the target would not sample: a served output is always the target's."""
    from typer.testing import CliRunner

    from specdec.cli import app
    from specdec.server.schema import BadRequest, parse_job, served_methods
    from specdec.server.service import Service

    target, drafter = tiny_model(0), tiny_model(1)
    service = Service(target, drafter)
    with pytest.raises(BadRequest, match="speculative.method must be one of") as caught:
        parse_job({"prompt": [1, 2], "speculative": {"method": "sd-typical"}}, False, target.name,
                  service.default, service.default_method)
    assert caught.value.param == "speculative.method" and "sd-typical" not in served_methods()
    result = CliRunner().invoke(app, ["serve", "--method", "sd-typical"])
    assert result.exit_code != 0 and "--method must be one of" in result.output
