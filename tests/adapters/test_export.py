"""export-heads: our Medusa heads in vLLM's Medusa layout (key names, shapes, config), and a
re-implementation of vLLM's Medusa forward over the exported files scores what ours does."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from specdec.cli import app
from specdec.adapters.checkpoints import head_rows
from specdec.errors import SpecdecError
from specdec.adapters.export import export_heads
from specdec.adapters.medusa_heads import Heads

from conftest import tiny_model
from test_self_drafting import _random_heads


def _vllm_medusa_logits(folder, hidden: torch.Tensor) -> torch.Tensor:
    """vLLM's Medusa (model_executor/models/medusa.py) as its config and weights direct: per head
    x + SiLU(W x (+ b if medusa_fc_bias)), the shared lm_head, logits scattered to `token_map` in a
    -inf row of vocab_size. hidden [H] -> [K, V]."""
    config = json.loads((folder / "config.json").read_text())
    weights = load_file(str(folder / "model.safetensors"))
    # vLLM's MedusaConfig.from_pretrained renames keys with "num" and "heads"/"layers": ours are already those names
    assert {k for k in config if "num" in k} == {"num_heads", "num_hidden_layers"}
    assert config["model_type"] == "medusa" and config["architectures"] == ["MedusaModel"]
    assert config["original_lm_head"] is True and config["medusa_fc_bias"] is True
    rows = []
    for k in range(config["num_heads"]):
        x = hidden.float()
        for j in range(config["num_hidden_layers"]):
            w, b = weights[f"blocks.{k}.layers.{j}.weight"], weights[f"blocks.{k}.layers.{j}.bias"]
            x = x + torch.nn.functional.silu(w.float() @ x + b.float())
        logits = weights["lm_head.weight"].float() @ x
        if config["truncated_vocab_size"] == config["vocab_size"]:  # vLLM keeps no token_map then
            rows.append(logits)
            continue
        full = torch.full((config["vocab_size"],), float("-inf"))
        full[weights["token_map"]] = logits
        rows.append(full)
    return torch.stack(rows)


@pytest.mark.slow
def test_medusa_heads_export_to_vllms_layout_and_score_what_ours_do(tmp_path):
    target = tiny_model(0, vocab=32)
    heads = _random_heads(target, num_heads=3)
    ids = torch.tensor([0, 1, 4, 5, 9, 17, 30])  # a scored subset, as a frequent-token head has
    heads = Heads(heads.heads, ids, heads.info)
    folder = export_heads(heads, target, tmp_path / "vllm", token_map=True)
    weights = load_file(str(folder / "model.safetensors"))
    hidden_size = target.hidden_size
    expected = {f"blocks.{k}.layers.0.{p}" for k in range(3) for p in ("weight", "bias")} | {"lm_head.weight", "token_map"}
    assert set(weights) == expected
    assert weights["blocks.0.layers.0.weight"].shape == (hidden_size, hidden_size)
    assert weights["lm_head.weight"].shape == (len(ids), hidden_size) and weights["token_map"].dtype == torch.int64
    config = json.loads((folder / "config.json").read_text())
    assert (config["vocab_size"], config["truncated_vocab_size"], config["num_heads"]) == (32, len(ids), 3)
    hidden = torch.randn(hidden_size, generator=torch.Generator().manual_seed(0))
    ours = heads.heads(hidden.float()) @ head_rows(target, ids).float().cpu().T  # [K, N]: what MedusaDrafter scores
    theirs = _vllm_medusa_logits(folder, hidden)
    assert torch.allclose(theirs[:, ids], ours, atol=1e-5)
    assert torch.isinf(theirs[:, [i for i in range(32) if i not in ids.tolist()]]).all()


def test_medusa_heads_export_with_the_whole_head_by_default_as_vllm_032_loads_them(tmp_path):
    """vLLM 0.32's Medusa loader refuses a token_map ("Following weights were not initialized from
    checkpoint: {'token_map'}"): the default writes every row of the target's head; on the ids the
    heads were trained to score it gives the logits ours gives."""
    target = tiny_model(0, vocab=32)
    heads = _random_heads(target, num_heads=2)
    ids = torch.tensor([0, 1, 4, 5, 9, 17, 30])
    heads = Heads(heads.heads, ids, heads.info)
    folder = export_heads(heads, target, tmp_path / "vllm")
    weights = load_file(str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    assert "token_map" not in weights and weights["lm_head.weight"].shape == (32, target.hidden_size)
    assert config["truncated_vocab_size"] == config["vocab_size"] == 32
    hidden = torch.randn(target.hidden_size, generator=torch.Generator().manual_seed(1))
    ours = heads.heads(hidden.float()) @ head_rows(target, ids).float().cpu().T
    theirs = _vllm_medusa_logits(folder, hidden)
    assert theirs.shape == (2, 32) and torch.isfinite(theirs).all()
    assert torch.allclose(theirs[:, ids], ours, atol=1e-5)


def test_export_refuses_eagle_another_target_and_a_used_folder(tmp_path):
    target = tiny_model(0, vocab=32)
    heads = _random_heads(target)
    with pytest.raises(SpecdecError, match="EAGLE heads cannot be exported"):
        export_heads(heads, target, tmp_path / "a", "eagle")
    with pytest.raises(SpecdecError, match="trained for"):
        export_heads(heads, tiny_model(1, vocab=32), tmp_path / "b")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "x").write_text("")
    with pytest.raises(SpecdecError, match="not empty"):
        export_heads(heads, target, tmp_path / "c")


def test_cli_export_errors_are_one_line(tmp_path):
    runner = CliRunner()
    for args, message in ((["export-heads", str(tmp_path), "--out", str(tmp_path / "o"), "--format", "eagle"],
                           "EAGLE heads cannot be exported"),
                          (["export-heads", str(tmp_path), "--out", str(tmp_path / "o"), "--format", "onnx"],
                           "unknown format 'onnx'"),
                          (["export-heads", str(tmp_path), "--out", str(tmp_path / "o")], "medusa.json is missing")):
        result = runner.invoke(app, args)
        assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output


def _random_lora(model, seed: int):
    from specdec.adapters.lora import DraftAdapter, adapted_layers

    torch.manual_seed(seed)
    lora = DraftAdapter(adapted_layers(model), rank=2)
    with torch.no_grad():
        for b in lora.b.values():
            b.normal_(0, 0.5)  # a trained adapter's B is not zero; a zero one would hide a missing merge
    return lora


def test_a_distilled_drafter_exports_as_a_plain_folder_that_computes_what_ours_drafts(tmp_path):
    """The exported folder, loaded by transformers as vLLM's draft_model loads any model, gives the
    logits our drafter gives with the adapter merged (`--drafter distilled:DIR`)."""
    from transformers import AutoModelForCausalLM

    from specdec.adapters.lora import Distilled, attach
    from specdec.adapters.export import export_drafter

    drafter = tiny_model(3, vocab=32, role="drafter", kernels="stock")
    lora = _random_lora(drafter, 0)
    folder = export_drafter(drafter, Distilled(lora, {"drafter": "tiny-3", "drafter_sha256": "x"}), tmp_path / "d",
                            dtype=torch.float32)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["specdec"]["kind"] == "distilled drafter"
    exported = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([[2, 7, 1, 30, 4, 4, 9]])
    with torch.no_grad():
        plain = drafter.hf(ids.to(drafter.device)).logits.cpu()
        attach(drafter, lora)
        ours = drafter.hf(ids.to(drafter.device)).logits.cpu()
        theirs = exported(ids).logits
    assert torch.allclose(theirs, ours, atol=1e-5) and not torch.allclose(theirs, plain, atol=1e-3)


def test_a_parallel_drafter_exports_with_its_mask_id_and_embedding_where_vllm_reads_them(tmp_path):
    """vLLM (v1/spec_decode/llm_base_proposer.py) reads the mask id from the drafter's config as
    `mask_token_id` or `pard_token`, and requires the drafter's vocabulary to be the target's: the
    mask takes a row of the table, its embedding ours, and the LoRA is merged into every row."""
    from transformers import AutoModelForCausalLM

    from specdec.adapters.pard import Parallel, ParallelAdapter
    from specdec.adapters.export import export_parallel, merged_state

    drafter = tiny_model(4, vocab=32, role="drafter", kernels="stock")
    lora = _random_lora(drafter, 1)
    adapter = ParallelAdapter(lora.shapes, 2, drafter.hidden_size, k=3)
    adapter.lora.load_state_dict(lora.state_dict())
    with torch.no_grad():
        adapter.mask.normal_()
    folder = export_parallel(drafter, Parallel(adapter, {"drafter": "tiny-4"}), tmp_path / "p", dtype=torch.float32)
    config = json.loads((folder / "config.json").read_text())
    assert config["pard_token"] == config["mask_token_id"] == 31 and config["vocab_size"] == 32  # no tokenizer: the last row
    assert config["specdec"]["k"] == 3 and config["specdec"]["mask_replaces_token"] is True
    exported = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    embeddings = exported.get_input_embeddings().weight
    assert torch.equal(embeddings[31], adapter.mask)
    assert torch.equal(embeddings[:31], drafter.hf.get_input_embeddings().weight[:31].cpu())
    q_proj = "model.layers.1.self_attn.q_proj.weight"
    assert torch.allclose(exported.state_dict()[q_proj], merged_state(drafter, lora)[q_proj].cpu())
    assert not torch.allclose(exported.state_dict()[q_proj], drafter.hf.state_dict()[q_proj].cpu(), atol=1e-3)


def test_export_refuses_eagle_quoting_vllms_layer_and_an_unknown_kind_in_one_line(tmp_path):
    runner = CliRunner()
    for kind, message in (("eagle", "input_layernorm = nn.Identity()"), ("onnx", "unknown kind 'onnx'")):
        result = runner.invoke(app, ["export", str(tmp_path), "--kind", kind, "--out", str(tmp_path / "o")])
        assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output
        assert len(result.output.strip().splitlines()) == 1
    for kind, message in (("drafter", "adapter.json"), ("parallel", "parallel.json"), ("medusa", "medusa.json")):
        result = runner.invoke(app, ["export", str(tmp_path), "--kind", kind, "--out", str(tmp_path / "o")])
        assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output, result.output


def test_the_written_dtype_defaults_to_the_one_the_drafters_config_names(tmp_path):
    from specdec.adapters.export import source_dtype

    for key, name, dtype in (("torch_dtype", "bfloat16", torch.bfloat16), ("dtype", "float32", torch.float32)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({key: name}))
        assert source_dtype(str(tmp_path / name)) == dtype
    assert source_dtype(str(tmp_path / "none")) is None
