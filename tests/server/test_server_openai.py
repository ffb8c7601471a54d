"""`specdec serve` as OpenAI's clients read it: every response body matches OpenAI's published
schema (a copy of its components in tests/data, checked by a small validator here), chat
`logprobs` carry each token's own bytes, and text streams in work linear in its tokens whatever
they decode to (a token that is a lone byte, which a client can ask for with `logit_bias`).
A tiny random model with a byte-level BPE tokenizer built here; real tokenizers at the end.
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import httpx
import pytest
import torch

from specdec import TransformersModel
from specdec.server.app import _Text
from specdec.server.service import Limits, Service
from specdec.backends.text import token_bytes_reader

from test_server import _client, serving

COMPONENTS = json.loads((Path(__file__).parents[1] / "data" / "openai_openapi_components.json").read_text())
SCHEMAS = COMPONENTS["components"]["schemas"]
NAME = "tiny-bytes"
SPECIALS = ["<|im_start|>", "<|im_end|>"]
TEXT = "héllo €uro 日本 🦜 ok"
PARTIAL = 3  # the U+FFFD an incomplete character at the end of a text may show: held back


# -- a small validator for the JSON Schema subset OpenAI's components use ----------------------

def violations(schema: dict, value, path: str = "$") -> list[str]:
    """Where `value` breaks `schema` (an OpenAPI 3.1 schema of `SCHEMAS`): type, nullable, enum,
    properties, required, items, additionalProperties, anyOf, oneOf, allOf, $ref; [] if nowhere.
    Keywords outside the subset (format, default, discriminator, descriptions) are not checked."""
    if "$ref" in schema:
        found = violations(SCHEMAS[schema["$ref"].rsplit("/", 1)[-1]], value, path)
        rest = {k: v for k, v in schema.items() if k != "$ref"}  # 3.1 allows keywords beside $ref
        return found + (violations(rest, value, path) if rest else [])
    if value is None and schema.get("nullable"):
        return []
    errors = []
    for key in ("anyOf", "oneOf"):
        if key in schema:
            passing = sum(not violations(option, value, path) for option in schema[key])
            if passing == 0 or (key == "oneOf" and passing > 1):
                errors.append(f"{path}: {passing} of its {key} options match {json.dumps(value)[:80]}")
    for option in schema.get("allOf", []):
        errors += violations(option, value, path)
    kinds = schema.get("type")
    if kinds is not None:
        kinds = kinds if isinstance(kinds, list) else [kinds]
        if not any(_is(kind, value) for kind in kinds):
            return errors + [f"{path}: {json.dumps(value)[:80]} is not of type {'/'.join(kinds)}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, dict):
        errors += [f"{path}: {name!r} is required" for name in schema.get("required", []) if name not in value]
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for name, item in value.items():
            if name in properties:
                errors += violations(properties[name], item, f"{path}.{name}")
            elif extra is False:
                errors.append(f"{path}: {name!r} is not allowed")
            elif isinstance(extra, dict):
                errors += violations(extra, item, f"{path}.{name}")
    if isinstance(value, list) and "items" in schema:
        for k, item in enumerate(value):
            errors += violations(schema["items"], item, f"{path}[{k}]")
    return errors


def _is(kind: str, value) -> bool:
    return {"object": lambda: isinstance(value, dict), "array": lambda: isinstance(value, list),
            "string": lambda: isinstance(value, str), "boolean": lambda: isinstance(value, bool),
            "integer": lambda: isinstance(value, int) and not isinstance(value, bool),
            "number": lambda: isinstance(value, (int, float)) and not isinstance(value, bool),
            "null": lambda: value is None}[kind]()


def check(kind: str, body: dict) -> None:
    errors = violations(SCHEMAS[kind], body)
    assert not errors, f"{kind}: " + "; ".join(errors[:5])


# OpenAI's API streams completions chunks with "finish_reason": null until the last, as its
# chat chunks do, but its schema (one for whole and streamed completions) types the field as a
# string: the chunks are checked against the schema with only that field made nullable
COMPLETION_CHUNK = copy.deepcopy(SCHEMAS["CreateCompletionResponse"])
COMPLETION_CHUNK["properties"]["choices"]["items"]["properties"]["finish_reason"]["nullable"] = True
SCHEMAS["CompletionChunk"] = COMPLETION_CHUNK


def test_the_validator_catches_a_missing_field_a_wrong_type_and_a_value_outside_an_enum():
    """The checks below could not pass by checking nothing."""
    good = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                         "message": {"role": "assistant", "content": "hi", "refusal": None}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2, "speculative": {}}}
    assert violations(SCHEMAS["CreateChatCompletionResponse"], good) == []
    bad = copy.deepcopy(good)
    del bad["choices"][0]["message"]["refusal"]
    assert violations(SCHEMAS["CreateChatCompletionResponse"], bad) == ["$.choices[0].message: 'refusal' is required"]
    bad = copy.deepcopy(good)
    bad["created"] = "1"
    assert violations(SCHEMAS["CreateChatCompletionResponse"], bad) == ['$.created: "1" is not of type integer']
    bad = copy.deepcopy(good)
    bad["choices"][0]["finish_reason"] = "done"
    assert len(violations(SCHEMAS["CreateChatCompletionResponse"], bad)) == 1
    bad = copy.deepcopy(good)
    bad["choices"][0]["logprobs"] = {"content": [{"token": "a", "logprob": 0.0, "bytes": [97]}], "refusal": None}
    assert violations(SCHEMAS["CreateChatCompletionResponse"], bad)  # anyOf: no option matches (top_logprobs)
    assert violations(SCHEMAS["ErrorResponse"], {"error": {"message": "m", "type": "t", "param": None}})
    assert violations(SCHEMAS["ListModelsResponse"], {"object": "list", "data": [{"id": 1}]})


# -- a tiny model with a byte-level BPE tokenizer and a chat template ---------------------------

def byte_level_tokenizer(merges: list[tuple[str, str]] = ()):
    """A byte-level BPE tokenizer (as Qwen2.5's and SmolLM2's): its 256 bytes, the `merges`, and
    SPECIALS; multi-byte characters not merged are split across byte tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=list(merges)))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=SPECIALS[0], eos_token=SPECIALS[1])
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS})
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                               "{% endfor %}<|im_start|>assistant\n")
    return tokenizer


