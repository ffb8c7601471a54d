"""The server's KV budget and its tenants (issue 65): the engine charges what the slabs really
grow to, a draft never writes past the room its charge keeps, `serve`'s default budget reaches the
engine; one API key's clients cannot evict another key's caches, `--online` is refused with
several keys, and `/metrics` asks for a key where keys are set.
"""

from __future__ import annotations

import time
from functools import partial

import httpx
import openai
import pytest
import torch
from typer.testing import CliRunner

from specdec.decoding import sequence as generate
from specdec.backends.prompts import Held, PromptStore
from specdec.backends.slab import SLAB_MIN, SlabLayer, slab_capacity
from specdec.cli import app as cli
from specdec.drafters import make_tree_drafter
from specdec.engine import Engine, Request
from specdec.engine.scheduler import kv_need, kv_positions
from specdec.errors import SpecdecError
from specdec.server import service as service_module
from specdec.server.service import Limits, Service

from conftest import tiny_model
from test_server import NAME, _client, live, serving


@pytest.fixture(scope="module")
def tiny_pair():
    return tiny_model(0, exact_rows=True, name=NAME), tiny_model(1, layers=1, exact_rows=True, name="tiny-drafter")


# --- item 10: the KV budget charges what the caches really take ---

def test_a_slab_grows_on_its_reserves_ladder_as_slab_capacity_says():
    """Written a pass at a time past its reserve, a slab holds what `slab_capacity` says (the
    reserve doubled), also when it started from a restored prompt shorter than the reserve."""
    for start, reserve, passes in ((0, 100, [7] * 60), (70, 100, [1] * 200), (30, 50, [40, 40, 40])):
        layer = SlabLayer()
        if start:  # a prompt cache's entries, restored before the reserve is known
            layer.update(torch.zeros(1, 1, start, 2), torch.zeros(1, 1, start, 2))
        layer.reserve = reserve
        most = start
        for width in passes:
            layer.update(torch.zeros(1, 1, width, 2), torch.zeros(1, 1, width, 2))
            most += width
            assert layer.capacity <= slab_capacity(most, reserve)
        assert layer.capacity == slab_capacity(most, reserve)
    assert slab_capacity(10, 0) == SLAB_MIN and slab_capacity(250, 100) == 400 and slab_capacity(100, 100) == 100


def test_the_engine_charges_slab_growth_and_no_sequence_holds_more_than_its_charge(tiny_pair, monkeypatch):
    """Past RESERVE_MAX positions a sequence's slabs double: the engine's charge is what they grow
    to, and the slabs a long generation really allocates (target and drafter model) stay within it."""
    monkeypatch.setattr(generate, "RESERVE_MAX", 64)
    target, drafter = tiny_pair
    per_position = target.kv_bytes_per_token + drafter.kv_bytes_per_token
    request = Request([1, 2, 3, 4], drafter, max_new_tokens=150, eos_token_ids=[])
    positions = kv_positions(4, 150, True)  # 218: the slabs grow 64 -> 128 -> 256
    assert kv_need(positions, [target, drafter]) == 256 * per_position
    engine = Engine(target, max_batch=1, kv_memory=256 * per_position)
    request_id = engine.add(request)
    peak, finished = 0, {}
    for _ in range(400):
        if not engine.busy:
            break
        finished.update(engine.step().finished)
        decoding = engine.scheduler.running.get(request_id)
        if decoding is not None:
            held = [layer.capacity for layer in decoding.cache.layers]
            drafted = [layer.capacity for layer in decoding.drafter.cache.layers]
            peak = max(peak, max(held) * target.kv_bytes_per_token + max(drafted) * drafter.kv_bytes_per_token)
            assert peak <= engine.scheduler.reserved[request_id]
    assert not engine.busy and len(finished[request_id].tokens) == 150
    assert peak > positions * per_position  # it did grow past the positions themselves


def test_the_engine_refuses_and_queues_by_the_real_charge(tiny_pair, monkeypatch):
    monkeypatch.setattr(generate, "RESERVE_MAX", 64)
    target, drafter = tiny_pair
    per_position = target.kv_bytes_per_token + drafter.kv_bytes_per_token
    positions = kv_positions(4, 150, True)
    # room for the positions of one request, not for what its slabs grow to: refused when added
    with pytest.raises(SpecdecError, match="whole budget"):
        Engine(target, kv_memory=positions * per_position).add(Request([1, 2, 3, 4], drafter, max_new_tokens=150))
    # room for two requests' positions, one's slabs: the second waits for the first
    engine = Engine(target, max_batch=2, kv_memory=2 * positions * per_position)
    ids = [engine.add(Request([1, 2, 3, 4], drafter, max_new_tokens=150, eos_token_ids=[])) for _ in range(2)]
    finished = dict(engine.step().finished)
    assert list(engine.scheduler.reserved) == [ids[0]] and [r.id for r in engine.waiting] == [ids[1]]
    for _ in range(800):
        if not engine.busy:
            break
        finished.update(engine.step().finished)
        assert sum(engine.scheduler.reserved.values()) <= engine.kv_memory
    assert sorted(finished) == ids


