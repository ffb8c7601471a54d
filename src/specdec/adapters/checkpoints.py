"""What every trained drafting module's checkpoint shares at run time (Medusa heads,
medusa_heads.py; the EAGLE layer, eagle_layer.py; a distilled drafter's adapter, lora.py; a
parallel drafter's, pard.py).

- The target's identity (`target_fingerprint`) and its frozen output head (`head_rows`).
- A checkpoint folder per kind: the weights (safetensors) and a json of shapes and provenance,
  written last, so that a folder without the json is an unfinished one (`save_checkpoint`,
  `read_checkpoint`), and the check that one was trained for a given target.

training/ fits the modules and writes their checkpoints through `save_checkpoint`.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..models import catalogue as registry
from ..errors import SpecdecError

FORMAT = 1
# kind -> (weights file, json file), and how the kind is named in messages
FILES = {"medusa": ("heads.safetensors", "medusa.json"), "eagle": ("eagle.safetensors", "eagle.json"),
         "adapter": ("adapter.safetensors", "adapter.json"), "parallel": ("parallel.safetensors", "parallel.json")}
TITLES = {"medusa": "Medusa heads", "eagle": "EAGLE drafter", "adapter": "distilled drafter adapter",
          "parallel": "parallel drafter"}  # "a ... checkpoint"
MAKERS = {"medusa": "specdec train-heads --kind medusa", "eagle": "specdec train-heads --kind eagle",
          "adapter": "specdec distill-drafter", "parallel": "specdec train-parallel-drafter"}
SPECS = {"medusa": "medusa:DIR", "eagle": "eagle:DIR", "adapter": "distilled:DIR", "parallel": "parallel:DIR"}  # how --drafter names each


def target_fingerprint(model) -> str:
    """What a checkpoint's target is: the registry file's sha256 for an embedded model, else the
    sha256 of its output head's first rows in bf16 (equal for fp32 and bf16 loads of one model)."""
    spec = registry.MODELS.get(model.name)
    if spec is not None:
        return spec.sha256
    rows = head_rows(model, torch.arange(min(1024, model.vocab_size)))
    data = rows.to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes()
    return hashlib.sha256(data + str(tuple(rows.shape)).encode()).hexdigest()


def head_rows(model, ids: torch.Tensor) -> torch.Tensor:
    """The target's output-head rows for `ids` [N] -> [N, H] (its weight dtype; fp32 when packed)."""
    from ..backends.transformers import TransformersModel

    if not isinstance(model, TransformersModel):  # the other backends keep their head in their own form
        raise SpecdecError(f"{model.name}: its output head cannot be read for self-drafting heads ({model.kernels}); "
                           "use --dtype auto (transformers' weights)")
    weight = model._head_weight
    if weight is None:  # packed for the CPU's kernels (a PackedLinear), the dense copy let go
        weight = model._head.packed_weight.to_dense()
    return weight.index_select(0, ids.to(weight.device))


def bound_copy(module: nn.Module, store: dict, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A copy of a checkpoint's `module` on `device` in `dtype`, kept in `store` (made once per
    pair): drafters never convert the loaded weights in place, which another target may need."""
    if (device, dtype) not in store:
        store[device, dtype] = copy.deepcopy(module).to(device=device, dtype=dtype)
    return store[device, dtype]


def check_reads_hidden(target) -> None:
    """SpecdecError unless the loop can hand `target`'s hidden states to a self-drafter."""
    from ..backends.captured import CapturedModel
    from ..backends.transformers import TransformersModel

    if not isinstance(target, (TransformersModel, CapturedModel)):  # the backends that keep `hidden_size`
        raise SpecdecError(f"self-drafting heads need a target whose hidden states can be read; {target.name} "
                           f"({target.kernels}) gives none; use --dtype auto (transformers' weights)")


