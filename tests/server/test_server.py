"""`specdec serve` on loopback, driven by the real `openai` client and httpx: responses equal the
target's AR run alone (also 8 streams at once), metrics add up to the responses' usage, bad input
is a 4xx naming the field and the next request succeeds, a vanished client frees its sequence,
a request's own error ends it alone. Tiny random models (token-id prompts); real weights at the end.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from specdec import Sampler
from specdec.cli import app as cli
from specdec.decoding.sequence import Decoding
from specdec.decoding.loop import autoregressive_generate
from specdec.sizing.schedules import AssumedCosts
from specdec.errors import SpecdecError
from specdec.server.app import create_app
from specdec.decoding.config import SpecConfig
from specdec.server.schema import BadRequest, parse_job
from specdec.server.service import Limits, Service
from specdec.server.worker import QueueFull, Worker

from conftest import tiny_model

NAME = "tiny"
PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10, 11, 12], [3], [2, 4, 6, 8], [9, 9, 9], [15, 0, 1], [4, 4]]


@contextlib.contextmanager
def serving(load, wait: bool = True, **options):
    """A live server on 127.0.0.1 (a free port) in this process -> (base URL, app); stopped after."""
    app = create_app(load, **options)
    with live(app, wait) as url:
        yield url, app


@contextlib.contextmanager
def live(app, wait: bool = True, config: dict | None = None, sockets=None):
    """`app` served by uvicorn on 127.0.0.1 (a free port, or the listening `sockets`; uvicorn's
    own settings in `config`) in this process -> its base URL, once /health says ready (`wait`)."""
    options = {"log_level": "warning", **(config or {})}
    if sockets is None:
        options.update(host="127.0.0.1", port=0)
    server = uvicorn.Server(uvicorn.Config(app, **options))
    thread = threading.Thread(target=server.run, kwargs={"sockets": sockets} if sockets else {}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    try:
        while wait and httpx.get(url + "/health").status_code != 200:
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.05)
        yield url
    finally:
        server.should_exit = True
        thread.join(20)


@pytest.fixture(scope="module")
def tiny_pair():
    return tiny_model(0, exact_rows=True, name=NAME), tiny_model(1, layers=1, exact_rows=True, name="tiny-drafter")


@pytest.fixture(scope="module")
def server(tiny_pair):
    target, drafter = tiny_pair
    # drafts sized by costs taken as given, not timed: every run drafts the same on any machine
    assumed = AssumedCosts(drafter=0.05, slope=0.0)
    with serving(lambda: Service(target, drafter, limits=Limits(max_tokens=24), assumed=assumed), max_batch=4,
                 steer=False) as (url, app):
        yield url, app


def _client(url: str, **options) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=options.pop("api_key", "unused"), max_retries=0,
                         timeout=60, **options)


def _alone(target, prompt: list[int], tokens: int) -> str:
    return target.decode(autoregressive_generate(prompt, target, max_new_tokens=tokens).tokens)


def _metrics(url: str) -> dict:
    values = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return values


def _metric(values: dict, name: str, **labels) -> float:
    return values.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.mark.parametrize("speculative", [False, None, {"method": "lookup"}, {"method": "suffix"},
                                         {"method": "tree", "tree_nodes": 8}, {"method": "lookahead", "tree_nodes": 12}],
                         ids=["ar", "default", "lookup", "suffix", "tree", "lookahead"])
def test_greedy_completions_equal_the_targets_run_alone(server, tiny_pair, speculative):
    url, _ = server
    client = _client(url)
    extra = {} if speculative is None else {"speculative": speculative}
    whole = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=20, temperature=0, extra_body=extra)
    assert whole.choices[0].text == _alone(tiny_pair[0], PROMPTS[0], 20)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 20
    assert whole.usage.prompt_tokens == 4
    spec = whole.usage.model_extra["speculative"]
    assert spec["method"] == ("off" if speculative is False else (speculative or {}).get("method", "default"))
    if speculative is False:
        assert spec["drafted_tokens"] == 0
    elif speculative is None or speculative["method"] in ("tree", "lookahead"):  # lookup finds nothing in a random prompt
        assert spec["drafted_tokens"] > 0
    pieces = [chunk.choices[0].text for chunk in client.completions.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=20, temperature=0, stream=True, extra_body=extra)]
    assert "".join(pieces) == whole.choices[0].text and len(pieces) > 1


def test_suffix_requests_draft_from_earlier_outputs(server, tiny_pair):
    """The suffix method's cache is the server's: a prompt asked again drafts its answer from the
    first answer (a random prompt's own text has little to copy), and the answer stays the same."""
    url, _ = server
    client = _client(url)
    answers = [client.completions.create(model=NAME, prompt=PROMPTS[5], max_tokens=20, temperature=0,
                                         extra_body={"speculative": {"method": "suffix"}}) for _ in range(2)]
    assert answers[0].choices[0].text == answers[1].choices[0].text == _alone(tiny_pair[0], PROMPTS[5], 20)
    first, again = (a.usage.model_extra["speculative"] for a in answers)
    assert again["accepted_tokens"] > first["accepted_tokens"] and again["target_passes"] < 20


def test_suffix_drafting_never_copies_another_tenants_outputs(server, tiny_pair):
    """Suffix drafting draws on earlier outputs of the same cache_salt only: a second tenant asking
    what the first asked drafts as the first did on its first try (nothing of the first's answer
    to copy), while the first tenant asking again copies its own answer."""
    url, _ = server
    client = _client(url)

    def ask(salt):
        return client.completions.create(model=NAME, prompt=PROMPTS[6], max_tokens=20, temperature=0,
                                         extra_body={"speculative": {"method": "suffix"}, "cache_salt": salt})
    first, other, again = (ask(salt).usage.model_extra["speculative"] for salt in ("tenant-a", "tenant-b", "tenant-a"))
    assert other["accepted_tokens"] == first["accepted_tokens"] and other["drafted_tokens"] == first["drafted_tokens"]
    assert again["accepted_tokens"] > first["accepted_tokens"]


class _IdTokenizer:
    """Token ids as text: enough for a datastore's tokenizer check and the server's decoding."""

    def get_vocab(self) -> dict[str, int]:
        return {str(i): i for i in range(16)}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def test_retrieval_requests_draft_from_the_servers_datastore(tmp_path):
    """A datastore holding the answer to a prompt: retrieval drafts it, the answer stays the target's;
    a server without a datastore refuses the method with a 400 naming the field."""
    from specdec.drafters.datastore import Datastore, build
    from specdec.models.vocab import tokenizer_key

    target = tiny_model(0, exact_rows=True, name=NAME)
    target.tokenizer = _IdTokenizer()
    prompt = PROMPTS[6]
    answer = autoregressive_generate(prompt, target, max_new_tokens=20).tokens
    build([prompt + answer], tmp_path / "store", tokenizer_key(target.tokenizer), 16, "answers")
    store = Datastore(tmp_path / "store")
    with serving(lambda: Service(target, None, limits=Limits(max_tokens=24), suffix_cache_tokens=0, datastore=store),
                 max_batch=2, steer=False) as (url, _):
        reply = _client(url).completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0,
                                                extra_body={"speculative": {"method": "retrieval"}})
    assert reply.choices[0].text == target.decode(answer)
    spec = reply.usage.model_extra["speculative"]
    assert spec["method"] == "retrieval" and spec["accepted_tokens"] > 0
    other = tiny_model(0, exact_rows=True, name=NAME)
    other.tokenizer = _OtherTokenizer()
    with pytest.raises(SpecdecError, match="another tokenizer"):
        Service(other, None, datastore=store)


class _OtherTokenizer(_IdTokenizer):
    def get_vocab(self) -> dict[str, int]:
        return {f"t{i}": i for i in range(16)}


