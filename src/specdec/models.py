"""Loading language models and running them with a KV cache that can be cropped.

`load(name_or_path)` accepts a registry name (see `registry.MODELS`), a local Hugging Face model
directory, or a `.gguf` file. The returned `LanguageModel` exposes the few operations the decoding
loops need: a forward pass over new tokens that extends a cache and returns fp32 logits for the
last few positions, and a crop of that cache back to a shorter prefix.
"""

from __future__ import annotations

import time
import weakref
from pathlib import Path
from typing import Callable, Sequence

import torch

from . import registry
from .errors import SpecdecError
from .heads import check_output_transform, max_row_norm, output_transform
from .kernels import (Int8Linear, PackedLinear, has_onednn, int8_fits, int8_supported, pack_linears,
                      pad_single_rows, quantize_linears, row_stable_linear)
from .rows import PREFIX, install_attention, refine_top_logits, row_exact
from .trees import tree_attention
from .vocab import check_vocab_options, restrict_drafter_vocabulary


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SpecdecError("device 'cuda' was asked for, but no CUDA device is available")
    return device


def cpu_has_native_bf16() -> bool:
    """True when the CPU computes bf16 natively (AMX or AVX512-BF16), where bf16 beats fp32.

    Without it (e.g. AVX2-only CPUs) bf16 matmuls are emulated: a 1-token forward is still
    cheaper than fp32 (half the weight traffic), but the cost grows linearly with the number of
    tokens scored at once, which removes the point of speculative decoding. See docs/KERNELS.md.
    """
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a private probe: absent in some builds
        return False


def cpu_has_amx() -> bool:
    """True when the CPU has AMX tiles (Linux's `amx_tile` flag). There bf16 matmuls cost about the
    same for 1 and 16 rows, so a drafter's int8 short path pays only up to 2 rows; on a CPU with
    native bf16 but no AMX (AVX512-BF16) it paid up to 8 (`int8_short_rows`). Elsewhere, or where
    the flags cannot be read, False."""
    try:
        with open("/proc/cpuinfo") as info:
            return any(line.startswith("flags") and " amx_tile" in line for line in info)
    except OSError:
        return False


