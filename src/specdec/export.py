"""Self-drafting heads trained here, written in the layout other engines load (`specdec export-heads`).

Medusa, for vLLM (`vllm/model_executor/models/medusa.py` and `transformers_utils/configs/medusa.py`):
a folder with `config.json` (model_type "medusa": hidden_size, vocab_size, num_heads,
num_hidden_layers 1 per head, truncated_vocab_size, medusa_fc_bias, original_lm_head) and
`model.safetensors` holding `blocks.{k}.layers.0.weight` [H, H] and `.bias` [H] (head k: h + SiLU(W h + b),
as ours), `lm_head.weight` [N, H] (the target's output-head rows for the N ids the heads score,
one head shared by all, as ours) and `token_map` [N] (those ids, which vLLM scatters the N logits
back to). vLLM's Medusa proposes head k's argmax as the token k + 1 ahead of the target's, as ours.

EAGLE is refused: vLLM's and SGLang's EAGLE layer feeds its first attention without a norm (the
reference EAGLE drops layer 0's input_layernorm), where ours normalises its input, so no mapping
of our weights onto their keys computes what ours does.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from .training.distill import head_rows
from .errors import SpecdecError
from .training.medusa import Heads, check_heads_target

FORMATS = ("medusa", "eagle")
CONFIG, WEIGHTS = "config.json", "model.safetensors"


def medusa_tensors(heads: Heads, target) -> dict[str, torch.Tensor]:
    """vLLM's Medusa state dict for `heads`, trained for `target` (whose head rows it copies)."""
    check_heads_target(heads, target)
    tensors = {}
    for k, block in enumerate(heads.heads.blocks):
        tensors[f"blocks.{k}.layers.0.weight"] = block.weight.detach().float().cpu().contiguous()
        tensors[f"blocks.{k}.layers.0.bias"] = block.bias.detach().float().cpu().contiguous()
    ids = heads.vocab_ids.long().cpu()
    tensors["lm_head.weight"] = head_rows(target, ids).detach().cpu().contiguous()
    tensors["token_map"] = ids.contiguous()
    return tensors


def medusa_config(heads: Heads, target) -> dict:
    """vLLM's Medusa config.json for `heads` (with specdec's provenance under "specdec")."""
    blocks = heads.heads.blocks
    dtype = str(getattr(target, "dtype", torch.float32)).removeprefix("torch.")
    return {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": blocks[0].in_features,
            "vocab_size": int(target.vocab_size), "num_heads": len(blocks), "num_hidden_layers": 1,
            "truncated_vocab_size": len(heads.vocab_ids), "medusa_fc_bias": True, "original_lm_head": True,
            "torch_dtype": dtype,
            "specdec": {**{k: heads.info.get(k) for k in ("target", "target_sha256", "corpus", "tokens",
                                                           "heldout_top1", "created")},
                        "exported": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}}


def check_format(fmt: str) -> None:
    """SpecdecError unless heads can be exported in `fmt`."""
    if fmt == "eagle":
        raise SpecdecError("EAGLE heads cannot be exported: vLLM's and SGLang's EAGLE layer attends without an "
                           "input norm, ours normalises its input, so their layer would compute another function")
    if fmt not in FORMATS:
        raise SpecdecError(f"unknown format {fmt!r}; use medusa")


def export_heads(heads: Heads, target, out: str | Path, fmt: str = "medusa") -> Path:
    """Write `heads` (trained for `target`) into `out` in `fmt`'s layout; returns the folder."""
    from safetensors.torch import save_file

    check_format(fmt)
    out = Path(out).expanduser()
    if out.exists() and any(out.iterdir()):
        raise SpecdecError(f"{out} is not empty; export into a new folder")
    tensors, config = medusa_tensors(heads, target), medusa_config(heads, target)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS))
    (out / CONFIG).write_text(json.dumps(config, indent=1))
    return out
