"""What is trained here, written in the layouts vLLM 0.32 loads (`specdec export --kind ...`).

- `drafter`: a distilled drafter (adapters/lora.py: LoRA on the drafter's projections) merged into the
  drafter's weights: a plain Hugging Face folder (config.json, model.safetensors, the tokenizer)
  for vLLM's `draft_model` method. It drafts what `--drafter distilled:DIR` drafts.
- `parallel`: a parallel drafter (adapters/pard.py: PARD) as a Hugging Face folder for vLLM's
  `draft_model` method with `parallel_drafting: true`; the mask token is an id of the drafter's own
  table (vLLM requires the drafter's vocabulary size to be the target's), named as `pard_token` and
  `mask_token_id` in config.json, its embedding row ours. vLLM runs one set of weights on every row,
  so the LoRA, which ours adds to the mask rows alone, is merged into all of them: the real tokens'
  rows are no longer the plain drafter's, and acceptance differs from ours (measured in the docs).

Medusa, for vLLM (`vllm/model_executor/models/medusa.py` and `transformers_utils/configs/medusa.py`):
a folder with `config.json` (model_type "medusa": hidden_size, vocab_size, num_heads,
num_hidden_layers 1 per head, truncated_vocab_size, medusa_fc_bias, original_lm_head) and
`model.safetensors` holding `blocks.{k}.layers.0.weight` [H, H] and `.bias` [H] (head k: h + SiLU(W h + b),
as ours), `lm_head.weight` [N, H] (the target's output-head rows for the N ids the heads score,
one head shared by all, as ours) and `token_map` [N] (those ids, which vLLM scatters the N logits
back to). vLLM's Medusa proposes head k's argmax as the token k + 1 ahead of the target's, as ours.
vLLM 0.32's Medusa loader refuses that truncated layout (its `load_weights` keeps `token_map` but
does not report it loaded: "ValueError: Following weights were not initialized from checkpoint:
{'token_map'}"), so by default the whole head is written ([V, H], no `token_map`): heads trained on
the N most frequent ids then score every id, and propose another token than ours only where an id
outside the N outscores those inside.

EAGLE is refused (`EAGLE_REFUSAL`). Ours: x = fc([e; f]) + b, x += attn(norm(x)), x += mlp(norm(x)).
vLLM 0.32's `eagle` (model_executor/models/llama_eagle.py) builds layer 0 with
`LlamaDecoderLayer(vllm_config, i == 0, ...)`, which "Skip[s] the input_layernorm" (`self.input_layernorm
= nn.Identity()`) with no config switch, and its `fc` has `bias=False`. Its `eagle3`
(llama_eagle3.py) normalises the embedding and the feature apart (`input_layernorm(embeds)`,
`hidden_norm(hidden_states)`), concatenates them into a 2H-wide qkv, and keeps the feature (not a
mix of both) as the residual. Neither computes our layer for any weights.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from .checkpoints import head_rows, target_fingerprint
from ..errors import SpecdecError
from .medusa_heads import Heads, check_heads_target

FORMATS = ("medusa", "eagle")
KINDS = ("medusa", "eagle", "drafter", "parallel")
CONFIG, WEIGHTS = "config.json", "model.safetensors"
EAGLE_REFUSAL = ("EAGLE heads cannot be exported: vLLM 0.32's eagle layer skips its input norm "
                 "(llama_eagle.py: layer 0's input_layernorm = nn.Identity(), no config switch) and its fc has no "
                 "bias, and its eagle3 layer normalises the embedding and the feature apart; ours normalises "
                 "fc([e; f]) + b, so either would compute another function")


def medusa_tensors(heads: Heads, target, token_map: bool = False) -> dict[str, torch.Tensor]:
    """vLLM's Medusa state dict for `heads`, trained for `target` (whose head rows it copies):
    token_map, the scored ids' rows and their ids; else every row of the target's head."""
    check_heads_target(heads, target)
    tensors = {}
    for k, block in enumerate(heads.heads.blocks):
        tensors[f"blocks.{k}.layers.0.weight"] = block.weight.detach().float().cpu().contiguous()
        tensors[f"blocks.{k}.layers.0.bias"] = block.bias.detach().float().cpu().contiguous()
    ids = heads.vocab_ids.long().cpu() if token_map else torch.arange(int(target.vocab_size))
    tensors["lm_head.weight"] = head_rows(target, ids).detach().cpu().contiguous()
    if token_map:
        tensors["token_map"] = ids.contiguous()
    return tensors


def medusa_config(heads: Heads, target, token_map: bool = False) -> dict:
    """vLLM's Medusa config.json for `heads` (with specdec's provenance under "specdec")."""
    blocks = heads.heads.blocks
    dtype = str(target.dtype).removeprefix("torch.")
    return {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": blocks[0].in_features,
            "vocab_size": int(target.vocab_size), "num_heads": len(blocks), "num_hidden_layers": 1,
            "truncated_vocab_size": len(heads.vocab_ids) if token_map else int(target.vocab_size),
            "medusa_fc_bias": True, "original_lm_head": True,
            "torch_dtype": dtype,
            "specdec": {**{k: heads.info.get(k) for k in ("target", "target_sha256", "corpus", "tokens",
                                                           "heldout_top1", "created")},
                        "exported": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}}


def check_format(fmt: str) -> None:
    """SpecdecError unless heads can be exported in `fmt`."""
    if fmt == "eagle":
        raise SpecdecError(EAGLE_REFUSAL)
    if fmt not in FORMATS:
        raise SpecdecError(f"unknown format {fmt!r}; use medusa")


def export_heads(heads: Heads, target, out: str | Path, fmt: str = "medusa", token_map: bool = False) -> Path:
    """Write `heads` (trained for `target`) into `out` in `fmt`'s layout; returns the folder.
    token_map: the truncated layout (the scored ids' rows and `token_map`), which vLLM 0.32's
    loader refuses; by default the target's whole head."""
    from safetensors.torch import save_file

    check_format(fmt)
    out = new_folder(out)
    tensors, config = medusa_tensors(heads, target, token_map), medusa_config(heads, target, token_map)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS))
    (out / CONFIG).write_text(json.dumps(config, indent=1))
    return out