def test_eight_streams_at_once_each_equal_its_prompt_alone(server, tiny_pair):
    url, app = server
    client = _client(url)

    def stream(prompt):
        return "".join(c.choices[0].text for c in client.completions.create(
            model=NAME, prompt=prompt, max_tokens=16, temperature=0, stream=True))

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(stream, PROMPTS))
    assert texts == [_alone(tiny_pair[0], p, 16) for p in PROMPTS]


def test_seeded_sampled_choices_repeat_and_n_gives_seed_plus_i(server):
    url, _ = server
    client = _client(url)
    one = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=12, temperature=1.0, seed=7, n=2,
                                    logprobs=0)
    again = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=12, temperature=1.0, seed=8)
    lengths = [len(c.logprobs.tokens) for c in one.choices]  # a seed may draw an end token (CUDA's draws differ)
    assert [c.index for c in one.choices] == [0, 1] and one.usage.completion_tokens == sum(lengths)
    assert all(n == 12 or c.finish_reason == "stop" for n, c in zip(lengths, one.choices))
    assert one.choices[1].text == again.choices[0].text  # choice i runs seed + i


def test_a_seed_gives_the_speculative_false_output_under_every_method(server, tiny_pair):
    """Sampled, seeded, 4 requests in flight at once per method: each is the seeded AR run alone
    (Gumbel-max coupling), whichever method drafted it and whatever shared its passes."""
    url, _ = server
    client = _client(url)
    methods = [False, None, {"method": "lookup"}, {"method": "suffix"}, {"method": "tree", "tree_nodes": 8},
               {"method": "lookahead", "tree_nodes": 12}]
    seeds = [3, 4, 5, 6]
    sampler = Sampler(temperature=0.9, top_p=0.95)
    alone = [tiny_pair[0].decode(autoregressive_generate(PROMPTS[1], tiny_pair[0], sampler, max_new_tokens=16,
                                                         seed=seed).tokens) for seed in seeds]

    def ask(speculative, seed):
        extra = {} if speculative is None else {"speculative": speculative}
        return client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=16, temperature=0.9, top_p=0.95,
                                         seed=seed, extra_body=extra)

    drafted = 0
    with ThreadPoolExecutor(4) as pool:
        for speculative in methods:
            answers = list(pool.map(lambda seed: ask(speculative, seed), seeds))
            assert [a.choices[0].text for a in answers] == alone, speculative
            drafted += sum(a.usage.model_extra["speculative"]["drafted_tokens"] for a in answers)
    assert drafted > 0


def test_several_prompts_give_n_choices_each_in_order(server, tiny_pair):
    """OpenAI's completions layout: choice k answers prompt k // n; usage counts every prompt."""
    url, _ = server
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[5]]
    # min_p = 1 keeps only the most likely token: sampled choices (n > 1 is refused greedy) are the greedy text
    reply = _client(url).completions.create(model=NAME, prompt=prompts, max_tokens=8, temperature=1.0, n=2,
                                            extra_body={"min_p": 1.0})
    assert [c.index for c in reply.choices] == list(range(6))
    assert [c.text for c in reply.choices] == [_alone(tiny_pair[0], p, 8) for p in prompts for _ in range(2)]
    assert reply.usage.prompt_tokens == sum(map(len, prompts)) and reply.usage.completion_tokens == 48
    streamed = {}
    for chunk in _client(url).completions.create(model=NAME, prompt=prompts, max_tokens=8, temperature=0,
                                                 stream=True):
        streamed[chunk.choices[0].index] = streamed.get(chunk.choices[0].index, "") + chunk.choices[0].text
    assert [streamed[k] for k in range(3)] == [_alone(tiny_pair[0], p, 8) for p in prompts]


def test_chat_without_a_template_is_a_clear_400_and_models_lists_the_target(server):
    url, _ = server
    client = _client(url)
    assert [m.id for m in client.models.list().data] == [NAME]
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}])


def test_stop_strings_cut_the_text_and_end_the_choice(server, tiny_pair):
    url, _ = server
    full = _alone(tiny_pair[0], PROMPTS[2], 20)
    stop = full.split(" ")[5]  # the sixth token's text
    cut = full[:full.find(stop)]
    client = _client(url)
    whole = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=20, temperature=0, stop=[stop])
    assert whole.choices[0].text == cut and whole.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=NAME, prompt=PROMPTS[2], max_tokens=20, temperature=0, stop=stop, stream=True))
    assert streamed == cut


@pytest.mark.parametrize("speculative", [False, None, {"method": "tree", "tree_nodes": 8}],
                         ids=["ar", "default", "tree"])
def test_logprobs_are_the_targets_alone_whole_and_streamed(server, tiny_pair, speculative):
    """Each token's log-probability and its top 2 equal those of the target's AR run alone, in
    OpenAI's completions layout; streamed chunks carry the same entries, each with its text."""
    url, _ = server
    target = tiny_pair[0]
    alone = autoregressive_generate(PROMPTS[2], target, max_new_tokens=12, logprobs=2)
    client = _client(url)
    extra = {} if speculative is None else {"speculative": speculative}
    whole = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=12, temperature=0, logprobs=2,
                                      extra_body=extra).choices[0]
    logprobs = whole.logprobs
    assert logprobs.token_logprobs == [e.logprob for e in alone.logprobs]
    assert logprobs.tokens == [target.decode([e.token], skip_special_tokens=False) for e in alone.logprobs]
    assert logprobs.text_offset == [len(target.decode(alone.tokens[:k])) for k in range(12)]
    assert [list(top.values()) for top in logprobs.top_logprobs] == [[v for _, v in e.top] for e in alone.logprobs]
    chunks = [c.choices[0] for c in client.completions.create(
        model=NAME, prompt=PROMPTS[2], max_tokens=12, temperature=0, logprobs=2, stream=True, extra_body=extra)]
    assert sum((c.logprobs.token_logprobs for c in chunks if c.logprobs), []) == logprobs.token_logprobs
    assert sum((c.logprobs.text_offset for c in chunks if c.logprobs), []) == logprobs.text_offset
    plain = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=3, temperature=0)
    assert plain.choices[0].logprobs is None


def test_text_pieces_carry_the_tokens_whose_text_they_hold():
    """Which tokens' logprobs go with a piece of text: those whose text it holds whole (a token
    that ends in a held-back stop-string prefix waits); at a stop string, those that begin before
    it; at the end, all."""
    from specdec.server.app import _Text

    words = {0: "ab", 1: "c", 2: "de", 3: "f", 4: "END", 5: "g"}
    text = _Text(lambda ids: "".join(words[i] for i in ids), stops=["cd"], offsets=True)
    assert text.add([0]) == "a" and text.released() == 0  # the last character is held (a stop may begin there)
    assert text.add([1]) == "b" and text.released() == 1  # "ab" sent: token 0 whole; "c" held
    assert text.ends == [2, 3]
    assert text.add([2]) == "" and text.stopped and text.sent == 2  # "abcde": "cd" at 2
    assert text.released() == 1  # token 1 ("c") begins the stop string: it is not sent
    whole = _Text(lambda ids: "".join(words[i] for i in ids), stops=[], offsets=True)
    assert whole.add([0, 3]) == "abf" and whole.released() == 2
    assert whole.add([4], final=True) == "END" and whole.released() == 3


def test_streamed_text_is_decoded_incrementally_and_equals_the_whole_decode():
    """A long answer costs linear decoding, not a decode of the whole output per token, and the
    text it streams is the whole decode's, also where a character's bytes span tokens."""
    import random

    from specdec.server.app import _Text

    rng = random.Random(0)
    pieces = [bytes([b]) for b in b"abc xyz"] + ["é".encode()[:1], "é".encode()[1:], "€".encode()[:2],
                                                   "€".encode()[2:], "ü".encode()]
    decoded = [0]

    def decode(ids):
        decoded[0] += len(ids)
        return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

    ids = []
    while len(ids) < 3000:  # whole characters: a split one's bytes in order
        k = rng.randrange(len(pieces) - 4)
        ids += [k] if k < 7 else {7: [7, 8], 8: [9, 10], 9: [11], 10: [11]}[k]
    text = _Text(decode, stops=[], offsets=True)
    sent = "".join(text.add(ids[i:i + 3]) for i in range(0, len(ids), 3)) + text.add([], final=True)
    whole = b"".join(pieces[i] for i in ids).decode("utf-8")
    assert sent == whole and text.text == whole
    assert text.ends[-1] == len(whole) and text.ends == sorted(text.ends)
    assert decoded[0] < 40 * len(ids)  # a whole decode per token would be ~len(ids)² / 2 = 4.5 million


