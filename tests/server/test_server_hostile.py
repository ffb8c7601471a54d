"""A black-box check of a live server (API keys set) with careless and hostile requests: each
gets the status docs/server.md documents and an OpenAI-style JSON error body, and the server
then still serves. The fixes behind each row have tests of their own (test_server_input,
test_server_ops, test_server_openai, test_server_kv); this one sends them all to one server.
"""

from __future__ import annotations

import socket
from urllib.parse import urlparse

import httpx
import pytest

from specdec.server.service import Limits, Service

from conftest import tiny_model
from test_server import NAME, serving

KEY = "secret-key-1"
AUTH = {"Authorization": f"Bearer {KEY}"}
OK = {"model": NAME, "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def live():
    target = tiny_model(0, exact_rows=True, name=NAME)
    limits = Limits(max_tokens=16, body_timeout=0.5, max_waiting=8)
    with serving(lambda: Service(target, None, limits=limits), api_key=[KEY, "secret-key-2"]) as (url, app):
        yield url


def _raw(body: str) -> dict:
    """A JSON body sent as written (a lone surrogate escape that no JSON encoder writes)."""
    return {"content": body.encode(), "headers": {**AUTH, "Content-Type": "application/json"}}


HOSTILE = [  # (what, endpoint, httpx.post keywords, status, param or None)
    ("a token-id key that is a superscript digit", "completions",
     {"json": {**OK, "logit_bias": {"²": 5}}}, 400, "logit_bias"),
    ("a 5,000-digit token id", "completions", {"json": {**OK, "logit_bias": {"9" * 5000: 5}}}, 400, "logit_bias"),
    ("a stop token id that is no number", "completions", {"json": {**OK, "stop_token_ids": ["٣"]}}, 400,
     "stop_token_ids"),
    ("one token biased twice", "completions", {"json": {**OK, "logit_bias": {"1": 5, "01": -5}}}, 400, "logit_bias"),
    ("a lone surrogate in a completions prompt", "completions",
     _raw('{"model": "tiny", "prompt": "a \\ud800 b", "max_tokens": 3}'), 400, "prompt"),
    ("a lone surrogate in chat content", "chat",
     _raw('{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}'), 400, None),
    ("a grammar field", "completions", {"json": {**OK, "guided_json": {"type": "object"}}}, 400, "guided_json"),
    ("a misspelt field", "completions", {"json": {**OK, "temprature": 0.5}}, 400, "temprature"),
    ("stream_options without stream", "completions", {"json": {**OK, "stream_options": {"include_usage": True}}},
     400, "stream_options"),
    ("a chat template of the client's", "chat",
     {"json": {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 1 }}"}}, 400, "chat_template"),
    ("a form-encoded body", "completions", {"content": b"prompt=hi&max_tokens=3",
                                            "headers": {**AUTH, "Content-Type": "application/x-www-form-urlencoded"}},
     415, None),
    ("a text/plain body", "completions", {"content": b'{"prompt": [1]}', "headers": {**AUTH, "Content-Type": "text/plain"}},
     415, None),
    ("min_tokens over max_tokens", "completions", {"json": {**OK, "min_tokens": 9}}, 400, "min_tokens"),
    ("a stop string of 2,000 characters", "completions", {"json": {**OK, "stop": "x" * 2000}}, 400, "stop"),
    ("greedy n > 1", "completions", {"json": {**OK, "n": 3}}, 400, "n"),
    ("one request filling the queue", "completions", {"json": {**OK, "temperature": 1, "n": 8}}, 400, "n"),
    ("an image part in chat", "chat",
     {"json": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}},
     400, "messages[0].content[0]"),
    ("a tree wider than the draft room", "completions",
     {"json": {**OK, "speculative": {"method": "tree", "tree_nodes": 500}}}, 400, "speculative.tree_nodes"),
    ("a wrong key", "completions", {"json": OK, "headers": {"Authorization": "Bearer nope"}}, 401, None),
    ("no key", "completions", {"json": OK, "headers": {"Authorization": ""}}, 401, None),
]


@pytest.mark.parametrize("what, endpoint, send, status, param", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_hostile_request_gets_its_documented_status_a_json_error_and_the_server_serves_on(
        live, what, endpoint, send, status, param):
    url = live
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    send = dict(send)
    send["headers"] = {**AUTH, **send.get("headers", {})}
    response = httpx.post(url + path, timeout=30, **send)
    assert response.status_code == status, (what, response.text[:300])
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"] and "Traceback" not in error["message"]
    assert error["type"] in ("invalid_request_error", "authentication_error")
    if param is not None:
        assert error["param"] == param, error
    after = httpx.post(url + "/v1/completions", json=OK, headers=AUTH, timeout=30)
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 3


def test_a_trickled_body_and_the_bearer_schemes_case(live):
    """A body that never ends: 408 with a JSON body once --body-timeout passes; `bearer` in any
    case is the Bearer scheme (RFC 7235); then the server serves."""
    url = live
    address = urlparse(url)
    with socket.create_connection((address.hostname, address.port), timeout=10) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 80\r\n\r\n{\"prompt\": [1, ")
        answer = b""
        while b'"}}' not in answer and b"}}" not in answer and (piece := conn.recv(65536)):
            answer += piece
    assert answer.startswith(b"HTTP/1.1 408") and b'"error"' in answer and b'"code":"body_timeout"' in answer
    for scheme in ("bearer", "BEARER", "Bearer"):
        reply = httpx.post(url + "/v1/completions", json=OK, headers={"Authorization": f"{scheme} {KEY}"})
        assert reply.status_code == 200, scheme
    assert httpx.get(url + "/health").json()["status"] == "ok"