def check_checkpoint_target(info: dict, vocab_ids: torch.Tensor, target, title: str) -> None:
    """SpecdecError unless a checkpoint (`info`, its scored `vocab_ids`) was trained for `target`:
    the same weights, width and vocabulary."""
    check_reads_hidden(target)
    if info["hidden_size"] != target.hidden_size:
        raise SpecdecError(f"this {title} checkpoint was trained for hidden size {info['hidden_size']} "
                           f"({info.get('target', '?')}), but {target.name} has {target.hidden_size}")
    if int(vocab_ids.max()) >= target.vocab_size:
        raise SpecdecError(f"this {title} checkpoint scores ids up to {int(vocab_ids.max())}, past "
                           f"{target.name}'s vocabulary of {target.vocab_size}")
    fingerprint = target_fingerprint(target)
    if info.get("target_sha256") != fingerprint:
        raise SpecdecError(f"this {title} checkpoint was trained for {info.get('target', '?')} "
                           f"(sha256 {str(info.get('target_sha256'))[:12]}…), not {target.name} "
                           f"(sha256 {fingerprint[:12]}…); train one for this target")


# ---------------------------------------------------------------- checkpoints


def save_checkpoint(folder: str | Path, kind: str, module: nn.Module, vocab_ids: torch.Tensor, info: dict) -> None:
    """Write `module`'s weights, the scored ids and `info` into `folder` (the json last)."""
    from safetensors.torch import save_file

    weights, config = FILES[kind]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: value.detach().float().cpu().contiguous() for name, value in module.state_dict().items()}
    tensors["vocab_ids"] = vocab_ids.long().contiguous()
    save_file(tensors, str(folder / weights))
    partial = folder / (config + ".part")
    partial.write_text(json.dumps({**info, "format": FORMAT, "kind": kind, "vocab_ids": len(vocab_ids)}, indent=1))
    partial.replace(folder / config)


def read_checkpoint(folder: str | Path, kind: str, build: Callable[[dict], nn.Module]
                    ) -> tuple[nn.Module, torch.Tensor, dict]:
    """(module, scored ids [N], info) of a checkpoint folder of `kind`; `build(info)` makes the
    empty module its json describes. SpecdecError naming what is wrong with a missing, damaged or
    other-kind folder."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder).expanduser()
    weights, config = FILES[kind]
    title = TITLES[kind]
    if not (folder / config).is_file():
        other = [k for k, (_, c) in FILES.items() if k != kind and (folder / c).is_file()]
        hint = f"; it holds a {TITLES[other[0]]} checkpoint (--drafter {SPECS[other[0]]})" if other else \
            f" (make one with `{MAKERS[kind]}`)"
        raise SpecdecError(f"no {title} checkpoint in {folder}: {config} is missing{hint}")
    try:
        info = json.loads((folder / config).read_text())
        if not isinstance(info, dict):
            raise ValueError("not an object")
    except (json.JSONDecodeError, ValueError) as exc:
        raise SpecdecError(f"{title} in {folder}: {config} is damaged ({type(exc).__name__}: {exc})") from None
    if info.get("kind") != kind or info.get("format") != FORMAT:
        raise SpecdecError(f"{folder} holds {info.get('kind')!r} heads of format {info.get('format')!r}, "
                           f"not a {title} checkpoint of format {FORMAT}")
    try:
        module = build(info)
        vocab = int(info["vocab_ids"])
    except (KeyError, TypeError, ValueError) as exc:
        raise SpecdecError(f"{title} in {folder}: {config} is damaged ({type(exc).__name__}: {exc})") from None
    try:
        tensors = load_file(str(folder / weights))
    except (OSError, SafetensorError, RuntimeError) as exc:
        raise SpecdecError(f"{title} in {folder}: {weights} cannot be read ({exc})") from None
    ids = tensors.pop("vocab_ids", None)
    expected = {name: tuple(value.shape) for name, value in module.state_dict().items()}
    found = {name: tuple(value.shape) for name, value in tensors.items()}
    if ids is None or ids.shape != (vocab,) or found != expected:
        raise SpecdecError(f"{title} in {folder}: {weights} does not match {config} "
                           f"(shapes or the {vocab} scored ids differ)")
    module.load_state_dict(tensors)
    return module.eval().requires_grad_(False), ids.long(), info