def test_metrics_parse_and_add_up_to_the_responses_usage(server):
    url, _ = server
    before = _metrics(url)
    client = _client(url)
    usages = [client.completions.create(model=NAME, prompt=p, max_tokens=10, temperature=0).usage for p in PROMPTS[:3]]
    # n > 1 and a stop string: a prompt's tokens count once, as in usage, whatever its choices did
    usages.append(client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=10, temperature=1.0, seed=2,
                                            n=3, stop=["a", "e"]).usage)
    after = _metrics(url)

    def grew(name, **labels):
        return _metric(after, name, **labels) - _metric(before, name, **labels)

    assert grew("specdec:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert grew("specdec:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    spec = [u.model_extra["speculative"] for u in usages]
    assert grew("specdec:spec_decode_num_draft_tokens_total") == sum(s["drafted_tokens"] for s in spec) > 0
    accepted = grew("specdec:spec_decode_num_accepted_tokens_total")
    assert accepted == sum(s["accepted_tokens"] for s in spec)
    positions = sum(v - _metric(before, name, **dict(labels)) for (name, labels), v in after.items()
                    if name == "specdec:spec_decode_num_accepted_tokens_per_pos_total")
    assert positions == accepted
    assert grew("specdec:requests_total", status="ok") == 4
    assert grew("specdec:time_to_first_token_seconds_count") == 6  # one per choice
    assert _metric(after, "specdec:num_requests_running") == 0


BAD = [
    (b"{not json", 400, None, "not valid JSON"),
    (b"[1, 2]", 400, None, "JSON object"),
    ({"prompt": [1], "temperature": "hot"}, 400, "temperature", "must be a number"),
    ({"prompt": [1], "model": "gpt-4"}, 404, "model", "does not exist"),
    ({"prompt": ""}, 400, "prompt", "empty"),
    ({"prompt": []}, 400, "prompt", "non-empty"),
    ({"prompt": [1] * 300}, 400, "prompt", "at most 255"),
    ({"prompt": [99]}, 400, "prompt", "outside the vocabulary"),
    ({"prompt": [1], "max_tokens": 0}, 400, "max_tokens", "must be in"),
    ({"prompt": [1] * 200, "max_tokens": 100}, 400, "max_tokens", "leaves 56"),
    ({"prompt": [1], "temperature": -0.5}, 400, "temperature", "must be in"),
    ({"prompt": [1], "top_p": 0}, 400, "top_p", "must be in (0"),
    ({"prompt": [1], "top_p": 1.5}, 400, "top_p", "must be in (0"),
    ({"prompt": [1], "n": 0}, 400, "n", "must be in"),
    ({"prompt": [1], "stop": [""]}, 400, "stop", "non-empty string"),
    ({"prompt": [[1]] * 17}, 400, "prompt", "at most 16 prompts"),
    ({"prompt": [[1], []]}, 400, "prompt", "list of several"),
    ({"prompt": [[1]] * 8, "n": 9}, 400, "n", "at most 64 choices"),
    ({"prompt": [1], "stream": "yes"}, 400, "stream", "true or false"),
    ({"prompt": [1], "logprobs": 21}, 400, "logprobs", "must be in"),
    ({"prompt": [1], "echo": True}, 400, "echo", "not supported"),
    ({"prompt": [1], "speculative": {"method": "magic"}}, 400, "speculative.method", "one of"),
    ({"prompt": [1], "speculative": {"method": "retrieval"}}, 400, "speculative.method", "needs a datastore"),
    ({"prompt": [1], "speculative": {"path": "/etc/passwd"}}, 400, "speculative", "takes method"),
    ({"prompt": [1], "speculative": "model.gguf"}, 400, "speculative", "must be false or an object"),
]


@pytest.mark.parametrize("body, status, param, message", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input_is_a_4xx_naming_the_field_and_the_next_request_succeeds(server, body, status, param, message):
    url, _ = server
    content = body if isinstance(body, bytes) else httpx.Request("POST", url, json={"model": NAME, **body}).content
    response = httpx.post(url + "/v1/completions", content=content, headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == param and error["type"]
    ok = _client(url).completions.create(model=NAME, prompt=[1, 2], max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens == 3


@pytest.mark.parametrize("field, value", [("top_logprobs", 2), ("max_completion_tokens", 5)])
def test_fields_the_server_does_not_honour_are_refused_by_name_never_ignored(server, field, value):
    url, _ = server
    body = {"prompt": [1, 2], "max_tokens": 2, "temperature": 0}
    refused = httpx.post(url + "/v1/completions", json={**body, field: value})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text
    assert httpx.post(url + "/v1/completions", json={**body, field: None}).status_code == 200  # null: not given


def test_penalties_bias_and_length_fields_are_honoured_as_ar_decoding_honours_them(server, tiny_pair):
    """Each field shapes the target's logits at every position, drafts included: the served greedy
    text is the AR text under the same rules (core/penalties.py), and differs from the plain one."""
    from specdec.core.penalties import LogitRules

    url, _ = server
    target, _ = tiny_pair
    client = _client(url)
    prompt = [4, 9, 4, 2]

    def served(**fields):
        extra = {k: fields.pop(k) for k in list(fields) if k not in ("presence_penalty", "frequency_penalty",
                                                                    "logit_bias")}
        choice = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0,
                                           extra_body=extra, **fields).choices[0]
        return choice.text, choice.finish_reason

    def alone(rules=LogitRules(), eos=None):
        return target.decode(autoregressive_generate(prompt, target, max_new_tokens=12, rules=rules,
                                                     eos_token_ids=eos).tokens)

    plain = alone()
    cases = [({"presence_penalty": 2.0, "frequency_penalty": 2.0}, LogitRules(presence=2.0, frequency=2.0)),
             ({"repetition_penalty": 3.0}, LogitRules(repetition=3.0)),
             ({"logit_bias": {"5": 100}}, LogitRules(bias=((5, 100.0),)))]
    for fields, rules in cases:
        assert served(**fields)[0] == alone(rules), fields
    assert served(logit_bias={"5": 100})[0] == target.decode([5] * 12) != plain
    # the end token (1) made likely: one token; held back by min_tokens, or ignored
    assert served(logit_bias={"1": 100}) == (alone(LogitRules(bias=((1, 100.0),))), "stop")
    assert served(logit_bias={"1": 100}, min_tokens=5)[0] == alone(LogitRules(bias=((1, 100.0),), min_tokens=5))
    assert served(logit_bias={"1": 100}, ignore_eos=True) == (target.decode([1] * 12), "length")
    first = autoregressive_generate(prompt, target, max_new_tokens=12).tokens[1]  # its second token ends it
    assert served(stop_token_ids=[first]) == (alone(eos=[1, first]), "stop")
    # min_p = 1 keeps only the most likely token: sampling at temperature 1 gives the greedy text
    choice = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=1.0, seed=3,
                                       extra_body={"min_p": 1.0}).choices[0]
    assert choice.text == plain


@pytest.mark.parametrize("fields, param, message", [
    ({"presence_penalty": 2.5}, "presence_penalty", "in [-2, 2]"),
    ({"repetition_penalty": 0}, "repetition_penalty", "in (0, 10]"),
    ({"logit_bias": {"16": 5}}, "logit_bias", "vocabulary of 16"),
    ({"logit_bias": {"x": 5}}, "logit_bias", "token ids"),
    ({"logit_bias": {"3": 101}}, "logit_bias", "[-100, 100]"),
    ({"stop_token_ids": [99]}, "stop_token_ids", "vocabulary of 16"),
    ({"min_tokens": -1}, "min_tokens", "in [0,"),
    ({"min_p": 1.5}, "min_p", "in [0, 1]"),
    ({"ignore_eos": "yes"}, "ignore_eos", "true or false"),
    ({"presence_penalty": 1.0, "speculative": {"method": "tree"}}, "speculative.method", "chain drafts")])
def test_bad_penalty_fields_are_a_400_naming_them(server, fields, param, message):
    url, _ = server
    response = httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_a_servers_default_speculation_applies_to_requests_that_name_none(tiny_pair):
    """As `specdec serve` sets it (every default field given): a plain request takes it, a request
    may change the method, and tree_nodes is refused only where a request names it off a tree."""
    target, drafter = tiny_pair
    service = Service(target, drafter, default=SpecConfig(gamma_max=20), default_method="default")
    for body, method in [({}, "default"), ({"speculative": {"method": "tree"}}, "tree"),
                         ({"speculative": {"method": "lookup", "gamma_max": 3}}, "lookup"),
                         ({"speculative": {"method": "lookahead", "tree_nodes": 8}}, "lookahead")]:
        job = parse_job({"prompt": [1, 2], **body}, False, NAME, service.default, service.default_method)
        assert job.method == method and len(service.requests(job, [1, 2], 4)) == 1
    with pytest.raises(BadRequest, match="applies to methods tree and lookahead"):
        parse_job({"prompt": [1], "speculative": {"method": "chain", "tree_nodes": 8}}, False, NAME, service.default)


def test_tree_methods_are_refused_where_the_backend_scores_no_trees(tiny_pair, monkeypatch):
    target, drafter = tiny_pair
    service = Service(target, drafter, default=SpecConfig(gamma_max=20), default_method="default")
    monkeypatch.setattr(target, "tree_masks", False, raising=False)  # as llama.cpp's backend
    for method in ("tree", "lookahead"):
        job = parse_job({"prompt": [1, 2], "speculative": {"method": method}}, False, NAME, service.default)
        with pytest.raises(BadRequest, match=f"'{method}' scores token trees") as caught:
            service.requests(job, [1, 2], 4)
        assert caught.value.param == "speculative.method"


def test_chat_bodies_are_checked_too():
    default = SpecConfig()
    for messages, needle in [([], "non-empty list"), ([{"role": "wizard", "content": "x"}], "messages[0]"),
                             ([{"role": "user", "content": 3}], "messages[0]"), ([{"role": "user", "content": ""}],
                                                                                 "all empty")]:
        with pytest.raises(BadRequest, match=needle.replace("[", r"\[")):
            parse_job({"messages": messages}, True, NAME, default)
    job = parse_job({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5, "speculative": False},
                    True, NAME, default)
    assert job.max_tokens == 5 and job.method is None and not job.speculation.speculative
    chat = {"messages": [{"role": "user", "content": "x"}]}
    for extra, needle in [({"top_logprobs": 2}, "needs logprobs: true"), ({"logprobs": 3}, "true or false"),
                          ({"logprobs": True, "top_logprobs": 21}, "must be in")]:
        with pytest.raises(BadRequest, match=needle):
            parse_job({**chat, **extra}, True, NAME, default)
    assert parse_job({**chat, "logprobs": True}, True, NAME, default).logprobs == 0
    assert parse_job({**chat, "logprobs": True, "top_logprobs": 5}, True, NAME, default).logprobs == 5
    assert parse_job({**chat, "logprobs": False}, True, NAME, default).logprobs is None


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_client_that_disconnects_frees_its_sequence(server, tiny_pair, monkeypatch, stream):
    """Steps slowed to 20 ms: 250 tokens would take 5 s; the client leaves after its first token
    (streaming) or 0.5 s (waiting whole), and the sequence must be gone long before 5 s."""
    url, app = server
    worker, target = app.state.specdec["worker"], tiny_pair[0]
    forward_batch = target.forward_batch

    def slow(segments):
        time.sleep(0.02)
        return forward_batch(segments)

    monkeypatch.setattr(target, "forward_batch", slow)
    before = _metrics(url)
    body = {"model": NAME, "prompt": [1, 2, 3], "max_tokens": 250, "temperature": 0, "stream": stream}
    left = time.monotonic()
    if stream:
        with httpx.stream("POST", url + "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    break  # the first token came: leave
        left = time.monotonic()
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=body, timeout=0.5)
    while worker.running or worker.engine.busy:
        assert time.monotonic() - left < 2, "the sequence of a vanished client was not freed"
        time.sleep(0.02)
    after = _metrics(url)
    assert _metric(after, "specdec:requests_total", status="cancelled") - \
        _metric(before, "specdec:requests_total", status="cancelled") == 1
    assert _metric(after, "specdec:generation_tokens_total") == _metric(before, "specdec:generation_tokens_total")


def test_one_requests_own_error_ends_it_alone(server, monkeypatch):
    """NaN logits in one sequence end that request alone, as the server's fault (500), not the
    client's (it was a 400)."""
    url, _ = server
    commit = Decoding.apply

    def failing(self, logits, seconds, decided=None, timed=True):
        if self.sequence[:2] == [13, 14]:  # what broken weights give: the sampler finds it
            return commit(self, logits * float("nan"), seconds, timed=timed)
        return commit(self, logits, seconds, decided, timed)

    monkeypatch.setattr(Decoding, "apply", failing)
    client = _client(url)
    with ThreadPoolExecutor(2) as pool:
        bad = pool.submit(client.completions.create, model=NAME, prompt=[13, 14, 1], max_tokens=40, temperature=0)
        good = pool.submit(client.completions.create, model=NAME, prompt=[1, 2, 3], max_tokens=40, temperature=0)
        with pytest.raises(openai.InternalServerError, match="NaN logits"):
            bad.result()
        assert good.result().usage.completion_tokens == 40


def test_an_error_between_requests_is_logged_and_the_engine_goes_on(tiny_pair, caplog):
    """The update between requests (an online learner's) raising must not end the engine's thread
    (it used to: /health said 200 while every later request waited for its 504)."""
    calls = []

    def failing_update():
        calls.append(1)
        raise RuntimeError("the learner broke")

    with serving(lambda: Service(tiny_pair[0], None, limits=Limits(request_timeout=10))) as (url, app):
        app.state.specdec["worker"].between = failing_update
        deadline = time.monotonic() + 5
        while not calls:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        reply = _client(url).completions.create(model=NAME, prompt=[1, 2], max_tokens=3, temperature=0)
        assert reply.usage.completion_tokens == 3
        assert httpx.get(url + "/health").status_code == 200
    assert calls == [1]  # turned off after it failed, not retried every idle turn
    assert "the learner broke" in caplog.text


class _Fatal(BaseException):
    """What no `except Exception` catches: the engine's thread ends on it."""


def test_a_dead_engine_is_503_at_once_for_requests_in_flight_and_after_and_on_health(tiny_pair, monkeypatch, caplog):
    with serving(lambda: Service(tiny_pair[0], None, limits=Limits(request_timeout=20))) as (url, app):
        worker = app.state.specdec["worker"]

        def fatal():
            raise _Fatal("the thread dies")

        monkeypatch.setattr(worker.engine, "step", fatal)
        client = _client(url)
        began = time.monotonic()
        with pytest.raises(openai.InternalServerError) as caught:
            client.completions.create(model=NAME, prompt=[1, 2], max_tokens=3, temperature=0)
        assert caught.value.status_code == 503 and time.monotonic() - began < 5  # not the 20 s timeout
        assert caught.value.body["code"] == "engine_stopped"
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and "engine stopped" in health.json()["error"]["message"]
        began = time.monotonic()
        after = httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
        assert after.status_code == 503 and time.monotonic() - began < 5
        assert not worker.thread.is_alive()
    assert "the thread dies" in caplog.text


def test_web_pages_and_foreign_host_names_are_refused_unless_allowed(tiny_pair):
    """A page in the user's browser (it sends Origin) may not drive a keyless loopback server, nor
    read its answers through DNS rebinding (Host names another machine)."""
    load = lambda: Service(tiny_pair[0], None)  # noqa: E731
    body = {"prompt": [1, 2], "max_tokens": 2, "temperature": 0}
    with serving(load, host="127.0.0.1", cors_origins=["http://ok.example"]) as (url, app):
        port = url.rsplit(":", 1)[1]
        foreign = httpx.post(url + "/v1/completions", json=body, headers={"Origin": "http://evil.example"})
        assert foreign.status_code == 403 and foreign.json()["error"]["code"] == "origin_not_allowed"
        allowed = httpx.post(url + "/v1/completions", json=body, headers={"Origin": "http://ok.example"})
        assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "http://ok.example"
        preflight = httpx.options(url + "/v1/completions", headers={
            "Origin": "http://ok.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type"})
        assert preflight.status_code == 200
        rebound = httpx.post(url + "/v1/completions", json=body, headers={"Host": f"evil.example:{port}"})
        assert rebound.status_code == 403 and rebound.json()["error"]["code"] == "host_not_allowed"
        assert httpx.get(url + "/health", headers={"Host": f"attacker.example:{port}"}).status_code == 403
        for name in (f"localhost:{port}", f"127.0.0.1:{port}", "localhost"):
            assert httpx.post(url + "/v1/completions", json=body, headers={"Host": name}).status_code == 200, name
        client = _client(url)  # the openai client sends neither an Origin nor another host
        assert client.completions.create(model=NAME, prompt=[1, 2], max_tokens=2, temperature=0).choices


def test_the_api_key_comes_from_the_flag_a_file_or_the_environment(tmp_path, monkeypatch):
    from specdec.server.app import api_key_from

    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    assert api_key_from(None, None) is None
    monkeypatch.setenv("SPECDEC_API_KEY", "from-env")
    assert api_key_from(None, None) == ["from-env"]
    path = tmp_path / "key"
    path.write_text("from-file\n\n  second  \n")
    assert api_key_from(None, path) == ["from-file", "second"] and api_key_from("flag", None) == ["flag"]
    with pytest.raises(SpecdecError, match="not both"):
        api_key_from("flag", path)
    path.write_text("\n")
    with pytest.raises(SpecdecError, match="is empty"):
        api_key_from(None, path)
    with pytest.raises(SpecdecError, match="cannot read"):
        api_key_from(None, tmp_path / "missing")


def test_the_api_key_is_required_when_set(tiny_pair):
    with serving(lambda: Service(tiny_pair[0], None), api_key="sekret") as (url, _):
        with pytest.raises(openai.AuthenticationError, match="API key"):
            _client(url, api_key="wrong").completions.create(model=NAME, prompt=[1], max_tokens=2)
        assert httpx.get(url + "/v1/models").status_code == 401
        ok = _client(url, api_key="sekret").completions.create(model=NAME, prompt=[1], max_tokens=2, temperature=0)
        assert ok.usage.completion_tokens == 2 and httpx.get(url + "/health").status_code == 200


def test_health_is_503_while_loading_and_requests_are_told_to_retry(tiny_pair):
    release = threading.Event()

    def load():
        assert release.wait(20)
        return Service(tiny_pair[0], None)

    with serving(load, wait=False) as (url, _):
        assert httpx.get(url + "/health").status_code == 503
        response = httpx.post(url + "/v1/completions", json={"prompt": [1], "max_tokens": 2})
        assert response.status_code == 503 and "loading" in response.json()["error"]["message"]
        release.set()
        deadline = time.monotonic() + 20
        while httpx.get(url + "/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_more_choices_than_the_queue_holds_is_a_400_not_a_429_forever(tiny_pair):
    with serving(lambda: Service(tiny_pair[0], None, limits=Limits(max_waiting=4))) as (url, app):
        response = httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "n": 3})
        assert response.status_code == 400 and "retry-after" not in response.headers
        error = response.json()["error"]
        assert error["param"] == "n" and "limit of 2 a request" in error["message"]
        ok = httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "n": 2})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


