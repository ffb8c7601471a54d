"""A third family on real weights: Gemma 3 270M (sliding-window layers, BOS, a 262,144-id tied head).

The drafter is the model's own first layers (a cut of the converted HF directory), so drafts are
partly accepted and the caches are cropped at varying points, past the sliding window too.
"""

from pathlib import Path

import pytest
import torch

from specdec import TransformersModel, Sampler, autoregressive_generate, load, speculative_generate
from specdec.models import catalogue as registry

from conftest import bf16_rows

NAME = "gemma3-270m"
DRAFTER_LAYERS = 15  # of 18; fewer layers are rejected almost always (first 6: 1 of 102 accepted)


pytestmark = pytest.mark.real  # Gemma 3 270M's real weights, in every test here


@pytest.fixture(autouse=True)
def one_thread():
    """On the shared 2-core machines a second OpenMP thread mostly waits on its barrier when another
    process is busy (a 1-token fp32 step: 0.17 s with 1 thread, ~1 s with 2 there)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _installed_or_skip() -> None:
    if not registry.is_installed(NAME):
        pytest.skip(f"{NAME} is not installed (run `specdec install {NAME}`)")


def _first_layers(dtype: torch.dtype, layers: int, tokenizer) -> TransformersModel:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(registry.converted_dir(NAME), dtype=dtype)
    hf.model.layers = hf.model.layers[:layers]
    hf.config.num_hidden_layers = layers
    hf.config.layer_types = hf.config.layer_types[:layers]  # the cache is built from them
    return TransformersModel(hf, tokenizer, f"{NAME}-first{layers}", role="drafter")


@pytest.fixture(scope="module")
def gemma3() -> tuple[TransformersModel, TransformersModel]:
    """(target, drafter) in fp32."""
    _installed_or_skip()
    target = load(NAME, dtype="fp32", device="cpu")
    return target, _first_layers(torch.float32, DRAFTER_LAYERS, target.tokenizer)


PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


def test_gemma3_greedy_past_the_sliding_window_is_identical(gemma3):
    target, drafter = gemma3
    window = target.hf.config.sliding_window
    assert window and any(getattr(layer, "is_sliding", False) for layer in target.new_cache().layers)
    source = (Path(__file__).parents[2] / "src" / "specdec" / "core" / "samplers.py").read_text()
    prompt = target.encode(source)[:window - 6]  # 6 tokens short of the window: generation crosses it
    assert prompt[0] == target.tokenizer.bos_token_id
    length = 16
    reference = autoregressive_generate(prompt, target, max_new_tokens=length, eos_token_ids=[])
    out = speculative_generate(prompt, target, drafter, gamma=3, max_new_tokens=length, eos_token_ids=[])
    assert out.tokens == reference.tokens
    assert 0 < out.stats.accepted < out.stats.drafted  # drafts cut at varying points: crops before and past the window


def test_gemma3_sampled_speculative_generation_gives_valid_tokens(gemma3):
    target, drafter = gemma3
    prompt = target.encode(PROMPT)
    out = speculative_generate(prompt, target, drafter, gamma=3, sampler=Sampler(1.0), max_new_tokens=8, seed=7)
    assert 1 <= len(out.tokens) <= 8 and out.stop_reason in ("eos", "max_new_tokens")
    assert all(0 <= t < target.vocab_size for t in out.tokens)
    assert isinstance(target.decode(out.tokens), str)


@bf16_rows
def test_gemma3_bf16_greedy_speculative_is_identical():
    """bf16 on a CPU without native bf16 costs ~1 s a token (AMD EPYC, AVX2): a short run."""
    _installed_or_skip()
    target = load(NAME, dtype="bf16", device="cpu")
    drafter = _first_layers(torch.bfloat16, DRAFTER_LAYERS, target.tokenizer)
    prompt = target.encode(PROMPT)
    reference = autoregressive_generate(prompt, target, max_new_tokens=6, eos_token_ids=[])
    out = speculative_generate(prompt, target, drafter, gamma=3, max_new_tokens=6, eos_token_ids=[])
    assert out.tokens == reference.tokens