def sentencepiece_tokenizer():
    """A SentencePiece-style BPE tokenizer (as Gemma's): '▁' for a space, <0xHH> byte tokens for
    what its vocabulary lacks (here every character outside ASCII letters)."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "▁"] + [f"<0x{b:02X}>" for b in range(256)] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    core = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], unk_token="<unk>",
                                byte_fallback=True))
    core.normalizer = normalizers.Replace(" ", "▁")
    core.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")


@pytest.mark.parametrize("build", [byte_level_tokenizer, sentencepiece_tokenizer], ids=["byte-level", "sentencepiece"])
def test_token_bytes_join_into_the_texts_utf8_where_characters_span_tokens(build):
    tokenizer = build()
    read = token_bytes_reader(tokenizer)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert any(tokenizer.decode([i]) == "\ufffd" for i in ids)  # characters split across tokens
    assert b"".join(read(i) for i in ids) == TEXT.encode()
    e2 = "€".encode()[0]
    token = tokenizer.convert_tokens_to_ids(pre_byte(e2) if build is byte_level_tokenizer else f"<0x{e2:02X}>")
    assert read(token) == bytes([e2])  # not U+FFFD's bytes
    if build is byte_level_tokenizer:
        assert read(tokenizer.convert_tokens_to_ids(SPECIALS[1])) == SPECIALS[1].encode()


def pre_byte(b: int) -> str:
    from specdec.backends.text import UNICODE_TO_BYTE

    return next(c for c, v in UNICODE_TO_BYTE.items() if v == b)


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer([("Ã", "©"), ("h", "Ã©")])  # "é" one token, and "hé" one


@pytest.fixture(scope="module")
def server(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = tokenizer.convert_tokens_to_ids(SPECIALS)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, bos_token_id=ids[0], eos_token_id=ids[1], pad_token_id=ids[1])
    torch.manual_seed(0)
    model = TransformersModel(LlamaForCausalLM(config), tokenizer, NAME, exact_rows=True)
    with serving(lambda: Service(model, limits=Limits(max_tokens=24)), max_batch=4, steer=False) as (url, _):
        yield url


def _chat_body(tokenizer, **fields) -> dict:
    # the random model's answers kept to the bytes of "é" (C3 A9, and the merged "é") and "a": split
    # characters, whole ones and stray bytes; never a special token, whose text a content skips
    allowed = set(tokenizer.convert_tokens_to_ids(["Ã", "©", "Ã©", "a"]))
    bias = {str(i): -100 for i in range(len(tokenizer)) if i not in allowed}
    return {"model": NAME, "messages": [{"role": "user", "content": TEXT}], "max_tokens": 40, "temperature": 1,
            "seed": 3, "n": 4, "logprobs": True, "top_logprobs": 2, "logit_bias": bias, **fields}


def test_chat_logprobs_bytes_rebuild_the_content_whole_and_streamed(server, tokenizer):
    """A token that is part of a character carries that part of its bytes, so that a choice's
    tokens' bytes, joined, decode to its content, also where a character's bytes span tokens."""
    whole = httpx.post(server + "/v1/chat/completions", json=_chat_body(tokenizer), timeout=60).json()
    contents = []
    for choice in whole["choices"]:
        content, entries = choice["message"]["content"], choice["logprobs"]["content"]
        assert b"".join(bytes(e["bytes"]) for e in entries).decode(errors="replace") == content
        # a token shown as U+FFFD is, in this vocabulary, one byte of a character: that byte
        assert all(len(t["bytes"]) == 1 and t["bytes"][0] >= 0x80 for e in entries
                   for t in [e, *e["top_logprobs"]] if t["token"] == "\ufffd")
        contents.append(content)
    assert any("é" in c for c in contents)  # a character made of two tokens among them
    assert any(bytes(e["bytes"]) in (b"\xc3", b"\xa9") for c in whole["choices"] for e in c["logprobs"]["content"])
    streamed = [[] for _ in contents], [[] for _ in contents]
    with httpx.stream("POST", server + "/v1/chat/completions", json=_chat_body(tokenizer, stream=True),
                      timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    streamed[0][choice["index"]].append(choice["delta"].get("content") or "")
                    streamed[1][choice["index"]] += (choice["logprobs"] or {}).get("content") or []
    for i, content in enumerate(contents):
        assert "".join(streamed[0][i]) == content
        assert b"".join(bytes(e["bytes"]) for e in streamed[1][i]).decode(errors="replace") == content


def _events(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json=body, timeout=60) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_every_response_body_matches_openais_schema(server, tokenizer):
    """Completions and chat completions, whole and streamed (with logprobs and a usage chunk), the
    models list and error bodies, against OpenAI's own schemas; our extra fields (usage's
    `speculative`, the model's `max_model_len`) are where they allow more properties."""
    post = lambda path, body: httpx.post(server + path, json=body, timeout=60)  # noqa: E731
    completion = {"model": NAME, "prompt": "héllo", "max_tokens": 8, "temperature": 0, "logprobs": 2}
    reply = post("/v1/completions", completion)
    assert reply.status_code == 200
    check("CreateCompletionResponse", reply.json())
    assert "speculative" in reply.json()["usage"]
    chunks = _events(server, "/v1/completions", {**completion, "stream": True, "stream_options": {"include_usage": True}})
    assert chunks[-1]["usage"] and any(c["choices"] and c["choices"][0]["logprobs"] for c in chunks)
    for chunk in chunks:
        check("CompletionChunk", chunk)
    chat = _chat_body(tokenizer, n=2, max_tokens=8)
    reply = post("/v1/chat/completions", chat)
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["refusal"] is None
    assert reply.json()["choices"][0]["logprobs"]["refusal"] is None
    check("CreateChatCompletionResponse", reply.json())
    check("CreateChatCompletionResponse", post("/v1/chat/completions", {**chat, "logprobs": False, "top_logprobs": None}).json())
    chunks = _events(server, "/v1/chat/completions", {**chat, "stream": True, "stream_options": {"include_usage": True}})
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "", "refusal": None}
    assert any(c["choices"] and c["choices"][0]["logprobs"] for c in chunks) and chunks[-1]["usage"]
    for chunk in chunks:
        check("CreateChatCompletionStreamResponse", chunk)
    models = httpx.get(server + "/v1/models").json()
    assert models["data"][0]["max_model_len"]
    check("ListModelsResponse", models)
    for path, body, status in [("/v1/completions", {"model": NAME, "prompt": ""}, 400),
                               ("/v1/chat/completions", {"model": "other", "messages": []}, 404),
                               ("/v1/completions", {**completion, "temperature": "hot"}, 400)]:
        reply = post(path, body)
        assert reply.status_code == status
        check("ErrorResponse", reply.json())
    assert _client(server).models.list().data[0].id == NAME  # and the real client reads them