def test_a_full_queue_is_429_with_retry_after(tiny_pair, monkeypatch):
    from specdec.engine import Engine, Request

    worker = Worker(Engine(tiny_pair[0], 1), max_waiting=2)  # not started: nothing leaves the queue
    sinks = [object(), object()]
    for sink in sinks:
        worker.submit(Request([1, 2]), sink)
    with pytest.raises(QueueFull):
        worker.submit(Request([1, 2]), object())

    def full(self, request, sink):
        raise QueueFull("2 requests are waiting, this server's limit")

    monkeypatch.setattr(Worker, "submit", full)
    with serving(lambda: Service(tiny_pair[0], None)) as (url, _):
        response = httpx.post(url + "/v1/completions", json={"prompt": [1], "max_tokens": 2})
        assert response.status_code == 429 and response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "queue_full"


@pytest.mark.real
def test_real_chat_streams_at_once_equal_ar_alone_token_for_token(default_pair):
    """The default pair (bf16 row-exact target, int8 drafter): 8 clients stream chat completions
    at once, half under the default method and half drafting trees; each text is the target's AR
    output alone, and the speculation of the whole run shows in /metrics."""
    from specdec.models.loading import load
    from specdec.models import catalogue as registry

    target = default_pair[0]  # row-exact, as the server loads it
    drafter = load(registry.DEFAULT_DRAFTER, device="cpu", role="drafter", exact_rows=True)
    questions = ["Write a Python function that reverses a string.", "What is a binary search?",
                 "Sort a list of tuples by the second item.", "Explain recursion in one sentence.",
                 "def fibonacci(n):", "Name three HTTP methods.", "How do I read a file in Python?",
                 "What does git rebase do?"]
    # drafts and trees sized for flat pass costs (not timed): drafting happens on any machine
    assumed = AssumedCosts(drafter=0.2, slope=0.0)
    with serving(lambda: Service(target, drafter, assumed=assumed), max_batch=8) as (url, _):
        client = _client(url)

        def ask(number):  # odd ones draft trees, which draft whatever the batch
            return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                model=target.name, messages=[{"role": "user", "content": questions[number]}], max_tokens=24,
                temperature=0, stream=True, extra_body={"speculative": {"method": "tree"}} if number % 2 else {}))

        with ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(ask, range(len(questions))))
        drafted = _metric(_metrics(url), "specdec:spec_decode_num_draft_tokens_total")
        scored = client.chat.completions.create(
            model=target.name, messages=[{"role": "user", "content": questions[0]}], max_tokens=24, temperature=0,
            logprobs=True, top_logprobs=3, extra_body={"speculative": {"method": "tree"}}).choices[0]
    alone = [target.decode(autoregressive_generate(target.encode(q, chat=True), target, max_new_tokens=24).tokens)
             for q in questions]
    assert texts == alone and drafted > 0
    # chat's logprobs layout: each token of the tree-drafted answer as the AR run alone scores it
    reference = autoregressive_generate(target.encode(questions[0], chat=True), target, max_new_tokens=24, logprobs=3)
    content = scored.logprobs.content
    assert [c.logprob for c in content] == [e.logprob for e in reference.logprobs]
    assert [[t.logprob for t in c.top_logprobs] for c in content] == [[v for _, v in e.top] for e in reference.logprobs]
    assert "".join(c.token for c, e in zip(content, reference.logprobs)
                   if e.token not in target.eos_token_ids) == scored.message.content
    assert all(c.bytes == list(c.token.encode()) for c in content)


