"""What some models do to their logits after the output head, and a check that we do the same.

`TransformersModel` computes `hidden @ W` itself (to keep the head exact and row-invariant), so it
must also apply what a model's own forward applies after that product, or its sampling would
follow another law than the model's: Gemma-2/3's final soft-capping, Cohere's `logit_scale`,
Granite's `logits_scaling`. A model that transforms its logits in a way not listed here is
refused by `check_output_transform` rather than run wrongly.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..errors import SpecdecError

Transform = Callable[[torch.Tensor], torch.Tensor]


def output_transform(config) -> Transform | None:
    """The function a model's forward applies to fp32 logits [..., V] after the head, or None."""
    config = getattr(config, "get_text_config", lambda: config)()
    steps: list[Transform] = []
    scale = getattr(config, "logit_scale", None)  # Cohere: logits * scale
    if isinstance(scale, (int, float)) and scale != 1:
        steps.append(lambda x, s=float(scale): x * s)
    divisor = getattr(config, "logits_scaling", None)  # Granite: logits / scaling
    if isinstance(divisor, (int, float)) and divisor != 1:
        steps.append(lambda x, d=float(divisor): x / d)
    cap = getattr(config, "final_logit_softcapping", None)  # Gemma 2/3: cap · tanh(logits / cap)
    if isinstance(cap, (int, float)) and cap > 0:
        steps.append(lambda x, c=float(cap): torch.tanh(x / c) * c)
    if not steps:
        return None

    def transform(logits: torch.Tensor) -> torch.Tensor:
        for step in steps:
            logits = step(logits)
        return logits
    return transform


@torch.inference_mode()
def check_output_transform(model, hf_model) -> None:
    """Raise SpecdecError unless `model`'s logits follow `hf_model`'s own forward on a few tokens.

    Run before any kernel is swapped: both sides then use the same head, and what can differ is
    only what happens after it (up to the model dtype's rounding).
    """
    vocab = hf_model.get_output_embeddings().weight.shape[0]
    ids = (torch.arange(3, device=model.device) % vocab).view(1, -1)
    try:
        reference = hf_model(input_ids=ids, use_cache=False).logits[0].float()
        hidden = getattr(hf_model, hf_model.base_model_prefix)(input_ids=ids, use_cache=False).last_hidden_state[0]
    except Exception as exc:  # noqa: BLE001 - any failure of the model's own forward is reported alike
        raise SpecdecError(f"{model.name}: the model's own forward fails ({type(exc).__name__}: {exc})") from exc
    ours = hf_model.get_output_embeddings()(hidden).float()
    if model._transform is not None:
        ours = model._transform(ours)
    exact = hf_model.dtype == torch.float32
    tolerance = (1e-4 if exact else 2e-2) * float(reference.abs().max()) + (1e-4 if exact else 1e-2)
    gap = float((ours - reference).abs().max())
    if gap > tolerance:
        raise SpecdecError(
            f"{model.name} ({type(hf_model).__name__}) transforms its logits after the output head in a way "
            f"specdec does not know (max difference {gap:.3g}); sampling would not follow the model's law"
        )


def max_row_norm(weight: torch.Tensor, chunk: int = 16384) -> float:
    """max over rows of ||weight[v]||₂ for weight [V, H], in fp32, without an fp32 copy of it all."""
    weight = weight.detach()
    return max(float(weight[i:i + chunk].float().norm(dim=-1).max()) for i in range(0, weight.shape[0], chunk))
