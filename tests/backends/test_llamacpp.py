"""The llama.cpp backend (backends/llamacpp.py) and llama.cpp's peers in the bench (bench/llama_peers.py).

llama-cpp-python is an optional extra (`pip install -e .[peers]`): without it these tests skip,
all but the one that checks the error a user gets then.
"""

from __future__ import annotations

import sys

import pytest
import torch

from specdec.models import catalogue as registry
from specdec.errors import SpecdecError
from specdec.models.loading import load

NEEDS_LLAMA = pytest.mark.skipif(
    "llama_cpp" not in sys.modules and __import__("importlib").util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed (optional: pip install -e '.[peers]')")


def _installed_or_skip(*names: str) -> None:
    for name in names:
        if not registry.is_installed(name):
            pytest.skip(f"{name} is not installed (run `make models`)")


def test_without_llama_cpp_python_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` raise ImportError
    with pytest.raises(SpecdecError, match=r"llama-cpp-python.*pip install -e '\.\[peers\]'"):
        load("smollm2-135m", dtype="gguf")
    from specdec.backends.llamacpp import available

    assert not available()


def test_31_rows_a_call_only_on_the_patched_x86_build(monkeypatch, tmp_path):
    """A target feeds 31 scored rows a call only where `make peers`' marker sits beside the
    llama_cpp module (its Q4_K GEMV then rounds as the GEMM does, its tiled matmul starts at 32
    rows) and the CPU is x86, whose kernel the patch changes; 3 elsewhere (below the stock GEMM's
    4 rows)."""
    import platform
    import types

    from specdec.backends import llamacpp

    fake = types.ModuleType("llama_cpp")
    fake.__file__ = str(tmp_path / "__init__.py")
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    monkeypatch.setattr(llamacpp, "_silence", lambda module: None)
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    assert llamacpp.rows_per_call() == llamacpp.ROWS_PER_CALL == 3
    (tmp_path / llamacpp.PATCH_MARKER).write_text("patches/llama.cpp-row-exact.patch\n")
    assert llamacpp.rows_per_call() == llamacpp.PATCHED_ROWS_PER_CALL == 31
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert llamacpp.rows_per_call() == 3


@pytest.fixture(scope="module")
def gguf_pair():
    _installed_or_skip(registry.DEFAULT_TARGET, registry.DEFAULT_DRAFTER)
    return load(registry.DEFAULT_TARGET, dtype="gguf"), load(registry.DEFAULT_DRAFTER, dtype="gguf", role="drafter")


@pytest.fixture(scope="module")
def gguf_batched(gguf_pair):
    """The same pair holding 4 sequences each (the engine's and the server's batches), the
    target with its prompt cache on (as `specdec serve` loads it)."""
    from specdec.backends.llamacpp import LlamaCppModel

    target, drafter = gguf_pair
    # 2,048 positions a sequence: a few hundred MB of KV cache, where the defaults would take GBs
    return (LlamaCppModel(target.path, target.tokenizer, target.name, eos_token_ids=target.eos_token_ids,
                          context=2048, sequences=4, prompt_cache=True),
            LlamaCppModel(drafter.path, drafter.tokenizer, drafter.name, role="drafter", context=2048, sequences=4))


@NEEDS_LLAMA
def test_gguf_model_reads_like_the_transformers_one(gguf_pair):
    target, drafter = gguf_pair
    assert target.weights == "gguf" and target.exact_rows and not drafter.exact_rows
    assert target.vocab_size == drafter.vocab_size == 151936
    assert 151645 in target.eos_token_ids  # <|im_end|>, from the model's generation config
    ids = target.encode("def quicksort(arr):")
    assert target.decode(ids) == "def quicksort(arr):"


def _rows(model, prefix: list[int], tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of `tokens` after `prefix`: from one pass, and from one-token passes."""
    cache = model.new_cache()
    model.forward(model.prefill(prefix, cache), cache)
    start = cache.get_seq_length()
    together = model.forward(tokens, cache, num_logits=len(tokens))
    cache.crop(start)
    alone = torch.stack([model.forward([t], cache)[0] for t in tokens])
    return together, alone


@NEEDS_LLAMA
def test_target_rows_are_exact_and_the_check_can_fail(gguf_pair):
    """Each row of a 40-token pass is bit for bit a 1-token pass, after a prefix of over 512
    tokens (where flash attention would split a 1-row query's keys across threads with an f16
    cache). The target feeds scored tokens 3 a call on a stock build; 31 on the patched one, so
    31 + 9: rows of ggml's 4-row GEMM and of its GEMV side by side, in both calls. The same model
    with exact_rows off feeds all 40 in one call, where ggml's tiled K-quant matmul takes over
    (from 32 rows patched, 8 stock), and differs: what makes the first assertion mean something."""
    from specdec.backends.llamacpp import row_exact_build

    target, _ = gguf_pair
    assert target.rows_per_call == (31 if row_exact_build() else 3)
    prefix = _long_prefix(target)
    assert len(prefix) > 600
    tokens = target.encode("    e = np.exp(x - np.max(x, axis=-1, keepdims=True))\n"
                           "    return e / e.sum(axis=-1, keepdims=True)\n\n\ndef relu(x):\n    return np.maximum(x, 0)\n")
    assert len(tokens) >= 40
    tokens = tokens[:40]
    together, alone = _rows(target, prefix, tokens)
    assert torch.equal(together, alone)
    target.exact_rows = False
    try:
        together, alone = _rows(target, prefix, tokens)
    finally:
        target.exact_rows = True
    assert not torch.equal(together, alone)


@NEEDS_LLAMA
def test_crop_then_forward_equals_a_fresh_pass(gguf_pair):
    """Rolled-back positions leave no trace: after scoring 3 tokens and cropping them, the next
    pass equals one on a cache that never saw them."""
    target, _ = gguf_pair
    ids = target.encode("def add(a, b):\n    return a + b\n")
    prefix, rest = ids[:-2], ids[-2:]
    results = []
    for detour in ([100, 200, 300], []):
        cache = target.new_cache()
        target.forward(target.prefill(prefix, cache), cache)
        if detour:
            target.forward(detour, cache, num_logits=3)
            cache.crop(len(prefix))
        results.append(target.forward(rest, cache, num_logits=2))
    assert torch.equal(*results)


@NEEDS_LLAMA
def test_greedy_speculative_is_token_identical_to_greedy_ar_on_gguf(gguf_pair, humaneval_prompts):
    """The default pair on its GGUF weights: model drafter (fixed γ and cost-sized), prompt lookup,
    and a transformers int8 drafter beside the GGUF target; rejections asserted."""
    from specdec import autoregressive_generate, speculative_generate
    from specdec.drafters import LookupDrafter
    from specdec.sizing.schedules import make_schedule

    target, drafter = gguf_pair
    torch_drafter = load(registry.DEFAULT_DRAFTER, role="drafter", device="cpu")
    prompts = [target.encode(humaneval_prompts[2]), target.encode("Write a short poem about rain.", chat=True)]
    rejections = 0
    for ids in prompts:
        reference = autoregressive_generate(ids, target, max_new_tokens=48).tokens
        for proposer, schedule in [(drafter, None), (drafter, make_schedule("cost", 5, 1, 20)),
                                   (LookupDrafter(), None), (torch_drafter, None)]:
            result = speculative_generate(ids, target, proposer, gamma=6, max_new_tokens=48, schedule=schedule)
            assert result.tokens == reference
            rejections += sum(step.num_accepted < len(step.draft_tokens) for step in result.steps)
    assert rejections > 0


def _long_prefix(model) -> list[int]:
    return model.encode("import numpy as np\n\n" + "".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n\n"
                                                              for i in range(40)) + "def softmax(x):\n")


@NEEDS_LLAMA
def test_batched_rows_are_each_sequences_own_and_the_check_can_fail(gguf_pair, gguf_batched):
    """Four sequences (one past 600 cached tokens) feed 8, 12, 9 and 14 tokens in one
    `forward_batch`, 3 rows a call across sequences (31 on the patched build): every row is bit for
    bit a 1-token pass of its sequence on a one-sequence model. With exact_rows off the same batch
    goes in one 43-row call. llama.cpp splits a call into pieces with as many tokens from each
    sequence (the first here: 8 each, 32 rows; 1, 12, 9 and 14 tokens gave no piece that wide and
    no difference), where ggml's tiled K-quant matmul takes over (from 32 rows patched, 8 stock),
    and differs: what makes the first assertion mean something. Sequences moved into freed streams
    (`_compact`) stay exact too."""
    from specdec.backends import Segment

    single, _ = gguf_pair
    target, _ = gguf_batched
    prefixes = [_long_prefix(target)] + [target.encode(t) for t in ("def add(a, b):", "class Stack:\n", "x = [1, 2]")]
    words = target.encode("    return a + b\n\n\nclass Stack:\n    def __init__(self):\n        self.items = []\n\n"
                          "    def push(self, item):\n        self.items.append(item)\n\n    def pop(self):\n"
                          "        return self.items.pop()\n")
    tokens = [words[:8], words[8:20], words[20:29], words[29:43]]
    assert sum(map(len, tokens)) == 43
    alone = []
    for prefix, new in zip(prefixes, tokens):
        cache = single.new_cache()
        single.forward(single.prefill(prefix, cache), cache)
        alone.append(torch.cat([single.forward([t], cache) for t in new]))

    caches = [target.new_cache() for _ in prefixes]
    for prefix, cache in zip(prefixes, caches):
        target.forward(target.prefill(prefix, cache), cache)
    segments = [Segment(new, cache, len(new)) for new, cache in zip(tokens, caches)]
    assert all(torch.equal(a, b) for a, b in zip(alone, target.forward_batch(segments)))
    for prefix, cache in zip(prefixes, caches):
        cache.crop(len(prefix))
    target.exact_rows = False
    try:
        assert not all(torch.equal(a, b) for a, b in zip(alone, target.forward_batch(segments)))
    finally:
        target.exact_rows = True
    # two sequences end: the later two move into their streams (whole-stream copies) and still
    # compute their own rows
    for prefix, cache in zip(prefixes, caches):
        cache.crop(len(prefix))
    del segments, caches[:2]
    assert [c.seq for c in caches] == [2, 3]
    moved = target.forward_batch([Segment(new, cache, len(new)) for new, cache in zip(tokens[2:], caches)])
    assert [c.seq for c in caches] == [1, 0]
    assert all(torch.equal(a, b) for a, b in zip(alone[2:], moved))


@NEEDS_LLAMA
def test_the_engine_batches_gguf_sequences_exactly(gguf_pair, gguf_batched, humaneval_prompts):
    """Four prompts through the engine at once on the GGUF pair: greedy AR and the drafter's chain
    give each prompt's greedy AR output alone, token for token (rejections asserted), and a seeded
    sampled chain gives what the same seed gives alone."""
    from specdec import autoregressive_generate, speculative_generate
    from specdec.engine import generate_many
    from specdec.core.samplers import Sampler

    single, single_drafter = gguf_pair
    target, drafter = gguf_batched
    prompts = [target.encode(p) for p in humaneval_prompts[:3]] + [target.encode("Write a haiku.", chat=True)]
    alone = [autoregressive_generate(ids, single, max_new_tokens=16).tokens for ids in prompts]
    for proposer in (None, drafter):
        results = generate_many(prompts, target, proposer, max_batch=4, max_new_tokens=16, gamma=4)
        assert [r.tokens for r in results] == alone
    assert sum(s.num_accepted < len(s.draft_tokens) for r in results for s in r.steps) > 0
    sampler = Sampler(temperature=1.0)
    seeded = generate_many(prompts, target, drafter, max_batch=4, max_new_tokens=16, gamma=4, sampler=sampler,
                           seeds=[11, 12, 13, 14])
    for ids, seed, result in zip(prompts, [11, 12, 13, 14], seeded):
        own = speculative_generate(ids, single, single_drafter, gamma=4, max_new_tokens=16, sampler=sampler, seed=seed)
        assert result.tokens == own.tokens


@NEEDS_LLAMA
def test_gguf_sequences_are_bounded_and_given_back(gguf_pair, gguf_batched):
    from specdec.backends import Segment
    from specdec.engine import Engine, Request

    single, single_drafter = gguf_pair
    target, _ = gguf_batched
    caches = [target.new_cache() for _ in range(4)]
    with pytest.raises(SpecdecError, match="all 4 sequences are in use"):
        target.new_cache()
    seq = caches[1].seq
    del caches[1]  # its sequence is emptied and free again
    cache = target.new_cache()
    assert cache.seq == seq and cache.get_seq_length() == 0
    with pytest.raises(SpecdecError, match="a cache of its own"):
        target.forward_batch([Segment([1], cache), Segment([2], cache)])
    del caches, cache
    with pytest.raises(SpecdecError, match="holds 4 sequence.*load it with sequences=5"):
        Engine(target, max_batch=5)
    with pytest.raises(SpecdecError, match="holds 1 sequence.*fewer than max_batch=2"):
        Engine(single, max_batch=2)
    with pytest.raises(SpecdecError, match=f"the drafter {single_drafter.name} holds 1 sequence"):
        Engine(target, max_batch=4).add(Request(target.encode("x = 1"), single_drafter))


@NEEDS_LLAMA
def test_the_prompt_cache_takes_whole_feeding_calls_and_stays_exact(gguf_pair, gguf_batched):
    """A finished prompt's entries serve a later prompt only where they came from the very calls
    that prompt would be fed in (256-id chunks): all of them for the same prompt, one chunk for a
    prompt that shares 300 ids, none for one that differs in its first chunk. Every output, with
    the target's log-probabilities, equals a cache-free model's."""
    from specdec import autoregressive_generate
    from specdec.backends.prompts import PREFILL_CHUNK

    single, _ = gguf_pair
    cached, _ = gguf_batched  # its target keeps finished prompts
    long = _long_prefix(single)
    assert len(long) > 2 * PREFILL_CHUNK
    shared = long[:300] + single.encode("\ndef tanh(x):\n")
    other = single.encode("# a different start\n") + long[:300]
    expect = {}
    # the last: "shared" took the stream that held "long", cut to their one common chunk
    for name, prompt, taken in (("long", long, 0), ("long", long, len(long) - 1), ("shared", shared, PREFILL_CHUNK),
                                ("other", other, 0), ("long", long, PREFILL_CHUNK)):
        result = autoregressive_generate(prompt, cached, max_new_tokens=6, logprobs=1)
        assert result.stats.cached_prompt_tokens == taken, name
        if name not in expect:
            alone = autoregressive_generate(prompt, single, max_new_tokens=6, logprobs=1)
            expect[name] = (alone.tokens, [(t.token, t.logprob) for t in alone.logprobs])
        assert (result.tokens, [(t.token, t.logprob) for t in result.logprobs]) == expect[name], name


@NEEDS_LLAMA
def test_compaction_keeps_a_kept_prompt(gguf_pair, gguf_batched):
    """A request takes its kept prompt from a high stream while a lower free stream keeps another
    prompt: compacting the batch moves the request down and swaps that prompt up (through the
    spare stream), so a later request still finds all of it, and its output stays exact."""
    from specdec import autoregressive_generate
    from specdec.backends import Segment
    from specdec.backends.prompts import PREFILL_CHUNK

    single, _ = gguf_pair
    cached, _ = gguf_batched
    drained = [cached.new_cache() for _ in range(cached.sequences)]  # every stream emptied
    del drained
    first, second = _long_prefix(single), single.encode("class Queue:\n    def __init__(self):\n")
    alone = autoregressive_generate(first, single, max_new_tokens=6).tokens
    for prompt in (first, second):  # kept in streams 0 and 1
        autoregressive_generate(prompt, cached, max_new_tokens=6)
    assert set(cached._kept) == {0, 1}
    other = cached.new_cache()  # stream 2
    again = cached.new_cache(second, PREFILL_CHUNK)  # stream 1, with its kept prompt
    assert (other.seq, again.seq, again.length) == (2, 1, len(second) - 1)
    cached.forward_batch([Segment(single.encode("x = 1"), other, 1), Segment(second[-1:], again, 1)])
    assert (other.seq, again.seq) == (0, 1) and set(cached._kept) == {2}
    del other, again
    result = autoregressive_generate(first, cached, max_new_tokens=6)
    assert result.stats.cached_prompt_tokens == len(first) - 1 and result.tokens == alone


@NEEDS_LLAMA
def test_gguf_backend_refuses_what_it_cannot_do(gguf_pair, tmp_path):
    from specdec import speculative_generate
    from specdec.drafters import make_tree_drafter
    from specdec.decoding.beam import beam_search_generate

    target, drafter = gguf_pair
    with pytest.raises(SpecdecError, match="beam search is not supported on the llama.cpp backend"):
        beam_search_generate(target.encode("x = 1"), target, num_beams=2, max_new_tokens=2)
    with pytest.raises(SpecdecError, match="token trees are not supported on the llama.cpp backend"):
        speculative_generate(target.encode("x = 1"), target, make_tree_drafter("sides", drafter, 8), max_new_tokens=4)
    with pytest.raises(SpecdecError, match="GGUF weights run on llama.cpp's CPU build"):
        load(registry.DEFAULT_TARGET, dtype="gguf", device="cuda")
    with pytest.raises(SpecdecError, match="drafter-vocab"):
        load(registry.DEFAULT_DRAFTER, dtype="gguf", role="drafter", vocab=1000)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SpecdecError, match="registry model or a .gguf file"):
        load(str(tmp_path), dtype="gguf")
    with pytest.raises(SpecdecError, match="GGUF file not found"):
        load(str(tmp_path / "missing.gguf"), dtype="gguf")
    old = target.new_cache()
    target.new_cache()
    with pytest.raises(SpecdecError, match="replaced by a newer one"):
        target.forward([1, 2], old)
    with pytest.raises(SpecdecError, match="outside"):
        target.forward([target.vocab_size], target.new_cache())


@NEEDS_LLAMA
@pytest.mark.real
def test_llama_cpp_peers_in_a_bench_run(tmp_path):
    """One tiny bench with ours on GGUF weights and llama.cpp's three peers (SmolLM2 drafting for itself)."""
    from specdec.bench.run import run_benchmark
    from specdec.bench.runners import Settings

    from specdec.cli import _tokenizer
    from specdec.drafters.datastore import build_from_corpus

    _installed_or_skip("smollm2-135m")
    corpus = tmp_path / "corpus.py"
    corpus.write_text("from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
                      "    for idx, elem in enumerate(numbers):\n        for idx2, elem2 in enumerate(numbers):\n")
    tokenizer = _tokenizer("smollm2-135m")
    build_from_corpus(str(corpus), tokenizer, len(tokenizer), tmp_path / "ds")
    result = run_benchmark(["humaneval:1:0+1"], None, ["ar", "sd", "suffix", "retrieval", "llama-cpp", "llama-cpp-spec",
                                                       "llama-cpp-lookup"], "smollm2-135m",
                           "smollm2-135m", Settings(max_new_tokens=16, spec={"gamma": 3}, datastore=str(tmp_path / "ds")),
                           dtype="gguf", drafter_dtype="gguf", json_path=str(tmp_path / "bench.json"))
    summary = result["summary"]
    assert result["info"]["target_dtype"] == "gguf" and result["info"]["llama_cpp"]
    for ours in ("sd", "suffix", "retrieval"):  # exact on the same backend
        assert summary[ours]["identical_to_ar"] == 1
    for method in ("llama-cpp", "llama-cpp-spec", "llama-cpp-lookup"):
        records = [r for r in result["records"] if r["method"] == method]
        assert len(records) == 2 and all(0 < r["new_tokens"] <= 16 for r in records)
        assert "median_speedup_vs_ar" in summary[method]
    assert "median_speedup_vs_llama-cpp" in summary["ar"]


@NEEDS_LLAMA
def test_the_server_batches_gguf_sequences(gguf_pair, gguf_batched):
    """`specdec serve --dtype gguf`: the engine runs up to 4 llama.cpp sequences at once; clients
    that ask at once each get the target's AR output alone (the default chain and plain decoding)."""
    from concurrent.futures import ThreadPoolExecutor

    from specdec.decoding.loop import autoregressive_generate
    from specdec.sizing.schedules import AssumedCosts
    from specdec.server.service import Service
    from test_server import _client, serving

    single, _ = gguf_pair
    target, drafter = gguf_batched
    prompts = ["def fibonacci(n):", "class Stack:\n    def push(self, item):", "import os\ndef walk(path):"]
    assumed = AssumedCosts(drafter=0.2, slope=0.0)  # drafts sized as given: drafting happens on any machine
    with serving(lambda: Service(target, drafter, assumed=assumed), max_batch=4) as (url, _):
        client = _client(url)

        def ask(number):
            return client.completions.create(model=target.name, prompt=prompts[number % 3], max_tokens=24,
                                             temperature=0, extra_body={} if number < 3 else {"speculative": False})

        with ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(ask, range(6)))
        again = [client.completions.create(model=target.name, prompt="def is_prime(n):", max_tokens=8, temperature=0)
                 for _ in range(2)]
    prime = single.encode("def is_prime(n):")
    assert again[0].choices[0].text == again[1].choices[0].text == single.decode(
        autoregressive_generate(prime, single, max_new_tokens=8).tokens)
    assert again[1].usage.prompt_tokens_details.cached_tokens == len(prime) - 1  # all the first's prompt call
    alone = [single.decode(autoregressive_generate(single.encode(p), single, max_new_tokens=24).tokens)
             for p in prompts]
    assert [r.choices[0].text for r in replies] == alone * 2
    assert sum(r.usage.model_extra["speculative"]["drafted_tokens"] for r in replies[:3]) > 0