@pytest.mark.real
def test_real_server_process_exits_0_on_sigterm_after_finishing_in_flight_requests(smollm2):
    """`specdec serve` as users start it: loopback, /health 503 then 200, a streamed request in
    flight when SIGTERM comes finishes, and the process exits 0."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "specdec", "serve", "--target", "smollm2-135m", "--drafter",
                                "none", "--method", "ar", "--port", str(port), "--grace", "20"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read() if \
                process.poll() is not None else "not ready in 120 s"
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        pieces = []
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"prompt": "def add(a, b):", "max_tokens": 40, "temperature": 0, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and not pieces:
                    os.kill(process.pid, signal.SIGTERM)  # in flight: the rest must still come
                if line:
                    pieces.append(line)
        assert pieces[-1] == "data: [DONE]" and sum(p.startswith("data: {") for p in pieces) >= 2
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


def test_a_request_past_its_time_is_504_and_a_body_past_the_limit_413(tiny_pair, monkeypatch):
    target = tiny_pair[0]
    forward_batch = target.forward_batch

    def slow(segments):
        time.sleep(0.02)
        return forward_batch(segments)

    monkeypatch.setattr(target, "forward_batch", slow)
    limits = Limits(request_timeout=0.5, max_body=300)
    with serving(lambda: Service(target, None, limits=limits)) as (url, app):
        response = httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 200, "temperature": 0})
        assert response.status_code == 504 and response.json()["error"]["code"] == "timeout"
        response = httpx.post(url + "/v1/completions", json={"prompt": [1] * 200, "max_tokens": 2})
        assert response.status_code == 413 and "limit of 300" in response.json()["error"]["message"]
        ok = httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 3, "temperature": 0})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        worker = app.state.specdec["worker"]
        assert not worker.engine.busy


def test_a_chunked_body_past_the_limit_is_413_before_it_ends_and_deep_nesting_is_400(tiny_pair):
    """A chunked body declares no length: the server must measure it as it arrives and answer
    413 once it passes the limit, not wait for (and hold) all of it. A deeply nested body is a
    400 with an OpenAI error body, not a RecursionError's 500."""
    import socket

    with serving(lambda: Service(tiny_pair[0], None, limits=Limits(max_body=100_000))) as (url, app):
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")
            chunk = b"[" * 8192
            for _ in range(20):  # 160 kB sent, and the body never ends: the answer must come anyway
                conn.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            answer = b""
            while b"\r\n\r\n" not in answer:
                answer += conn.recv(65536)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        response = httpx.post(url + "/v1/completions", content=b"[" * 50_000 + b"]" * 50_000,
                              headers={"Content-Type": "application/json"})
        assert response.status_code == 400, response.text[:200]
        error = response.json()["error"]
        assert error["code"] == "invalid_json" and "nested too deeply" in error["message"]
        ok = httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "temperature": 0})
        assert ok.status_code == 200