# -- detokenising tokens that never decode cleanly ---------------------------------------------

class _Counted(list):
    """A list that counts the items read from it (by index or by iterating)."""

    reads = 0

    def __getitem__(self, k):
        _Counted.reads += 1
        return super().__getitem__(k)

    def __iter__(self):
        _Counted.reads += len(self)
        return super().__iter__()


def _byte_decode(pieces: list[bytes], counter: list[int]):
    def decode(ids):
        counter[0] += len(ids)
        return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")
    return decode


def _stream(token: int, n: int, pieces: list[bytes]) -> tuple[int, _Text]:
    """n copies of `token` one at a time -> (ids decoded in all, the _Text); checks on the way
    that the text sent keeps up with the tokens and that the tokens counted as sent do too."""
    counter = [0]
    text = _Text(_byte_decode(pieces, counter), stops=[], offsets=True)
    text.ends = _Counted()
    _Counted.reads = 0
    for k in range(1, n + 1):
        text.add([token])
        assert text.sent >= k - PARTIAL  # not held back to the end
        assert text.released() >= k - PARTIAL
    return counter[0], text


def test_lone_byte_tokens_cost_what_plain_ones_do_and_stream_as_they_come():
    """A token that decodes alone to U+FFFD (a byte that starts or continues no character) settles
    like any other: a client's `logit_bias` towards it costs linear work, and its text streams."""
    pieces = [b"a", b"\x80", b"\xe2"]
    n = 1500
    plain, _ = _stream(0, n, pieces)
    assert _Counted.reads < 10 * n  # tokens counted as sent on from the last count, not all again
    for lone in (1, 2):
        work, text = _stream(lone, n, pieces)
        assert work <= 1.5 * plain  # a whole decode per token: ~n² / 2 = 1.1 million ids
        assert _Counted.reads < 10 * n
        assert text.add([], final=True) == "\ufffd" * PARTIAL
        assert text.text == (pieces[lone] * n).decode(errors="replace")
    assert plain < 40 * n


