"""Prompt caches on transformers' weights (backends/prompts.py): a later prompt reuses an earlier
one's entries only where they came from the very calls it would be fed in, and every output and
log-probability equals a cache-free run's. llama.cpp's prompt cache: tests/backends/test_llamacpp.py."""

from __future__ import annotations

import openai
import pytest
import torch

from specdec import SpecdecError, autoregressive_generate, speculative_generate
from specdec.backends.cache import cache_length
from specdec.backends.prompts import Held, reusable
from specdec.engine import generate_many
from specdec.backends.prompts import PREFILL_CHUNK
from specdec.server.service import Limits, Service

from conftest import tiny_model
from test_rows import _ids, qwen_like
from test_server import serving

VOCAB = 4096


def _fed(prompt: list[int], chunk: int = PREFILL_CHUNK) -> Held:
    """The record of a prompt fed as `Decoding.prefill_step` feeds it."""
    held, start = Held([], []), 0
    while start < len(prompt) - 1:
        end = min(start + chunk, len(prompt) - 1)
        held.fed(prompt[:end + 1], start)
        start = end
    return held


def test_only_whole_feeding_calls_are_reusable():
    long = _ids(700, VOCAB, 1)
    held = _fed(long)
    assert held.calls == [256, 512, 699] and held.tokens == long[:699]
    assert reusable(held, long, PREFILL_CHUNK) == 699  # the same prompt: all of it
    assert reusable(held, long + [5], PREFILL_CHUNK) == 512  # longer: its third call ends elsewhere
    assert reusable(held, long[:300] + [1, 2, 3], PREFILL_CHUNK) == 256
    assert reusable(held, [7] + long[1:], PREFILL_CHUNK) == 0
    assert reusable(held, long[:200], PREFILL_CHUNK) == 0  # a shorter prompt's one call ends at 199
    after = Held(list(held.tokens), list(held.calls))
    after.fed(long[:10], 800)  # a feed after something else (output tokens): not a prompt call
    assert after.calls == held.calls


def _run(model, prompt, **options):
    result = autoregressive_generate(prompt, model, max_new_tokens=6, logprobs=1, eos_token_ids=[], **options)
    return result.stats.cached_prompt_tokens, result.tokens, [(t.token, t.logprob) for t in result.logprobs]


def test_the_prompt_cache_takes_whole_calls_and_stays_exact():
    """All of a repeated prompt, one chunk of a prompt that shares 300 ids, nothing of one that
    differs in its first: outputs and log-probabilities equal the cache-free model's. A store of
    one long prompt's size drops the least recently used."""
    model = qwen_like(torch.bfloat16, exact_rows=True, layers=1)
    long = _ids(600, VOCAB, 2)
    shared, other = long[:300] + _ids(40, VOCAB, 3), _ids(5, VOCAB, 4) + long[:300]
    expect = {name: _run(model, prompt)[1:] for name, prompt in (("long", long), ("shared", shared), ("other", other))}
    model.use_prompt_cache(700 * model.kv_bytes_per_token)  # room for one long prompt and a short one
    for name, prompt, taken in (("long", long, 0), ("long", long, 599), ("shared", shared, 256),
                                ("other", other, 0), ("long", long, 256)):  # the long one's copy was dropped
        cached, *rest = _run(model, prompt)
        assert cached == taken and tuple(rest) == expect[name], name
    assert model.prompt_store.held_tokens <= 700


def test_batched_and_speculative_runs_reuse_prompts_exactly():
    """The engine's batch and a drafter's chain take the kept entries too, and give each prompt's
    greedy AR output alone."""
    target = qwen_like(torch.bfloat16, exact_rows=True, layers=1)
    drafter = qwen_like(torch.bfloat16, exact_rows=True, layers=1, seed=1)
    prompts = [_ids(300, VOCAB, 5)[:290] + _ids(8, VOCAB, k) for k in range(6, 10)]
    alone = [autoregressive_generate(p, target, max_new_tokens=8, eos_token_ids=[]).tokens for p in prompts]
    target.use_prompt_cache(2**26)
    first = generate_many(prompts[:1], target, None, max_new_tokens=8, eos_token_ids=[])
    results = generate_many(prompts, target, drafter, max_batch=4, max_new_tokens=8, gamma=3, eos_token_ids=[])
    assert first[0].stats.cached_prompt_tokens == 0
    assert [r.stats.cached_prompt_tokens for r in results] == [297, 256, 256, 256]
    assert [r.tokens for r in [first[0]] + results] == [alone[0]] + alone
    again = speculative_generate(prompts[2], target, drafter, gamma=3, max_new_tokens=8, eos_token_ids=[])
    assert again.stats.cached_prompt_tokens == 297 and again.tokens == alone[2]