@pytest.mark.parametrize("args, message", [
    (["--method", "magic"], "--method must be one of"),
    (["--drafter", "none"], "--method default drafts with a drafter model"),
    (["--drafter", "lookup", "--method", "tree"], "--drafter lookup names the lookup method"),
    (["--drafter", "self-skip"], "the target drafting for itself runs one sequence at a time"),
    (["--dtype", "gguf", "--method", "tree"], "token trees, which need transformers' weights"),
    (["--dtype", "gguf", "--method", "lookahead"], "--method lookahead scores token trees"),
    (["--max-batch", "0"], "--max-batch must be >= 1"),
    (["--prefill-tokens", "0"], "--prefill-tokens must be >= 1"),
    (["--kv-memory", "lots"], "--kv-memory"),
    (["--max-body", "-1"], "--max-body"),
    (["--suffix-cache-tokens", "-5"], "--suffix-cache-tokens must be >= 0"),
    (["--method", "retrieval"], "--method retrieval drafts from a datastore"),
    (["--datastore", "no-such-folder"], "no-such-folder"),
    (["--api-key", "k", "--api-key-file", "key.txt"], "not both"),
    (["--api-key-file", "no-such-key-file"], "cannot read it"),
])
def test_serve_options_are_checked_before_loading(args, message):
    result = CliRunner().invoke(cli, ["serve", "--target", "no-such-model"] + args)
    assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output