@pytest.mark.parametrize("seed", range(3))
def test_text_with_stray_and_split_bytes_streams_the_whole_decode(seed):
    """Streamed in chunks of random sizes, a mix of whole characters, characters split across
    tokens, stray continuation bytes and cut sequences gives the whole decode's text, and each
    token's end offset never decreases."""
    rng = random.Random(seed)
    pieces = [b"a", b" b", "é".encode(), "€".encode()[:1], "€".encode()[1:2], "€".encode()[2:], b"\x80",
              "🦜".encode()[:2], "🦜".encode()[2:], b"\xff"]
    ids = [rng.randrange(len(pieces)) for _ in range(2000)]
    counter = [0]
    text = _Text(_byte_decode(pieces, counter), stops=[], offsets=True)
    sent, k = [], 0
    while k < len(ids):
        step = rng.randrange(1, 5)
        sent.append(text.add(ids[k:k + step]))
        k += step
    sent.append(text.add([], final=True))
    whole = b"".join(pieces[i] for i in ids).decode(errors="replace")
    assert "".join(sent) == whole and text.text == whole
    assert text.ends == sorted(text.ends) and text.ends[-1] == len(whole)
    assert counter[0] < 40 * len(ids)


# -- real tokenizers ---------------------------------------------------------------------------

def _real_tokenizer(name: str):
    from transformers import AutoTokenizer

    from specdec.models import catalogue as registry

    if not registry.is_installed(name):
        pytest.skip(f"{name} is not installed (run `make models`)")
    return AutoTokenizer.from_pretrained(registry.require_installed(name))


@pytest.mark.real
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "smollm2-135m", "gemma3-270m"])
def test_real_tokenizers_token_bytes_are_each_tokens_own(name):
    """On each family's tokenizer: a text's tokens' bytes join into its UTF-8, and every token
    that decodes alone without U+FFFD has that decode's bytes (special tokens by name)."""
    tokenizer = _real_tokenizer(name)
    read = token_bytes_reader(tokenizer)
    text = TEXT + ' a\u00a0b \x01 x\n\n  def f():\n\treturn "∀x" 🦜🦜'
    assert b"".join(read(i) for i in tokenizer.encode(text, add_special_tokens=False)) == text.encode()
    for token in range(0, len(tokenizer), 13):
        alone = tokenizer.decode([token], skip_special_tokens=False)
        if "\ufffd" not in alone:
            assert read(token) == alone.encode(), token


@pytest.mark.real
def test_real_qwen_lone_byte_token_costs_what_a_plain_one_does():
    """Qwen2.5's id 94 decodes alone to U+FFFD: n of them cost the decoding of n plain tokens,
    and their text streams as they come."""
    tokenizer = _real_tokenizer("qwen2.5-coder-0.5b")
    assert tokenizer.decode([94]) == "\ufffd"
    costs = []
    for token in (94, tokenizer.convert_tokens_to_ids("a")):
        counter = [0]

        def decode(ids):
            counter[0] += len(ids)
            return tokenizer.decode(ids)

        text = _Text(decode, stops=[])
        for k in range(1, 401):
            text.add([token])
            assert text.sent >= k - PARTIAL
        costs.append(counter[0])
    assert costs[0] <= 1.5 * costs[1]