def test_a_tree_wider_than_the_draft_room_is_refused_under_a_budget(tiny_pair):
    target, drafter = tiny_pair
    budget = 10**9
    wide = lambda: make_tree_drafter("lookup", max_nodes=generate.DRAFT_ROOM + 1)  # noqa: E731
    with pytest.raises(SpecdecError, match="tree nodes"):
        Engine(target, kv_memory=budget).add(Request([1, 2, 3], wide, max_new_tokens=4))
    fits = lambda: make_tree_drafter("lookup", max_nodes=generate.DRAFT_ROOM)  # noqa: E731
    engine = Engine(target, kv_memory=budget)
    engine.add(Request([1, 2, 3], fits, max_new_tokens=4))
    assert len(engine.run()) == 1
    Engine(target).add(Request([1, 2, 3], wide, max_new_tokens=4))  # no budget: nothing to overrun


def test_the_server_refuses_tree_nodes_above_the_draft_room(tiny_pair):
    target, drafter = tiny_pair
    with serving(lambda: Service(target, drafter, limits=Limits(max_tokens=4)), max_batch=2) as (url, _):
        body = {"prompt": [1, 2], "max_tokens": 2, "temperature": 0,
                "speculative": {"method": "tree", "tree_nodes": generate.DRAFT_ROOM + 1}}
        refused = httpx.post(url + "/v1/completions", json=body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "speculative.tree_nodes"
        body["speculative"]["tree_nodes"] = generate.DRAFT_ROOM
        assert httpx.post(url + "/v1/completions", json=body).status_code == 200
    for flag in ("--tree-nodes", "--gamma-max"):
        result = CliRunner().invoke(cli, ["serve", "--target", "no-such-model", flag, str(generate.DRAFT_ROOM + 1)])
        assert result.exit_code == 1 and f"{flag} must be <= {generate.DRAFT_ROOM}" in result.output


def test_serves_default_auto_budget_reaches_the_engine(tiny_pair, monkeypatch):
    """`serve` with no --kv-memory: the budget is KV_SHARE of the memory free once the models are
    in, less the prompt caches, and it is the engine's: a request beyond it is a 400."""
    from specdec.cli import serve as serve_module

    target, drafter = tiny_pair
    per_position = target.kv_bytes_per_token + drafter.kv_bytes_per_token
    prompt_caches = 2 * 256 * 2**20  # --prompt-cache-memory's default, in the target and the drafter
    free = prompt_caches + int(200 * per_position / service_module.KV_SHARE)  # leaves room for 200 positions
    monkeypatch.setattr(service_module, "free_memory", lambda device: free)
    monkeypatch.setattr(serve_module, "_service_loader",
                        lambda *args: lambda: Service(target, drafter, limits=Limits(max_tokens=8)))
    apps = []
    monkeypatch.setattr(serve_module, "_run_until_stopped", lambda make_app, *args: apps.append(make_app(None)))
    result = CliRunner().invoke(cli, ["serve", "--target", "no-such-model"])
    assert result.exit_code == 0, result.output
    with live(apps[0]) as url:
        budget = apps[0].state.specdec["worker"].engine.kv_memory
        assert budget == int(service_module.KV_SHARE * (free - prompt_caches))
        client = _client(url)
        assert client.completions.create(model=NAME, prompt=[1, 2], max_tokens=8, temperature=0).usage \
            .completion_tokens == 8
        with pytest.raises(openai.BadRequestError, match="whole budget"):
            client.completions.create(model=NAME, prompt=[1, 2], max_tokens=150, temperature=0)


# --- item 11: tenants ---

def test_online_learning_is_refused_with_several_api_keys(tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("alpha\nbeta\n")
    result = CliRunner().invoke(cli, ["serve", "--target", "no-such-model", "--online", "--api-key-file", str(keys)])
    assert result.exit_code == 1 and "not with several API keys" in result.output and "Traceback" not in result.output


def test_one_keys_salts_never_evict_another_keys_suffix_caches(tiny_pair):
    """Each API key keeps the suffix caches of its own MAX_SALTS most recent salts: any number of
    fresh salts under one key leaves another key's caches as they were, and bounds its own."""
    service = Service(tiny_pair[0], None, suffix_cache_tokens=1000)
    kept = service.suffix_cache("key0/mine", "key0")
    for i in range(3 * service_module.MAX_SALTS):
        service.suffix_cache(f"key1/fresh-{i}", "key1")
    assert service.suffix_cache("key0/mine", "key0") is kept
    first = service.suffix_cache("key1/fresh-0", "key1")
    assert len(service._suffix_caches["key1"]) == service_module.MAX_SALTS
    for i in range(service_module.MAX_SALTS):
        service.suffix_cache(f"key1/again-{i}", "key1")
    assert service.suffix_cache("key1/fresh-0", "key1") is not first  # its own oldest went


def test_a_key_cannot_push_another_keys_prompts_out_of_the_prompt_cache():
    """The prompt store drops the least recently used prompt of the tenant holding the most: one
    key sending many prompts drops its own, not another key's smaller holding."""

    class Cache:
        def __init__(self, salt: str, tokens: list[int]):
            layer = SlabLayer()
            layer.update(torch.zeros(1, 1, len(tokens), 2), torch.zeros(1, 1, len(tokens), 2))
            self.layers, self.held = [layer], Held(list(tokens), [len(tokens)], salt)

    store = PromptStore(300)
    store.keep(Cache("key0/a", list(range(100))))
    for i in range(20):  # key1 floods with prompts of its own
        store.keep(Cache(f"key1/{i}", [i] * 60))
        assert store.held_tokens <= 300
    salts = [held.salt for held, _ in store._entries.values()]
    assert "key0/a" in salts and sum(salt.startswith("key1/") for salt in salts) == 3
    store.keep(Cache("key0/b", [7] * 50))  # key0 would hold 150, key1 holds 180: key1's oldest goes
    salts = [held.salt for held, _ in store._entries.values()]
    assert {"key0/a", "key0/b"} <= set(salts) and sum(salt.startswith("key1/") for salt in salts) == 2
    store.keep(Cache("key0/c", [8] * 100))  # now key0 would hold the most: its own oldest goes
    salts = [held.salt for held, _ in store._entries.values()]
    assert "key0/a" not in salts and {"key0/b", "key0/c"} <= set(salts) and store.held_tokens <= 300


def test_a_servers_keys_each_keep_their_suffix_caches(tiny_pair):
    """Through the app: a request under the second key reaches the service's cache of that key."""
    target, drafter = tiny_pair
    service = Service(target, drafter, limits=Limits(max_tokens=4))
    with serving(lambda: service, api_key=["alpha", "beta"]) as (url, _):
        for key in ("alpha", "beta"):
            _client(url, api_key=key).completions.create(model=NAME, prompt=[1, 2, 3], max_tokens=4, temperature=0,
                                                         extra_body={"speculative": {"method": "suffix"},
                                                                     "cache_salt": "s"})
    assert set(service._suffix_caches) == {"key0", "key1"}
    assert list(service._suffix_caches["key1"]) == ["key1/s"]


def test_metrics_ask_for_a_key_where_keys_are_set_unless_public(tiny_pair):
    target = tiny_pair[0]
    with serving(lambda: Service(target, None), api_key=["alpha", "beta"]) as (url, _):
        refused = httpx.get(url + "/metrics")
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url + "/metrics", headers={"Authorization": "Bearer nope"}).status_code == 401
        shown = httpx.get(url + "/metrics", headers={"Authorization": "Bearer beta"})
        assert shown.status_code == 200 and "specdec:" in shown.text
    with serving(lambda: Service(target, None), api_key="alpha", metrics_public=True) as (url, _):
        assert httpx.get(url + "/metrics").status_code == 200
    with serving(lambda: Service(target, None)) as (url, _):  # no keys: open, as before
        assert httpx.get(url + "/metrics").status_code == 200
    apps = []
    from specdec.cli import serve as serve_module

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(serve_module, "_service_loader", lambda *args: lambda: Service(target, None))
        patch.setattr(serve_module, "_run_until_stopped", lambda make_app, *args: apps.append(make_app(None)))
        result = CliRunner().invoke(cli, ["serve", "--target", "no-such-model", "--drafter", "none", "--method", "ar",
                                          "--api-key", "alpha", "--metrics-public", "--kv-memory", "none"])
    assert result.exit_code == 0, result.output
    with live(apps[0]) as url:
        assert httpx.get(url + "/metrics").status_code == 200
        assert httpx.get(url + "/v1/models").status_code == 401


def test_a_newcomer_heavier_than_every_tenant_evicts_nobody_else():
    """A prompt whose tenant would then hold the most, while it keeps nothing yet, is not kept:
    another tenant's smaller holding stays."""
    class Cache:
        def __init__(self, salt: str, tokens: list[int]):
            layer = SlabLayer()
            layer.update(torch.zeros(1, 1, len(tokens), 2), torch.zeros(1, 1, len(tokens), 2))
            self.layers, self.held = [layer], Held(list(tokens), [len(tokens)], salt)

    store = PromptStore(1000)
    store.keep(Cache("key1/a", [1] * 600))
    store.keep(Cache("key0/b", [2] * 900))
    assert [held.salt for held, _ in store._entries.values()] == ["key1/a"]


def test_suffix_caches_are_bounded_in_all_and_a_clients_salt_names_no_tenant(tiny_pair):
    service = Service(tiny_pair[0], None, suffix_cache_tokens=1000)
    for key in range(8):
        for i in range(service_module.MAX_SALTS):
            service.suffix_cache(f"key{key}/{i}", f"key{key}")
    assert sum(map(len, service._suffix_caches.values())) <= service_module.MAX_SUFFIX_CACHES
    assert min(map(len, service._suffix_caches.values())) >= service_module.MAX_SUFFIX_CACHES // 8 - 1
    from specdec.backends.prompts import salt_tenant

    # the server prefixes every salt with its key's tenant ("" without keys): "a/b" sent by a
    # keyless client is "/a/b", the keyless tenant's, not a tenant "a" of its own
    assert salt_tenant("/a/b") == "" and salt_tenant("key1/a/b") == "key1"
