"""The batched pass's layer loop (backends/lean.py): the bits of the modules' own forwards."""

import pytest
import torch

from specdec.backends import Segment, lean, native
from specdec.backends.cache import cache_length
from specdec.backends.transformers import TransformersModel

from conftest import cpu_only
from test_rows import _ids, packed_bf16, qwen_like

# the loop runs where the layers are fused: our kernels built (norm, rotation, SwiGLU middle)
fused_here = pytest.mark.skipif(None in (native.rms_norm_kernel(), native.rotary_kernel(), native.silu_mul_kernel()),
                                reason="our kernels are not built here: no layer is fused, the loop never runs")
pytestmark = [packed_bf16, cpu_only, fused_here]


def _llama_like(seed: int = 0) -> TransformersModel:
    """A random bf16 Llama of qwen_like's sizes (grouped-query attention, no q/k/v bias)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    return TransformersModel(LlamaForCausalLM(config).to(torch.bfloat16), None, "llama-like", role="target",
                             exact_rows=True)


def _model(family: str) -> TransformersModel:
    return qwen_like(torch.bfloat16, exact_rows=True) if family == "qwen2" else _llama_like()


def _pass(model: TransformersModel, monkeypatch, loop: bool) -> tuple[list[torch.Tensor], list, list[bool]]:
    """Three sequences after prompts of their own in one batched pass: a decode row, a chain of 5 and
    a tree of 4 nodes; through our loop or (loop False) the modules' forwards -> (logits, each
    cache's keys and values, whether each pass took the loop)."""
    real, used = lean.forward, []

    def counted(*args, **kwargs):
        hidden = real(*args, **kwargs)
        used.append(hidden is not None)
        return hidden
    monkeypatch.setattr(lean, "forward", counted if loop else lambda *args, **kwargs: None)
    caches = []
    for i, length in enumerate((37, 20, 51)):
        cache = model.new_cache()
        model.prefill(_ids(length, 4096, i), cache)
        caches.append(cache)
    segments = [Segment(_ids(1, 4096, 10), caches[0]), Segment(_ids(5, 4096, 11), caches[1], 5),
                Segment(_ids(4, 4096, 12), caches[2], 4, parents=[-1, 0, 0, 1])]
    logits = model.forward_batch(segments)
    entries = [(layer.keys[..., :cache_length(c), :].clone(), layer.values[..., :cache_length(c), :].clone())
               for c in caches for layer in c.layers]
    monkeypatch.undo()
    return logits, entries, used


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_the_loop_gives_a_batched_pass_the_modules_own_bits(monkeypatch, family):
    """Decode rows, a chain and a tree in one pass: every logit and cache entry the modules' own
    forwards give, bit for bit, and the loop did run."""
    model = _model(family)
    theirs, their_cache, _ = _pass(model, monkeypatch, loop=False)
    ours, our_cache, used = _pass(model, monkeypatch, loop=True)
    assert used == [True]
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert all(torch.equal(a, b) for pair, other in zip(our_cache, their_cache) for a, b in zip(pair, other))


def _doubled_output(module, inputs, output):
    if isinstance(output, torch.Tensor):
        return output * 2
    output.last_hidden_state = output.last_hidden_state * 2  # the decoder's own output
    return output


@pytest.mark.parametrize("where", ["norm", "decoder"])
def test_a_hooked_module_sends_the_pass_through_the_modules(monkeypatch, where):
    """A hook on a module whose call the loop would skip (a norm; the decoder itself; an adapter
    hooks projections) is run: the pass takes the modules' forwards, and the hook's effect shows."""
    model = qwen_like(torch.bfloat16, exact_rows=True)
    plain, _, _ = _pass(model, monkeypatch, loop=True)
    module = model._decoder.layers[1].input_layernorm if where == "norm" else model._decoder
    handle = module.register_forward_hook(_doubled_output)
    try:
        hooked, _, used = _pass(model, monkeypatch, loop=True)
        theirs, _, _ = _pass(model, monkeypatch, loop=False)
    finally:
        handle.remove()
    assert used == [False]
    assert all(torch.equal(a, b) for a, b in zip(hooked, theirs))
    assert not all(torch.equal(a, b) for a, b in zip(hooked, plain))


def test_the_loop_declines_what_the_modules_would_compute_otherwise(monkeypatch):
    """Gradients on, a training decoder, a layer whose attention kept transformers' own forward, a
    norm's weight in fp32, a layer with a forward of its own: each leaves the pass to the modules
    before the cache is touched."""
    model = qwen_like(torch.bfloat16, exact_rows=True)
    decoder = model._decoder
    ids, positions, cache = torch.tensor([[5, 6]]), torch.tensor([[0, 1]]), model.new_cache()

    def declines() -> bool:
        with torch.inference_mode():
            return lean.forward(decoder, ids, positions, cache, None) is None and cache_length(cache) == 0

    with torch.enable_grad():
        assert lean.forward(decoder, ids, positions, cache, None) is None
    decoder.train()
    assert declines()
    decoder.eval()
    attention = decoder.layers[0].self_attn
    with monkeypatch.context() as patch:
        patch.setattr(attention, "__class__", type(attention).__mro__[2])  # transformers' class under the fused one
        assert declines()
    norm = decoder.layers[1].post_attention_layernorm
    weight = norm.weight
    norm.weight = torch.nn.Parameter(weight.float(), requires_grad=False)
    try:
        assert declines()
    finally:
        norm.weight = weight
    layer = decoder.layers[1]
    with monkeypatch.context() as patch:
        patch.setattr(layer, "__class__", type("OwnLayer", (type(layer),), {"forward": lambda self, *a, **k: None}))
        assert declines()
    assert not declines()  # and with all of it undone, the loop runs