def check_kind(kind: str) -> None:
    """SpecdecError unless `kind` can be exported (before any loading)."""
    if kind == "eagle":
        raise SpecdecError(EAGLE_REFUSAL)
    if kind not in KINDS:
        raise SpecdecError(f"unknown kind {kind!r}; use medusa, drafter or parallel (eagle is refused)")


def new_folder(out: str | Path) -> Path:
    """`out` as a Path, SpecdecError where it holds anything already."""
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SpecdecError(f"{out} is not empty; export into a new folder")
    return out


def check_trained_on(model, info: dict, folder) -> None:
    """SpecdecError unless `model` has the weights the checkpoint in `folder` (its `info`) was trained on."""
    if target_fingerprint(model) != info.get("drafter_sha256"):
        raise SpecdecError(f"the checkpoint in {folder} was trained on {info.get('drafter')}'s weights, which "
                           f"{model.name} does not have")


def merged_state(model, lora) -> dict[str, torch.Tensor]:
    """`model`'s Hugging Face state dict with `lora` (adapters/lora.py's DraftAdapter) merged into its
    projections: W + B·A [out, in], summed in fp32. The model itself is left as it was."""
    hf = model.hf
    state = dict(hf.state_dict())
    prefix = hf.base_model_prefix + "."
    for name, shape in lora.shapes.items():
        weight = state.get(prefix + name + ".weight")
        if weight is None or tuple(weight.shape) != shape or not weight.is_floating_point():
            raise SpecdecError(f"{model.name}'s {name} is not a dense {shape[0]}x{shape[1]} weight; load the drafter "
                               "with fp32 or bf16 weights to export it")
        state[prefix + name + ".weight"] = (weight.float() + lora.delta(name).to(weight.device)).to(weight.dtype)
    return state