@pytest.mark.slow
def test_a_model_that_cannot_load_stops_the_server_with_one_line(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "specdec", "serve", "--target", str(tmp_path / "missing"),
                           "--drafter", "none", "--method", "ar", "--port", "0"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error:") and "missing" in done.stderr


@pytest.mark.slow
def test_bench_serve_reports_every_request_and_the_speculation_metrics_counted(server):
    from specdec.bench.serving import Server, bench_serve, bench_servers, render

    url, _ = server
    prompts = [(PROMPTS[0], False), (PROMPTS[2], False)]
    summaries = bench_serve(url, prompts, [1, 4], 12, {"model": NAME, "max_tokens": 8, "temperature": 0})
    for summary in summaries:
        assert summary["completed"] == 12 and summary["failed"] == 0 and summary["output_tokens"] == 96
        assert summary["ttft_ms"]["p50"] > 0 and summary["e2e_ms"]["p99"] >= summary["e2e_ms"]["p50"]
        assert summary["speculation"]["draft_tokens"] > 0 and 0 <= summary["speculation"]["acceptance_rate"] <= 1
    assert render(summaries).count("\n") == 3
    both = bench_serve(url, prompts, [2], 4, {"model": NAME, "max_tokens": 8, "temperature": 0},
                       variants={"chain": {}, "ar": {"speculative": False}})
    assert [s["variant"] for s in both] == ["chain", "ar"] and both[1]["speculation"]["draft_tokens"] == 0
    assert both[0]["speculation"]["draft_tokens"] > 0 and "| 2 | ar |" in render(both)
    settings = {"model": NAME, "max_tokens": 8, "temperature": 0}
    side_by_side = bench_servers([Server("spec", url, settings), Server("plain", url, {**settings, "speculative": False})],
                                 prompts, [1, 2], 4, warmups=2)
    assert [(s["concurrency"], s["server"]) for s in side_by_side] == [(1, "spec"), (1, "plain"), (2, "spec"), (2, "plain")]
    assert side_by_side[0]["speculation"]["draft_tokens"] > 0 == side_by_side[1]["speculation"]["draft_tokens"]
    assert "| 2 | plain |" in render(side_by_side)
    twice = bench_servers([Server("spec", url, settings)], prompts, [2], 4, repeats=2)[0]
    assert twice["completed"] == 8 and len(twice["repeat_output_throughput"]) == 2 and twice["output_tokens"] == 64
    failing = bench_serve(url, prompts, [2], 4, {"model": NAME, "max_tokens": 1000, "temperature": 0})[0]
    assert failing["completed"] == 0 and failing["failed"] == 4 and "HTTP 400" in failing["first_error"]


def test_bench_serve_repeats_pool_each_servers_rounds_taken_in_turn(monkeypatch):
    """--repeats: every server's rounds at a level pooled (requests, seconds and speculation counters
    summed), each round's throughput listed and its range shown, the servers' order counterbalanced."""
    from specdec.bench import serving

    ran, counters = [], {"a": 0.0, "b": 0.0}

    async def level(url, prompts, concurrency, requests, settings, api_key=None, timeout=600.0):
        ran.append(url)
        tokens = 10 if url == "a" else 20 + 10 * sum(u == "b" for u in ran)  # b: 30 tokens, then 40
        counters[url] += 4  # four draft tokens a round, three accepted
        return [serving.Record(True, 0.0, 1.0, 0.5, [0.5, 1.0], tokens)], 2.0

    def metrics(url, api_key):
        return (f"specdec:spec_decode_num_draft_tokens_total {counters[url]}\n"
                f"specdec:spec_decode_num_accepted_tokens_total {counters[url] * 0.75}\n")

    monkeypatch.setattr(serving, "run_level", level)
    monkeypatch.setattr(serving, "_metrics", metrics)
    a, b = serving.bench_servers([serving.Server("a", "a", {}), serving.Server("b", "b", {})], [("x", False)], [2], 1,
                                 repeats=2)
    assert sorted(ran[:2]) == ["a", "b"] and ran[2:] == ran[1::-1]  # the second round in the other order
    assert a["completed"] == 2 and a["duration_s"] == 4.0 and a["output_throughput"] == 5.0
    assert b["output_tokens"] == 70 and b["repeat_output_throughput"] == [15.0, 20.0]
    assert b["speculation"]["draft_tokens"] == 8 and b["speculation"]["acceptance_rate"] == 0.75
    assert "| 17.50 (15.00–20.00) |" in serving.render([a, b])
    with pytest.raises(SpecdecError, match="repeats"):
        serving.bench_servers([serving.Server("a", "a", {})], [("x", False)], [1], 1, repeats=0)


def test_bench_serve_results_name_the_home_directory_tilde(monkeypatch):
    """A model path given as a server's model name must not put this machine's home in shared results."""
    from pathlib import Path

    from specdec.cli import _home_as_tilde

    monkeypatch.setattr(Path, "home", classmethod(lambda cls: Path("/home/someone")))
    assert _home_as_tilde('{"model": "/home/someone/.cache/m/hf", "other": "/home/someoneelse/x"}') == \
        '{"model": "~/.cache/m/hf", "other": "/home/someoneelse/x"}'
    monkeypatch.setattr(Path, "home", classmethod(lambda cls: Path("/")))
    assert _home_as_tilde("/srv/m") == "/srv/m"


@pytest.mark.parametrize("args, message", [
    (["--concurrency", "0"], "integers >= 1"), (["--requests", "0"], "--requests, --max-tokens and --repeats"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--extra", "{bad"], "--extra is not JSON"), (["--url", "http://127.0.0.1:9"], "no server answers"),
    (["--variants", "[1]"], "--variants must be a JSON object"),
    (["--url", "http://127.0.0.1:9", "--url", "http://127.0.0.1:10"], "name each of several servers"),
    (["--url", "a=http://127.0.0.1:9", "--url", "a=http://127.0.0.1:10"], "two servers named 'a'"),
    (["--url", "a=http://127.0.0.1:9", "--fields", 'b={"x": 1}'], "--fields takes NAME=JSON for a server named"),
    (["--url", "a=http://127.0.0.1:9", "--fields", "a=[1]"], "--fields a must be a JSON object"),
    (["--url", "http://127.0.0.1:9", "--wait", "1"], "was not ready after 1 s"),
    (["--wait", "-1"], "--wait and --warmups >= 0"), (["--warmups", "-1"], "--wait and --warmups >= 0"),
])
def test_bench_serve_options_are_one_line_errors(args, message):
    result = CliRunner().invoke(cli, ["bench-serve", "--dataset", "humaneval:1"] + args)
    assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


FAULT_EVERY = 50  # one engine step in so many fails in the target's pass
WARM_UP = 1000  # requests before the soak's 1,000 are counted and its memory watched
# per-request call sites, each failing once in so many calls (primes, so that they seldom meet)
SITE_FAULTS = {"begin": 37, "prefill": 41, "lag": 211, "accept": 97, "finish": 23, "rules": 53, "apply": 307}


def _faulty_sites(target, drafter_counts: dict) -> list[tuple[object, str, object]]:
    """(owner, name, replacement) for every per-request call site of the engine, each raising once
    in SITE_FAULTS[site] calls (counted in `drafter_counts`): the chaos soak patches them in."""
    from specdec.drafters.base import Drafter
    from specdec.drafters.model import ModelDrafter
    from specdec.drafters.suffix import SuffixDrafter
    from specdec.core.penalties import LogitRules

    def faulty(site, original):
        def wrapped(*args, **kwargs):
            drafter_counts[site] = drafter_counts.get(site, 0) + 1
            if drafter_counts[site] % SITE_FAULTS[site] == 0:
                raise RuntimeError(f"injected fault at {site}")
            return original(*args, **kwargs)
        return wrapped

    return [(Decoding, "begin", faulty("begin", Decoding.begin)),
            (Decoding, "prefill_step", faulty("prefill", Decoding.prefill_step)),
            # a prompt fed in a shared pass, or riding in the running sequences' pass, is in here
            (Decoding, "prefilled_together", faulty("prefill", Decoding.prefilled_together)),
            (ModelDrafter, "lag", faulty("lag", ModelDrafter.lag)),
            (ModelDrafter, "accept", faulty("accept", Drafter.accept)),
            (SuffixDrafter, "finish", faulty("finish", SuffixDrafter.finish)),
            (LogitRules, "apply", faulty("rules", LogitRules.apply)),
            (Decoding, "apply", faulty("apply", Decoding.apply))]


@pytest.mark.soak
def test_chaos_soak_1000_requests_at_16_with_disconnects_faults_and_bad_bodies(tiny_pair, monkeypatch):
    """1,000 short requests, 16 in flight (after a warm-up), a third drafting by suffix and a fifth
    with a penalty: about one in five dropped by its client after the first token; one engine step
    in fifty failing in the target's pass as llama.cpp's failed decode does (its sequences are
    scored again alone, one in five of those failing again); every per-request call site (a
    sequence's start, its prompt's feeding, its drafter's lag, accept and finish, its logit
    rules, its verification) failing now and then; one request in twenty a bad body. Every good
    request completes in full and equal to the target's run alone, or gets a clear error (never
    hangs: each is bounded); bad bodies get 400s, /health stays ok, nothing stays in the engine,
    and resident memory over the second half stays within 5%."""
    import random

    from specdec.errors import ModelFault

    target, drafter = tiny_pair
    total, rss, health, counts_at = 1000, [], [], {}
    passes, retries = itertools.count(1), itertools.count(1)
    forward_batch, forward = target.forward_batch, target.forward
    alone = {tuple(p): autoregressive_generate(p, target, max_new_tokens=12).tokens for p in PROMPTS}

    def faulty(segments):  # one step in fifty fails inside the target's pass (a backend's failed call)
        if next(passes) % FAULT_EVERY == 0:
            raise ModelFault("injected fault: the backend failed to decode")
        return forward_batch(segments)

    def faulty_alone(*args, **kwargs):  # a sequence scored alone after such a failure: one in five fails again
        if next(retries) % 5 == 0:
            raise ModelFault("injected fault, again")
        return forward(*args, **kwargs)

    with serving(lambda: Service(target, drafter), max_batch=16) as (url, app):
        target.forward_batch, target.forward = faulty, faulty_alone
        for owner, name, replacement in _faulty_sites(target, counts_at):
            monkeypatch.setattr(owner, name, replacement)
        try:
            rng = random.Random(0)
            plans = [(PROMPTS[i % len(PROMPTS)], 6 + i % 7, rng.random() < 0.2, rng.random() < 0.05,
                      "suffix" if i % 3 == 0 else None, i % 5 == 1) for i in range(total)]

            def one(plan):
                prompt, tokens, drop, bad, method, penalty = plan
                if bad:  # malformed JSON, or a max_tokens below 1
                    json_type = {"content-type": "application/json"}
                    send = dict(content=b'{"model": ', headers=json_type) if tokens % 2 else \
                        dict(json={"model": NAME, "prompt": prompt, "max_tokens": -tokens})
                    response = httpx.post(url + "/v1/completions", timeout=30, **send)
                    return "refused" if response.status_code == 400 and "error" in response.json() else "wrong"
                body = {"model": NAME, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True}}
                if method:
                    body["speculative"] = {"method": method}
                if penalty:
                    body["presence_penalty"] = 0.5
                text = ""
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
                    assert response.status_code == 200
                    for line in response.iter_lines():
                        if line.startswith('data: {"error"'):
                            error = json.loads(line[6:])["error"]
                            # a server fault, in words that show no internals (a ModelFault says its own)
                            clear = error["type"] == "server_error" and "injected fault at" not in error["message"]
                            return "failed" if clear else "wrong"
                        if drop and line.startswith("data: {"):
                            return "dropped"
                        if line.startswith("data: {"):
                            chunk = json.loads(line[6:])
                            text += "".join(c["text"] for c in chunk["choices"])
                            if chunk.get("usage") and not chunk["choices"]:
                                right = chunk["usage"]["completion_tokens"] == tokens and \
                                    (penalty or text == target.decode(alone[tuple(prompt)][:tokens]))
                                return "completed" if right else "wrong"
                return "lost"

            outcomes = []
            with ThreadPoolExecutor(16) as pool:
                # a warm-up first: allocators and pools grow with 16 streams in flight for the first
                # few hundred requests (~20% here), then hold; memory is watched after it
                list(pool.map(one, [plan[:3] + (False,) + plan[4:] for plan in plans[:WARM_UP]]))
                for start in range(0, total, 50):
                    outcomes += list(pool.map(one, plans[start:start + 50]))
                    health.append(httpx.get(url + "/health").status_code)
                    rss.append(_rss_bytes())
        finally:
            target.forward_batch, target.forward = forward_batch, forward
            monkeypatch.undo()
        worker = app.state.specdec["worker"]
        deadline = time.monotonic() + 10
        while worker.running or worker.engine.busy:
            assert time.monotonic() < deadline, "sequences left in the engine"
            time.sleep(0.05)
    counts = Counter(outcomes)
    assert counts["lost"] == 0 and counts["wrong"] == 0, counts
    assert counts["refused"] == sum(p[3] for p in plans) > 20 and counts["failed"] > 0, counts
    assert counts["completed"] > total // 2 and counts["dropped"] > 50, counts
    assert all(counts_at.get(site, 0) >= every for site, every in SITE_FAULTS.items()), counts_at  # each site failed
    assert set(health) == {200}, health
    assert not worker.engine.busy and not worker._sinks and worker.waiting == 0
    half = rss[len(rss) // 2:]
    assert max(half) <= 1.05 * min(half), [r >> 20 for r in rss]


def test_an_online_drafter_learns_between_requests_and_answers_stay_the_targets():
    from specdec.adapters.lora import OnlineDistiller

    target = tiny_model(0, exact_rows=True, name=NAME)
    drafter = tiny_model(1, layers=1, exact_rows=True, name="tiny-drafter", role="drafter")
    online = OnlineDistiller(drafter, min_records=1, lr=1e-2)
    assumed = AssumedCosts(drafter=0.05, slope=0.0)
    with serving(lambda: Service(target, drafter, limits=Limits(max_tokens=24), assumed=assumed), max_batch=4,
                 steer=False) as (url, _):
        client = _client(url)
        for prompt in PROMPTS[:4]:
            answer = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0)
            assert answer.choices[0].text == _alone(target, prompt, 16)
            deadline = time.monotonic() + 20
            while online.fresh and time.monotonic() < deadline:  # the worker updates once the engine is idle
                time.sleep(0.05)
    assert online.updates >= 1 and drafter.adapter is not None


def test_a_request_that_could_never_fit_the_kv_budget_is_a_400_before_the_answer_starts(tiny_pair):
    target, drafter = tiny_pair
    per_position = target.kv_bytes_per_token + drafter.kv_bytes_per_token
    budget = per_position * 100  # 100 positions of both caches
    with serving(lambda: Service(target, drafter, limits=Limits(max_tokens=8)), kv_memory=budget) as (url, _):
        client = _client(url)
        ok = client.completions.create(model=NAME, prompt=[1, 2, 3], max_tokens=8, temperature=0)
        assert ok.usage.completion_tokens == 8
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError, match="whole budget") as caught:
                client.completions.create(model=NAME, prompt=[1, 2, 3], max_tokens=60, temperature=0, stream=stream)
            assert caught.value.body["param"] == "max_tokens"
        # without drafting, only the target's cache counts: the same request fits
        plain = client.completions.create(model=NAME, prompt=[1, 2, 3], max_tokens=60, temperature=0,
                                          extra_body={"speculative": False})
        assert plain.usage.completion_tokens == 60


def test_the_default_kv_budget_is_a_share_of_the_memory_free_after_loading(tiny_pair, monkeypatch):
    from specdec.server import service as module

    target, drafter = tiny_pair
    service = Service(target, drafter)
    monkeypatch.setattr(module, "free_memory", lambda device: 10 * 2**30)
    budget, phrase = module.auto_kv_budget(service, reserved=2 * 2**30)
    assert budget == int(module.KV_SHARE * 8 * 2**30) and "of the 10.0 GiB free" in phrase
    monkeypatch.setattr(module, "free_memory", lambda device: None)
    assert module.auto_kv_budget(service)[0] is None
    assert module.free_memory("cpu") is None or module.free_memory("cpu") > 0


def test_prompts_are_tokenised_off_the_event_loop(tiny_pair):
    """Tokenising and chat-templating a long prompt is CPU work: it runs on a worker thread, so the
    event loop goes on serving other streams meanwhile (checked by thread, not by a timing)."""
    seen = []

    def load():
        service = Service(tiny_pair[0], None, limits=Limits(max_tokens=4))
        prompt_ids = service.prompt_ids

        def recorded(job):
            seen.append(threading.current_thread())
            return prompt_ids(job)
        service.prompt_ids = recorded
        return service

    with serving(load) as (url, app):
        _client(url).completions.create(model=NAME, prompt=[1, 2, 3], max_tokens=2, temperature=0)
    # the loop's default executor (asyncio's, or uvloop's where uvicorn finds it), not the loop's own thread
    assert seen and seen[0].name.startswith(("asyncio", "uvloop"))


def test_a_drafter_with_a_shorter_context_never_cuts_an_answer_silently():
    target = tiny_model(0, exact_rows=True, name=NAME, max_positions=256)
    drafter = tiny_model(1, layers=1, exact_rows=True, name="short-drafter", max_positions=64)
    with serving(lambda: Service(target, drafter, limits=Limits(max_tokens=200))) as (url, _):
        client = _client(url)
        with pytest.raises(openai.BadRequestError, match="drafter model's context of 64") as caught:
            client.completions.create(model=NAME, prompt=[1, 2, 3], max_tokens=100, temperature=0)
        assert caught.value.body["param"] == "max_tokens"
        plain = client.completions.create(model=NAME, prompt=[1, 2, 3], max_tokens=100, temperature=0,
                                          extra_body={"speculative": False})
        assert plain.usage.completion_tokens == 100 and plain.choices[0].finish_reason == "length"
        fits = client.completions.create(model=NAME, prompt=[1, 2, 3], max_tokens=40, temperature=0)
        assert fits.usage.completion_tokens == 40


def test_a_parallel_drafter_serves_the_parallel_method_and_a_plain_one_refuses_it(tiny_pair):
    """`serve --drafter parallel:DIR` makes it the default method; the real client's greedy
    completion is the target's own, and a server with a plain drafter refuses the method in one line."""
    from specdec.cli.serve import _served_method
    from conftest import tiny_parallel

    assert _served_method("default", "parallel:some/dir", None, "auto") == ("parallel", False, None)
    target, plain = tiny_pair
    job = parse_job({"prompt": [1, 2], "speculative": {"method": "parallel"}}, False, NAME, SpecConfig())
    with pytest.raises(BadRequest, match="parallel drafter") as caught:
        Service(target, plain).requests(job, [1, 2], 4)
    assert caught.value.param == "speculative.method"
    drafter = tiny_parallel(1, vocab=16, k=3, exact_rows=True)
    with serving(lambda: Service(target, drafter, default=SpecConfig("parallel", gamma_max=20),
                                 default_method="parallel",
                                 limits=Limits(max_tokens=24)), max_batch=4) as (url, _):
        whole = _client(url).completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=16, temperature=0)
        assert whole.choices[0].text == _alone(target, PROMPTS[2], 16)
        assert whole.usage.model_extra["speculative"]["method"] == "parallel"