def int8_short_rows() -> int:
    """The most rows a drafter's int8 layers and head take before its bf16 path does, where bf16 is
    native: 2 on AMX (issue 13's probe: break-even with bf16 at 2-3 rows), 8 without AMX (on the
    AVX512-BF16 EPYC a 0.5B drafter pass of 3-4 tokens took 23 ms in int8 against 44 in bf16, of
    8 tokens 39 against 49, and bf16 won at 16; `scripts/row_cost.py --drafter`, docs/KERNELS.md)."""
    return 2 if cpu_has_amx() else 8


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, role: str = "target") -> torch.dtype:
    """The working dtype. "auto": bf16 on CUDA and on CPUs with native bf16; on other CPUs fp32
    for a target (multi-token passes, see kernels.py) and bf16 for a drafter (1-token passes,
    where half the weight traffic wins and its rounding can only cost acceptance, never exactness).
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
             "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
    if dtype in names:
        return names[dtype]
    if dtype == "int8":
        return torch.bfloat16  # int8 weights, bf16 activations (`use_int8`)
    if dtype != "auto":
        raise SpecdecError(f"unknown dtype '{dtype}'; use auto, fp32, bf16, fp16, gguf or (drafters) int8")
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if role == "drafter":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def use_int8(dtype: str | torch.dtype, device: torch.device, role: str = "target") -> bool:
    """Whether a model loaded with `dtype` gets int8 weight-only linears (kernels.Int8Linear).

    "int8" asks for them (drafters only: a target's weights decide the output); "auto" picks
    them for a drafter on the CPU, where its 1-2-token passes are bound by weight traffic and
    int8 reads half of bf16's bytes (docs/KERNELS.md). CUDA keeps bf16: torch's int8 op is a CPU one.
    """
    if dtype == "int8":
        if role != "drafter":
            raise SpecdecError("int8 weights are for drafters only: rounding a target's weights changes its output")
        if not int8_supported(device):
            raise SpecdecError(f"int8 drafter weights need torch's CPU int8 kernel, which {device} lacks; "
                               "use --drafter-dtype bf16")
        return True
    return dtype == "auto" and role == "drafter" and int8_supported(device)


class LanguageModel:
    """A causal LM with its tokenizer, run one sequence at a time with a croppable KV cache."""

    def __init__(self, hf_model, tokenizer=None, name: str = "model", role: str = "target", kernels: str = "auto",
                 exact_rows: bool | None = None, int8: bool = False):
        """Wrap a transformers causal LM.

        role: "target" or "drafter". On the CPU it picks the linear kernels (kernels.py): a
            target in fp32 gets oneDNN-packed linears; a drafter in bf16 on a CPU without native
            bf16 gets hybrid ones. A target's logits are fp32-exact where they decide the output
            (see `_logits`); a drafter's need not be (they only steer acceptance).
        kernels: "auto" (as above) or "stock" (leave transformers' linear layers alone).
            Packed weights live in oneDNN's layout: move or cast `hf_model` before wrapping it,
            not after (`.to()` cannot move them).
        exact_rows: compute every row of a multi-token pass bit for bit as a one-token pass
            would (rows.py), so that greedy speculative output is token-identical to greedy AR
            by construction. None: on for a bf16 target on the CPU (nearly free there); off for
            fp32 (where it slows 1-token passes), for drafters and on CUDA.
        int8: (drafters, CPU) int8 weight-only linears and output head for passes of a few
            tokens (`kernels.Int8Linear`); longer passes keep the paths above.
        """
        if kernels not in ("auto", "stock"):
            raise SpecdecError(f"kernels must be 'auto' or 'stock', got {kernels!r}")
        if role not in ("target", "drafter"):
            raise SpecdecError(f"role must be 'target' or 'drafter', got {role!r}")
        if int8 and (role != "drafter" or not int8_supported(hf_model.get_output_embeddings().weight.device)):
            raise SpecdecError("int8 weights are for drafters on the CPU only")
        self.hf = hf_model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.role = role
        self._decoder = getattr(hf_model, hf_model.base_model_prefix)
        head = hf_model.get_output_embeddings()
        weight = head.weight
        self._device, self._dtype = weight.device, weight.dtype
        self._transform = output_transform(hf_model.config)
        if self._transform is not None or role == "target":
            check_output_transform(self, hf_model)
        self._head_bias = getattr(head, "bias", None)
        self._head_weight = weight
        self._head = None
        self._head_row_norm = None
        self.kernels = "stock"
        on_cpu = self._device.type == "cpu" and has_onednn() and kernels == "auto"
        if on_cpu and self._dtype == torch.float32 and not int8:
            pack_linears(self._decoder)
            self.kernels = "onednn-packed"
            # our forward uses a packed head; transformers' own calls (generate) get it too,
            # unless the head is tied to the embedding, which must stay dense
            self._head = PackedLinear(weight, self._head_bias)
            if not getattr(hf_model.config, "tie_word_embeddings", False):
                hf_model.set_output_embeddings(self._head)
                if role == "target":  # a drafter keeps it for a head of its own (`restrict_vocabulary`)
                    self._head_weight = None  # let the dense copy go
        elif on_cpu and role == "drafter" and not cpu_has_native_bf16() and (int8 or self._dtype == torch.bfloat16):
            # int8 beat packed fp32 up to 16 rows (measured on the AVX512-BF16 EPYC, not on AVX2);
            # emulated bf16 beats packed fp32 only up to 2
            pack_linears(self._decoder, dense_rows=0 if int8 else 2, int8_rows=16 if int8 else 0)
            self.kernels = "int8+onednn-packed-fp32" if int8 else "bf16+onednn-packed-fp32"
        elif int8:
            # native bf16 grows slowly with rows on AMX, where int8 wins for 1-2 rows; up to 8 without
            quantize_linears(self._decoder, short_rows=int8_short_rows())
            self.kernels = f"int8+{str(self._dtype).removeprefix('torch.')}"
        self.int8 = bool(int8)
        self._vocab_ids: torch.Tensor | None = None
        self._draft_head: torch.nn.Module | None = None
        self.exact_logits = role == "target"
        if self.exact_logits and self._head is None and self._dtype != torch.float32 and self._device.type == "cpu":
            self._head_row_norm = max_row_norm(weight)
        if exact_rows is None:
            # on where it is nearly free: bf16 linears give row-invariant results at any row count,
            # so only attention changes. Packed fp32 needs 1-row passes computed as 2-row ones,
            # which made the 1.5B target's 1-token pass 1.6x slower on an AVX2 CPU (docs/KERNELS.md).
            exact_rows = role == "target" and self._device.type == "cpu" and self._dtype == torch.bfloat16 and \
                hf_model.config._attn_implementation in ("sdpa", "eager")
        if exact_rows or hf_model.config._attn_implementation in ("sdpa", "eager"):
            install_attention(hf_model)  # row-exact passes, and cheaper one-query ones either way
        if exact_rows:
            if self.kernels == "stock" and self._device.type == "cpu":
                pad_single_rows(self._decoder)
        self.exact_rows = bool(exact_rows)
        self._vocab_size = weight.shape[0]
        self.last_hidden: torch.Tensor | None = None  # [num_logits, H] of the last `forward`
        self.pass_hidden: torch.Tensor | None = None  # [T, H] every input's, of the last `forward` or `prefill`
        if int8:
            self._build_draft_head()

    @property
    def draft_vocabulary(self) -> int | None:
        """How many ids the output head scores (None: all of them); see `restrict_vocabulary`."""
        return None if self._vocab_ids is None else len(self._vocab_ids)

    @torch.inference_mode()
    def restrict_vocabulary(self, ids: Sequence[int] | torch.Tensor | None) -> None:
        """Score only `ids` in the output head from now on (FR-Spec, Zhao et al. 2025); None: all.

        Logits keep their full width V, -inf outside `ids`, so a drafter's q is exactly 0 there
        and verification stays exact. Drafters only: a target's logits decide the output.
        """
        if self.role != "drafter":
            raise SpecdecError("a restricted vocabulary is for drafters only: it would change the target's output")
        if ids is None:
            self._vocab_ids = None
        else:
            ids = torch.as_tensor(ids, dtype=torch.long).flatten().unique()
            if len(ids) == 0 or int(ids[0]) < 0 or int(ids[-1]) >= self._vocab_size:
                raise SpecdecError(f"a draft vocabulary must be a non-empty set of ids in [0, {self._vocab_size})")
            self._vocab_ids = ids.to(self.device)
        self._build_draft_head()

    def _build_draft_head(self) -> None:
        """The drafter's own output head over its scored ids: int8 for few rows where `int8`."""
        if self._head_weight is None:
            raise SpecdecError(f"{self.name}: its output head was packed away; a drafter keeps it dense")
        weight, bias = self._head_weight, self._head_bias
        if self._vocab_ids is not None:
            weight = weight.index_select(0, self._vocab_ids)
            bias = None if bias is None else bias.index_select(0, self._vocab_ids)
        if not self.int8 and self._vocab_ids is None:
            self._draft_head = None
            return
        long = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=self.device,
                               dtype=weight.dtype)
        long.weight = torch.nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            long.bias = torch.nn.Parameter(bias, requires_grad=False)
        # the head's long path is plain bf16. int8 beat it up to 8 rows on the AVX512-BF16 EPYC, up
        # to 2-3 on AMX (issue 13's probe)
        short_rows = int8_short_rows() if cpu_has_native_bf16() else 8
        self._draft_head = Int8Linear(weight, bias, long, short_rows) if self.int8 and int8_fits(long) else long

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def hidden_size(self) -> int:
        """Width of the final hidden states (`last_hidden`)."""
        return int(self._head_weight.shape[1] if self._head_weight is not None else self._head.in_features)

    @property
    def vocab_size(self) -> int:
        """Size of the logits' last dimension (may exceed the tokenizer's count by padding rows)."""
        return self._vocab_size

    @property
    def max_context(self) -> int:
        return int(getattr(self.hf.config, "max_position_embeddings", 0) or 1 << 30)

    @property
    def eos_token_ids(self) -> list[int]:
        """All ids that end a generation: the generation config's and the tokenizer's EOS."""
        return eos_ids([getattr(self.hf, "generation_config", None), self.hf.config, self.tokenizer])

    def new_cache(self):
        """An empty KV cache that `crop` can roll back.

        Sliding-window layers (Mistral, Gemma 2/3) drop keys older than their window as they go,
        after which they cannot be cropped; with past recording on (as in transformers' assisted
        generation) they keep a pass's keys until the next `crop` trims them back to the window.
        `cache_length` counts every position of the sequence either way.
        """
        from transformers import DynamicCache

        cache = DynamicCache(config=self.hf.config)
        cache.activate_past_recording()
        return cache

    @staticmethod
    def cache_length(cache) -> int:
        return cache.get_seq_length()

    @staticmethod
    def crop(cache, length: int) -> None:
        """Drop cached positions from `length` on (rejected draft tokens).

        Sliding-window layers that record their past are trimmed back to their window even when
        nothing is dropped. Raises SpecdecError where the cache cannot go back to `length`: layers
        with a recurrent state (Mamba-like), or a sliding layer asked to drop more than the
        tokens fed since its last crop (their keys are gone).
        """
        current = cache.get_seq_length()
        remove = current - length
        layers = getattr(cache, "layers", ())
        if remove > 0:
            if not getattr(cache, "is_croppable", True):
                raise SpecdecError("this model's cache cannot be rolled back (a recurrent state); "
                                   "speculative decoding needs a croppable KV cache")
            for layer in layers:
                if getattr(layer, "is_sliding", False) and getattr(layer, "is_initialized", False) and \
                        layer.keys.shape[-2] - remove < min(layer.sliding_window - 1, length):
                    raise SpecdecError(f"cannot crop a sliding-window cache from {current} to {length} tokens: "
                                       "it keeps only the window and the tokens fed since its last crop")
            cache.crop(-remove)
        elif remove == 0 and current > 0 and any(getattr(layer, "record_past", False) for layer in layers):
            cache.crop(0)  # restrict sliding layers to their window

    @torch.inference_mode()
    def forward(self, input_ids: Sequence[int] | torch.Tensor, cache=None, num_logits: int = 1,
                parents: Sequence[int] | None = None, tree_start: int | None = None) -> torch.Tensor:
        """Run new tokens through the model, extending `cache` (if given).

        Args:
            input_ids: [T] new token ids, following what `cache` already holds.
            cache: a cache from `new_cache()`, or None for a cache-free pass.
            num_logits: how many of the last positions to return logits for.
            parents: [T] a token tree over the inputs (trees.py, `input_parents`): each token's
                parent among them (-1: it follows the cache). Each token then sees the cache and
                its ancestors only, at position (cache length + depth - 1). None: a chain.
            tree_start: where the tree region begins in the cache (default: the cache's length).
                Earlier: the cache already holds the region's first tokens (a tree grown one
                depth per pass); `parents` then covers the whole region, cached tokens first.
        Returns:
            logits: [num_logits, V] fp32, for the last `num_logits` input positions; with
            `exact_rows`, each row bit for bit what a one-token pass at its position returns
            (for a tree: a one-token pass after the cache and the token's ancestors).
        The final hidden states of those positions, [num_logits, H] (what the output head read),
        are kept in `last_hidden` until the next pass, and those of every input, [T, H], in
        `pass_hidden`: self-drafting heads draft from them.
        """
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=self.device).view(1, -1)
        extra = {} if parents is None else self._tree_inputs(parents, cache, ids.shape[1], tree_start)
        with row_exact(self.exact_rows):
            out = self._decoder(input_ids=ids, past_key_values=cache, use_cache=cache is not None, **extra)
            self.pass_hidden = out.last_hidden_state[0]
            self.last_hidden = self.pass_hidden[-num_logits:]
            return self._logits(self.last_hidden)

    def _tree_inputs(self, parents: Sequence[int], cache, new: int, tree_start: int | None) -> dict:
        """The 4D attention mask and position ids of a tree pass; SpecdecError where the model
        cannot take them."""
        config = self.hf.config
        implementation = config._attn_implementation.removeprefix(PREFIX)
        if implementation not in ("sdpa", "eager"):
            raise SpecdecError(f"token trees need sdpa or eager attention (a custom 4D mask), not "
                               f"{implementation!r}; load the model with attn_implementation='sdpa'")
        if getattr(config, "sliding_window", None) and (getattr(config, "use_sliding_window", True) or
                                                        "sliding_attention" in (getattr(config, "layer_types", None) or ())):
            raise SpecdecError(f"token trees are not supported for {self.name}: its sliding-window attention "
                               "would need a window in the tree mask; use a chain drafter")
        cached = 0 if cache is None else self.cache_length(cache)
        past = cached if tree_start is None else tree_start
        if past + len(parents) != cached + new:
            raise SpecdecError(f"tree region of {len(parents)} tokens from position {past} does not end where "
                               f"the {new} new tokens after {cached} cached ones do")
        mask, positions = tree_attention(parents, past, self.dtype, self.device, additive=implementation == "eager",
                                         new=new)
        return {"attention_mask": mask, "position_ids": positions}

    @staticmethod
    @torch.inference_mode()
    def compact(cache, start: int, offsets: Sequence[int]) -> None:
        """Keep the cache's first `start` positions and then those at start + offsets (ascending),
        moved into place; drop the rest: what stays of a tree pass is the accepted path.

        A main-chain path (offsets 0..k-1) is a plain `crop`.
        """
        offsets = [int(o) for o in offsets]
        if offsets != list(range(len(offsets))):
            for layer in getattr(cache, "layers", ()):
                if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
                    continue
                index = torch.tensor([start + o for o in offsets], dtype=torch.long, device=layer.keys.device)
                # index_select copies first, so overlapping source and destination are safe
                layer.keys[..., start:start + len(offsets), :] = layer.keys.index_select(-2, index)
                layer.values[..., start:start + len(offsets), :] = layer.values.index_select(-2, index)
        LanguageModel.crop(cache, start + len(offsets))

    @torch.inference_mode()
    def prefill(self, prompt: Sequence[int], cache) -> list[int]:
        """Feed all of `prompt` but its last token into `cache` in one batched pass (no logits) and
        return what is left to score, [prompt[-1]].

        Both decoding loops start this way, so the prompt's cache entries come from one identical
        call, and the first token (or first draft) is scored by a row-exact pass like every later
        one: the prompt needs no row-exact attention (a call per prompt token per layer). Without
        `exact_rows` nothing is fed here and the whole prompt is left to the first scoring pass.
        The fed positions' final hidden states are kept in `pass_hidden` ([0, H] when none).
        """
        prompt = list(prompt)
        self.pass_hidden = torch.zeros(0, self.hidden_size, dtype=self.dtype, device=self.device)
        if not self.exact_rows:
            return prompt
        if len(prompt) > 1:
            ids = torch.as_tensor(prompt[:-1], dtype=torch.long, device=self.device).view(1, -1)
            with row_exact(False):
                self.pass_hidden = self._decoder(input_ids=ids, past_key_values=cache, use_cache=True).last_hidden_state[0]
        return prompt[-1:]

    @torch.inference_mode()
    def forward_rows(self, input_ids: torch.Tensor, cache) -> torch.Tensor:
        """Several sequences at once (beam search): input_ids [B, T] new tokens after what each row
        of `cache` holds -> logits [B, V] fp32 at each row's last position."""
        out = self._decoder(input_ids=input_ids.to(self.device), past_key_values=cache, use_cache=True)
        return self._logits(out.last_hidden_state[:, -1])

    def _logits(self, hidden: torch.Tensor, exact: bool | None = None) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V] fp32, after the model's own output transform.

        A target's head is exact in fp32 where it decides the output, and row-invariant: fp32
        weights go through the packed head; bf16 weights on the CPU through a bf16 head whose
        near-top candidates are re-scored in fp32 (`rows.refine_top_logits`; an fp32 copy of a
        151,936-row head would double the bytes read per token); low-precision weights on CUDA
        through a matmul with fp32 accumulation. A drafter's own head (int8, or over its frequent
        ids only: `restrict_vocabulary`) need not be exact; it returns -inf for the ids it skips.
        exact=False skips a target's refinements (its layers drafting for it: drafters/layerskip.py).
        """
        exact = self.exact_logits if exact is None else exact
        if self._draft_head is not None:
            scored = self._draft_head(hidden).float()
            if self._transform is not None:  # before the scatter: a soft cap would lift -inf to -cap
                scored = self._transform(scored)
            if self._vocab_ids is None:
                return scored
            logits = scored.new_full((*scored.shape[:-1], self._vocab_size), float("-inf"))
            logits[..., self._vocab_ids] = scored
            return logits
        if self._head is not None:
            logits = self._head(hidden)
        elif self._head_row_norm is not None and exact:
            flat = hidden.reshape(-1, hidden.shape[-1])
            logits = row_stable_linear(flat, self._head_weight).float()
            logits = refine_top_logits(logits, flat, self._head_weight, self._head_row_norm)
            logits = logits.view(*hidden.shape[:-1], -1)
        elif self.dtype != torch.float32 and exact:
            logits = _fp32_matmul(hidden, self._head_weight)
        else:
            logits = torch.nn.functional.linear(hidden, self._head_weight).float()
        if self._head_bias is not None and self._head is None:
            logits = logits + self._head_bias.float()
        return logits if self._transform is None else self._transform(logits)

    def encode(self, text: str, chat: bool = False) -> list[int]:
        """Text -> prompt token ids (`encode_text`)."""
        return encode_text(self.tokenizer, self.name, text, chat)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return decode_ids(self.tokenizer, ids, skip_special_tokens)


def encode_text(tokenizer, name: str, text: str, chat: bool = False) -> list[int]:
    """Text -> prompt token ids; with chat=True, wrapped in the model's chat template.

    Plain text starts with BOS where the tokenizer's own default encoding adds one (Llama,
    Gemma; not Qwen or SmolLM2), once even if the text already starts with it; never EOS.
    """
    if tokenizer is None:
        raise SpecdecError(f"{name} has no tokenizer; pass token ids instead of text")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise SpecdecError(f"{name} has no chat template; drop --chat")
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    ids = tokenizer.encode(text, add_special_tokens=False)
    bos = tokenizer.bos_token_id
    if bos is not None and ids[:1] != [bos]:
        default = tokenizer.encode(text)  # the tokenizer's own choice of special tokens
        if default[:1] == [bos] and default[1:len(ids) + 1] == ids:
            ids = [bos] + ids
    return ids


def decode_ids(tokenizer, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    if tokenizer is None:
        return " ".join(map(str, ids))
    return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _fp32_matmul(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden [T, H] @ weight[V, H]^T with fp32 accumulation and output (CUDA low-precision weights)."""
    try:
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError):  # builds without mm's out_dtype
        return torch.nn.functional.linear(hidden.float(), weight.float())


