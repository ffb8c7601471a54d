"""The llama.cpp backend (backends/llamacpp.py) and llama.cpp's peers in the bench (bench/llama_peers.py).

llama-cpp-python is an optional extra (`pip install -e .[peers]`): without it these tests skip,
all but the one that checks the error a user gets then.
"""

from __future__ import annotations

import sys

import pytest
import torch

from specdec import registry
from specdec.errors import SpecdecError
from specdec.models import load

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


@pytest.fixture(scope="module")
def gguf_pair():
    _installed_or_skip(registry.DEFAULT_TARGET, registry.DEFAULT_DRAFTER)
    return load(registry.DEFAULT_TARGET, dtype="gguf"), load(registry.DEFAULT_DRAFTER, dtype="gguf", role="drafter")


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
    """Each row of a 12-token pass is bit for bit a 1-token pass (the target feeds scored tokens 3
    per call), after a prefix of over 512 tokens (where flash attention would split a 1-row
    query's keys across threads with an f16 cache); the same model with exact_rows off takes
    ggml's repacked GEMM from 4 rows and its tiled K-quant matmul from 8, and differs: what makes
    the first assertion mean something."""
    target, _ = gguf_pair
    prefix = target.encode("import numpy as np\n\n" + "".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n\n"
                                                               for i in range(40)) + "def softmax(x):\n")
    assert len(prefix) > 600
    tokens = [262, 470, 284, 2595, 13, 4580, 2075, 481, 2595, 6678, 2075, 1171]
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
    from specdec.schedules import make_schedule

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


@NEEDS_LLAMA
def test_gguf_backend_refuses_what_it_cannot_do(gguf_pair, tmp_path):
    from specdec import speculative_generate
    from specdec.drafters import make_tree_drafter
    from specdec.beam import beam_search_generate

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
    from specdec.bench.methods import Settings

    from specdec.cli import _tokenizer
    from specdec.datastore import build_from_corpus

    _installed_or_skip("smollm2-135m")
    corpus = tmp_path / "corpus.py"
    corpus.write_text("from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
                      "    for idx, elem in enumerate(numbers):\n        for idx2, elem2 in enumerate(numbers):\n")
    tokenizer = _tokenizer("smollm2-135m")
    build_from_corpus(str(corpus), tokenizer, len(tokenizer), tmp_path / "ds")
    result = run_benchmark(["humaneval:1:0+1"], None, ["ar", "sd", "suffix", "retrieval", "llama-cpp", "llama-cpp-spec",
                                                       "llama-cpp-lookup"], "smollm2-135m",
                           "smollm2-135m", Settings(max_new_tokens=16, gamma=3, datastore=str(tmp_path / "ds")),
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
def test_the_server_serves_gguf_weights_one_sequence_at_a_time(gguf_pair):
    """`specdec serve --dtype gguf`: the engine takes one llama.cpp sequence at a time; clients
    that ask at once each get the target's AR output alone (the default chain and plain decoding)."""
    from concurrent.futures import ThreadPoolExecutor

    from specdec.generate import autoregressive_generate
    from specdec.schedules import AssumedCosts
    from specdec.server.service import Service
    from test_server import _client, serving

    target, drafter = gguf_pair
    prompts = ["def fibonacci(n):", "class Stack:\n    def push(self, item):", "import os\ndef walk(path):"]
    assumed = AssumedCosts(drafter=0.2, slope=0.0)  # drafts sized as given: drafting happens on any machine
    with serving(lambda: Service(target, drafter, assumed=assumed), max_batch=1) as (url, _):
        client = _client(url)

        def ask(number):
            return client.completions.create(model=target.name, prompt=prompts[number % 3], max_tokens=24,
                                             temperature=0, extra_body={} if number < 3 else {"speculative": False})

        with ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(ask, range(6)))
    alone = [target.decode(autoregressive_generate(target.encode(p), target, max_new_tokens=24).tokens)
             for p in prompts]
    assert [r.choices[0].text for r in replies] == alone * 2
    assert sum(r.usage.model_extra["speculative"]["drafted_tokens"] for r in replies[:3]) > 0