def test_a_prompt_cache_needs_row_exact_passes():
    model = qwen_like(torch.float32, exact_rows=False, layers=1)
    with pytest.raises(SpecdecError, match="row-exact passes"):
        model.use_prompt_cache(2**20)
    model.use_prompt_cache(0)
    assert not model.prompt_cache


def test_the_server_reports_cached_prompt_tokens():
    target = tiny_model(0, exact_rows=True, name="tiny")
    target.use_prompt_cache(2**20)
    prompt = _ids(40, 16, 9)
    with serving(lambda: Service(target, None, limits=Limits(max_tokens=8)), max_batch=2, steer=False) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        replies = [client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
                   for _ in range(2)]
    assert replies[0].choices[0].text == replies[1].choices[0].text
    assert [r.usage.prompt_tokens_details.cached_tokens for r in replies] == [0, 39]


def test_a_cache_salt_keeps_tenants_apart_in_the_prompt_cache():
    """A prompt kept under one salt serves only requests of that salt: another tenant sees no
    cached tokens (it cannot learn what was sent), the same tenant reuses it; outputs never change."""
    target = tiny_model(0, exact_rows=True, name="tiny")
    target.use_prompt_cache(2**20)
    prompt = _ids(40, 16, 9)
    with serving(lambda: Service(target, None, limits=Limits(max_tokens=8)), max_batch=2, steer=False) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)

        def ask(salt):
            extra = {} if salt is None else {"extra_body": {"cache_salt": salt}}
            return client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, **extra)
        replies = [ask(salt) for salt in ("alice", "bob", None, "alice", "bob", None)]
        refused = client.with_options(max_retries=0).completions.with_raw_response
        with pytest.raises(openai.BadRequestError, match="cache_salt"):
            refused.create(model="tiny", prompt=prompt, max_tokens=8, extra_body={"cache_salt": 7})
    assert len({r.choices[0].text for r in replies}) == 1
    assert [r.usage.prompt_tokens_details.cached_tokens for r in replies] == [0, 0, 0, 39, 39, 39]
    assert reusable(_fed(prompt), prompt, PREFILL_CHUNK, "alice") == 0  # the check itself: salts must match


def test_each_api_key_is_a_tenant_of_its_own():
    target = tiny_model(0, exact_rows=True, name="tiny")
    target.use_prompt_cache(2**20)
    prompt = _ids(40, 16, 9)
    with serving(lambda: Service(target, None, limits=Limits(max_tokens=8)), max_batch=2, steer=False,
                 api_key=["key-a", "key-b"]) as (url, _):
        def ask(key):
            client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)
            return client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
        cached = [ask(key).usage.prompt_tokens_details.cached_tokens for key in ("key-a", "key-b", "key-a", "key-b")]
    assert cached == [0, 0, 39, 39]


def test_a_drafter_model_keeps_and_reuses_prompts_too():
    """A drafter model with a prompt cache feeds a prompt in the target's chunks, keeps it, and
    starts a later prompt from the whole chunks it shares; outputs (greedy, and sampled with a
    seed, whose drafts hang on the drafter's values) equal a cache-free drafter's."""
    from specdec import Sampler

    target = qwen_like(torch.bfloat16, exact_rows=True, layers=1)
    drafter = qwen_like(torch.bfloat16, exact_rows=True, layers=1, seed=1)
    prompts = [_ids(300, VOCAB, 5)[:290] + _ids(8, VOCAB, k) for k in (10, 11)]

    def runs():
        return [speculative_generate(p, target, drafter, gamma=3, max_new_tokens=8, eos_token_ids=[], **options).tokens
                for p in prompts for options in ({}, {"sampler": Sampler(1.0), "seed": 3})]
    expect = runs()
    drafter.use_prompt_cache(2**26)
    fed = []
    prefill = drafter.prefill
    drafter.prefill = lambda prompt, cache: fed.append((cache_length(cache), len(prompt) - 1)) or prefill(prompt, cache)
    assert runs() == expect
    # the drafter first sees the prompt and the target's first token (298 ids + 1 pending): the
    # first prompt goes in two calls; its sampled run reuses both, the second prompt (290 ids
    # shared) the first and feeds the rest, and its sampled run reuses its own two
    assert fed == [(0, 256), (256, 298), (256, 298)]
    assert drafter.prompt_store.held_tokens > 0


def test_loading_with_a_prompt_cache_gives_drafter_models_one(tmp_path):
    """`models.load(..., prompt_cache=...)`, as `specdec serve` loads both models: a row-exact
    drafter model gets a store of its own, a drafter without row-exact passes none."""
    from specdec import load
    from test_models import _tiny_checkpoint

    folder = _tiny_checkpoint(tmp_path)
    kept = load(folder, dtype="fp32", role="drafter", exact_rows=True, prompt_cache=True)
    plain = load(folder, dtype="fp32", role="drafter", exact_rows=False, prompt_cache=True)
    assert kept.prompt_cache and kept.prompt_store.tokens > 0 and not plain.prompt_cache