def write_hf_folder(model, state: dict, out: Path, extra_config: dict, dtype: torch.dtype | None = None) -> Path:
    """Write `state` as `model`'s Hugging Face folder in `out` (weights in `dtype`: default the
    config's own), with `extra_config` added to config.json, and the tokenizer."""
    hf = model.hf
    dtype = dtype or getattr(hf.config, "torch_dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    tied = {id(t): t.to(dtype).contiguous() for t in state.values()}  # one copy per shared tensor keeps ties tied
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out), state_dict={k: tied[id(v)] for k, v in state.items()}, safe_serialization=True)
    config = json.loads((out / CONFIG).read_text())
    name = str(dtype).removeprefix("torch.")
    config.update(**{key: name for key in ("torch_dtype", "dtype") if key in config or key == "torch_dtype"},
                  **extra_config)
    (out / CONFIG).write_text(json.dumps(config, indent=1))
    if model.tokenizer is not None:
        model.tokenizer.save_pretrained(str(out))
    return out


def source_dtype(source: str) -> torch.dtype | None:
    """The weights' dtype a drafter's own config.json names (a registry name or a folder), if any."""
    from ..models import catalogue as registry

    folder = registry.converted_dir(source) if source in registry.MODELS else Path(source)
    try:
        config = json.loads((folder / CONFIG).read_text())
    except (OSError, ValueError):
        return None
    name = config.get("torch_dtype") or config.get("dtype")
    return getattr(torch, name, None) if isinstance(name, str) else None


def _provenance(info: dict) -> dict:
    return {**{k: info.get(k) for k in ("drafter", "drafter_sha256", "target", "corpus", "tokens", "created")
               if k in info}, "exported": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def export_drafter(model, distilled, out: str | Path, dtype: torch.dtype | None = None) -> Path:
    """A distilled drafter as a plain Hugging Face folder in `out` for vLLM's draft_model method:
    `model` (the plain drafter the adapter was trained on, dense weights) with `distilled.adapter`
    merged in. Returns the folder."""
    out = new_folder(out)
    state = merged_state(model, distilled.adapter)
    return write_hf_folder(model, state, out, {"specdec": {"kind": "distilled drafter", **_provenance(distilled.info)}},
                           dtype)


def parallel_mask_id(model) -> int:
    """The id the exported parallel drafter's mask takes: the first row of the embedding table no
    tokenizer id reaches, else the table's last row (that token's embedding is given up)."""
    rows = model._decoder.get_input_embeddings().num_embeddings
    used = rows if model.tokenizer is None else len(model.tokenizer)
    return used if used < rows else rows - 1


def export_parallel(model, parallel, out: str | Path, dtype: torch.dtype | None = None) -> Path:
    """A parallel drafter (adapters/pard.py) as a Hugging Face folder in `out` for vLLM's draft_model
    method with parallel_drafting: `model` (the plain drafter it was trained on) with the LoRA
    merged into every row and the mask's embedding in row `parallel_mask_id(model)` (of the output
    head's too where the two are tied), named in config.json as `pard_token` and `mask_token_id`.
    Returns the folder."""
    out = new_folder(out)
    adapter = parallel.adapter
    state = merged_state(model, adapter.lora)
    embedding = model._decoder.get_input_embeddings().weight
    mask = parallel_mask_id(model)
    keys = [k for k, v in state.items() if v.data_ptr() == embedding.data_ptr()]  # the input table, and a tied head
    rows = embedding.detach().clone()
    rows[mask] = adapter.mask.to(rows.dtype).to(rows.device)
    for key in keys:
        state[key] = rows
    info = {**_provenance(parallel.info), "kind": "parallel drafter", "k": adapter.k,
            "mask_replaces_token": mask == model._decoder.get_input_embeddings().num_embeddings - 1}
    return write_hf_folder(model, state, out, {"pard_token": mask, "mask_token_id": mask, "specdec": info}, dtype)
