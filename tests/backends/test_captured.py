"""The captured backend (backends/captured.py): its arithmetic against transformers' model, its
slots and rollback, its rows against single-sequence passes, and the loops on it. On the CPU it
runs eagerly in fp32; under `make test-cuda` in bf16 with CUDA graphs, where batches must equal
single sequences bit for bit and graphs the eager pass. `python -m specdec.bench.rowprobe
--captured` measures its row gaps and costs on a GPU (docs/kernels.md)."""

from __future__ import annotations

import pytest
import torch

from specdec import autoregressive_generate, speculative_generate
from specdec.backends import Segment, features
from specdec.backends.captured import BUCKETS, QUERY_ROWS, CapturedModel
from specdec.engine import generate_many
from specdec.errors import SpecdecError

from conftest import TEST_DEVICE

ON_CUDA = TEST_DEVICE != "cpu"


def _hf(seed: int, family: str = "qwen2", vocab: int = 48, layers: int = 2):
    import transformers

    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    config = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig,
              "qwen3": transformers.Qwen3Config}[family](**common)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(40.0)
    # flash attention, what CUDA passes run, takes bf16 and fp16 only
    return model.to(TEST_DEVICE, torch.bfloat16) if ON_CUDA else model


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
def test_logits_match_transformers(family):
    hf = _hf(0, family)
    model = CapturedModel(hf, None, "captured", sequences=3, capacity=600)
    ids = torch.randint(2, 48, (1, 300), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids.to(hf.device)).logits[0].float()
    # bf16 on CUDA: transformers' sdpa and our flash attention round differently
    tolerance = dict(atol=0.05 * float(expected.abs().max()), rtol=0) if ON_CUDA else dict(atol=1e-4, rtol=1e-4)
    cache = model.new_cache()
    assert model.prefill(ids[0].tolist(), cache) == [ids[0, -1].item()]
    assert cache.get_seq_length() == 299  # fed in chunks of QUERY_ROWS: two passes
    last = model.forward([ids[0, -1].item()], cache)
    torch.testing.assert_close(last[0], expected[-1], **tolerance)
    whole = model.forward(ids[0].tolist(), None, num_logits=300)  # a cache-free pass, 2 chunks
    torch.testing.assert_close(whole, expected, **tolerance)
    assert model.pass_hidden.shape == (300, 32) and model.last_hidden.shape == (300, 32)


def test_rollback_and_batches_match_single_sequences():
    model = CapturedModel(_hf(1), None, "captured", sequences=4, capacity=256)
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 48, (n,), generator=generator).tolist() for n in (5, 40, 17)]
    alone = []
    for prompt in prompts:
        cache = model.new_cache()
        pending = model.prefill(prompt, cache)
        model.forward(pending + [3, 4, 5], cache, 4)
        cache.crop(cache.get_seq_length() - 3)  # reject the draft: the slab's rows stay, unread
        alone.append(model.forward([7, 8], cache, 2))
    caches = []
    for prompt in prompts:
        caches.append(model.new_cache())
        model.prefill(prompt, caches[-1])
    model.forward_batch([Segment([p[-1], 9, 9, 9], c, 1) for p, c in zip(prompts, caches)])
    for cache in caches:
        cache.crop(-3)
    together = model.forward_batch([Segment([7, 8], c, 2)
                                     for c in caches])
    for a, b in zip(alone, together):
        assert torch.equal(a, b)  # every GEMM and norm in calls of CUDA_ROWS rows, attention per row


@pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs: make test-cuda")
def test_graphs_replay_the_eager_pass():
    hf = _hf(5)
    captured = CapturedModel(hf, None, "graphs", sequences=2, capacity=256)
    eager = CapturedModel(hf, None, "eager", sequences=2, capacity=256, graphs=False)
    assert captured.kernels.startswith("cuda-graphs") and eager.kernels.startswith("static-eager")
    outputs = []
    for model in (captured, eager):
        cache = model.new_cache()
        model.forward(model.prefill(list(range(2, 40)), cache), cache)
        outputs.append(model.forward([5, 6, 7], cache, 3))
    assert torch.equal(*outputs)


