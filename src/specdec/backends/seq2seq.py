"""Encoder-decoder models (T5, BART) as targets and drafters.

The encoder runs once per source text for each model (`Seq2SeqModel.bind`); what the decoding
loops then drive is the decoder (`BoundDecoder`): a Backend whose "prompt" is the decoder's start
token and whose cache holds its own self-attention keys beside the cross-attention keys of the
encoded source. Drafts and verification run on the decoders with their own caches, cropped on
rejection like a decoder-only model's, so the whole speculative loop applies unchanged
(`loop.speculative_generate_encoder_decoder`). Chains only: no tree masks, no batched engine.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..errors import SpecdecError
from . import Features
from .text import eos_ids


class Seq2SeqModel:
    """A transformers encoder-decoder (`AutoModelForSeq2SeqLM`), its tokenizer (or None) and name."""

    role = None  # the loader gives encoder-decoders no role (roles.check_roles then compares sizes alone)
    kernels = "encoder-decoder"

    def __init__(self, hf_model, tokenizer=None, name: str | None = None):
        config = hf_model.config
        if not getattr(config, "is_encoder_decoder", False):
            raise SpecdecError(f"{name or config.model_type} is not an encoder-decoder model")
        self.hf = hf_model.eval()
        self.num_parameters = sum(p.numel() for p in hf_model.parameters())  # roles.check_roles
        self.tokenizer = tokenizer
        self.name = name or config.model_type
        self.device = next(hf_model.parameters()).device
        self.dtype = next(hf_model.parameters()).dtype
        self.weights = str(self.dtype).removeprefix("torch.")  # the Backend protocol's: which weights run
        self.vocab_size = hf_model.get_output_embeddings().weight.shape[0]
        start = config.decoder_start_token_id
        if start is None:
            raise SpecdecError(f"{self.name}'s config names no decoder_start_token_id")
        self.decoder_start_token_id = int(start)
        self.eos_token_ids = eos_ids([getattr(hf_model, "generation_config", None), config, tokenizer])
        self.max_context = int(getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
                               or 512)

    def features(self) -> Features:
        """What this model does beyond `Backend` (`backends.Features`): nothing (chains, one sequence)."""
        return Features(tree_masks=False)

    def encode(self, text: str) -> list[int]:
        """The source text's ids (with the tokenizer's own special tokens, e.g. T5's closing </s>)."""
        if self.tokenizer is None:
            raise SpecdecError(f"{self.name} has no tokenizer: give token ids")
        return list(self.tokenizer(text).input_ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            raise SpecdecError(f"{self.name} has no tokenizer to decode with")
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @torch.inference_mode()
    def bind(self, source_ids: Sequence[int]) -> "BoundDecoder":
        """Encode `source_ids` [S] once -> the decoder conditioned on them."""
        source = [int(t) for t in source_ids]
        if not source:
            raise SpecdecError("the source text encodes to no tokens")
        if max(source) >= self.hf.get_input_embeddings().num_embeddings or min(source) < 0:
            raise SpecdecError(f"source ids must lie in [0, {self.hf.get_input_embeddings().num_embeddings}) "
                               f"for {self.name}")
        ids = torch.tensor([source], device=self.device)
        mask = torch.ones_like(ids)
        encoded = self.hf.get_encoder()(input_ids=ids, attention_mask=mask)
        return BoundDecoder(self, encoded, mask)


class BoundDecoder:
    """One source's decoder: what `speculative_generate` and `autoregressive_generate` drive.

    forward(input_ids [T], cache, num_logits) -> logits [num_logits, V] fp32, as TransformersModel's
    (chains only). Each `new_cache` is an `EncoderDecoderCache`: the decoder's self-attention keys,
    which `crop_cache` rolls back, and the cross-attention keys, computed from the encoded source
    at the cache's first pass and kept.
    """

    tree_masks = False  # relative position biases (T5) take no tree positions here: chains only
    exact_rows = False
    kernels = "encoder-decoder"

    def __init__(self, model: Seq2SeqModel, encoded, mask: torch.Tensor):
        self.model, self.hf, self.tokenizer = model, model.hf, model.tokenizer
        self.name, self.device, self.dtype, self.weights = model.name, model.device, model.dtype, model.weights
        self.role, self.num_parameters = model.role, model.num_parameters
        self.vocab_size, self.eos_token_ids, self.max_context = model.vocab_size, model.eos_token_ids, model.max_context
        self.encoded, self.mask = encoded, mask

    def features(self) -> Features:
        """What this decoder does beyond `Backend` (`backends.Features`): chains, one sequence a pass."""
        return Features(tree_masks=False, embedded=self.hf.get_input_embeddings().num_embeddings)

    def new_cache(self):
        from transformers.cache_utils import DynamicCache, EncoderDecoderCache

        return EncoderDecoderCache(DynamicCache(), DynamicCache())

    def prefill(self, prompt: Sequence[int], cache) -> list[int]:
        """Feed all of the decoder prompt (its start token, and any forced prefix) but the last token."""
        prompt = list(prompt)
        if len(prompt) > 1:
            self.forward(prompt[:-1], cache, 1)
        return prompt[-1:]

    @torch.inference_mode()
    def forward(self, input_ids: Sequence[int] | torch.Tensor, cache=None, num_logits: int = 1,
                parents: Sequence[int] | None = None, tree_start: int | None = None) -> torch.Tensor:
        if parents is not None:
            raise SpecdecError(f"token trees are not supported on encoder-decoder models ({self.name}); use a chain")
        ids = torch.as_tensor(list(input_ids) if not torch.is_tensor(input_ids) else input_ids,
                              dtype=torch.long, device=self.device).view(1, -1)
        out = self.hf(encoder_outputs=self.encoded, attention_mask=self.mask, decoder_input_ids=ids,
                      past_key_values=cache if cache is not None else self.new_cache(), use_cache=True)
        return out.logits[0, -num_logits:].float()
