"""Loading language models and running them with a KV cache that can be cropped.

`load(name_or_path)` accepts a registry name (see `registry.MODELS`), a local Hugging Face model
directory, or a `.gguf` file. The returned `LanguageModel` exposes the few operations the decoding
loops need: a forward pass over new tokens that extends a cache and returns fp32 logits for the
last few positions, and a crop of that cache back to a shorter prefix.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from . import registry
from .errors import SpecdecError
from .kernels import PackedLinear, has_onednn, pack_linears


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
    if dtype != "auto":
        raise SpecdecError(f"unknown dtype '{dtype}'; use auto, fp32, bf16 or fp16")
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if role == "drafter":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


class LanguageModel:
    """A causal LM with its tokenizer, run one sequence at a time with a croppable KV cache."""

    def __init__(self, hf_model, tokenizer=None, name: str = "model", role: str = "target", kernels: str = "auto"):
        """Wrap a transformers causal LM.

        role: "target" or "drafter". On the CPU it picks the linear kernels (kernels.py): a
            target in fp32 gets oneDNN-packed linears; a drafter in bf16 on a CPU without native
            bf16 gets hybrid ones. A target's logits are computed in fp32 even from bf16 weights
            (they decide the output); a drafter's are not (they only steer acceptance).
        kernels: "auto" (as above) or "stock" (leave transformers' linear layers alone).
            Packed weights live in oneDNN's layout: move or cast `hf_model` before wrapping it,
            not after (`.to()` cannot move them).
        """
        if kernels not in ("auto", "stock"):
            raise SpecdecError(f"kernels must be 'auto' or 'stock', got {kernels!r}")
        if role not in ("target", "drafter"):
            raise SpecdecError(f"role must be 'target' or 'drafter', got {role!r}")
        self.hf = hf_model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.role = role
        self._decoder = getattr(hf_model, hf_model.base_model_prefix)
        head = hf_model.get_output_embeddings()
        weight = head.weight
        self._device, self._dtype = weight.device, weight.dtype
        self._head_bias = getattr(head, "bias", None)
        self._head_weight = weight
        self._head = None
        self.kernels = "stock"
        on_cpu = self._device.type == "cpu" and has_onednn() and kernels == "auto"
        if on_cpu and self._dtype == torch.float32:
            pack_linears(self._decoder)
            self.kernels = "onednn-packed"
            # our forward uses a packed head; transformers' own calls (generate) get it too,
            # unless the head is tied to the embedding, which must stay dense
            self._head = PackedLinear(weight, self._head_bias)
            if not getattr(hf_model.config, "tie_word_embeddings", False):
                hf_model.set_output_embeddings(self._head)
                self._head_weight = None  # let the dense copy go
        elif on_cpu and self._dtype == torch.bfloat16 and role == "drafter" and not cpu_has_native_bf16():
            pack_linears(self._decoder, dense_rows=2)
            self.kernels = "bf16+onednn-packed-fp32"
        # Logits are compared across 1-token and multi-token passes; bf16 logits tie often
        # (resolution 0.125 near 20), so a target's head is computed in fp32 (see DESIGN.md).
        self.exact_logits = role == "target"
        self._head_weight_fp32 = None
        if self.exact_logits and self._dtype != torch.float32 and self._device.type == "cpu":
            self._head_weight_fp32 = weight.detach().float()
        self._vocab_size = weight.shape[0]

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

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
        ids: list[int] = []
        for source in (getattr(self.hf, "generation_config", None), self.hf.config, self.tokenizer):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(v, int) and v not in ids:
                    ids.append(v)
        return ids

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.hf.config)

    @staticmethod
    def cache_length(cache) -> int:
        return cache.get_seq_length()

    @staticmethod
    def crop(cache, length: int) -> None:
        """Drop cached positions from `length` on (rejected draft tokens)."""
        remove = cache.get_seq_length() - length
        if remove > 0:
            cache.crop(-remove)

    @torch.inference_mode()
    def forward(self, input_ids: Sequence[int] | torch.Tensor, cache=None, num_logits: int = 1) -> torch.Tensor:
        """Run new tokens through the model, extending `cache` (if given).

        Args:
            input_ids: [T] new token ids, following what `cache` already holds.
            cache: a cache from `new_cache()`, or None for a cache-free pass.
            num_logits: how many of the last positions to return logits for.
        Returns:
            logits: [num_logits, V] fp32, for the last `num_logits` input positions.
        """
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=self.device).view(1, -1)
        out = self._decoder(input_ids=ids, past_key_values=cache, use_cache=cache is not None)
        return self._logits(out.last_hidden_state[0, -num_logits:])

    @torch.inference_mode()
    def forward_rows(self, input_ids: torch.Tensor, cache) -> torch.Tensor:
        """Several sequences at once (beam search): input_ids [B, T] new tokens after what each row
        of `cache` holds -> logits [B, V] fp32 at each row's last position."""
        out = self._decoder(input_ids=input_ids.to(self.device), past_key_values=cache, use_cache=True)
        return self._logits(out.last_hidden_state[:, -1])

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V] fp32 (see __init__ for which head computes them)."""
        if self._head is not None:
            return self._head(hidden)
        if self._head_weight_fp32 is not None:
            logits = torch.nn.functional.linear(hidden.float(), self._head_weight_fp32)
        elif self.dtype != torch.float32 and self.exact_logits:
            logits = _fp32_matmul(hidden, self._head_weight)
        else:
            logits = torch.nn.functional.linear(hidden, self._head_weight).float()
        if self._head_bias is not None:
            logits = logits + self._head_bias.float()
        return logits

    def encode(self, text: str, chat: bool = False) -> list[int]:
        """Text -> prompt token ids; with chat=True, wrapped in the model's chat template."""
        if self.tokenizer is None:
            raise SpecdecError(f"{self.name} has no tokenizer; pass token ids instead of text")
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise SpecdecError(f"{self.name} has no chat template; drop --chat")
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return list(ids)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _fp32_matmul(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden [T, H] @ weight[V, H]^T with fp32 accumulation and output (CUDA low-precision weights)."""
    try:
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError):  # builds without mm's out_dtype
        return torch.nn.functional.linear(hidden.float(), weight.float())


def load(name_or_path: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "auto",
         role: str = "target", kernels: str = "auto", say: Callable[[str], None] = lambda msg: None) -> LanguageModel:
    """Load a registry model name, a local Hugging Face directory, or a .gguf file.

    role: "target" or "drafter"; it steers dtype="auto" (see `resolve_dtype`, docs/KERNELS.md)
    and whether logits must be exact fp32. kernels: "auto" or "stock" (see LanguageModel).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if role not in ("target", "drafter"):
        raise SpecdecError(f"role must be 'target' or 'drafter', got {role!r}")
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device, role)
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

    say(f"loading {name} ({str(torch_dtype).removeprefix('torch.')}, {device})")
    start = time.perf_counter()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        extra = {"gguf_file": gguf_file} if gguf_file else {}
        hf_logging.disable_progress_bar()
        tokenizer = AutoTokenizer.from_pretrained(directory, **extra)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype, **extra)
    except OSError as exc:
        raise SpecdecError(f"could not load {name_or_path}: {exc}") from exc
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    model.to(device)
    wrapped = LanguageModel(model, tokenizer, name=name, role=role, kernels=kernels)
    say(f"loaded {name} in {time.perf_counter() - start:.1f} s")
    return wrapped


def check_pair(target: LanguageModel, drafter: LanguageModel) -> None:
    """Raise a clear error unless the drafter proposes tokens in the target's vocabulary."""
    if target.vocab_size != drafter.vocab_size:
        raise SpecdecError(
            f"vocabularies differ: target {target.name} has {target.vocab_size} ids, "
            f"drafter {drafter.name} has {drafter.vocab_size}; speculative decoding needs one shared vocabulary"
        )
    if target.tokenizer is not None and drafter.tokenizer is not None:
        if len(target.tokenizer) != len(drafter.tokenizer) or target.tokenizer.get_vocab() != drafter.tokenizer.get_vocab():
            raise SpecdecError(
                f"tokenizers differ: target {target.name} and drafter {drafter.name} map tokens to different ids"
            )
    if target.device != drafter.device:
        raise SpecdecError(f"target is on {target.device} but drafter on {drafter.device}; load both on one device")