def test_slots_are_freed_and_bounded():
    model = CapturedModel(_hf(2), None, "captured", sequences=2, capacity=64)
    first, second = model.new_cache(), model.new_cache()
    with pytest.raises(SpecdecError, match="2 sequences at once"):
        model.new_cache()
    del first
    third = model.new_cache()
    with pytest.raises(SpecdecError, match="64 positions"):
        model.forward(list(range(2, 40)) * 2, third)
    with pytest.raises(SpecdecError, match="chains, not token trees"):
        model.forward([2, 3], second, parents=[-1, 0])
    assert features(model).sequences == 2 and not features(model).tree_masks
    assert QUERY_ROWS <= BUCKETS[-1]


def test_greedy_speculative_equals_autoregressive_and_the_engine():
    target = CapturedModel(_hf(3), None, "target", sequences=8, capacity=256)
    drafter = CapturedModel(_hf(4), None, "drafter", role="drafter", sequences=8, capacity=256)
    prompt = [0, 5, 9, 12, 3]
    ar = autoregressive_generate(prompt, target, max_new_tokens=40).tokens
    spec = speculative_generate(prompt, target, drafter, max_new_tokens=40, gamma=4).tokens
    assert spec == ar
    prompts = [prompt, [0, 7, 2], [0, 7, 3]]
    batched = generate_many(prompts, target, drafter, max_batch=3, max_new_tokens=40, gamma=4)
    assert [r.tokens for r in batched] == [autoregressive_generate(p, target, max_new_tokens=40).tokens
                                           for p in prompts]


def test_refuses_other_families():
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(SpecdecError, match="not 'gpt2'"):
        CapturedModel(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=40)), None)


fused_kernels = pytest.importorskip("specdec.backends.fused")


@pytest.mark.skipif(not fused_kernels.available(torch.device(TEST_DEVICE)),
                    reason="Triton on CUDA, or TRITON_INTERPRET=1 with Triton installed")
def test_fused_pass_matches_torch_ops():
    hf = _hf(6, vocab=64)
    fused = CapturedModel(hf, None, "fused", sequences=3, capacity=300, fused=True)
    plain = CapturedModel(hf, None, "torch-ops", sequences=3, capacity=300, fused=False)
    ids = torch.randint(2, 64, (280,), generator=torch.Generator().manual_seed(3)).tolist()
    got, expected = (model.forward(ids, None, num_logits=280) for model in (fused, plain))
    # one rounding per kernel against torch's one per op
    torch.testing.assert_close(got, expected, atol=0.05 * float(expected.abs().max()), rtol=0)
    caches = [fused.new_cache() for _ in range(2)]
    for cache, start in zip(caches, (0, 11)):
        fused.prefill(ids[start:start + 100], cache)
    together = fused.forward_batch([Segment(ids[20:30], caches[0], 2), Segment([5, 6, 7], caches[1], 3)])
    cache = fused.new_cache()
    fused.prefill(ids[11:111], cache)
    assert torch.equal(fused.forward([5, 6, 7], cache, 3), together[1])  # rows exact across passes


@pytest.mark.skipif(ON_CUDA, reason="the refusals of a CPU machine")
def test_load_refuses_captured_passes_off_cuda_before_loading_weights():
    from typer.testing import CliRunner

    from specdec.cli import app
    from specdec.models.loading import load

    with pytest.raises(SpecdecError, match="needs a CUDA device, not cpu"):
        load("no-such-model", device="cpu", kernels="captured")
    runner = CliRunner()
    for kernels, message in (("captured", "needs a CUDA device"), ("fast", "--kernels is auto or captured")):
        result = runner.invoke(app, ["generate", "x", "--device", "cpu", "--kernels", kernels])
        assert result.exit_code != 0 and message in result.output


def test_a_captured_model_has_every_protocol_member():
    from specdec.backends import Backend
    from test_layout import protocol_members

    model = CapturedModel(_hf(7), None, "captured", sequences=1, capacity=64)
    attributes, methods = protocol_members(Backend)
    assert [name for name in sorted(attributes | set(methods)) if not hasattr(model, name)] == []
