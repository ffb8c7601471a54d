"""Model backends: the `Backend` protocol (what the decoding loops and drafters need from a model)
and one file per backend behind it:

- `transformers.py`: a Hugging Face causal LM (`TransformersModel`), row-exact passes, token trees;
- `llamacpp.py`: a GGUF file's own quantized weights on llama.cpp (`LlamaCppModel`), chains only;
- `captured.py`: a Llama-family model's passes as CUDA graphs over static buffers (`CapturedModel`),
  with the fused kernels of `fused.py`, chains only;
- `cache.py`: rolling either backend's KV cache back to what verification kept.

`models.load` picks and builds one. tests/test_layout.py checks that both satisfy the protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from ..errors import SpecdecError


class Cache(Protocol):
    """A KV cache the loops can measure and roll back (transformers' DynamicCache is one)."""

    def get_seq_length(self) -> int:
        """Positions held."""

    def crop(self, max_length: int) -> None:
        """Keep the first `max_length` positions (negative: drop that many from the end)."""


class Backend(Protocol):
    """The surface `autoregressive_generate`, `speculative_generate` and the drafters use."""

    name: str
    role: str  # "target" or "drafter"
    tokenizer: object  # a transformers tokenizer (check_pair compares them), or None
    exact_rows: bool  # each row of a k-token pass equals a 1-token pass, bit for bit
    kernels: str  # what runs the weights, for reports
    weights: str  # which weights run, for every output: "bfloat16", "float32", "float16", "int8" or "gguf"
    tree_masks: bool  # whether `forward` takes `parents`; speculative_generate checks it
    num_parameters: int | None  # the weights it holds (roles.check_roles); None: unknown

    device: torch.device
    dtype: torch.dtype  # of the logits' computation (reports); logits are returned in fp32
    vocab_size: int  # the logits' width
    max_context: int
    eos_token_ids: list[int]
    # the final hidden states [num_logits, H] of the last `forward`, and [T, H] of every input of
    # the last `forward` or `prefill`; None on a backend that does not read them (llama.cpp's).
    # Self-drafting heads need them, and a `hidden_size`, and refuse a backend without
    last_hidden: torch.Tensor | None
    pass_hidden: torch.Tensor | None

    def features(self) -> Features:
        """What this model does beyond this protocol (`Features`), declared by its class."""

    def new_cache(self) -> Cache:
        """An empty cache."""

    def prefill(self, prompt: Sequence[int], cache: Cache) -> list[int]:
        """Feed the prompt's unscored part; return the ids left for the first scoring pass."""

    def forward(self, input_ids: Sequence[int] | torch.Tensor, cache: Cache | None = None, num_logits: int = 1,
                parents: Sequence[int] | None = None, tree_start: int | None = None) -> torch.Tensor:
        """[T] new ids -> logits [num_logits, V] fp32 of the last positions (a token tree under
        `parents` where the backend supports tree masks; SpecdecError where it does not)."""

    def encode(self, text: str, chat: bool = False) -> list[int]:
        """Text -> prompt ids."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Ids -> text."""


@dataclass(frozen=True)
class Features:
    """What a loaded model can do beyond the `Backend` protocol, as the loops and the engine need
    it; every backend class declares them (a `features()` method), none is derived by probing.

    batched: `forward_batch` (`BatchedBackend`): several sequences' rows in one pass.
    exact_rows: each row of a k-token pass equals a 1-token pass, bit for bit.
    rows_invariant: ... batched passes included, whatever shares them (int8 layers: not).
    tree_masks: `forward` takes `parents` (token trees).
    prompt_cache: `new_cache(prompt=, chunk=)` starts from a kept earlier prompt's entries.
    keeps_prompts: `keep_prompt(cache)` once a prompt is in (transformers' prompt store).
    sequences: the most caches live at once (llama.cpp's streams); None: any number.
    kv_bytes_per_token: bytes a cached position takes (the engine's budget); None: unknown.
    parallel_k: tokens a pass proposes, where a parallel drafting adapter is installed
        (adapters/pard.py `make_parallel`); None: one, as any causal model.
    online: the learner updating this drafter model between requests (adapters/lora.py
        `OnlineDistiller`, `--online`), which the loop tells of each rejection; None: none.
    embedded: the ids its input embeddings cover (a drafter feeds a stand-in for a target id past
        them); None: every id the target gives.
    shared_prefill: > 0 where several prompts can share one pass (`prefill_batch`), each cache
        getting the bits its own `prefill` gives: prompts of at most this many ids, fed row-exactly;
        0: none.
    shared_chunks: longer prompts' chunks may share that pass too, attending causally as alone.
    """

    batched: bool = False
    exact_rows: bool = False
    rows_invariant: bool = False
    tree_masks: bool = True
    prompt_cache: bool = False
    keeps_prompts: bool = False
    sequences: int | None = None
    kv_bytes_per_token: int | None = None
    parallel_k: int | None = None
    online: object | None = None
    embedded: int | None = None
    shared_prefill: int = 0
    shared_chunks: bool = False


def declares_features(model) -> bool:
    """Whether `model`'s class declares `features()`: the mark of a model backend."""
    return callable(getattr(type(model), "features", None))  # the class's declaration, never the instance's members


def features(model) -> Features:
    """The `Features` `model`'s class declares (`features()`); SpecdecError for a model whose class
    declares none (every backend, wrapper and test double declares them: nothing is derived by probing)."""
    if not declares_features(model):
        raise SpecdecError(f"{type(model).__name__} declares no features(): a model backend's class declares what "
                           "it does beyond the Backend protocol (specdec.backends.Features)")
    return model.features()


@dataclass
class Segment:
    """One sequence's part of a batched pass (`BatchedBackend.forward_batch`): what `forward` takes
    for that sequence alone."""

    input_ids: Sequence[int]  # [T >= 1] new ids after what `cache` holds
    cache: Cache
    num_logits: int = 1
    parents: Sequence[int] | None = None  # a token tree over the inputs, as in `forward`
    tree_start: int | None = None


class BatchedBackend(Backend, Protocol):
    """A backend that scores several sequences' new tokens in one pass (transformers' on the CPU,
    llama.cpp's)."""

    def forward_batch(self, segments: Sequence[Segment]) -> list[torch.Tensor]:
        """One pass over every segment's tokens, each seeing only its own cache and tree -> per
        segment logits [num_logits, V] fp32, bit for bit what `forward` returns for it alone."""

    def prefill_batch(self, prompts: Sequence[tuple[Sequence[int], Cache]],
                      segments: Sequence[Segment] = ()) -> list[torch.Tensor]:
        """`prefill` for several prompts (or prompts up to their next chunk's end) in one pass, each
        cache getting the bits its own `prefill` gives it; only where `Features.shared_prefill` > 0,
        and prompts past that many ids only where `Features.shared_chunks`. Other sequences'
        `segments` are scored in the same pass -> their logits, as `forward_batch` returns them."""