# FR-Spec's head size for the default drafter: docs/KERNELS.md, "A cheaper drafter"
DRAFTER_VOCAB = 65536


def load(name_or_path: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "auto",
         role: str = "target", kernels: str = "auto", exact_rows: bool | None = None,
         say: Callable[[str], None] = lambda msg: None, vocab: int | None = None,
         vocab_corpus: str | Path | None = None) -> LanguageModel:
    """Load a registry model name, a local Hugging Face directory, or a .gguf file.

    dtype: "auto", "fp32", "bf16", "fp16", "int8" (drafters) for transformers' model, or "gguf":
    the GGUF file's own quantized weights on llama.cpp (backends/llamacpp.py; registry models
    and .gguf files; needs the `peers` extra).
    role: "target" or "drafter"; it steers dtype="auto" (see `resolve_dtype`, `use_int8`,
    docs/KERNELS.md) and whether logits must be exact fp32. kernels: "auto" or "stock";
    exact_rows: None (auto), True or False (see LanguageModel).
    vocab: (drafters) how many of the most frequent ids the output head scores (vocab.py): None
    for the default (`DRAFTER_VOCAB` where the vocabulary is over twice that), 0 for all.
    vocab_corpus: a text file to count frequencies in (default: Python's standard library).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if role not in ("target", "drafter"):
        raise SpecdecError(f"role must be 'target' or 'drafter', got {role!r}")
    if role == "target" and (vocab or vocab_corpus):
        raise SpecdecError("a restricted vocabulary is for drafters only: it would change the target's output")
    check_vocab_options(vocab, vocab_corpus)
    if dtype in GGUF_WEIGHTS:
        return _load_gguf(name_or_path, device, role, vocab, say, exact_rows)
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device, role)
    int8 = use_int8(dtype, device, role)
    text = str(name_or_path)
    path = Path(text).expanduser()
    gguf_file = None
    if text in registry.MODELS:
        directory, name = registry.require_installed(text), text
    elif path.is_dir():
        if not (path / "config.json").exists():
            raise SpecdecError(f"{path} is a directory without config.json: not a Hugging Face model directory")
        directory, name = path, path.name
    elif path.suffix == ".gguf":
        if not path.is_file():
            raise SpecdecError(f"GGUF file not found: {path}")
        directory, name, gguf_file = path.parent, path.stem, path.name
    else:
        registry.spec(text)  # raises the "unknown model" error listing the options
        raise AssertionError("unreachable")

    say(f"loading {name} ({'int8' if int8 else str(torch_dtype).removeprefix('torch.')}, {device})")
    start = time.perf_counter()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    part = "tokenizer"
    try:
        extra = {"gguf_file": gguf_file} if gguf_file else {}
        hf_logging.disable_progress_bar()
        tokenizer = AutoTokenizer.from_pretrained(directory, **extra)
        part = "weights"
        # Mismatched shapes are reported by _check_loading_info with the tensor's name; transformers'
        # own error only points at a report that the silenced logger never prints.
        model, info = AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype, output_loading_info=True,
                                                           ignore_mismatched_sizes=True, **extra)
        _check_loading_info(model, info)
        part = "model"
        model.to(device)
        wrapped = LanguageModel(model, tokenizer, name=name, role=role, kernels=kernels, exact_rows=exact_rows,
                                int8=int8)
        if role == "drafter":
            part = "vocabulary"
            if vocab is None:
                vocab = DRAFTER_VOCAB if wrapped.vocab_size > 2 * DRAFTER_VOCAB else 0
            restrict_drafter_vocabulary(wrapped, vocab, vocab_corpus, say)
    except SpecdecError as exc:
        raise SpecdecError(f"could not load {name_or_path}: {exc}") from exc
    except Exception as exc:  # transformers, safetensors and torch each raise their own types
        raise SpecdecError(f"could not load {name_or_path} ({part}): {_one_line(exc)}") from exc
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    say(f"loaded {name} in {time.perf_counter() - start:.1f} s")
    return wrapped


def auto_weights(name: str, device: str | torch.device = "auto", on_llama_cpp: bool = True) -> str:
    """What `--dtype auto` means for `name` in the CLI's generate and chat: "gguf" (the GGUF file's
    own quantized weights on llama.cpp) where that is the fastest exact choice, else "auto"
    (transformers' weights, `resolve_dtype`).

    "gguf" needs all of: the device is the CPU; llama-cpp-python is installed (the `peers` extra);
    `name` is a registry model whose GGUF file is kept; and the method runs on llama.cpp
    (on_llama_cpp: chains, not trees or self-drafting). On every CPU measured so far the GGUF's
    4-bit weights decode several times faster than transformers' bf16 or fp32 ones (docs/KERNELS.md:
    our AR 5.4x on an AVX512-BF16 EPYC, and faster than our best speculative method on
    transformers' weights there and on an AMX Xeon); the library's `load` keeps "auto" =
    transformers, whose models every feature takes.
    """
    if not on_llama_cpp or resolve_device(device).type != "cpu" or name not in registry.MODELS:
        return "auto"
    from .backends.llamacpp import available

    root = registry.model_root(name)
    if not (registry.is_installed(name) and (root / registry.spec(name).gguf_name).is_file() and available()):
        return "auto"
    return "gguf"


GGUF_WEIGHTS = ("gguf",)  # the dtype names that mean "the GGUF file's own quantized weights, on llama.cpp"


def _load_gguf(name_or_path: str | Path, device, role: str, vocab: int | None,
               say: Callable[[str], None], exact_rows: bool | None = None):
    """A registry model's GGUF file, or a .gguf path, on the llama.cpp backend (backends/llamacpp.py)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from .backends.llamacpp import LlamaCppModel, import_llama_cpp

    import_llama_cpp()  # before anything loads: a missing extra is the first thing to say
    if str(device) not in ("auto", "cpu"):
        raise SpecdecError(f"GGUF weights run on llama.cpp's CPU build here, not on {device}; use --device cpu "
                           "or --dtype bf16")
    if vocab:
        raise SpecdecError("--drafter-vocab applies to transformers drafters; a GGUF drafter scores its whole vocabulary")
    text = str(name_or_path)
    path = Path(text).expanduser()
    eos = None
    if text in registry.MODELS:
        directory, name = registry.require_installed(text), text
        gguf_path = registry.model_root(text) / registry.spec(text).gguf_name
        if not gguf_path.is_file():
            raise SpecdecError(f"{text}'s GGUF file is gone from {gguf_path.parent} (installed without keeping it?); "
                               f"run `specdec install {text}` again")
        tokenizer = AutoTokenizer.from_pretrained(directory)
        try:
            generation = GenerationConfig.from_pretrained(directory)
        except OSError:  # a model without one
            generation = None
        eos = eos_ids([generation, AutoConfig.from_pretrained(directory), tokenizer])
    elif path.suffix == ".gguf":
        if not path.is_file():
            raise SpecdecError(f"GGUF file not found: {path}")
        gguf_path, name = path, path.stem
        try:
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        except Exception as exc:  # transformers' GGUF reader raises its own types on files it cannot read
            raise SpecdecError(f"could not load {text} (tokenizer): {_one_line(exc)}") from exc
    else:
        raise SpecdecError(f"--dtype gguf needs a registry model or a .gguf file, not {text}")
    say(f"loading {name} (its GGUF weights on llama.cpp)")
    start = time.perf_counter()
    model = LlamaCppModel(gguf_path, tokenizer, name=name, role=role, eos_token_ids=eos or None,
                          exact_rows=exact_rows)
    say(f"loaded {name} in {time.perf_counter() - start:.1f} s")
    return model


def eos_ids(sources) -> list[int]:
    """The EOS ids that `sources` (generation config, model config, tokenizer; None skipped) name."""
    ids: list[int] = []
    for source in sources:
        value = getattr(source, "eos_token_id", None) if source is not None else None
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and v not in ids:
                ids.append(v)
    return ids


def check_pair(target: LanguageModel, drafter: LanguageModel) -> None:
    """Raise a clear error unless the drafter proposes tokens in the target's vocabulary.

    With both tokenizers at hand, their token -> id maps must be equal; the output heads may be
    padded to different widths (Qwen2.5-7B: 152,064 rows, 0.5B: 151,936), since `ModelDrafter`
    gives q over the target's ids. Without a tokenizer on either side, the widths must be equal.
    """
    if target.tokenizer is not None and drafter.tokenizer is not None:
        if len(target.tokenizer) != len(drafter.tokenizer) or not _same_vocabulary(target.tokenizer, drafter.tokenizer):
            raise SpecdecError(
                f"tokenizers differ: target {target.name} and drafter {drafter.name} map tokens to different ids"
            )
    elif target.vocab_size != drafter.vocab_size:
        raise SpecdecError(
            f"vocabularies differ: target {target.name} has {target.vocab_size} ids, "
            f"drafter {drafter.name} has {drafter.vocab_size}; speculative decoding needs one shared vocabulary"
        )
    if target.device != drafter.device:
        raise SpecdecError(f"target is on {target.device} but drafter on {drafter.device}; load both on one device")


# tokenizer -> the tokenizers (and their lengths) found to map every token to the same id: building
# two 151,665-entry vocabularies took 0.17 s, at every generation (a chat turn, a bench run)
_SAME_VOCABULARY: "weakref.WeakKeyDictionary[object, weakref.WeakKeyDictionary[object, int]]" = \
    weakref.WeakKeyDictionary()


def _same_vocabulary(a, b) -> bool:
    """a.get_vocab() == b.get_vocab(), remembered for the pair while neither grows (tokens added)."""
    try:
        known = _SAME_VOCABULARY.setdefault(a, weakref.WeakKeyDictionary())
        if known.get(b) == len(a) == len(b):
            return True
    except TypeError:  # a tokenizer that cannot be weakly referenced: compare every time
        return a.get_vocab() == b.get_vocab()
    same = a.get_vocab() == b.get_vocab()
    if same:
        known[b] = len(a)
    return same


def _check_loading_info(model, info: dict) -> None:
    """Raise SpecdecError if the checkpoint left any parameter at its random initial value.

    transformers fills missing or wrongly shaped tensors with random values and only logs it, which
    would make a broken checkpoint generate fluent-looking garbage.
    """
    mismatched = sorted(info.get("mismatched_keys") or (), key=lambda entry: entry[0])
    if mismatched:
        key, in_checkpoint, in_model = mismatched[0]
        more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
        raise SpecdecError(f"{len(mismatched)} tensor(s) have the wrong shape: {key} is {list(in_checkpoint)} "
                           f"in the checkpoint but the model's config expects {list(in_model)}{more}")
    missing = _unexplained_missing(model, set(info.get("missing_keys") or ()))
    if missing:
        shown = ", ".join(missing[:5]) + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
        raise SpecdecError(f"the checkpoint lacks {len(missing)} tensor(s) the model needs: {shown}")


def _unexplained_missing(model, missing: set[str]) -> list[str]:
    """The missing names that really are absent: not buffers (rotary inv_freq and the like, computed at
    init) and not aliases of a loaded tensor (tied output embeddings are saved once, as the input's)."""
    names_of: dict[int, list[str]] = {}
    for param_name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(param_name)
    loaded_alias = {n for names in names_of.values() if any(m not in missing for m in names) for n in names}
    buffers = {buffer_name for buffer_name, _ in model.named_buffers(remove_duplicate=False)}
    return sorted(key for key in missing if key not in loaded_alias and key not in buffers)


def _one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception as one short line: its first paragraph, whitespace collapsed, with its type."""
    text = " ".join(str(exc).split("\n\n")[0].split())
    text = text if len(text) <= limit else text[: limit - 1] + "…"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
