"""Loading: `load(name_or_path)` takes a registry name (see `registry.MODELS`), a local Hugging Face
model directory, or a `.gguf` file, picks the weights for this machine (`resolve_dtype`,
`use_int8`), and returns a backend model: `backends.transformers.TransformersModel`, or with
dtype="gguf" `backends.llamacpp.LlamaCppModel`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch

from . import catalogue as registry
from ..backends.transformers import TransformersModel
from ..errors import SpecdecError
from ..backends.kernels import CUDA_ROWS, fast_bf16, int8_supported
from ..backends.text import eos_ids
from .vocab import check_vocab_options, restrict_drafter_vocabulary


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SpecdecError("device 'cuda' was asked for, but no CUDA device is available")
    return device

def resolve_dtype(dtype: str | torch.dtype, device: torch.device, role: str = "target") -> torch.dtype:
    """The working dtype. "auto": bf16 on CUDA, on CPUs with native bf16 and where our tiled kernel
    runs bf16 weights (AVX512 without BF16: `kernels.fast_bf16`); on other CPUs fp32 for a target
    (multi-token passes, see backends/kernels.py) and bf16 for a drafter (1-token passes, where half
    the weight traffic wins and its rounding can only cost acceptance, never exactness).
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
    return torch.bfloat16 if fast_bf16() else torch.float32


def use_int8(dtype: str | torch.dtype, device: torch.device, role: str = "target") -> bool:
    """Whether a model loaded with `dtype` gets int8 weight-only linears (kernels.Int8Linear).

    "int8" asks for them (drafters only: a target's weights decide the output); "auto" picks
    them for a drafter on the CPU, where its 1-2-token passes are bound by weight traffic and
    int8 reads half of bf16's bytes (docs/kernels.md). CUDA keeps bf16: torch's int8 op is a CPU one.
    """
    if dtype == "int8":
        if role != "drafter":
            raise SpecdecError("int8 weights are for drafters only: rounding a target's weights changes its output")
        if not int8_supported(device):
            raise SpecdecError(f"int8 drafter weights need torch's CPU int8 kernel, which {device} lacks; "
                               "use --drafter-dtype bf16")
        return True
    return dtype == "auto" and role == "drafter" and int8_supported(device)

# FR-Spec's head size for the default drafter: docs/kernels.md, "A cheaper drafter"
DRAFTER_VOCAB = 65536
PROMPT_CACHE_MEMORY = 256 * 2**20  # bytes of kept prompts on transformers' weights, by default


def load(name_or_path: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "auto",
         role: str = "target", kernels: str = "auto", exact_rows: bool | None = None,
         say: Callable[[str], None] = lambda msg: None, vocab: int | None = None,
         vocab_corpus: str | Path | None = None, sequences: int = 1, prompt_cache: bool | int = False) -> TransformersModel:
    """Load a registry model name, a local Hugging Face directory, or a .gguf file.

    dtype: "auto", "fp32", "bf16", "fp16", "int8" (drafters) for transformers' model, or "gguf":
    the GGUF file's own quantized weights on llama.cpp (backends/llamacpp.py; registry models
    and .gguf files; needs the `peers` extra).
    role: "target" or "drafter"; it steers dtype="auto" (see `resolve_dtype`, `use_int8`,
    docs/kernels.md) and whether logits must be exact fp32. kernels: "auto" or "stock" (for GGUF
    weights "auto" or "plain"), or "captured" (CUDA: a Llama-family model's passes as CUDA graphs,
    `backends.captured.CapturedModel`, chains only); exact_rows: None (auto), True or False (see
    TransformersModel; captured passes are row-exact unless False).
    vocab: (drafters) how many of the most frequent ids the output head scores (models/vocab.py): None
    for the default (`DRAFTER_VOCAB` where the vocabulary is over twice that), 0 for all.
    vocab_corpus: a text file to count frequencies in (default: Python's standard library).
    sequences: (GGUF weights and captured passes) how many sequences may be live at once
    (`LlamaCppModel`, `CapturedModel`); a transformers model holds any number.
    prompt_cache: keep finished prompts' entries for later prompts that start alike: on GGUF weights in free KV streams (`LlamaCppModel`), on
    transformers' as copies of up to PROMPT_CACHE_MEMORY bytes, or as many as an int says
    (`TransformersModel.use_prompt_cache`: targets and drafter models with row-exact passes, else
    none; GGUF drafters keep none).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if role not in ("target", "drafter"):
        raise SpecdecError(f"role must be 'target' or 'drafter', got {role!r}")
    if role == "target" and (vocab or vocab_corpus):
        raise SpecdecError("a restricted vocabulary is for drafters only: it would change the target's output")
    check_vocab_options(vocab, vocab_corpus)
    for prefix in (DISTILLED, PARALLEL):
        if str(name_or_path).startswith(prefix):
            return _load_adapted(prefix, str(name_or_path).removeprefix(prefix), dtype, role,
                                 lambda base: load(base, dtype, device, role, kernels, exact_rows, say, vocab, vocab_corpus))
    if dtype in GGUF_WEIGHTS:
        # a GGUF drafter keeps no prompts: its KV streams hold only live sequences
        return _load_gguf(name_or_path, device, role, vocab, say, exact_rows, kernels, sequences,
                          bool(prompt_cache) and role == "target")
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device, role)
    int8 = use_int8(dtype, device, role)
    if kernels == "captured":
        _check_captured(device, torch_dtype, int8, vocab, vocab_corpus, prompt_cache)
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
        if gguf_file is None and _is_encoder_decoder(directory):
            raise SpecdecError("an encoder-decoder model (T5, BART): load it with specdec.load_seq2seq, and "
                               "generate with speculative_generate_encoder_decoder")
        part = "weights"
        # Mismatched shapes are reported by _check_loading_info with the tensor's name; transformers'
        # own error only points at a report that the silenced logger never prints.
        model, info = AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype, output_loading_info=True,
                                                           ignore_mismatched_sizes=True, **extra)
        _check_loading_info(model, info)
        part = "model"
        model.to(device)
        if kernels == "captured":
            from ..backends.captured import CapturedModel

            wrapped = CapturedModel(model, tokenizer, name=name, role=role, sequences=sequences,
                                    rows=None if exact_rows is False else CUDA_ROWS)
            say(f"captured passes ({wrapped.kernels}), {sequences} sequence(s) of up to {wrapped.max_context} positions")
            return _loaded(wrapped, text, name, start, say)
        wrapped = TransformersModel(model, tokenizer, name=name, role=role, kernels=kernels, exact_rows=exact_rows,
                                int8=int8)
        if prompt_cache and wrapped.exact_rows:
            wrapped.use_prompt_cache(PROMPT_CACHE_MEMORY if prompt_cache is True else int(prompt_cache))
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
    return _loaded(wrapped, text, name, start, say)


def _loaded(wrapped, text: str, name: str, start: float, say: Callable[[str], None]):
    say(f"loaded {name} in {time.perf_counter() - start:.1f} s")
    wrapped.source = text  # what loads it again (a distilled drafter's checkpoint names its drafter so)
    return wrapped


def _check_captured(device: torch.device, dtype: torch.dtype, int8: bool, vocab: int | None,
                    vocab_corpus, prompt_cache) -> None:
    """SpecdecError, before any weights load, where captured passes cannot serve."""
    if device.type != "cuda":
        raise SpecdecError(f"kernels='captured' replays CUDA graphs: it needs a CUDA device, not {device}; "
                           "use kernels='auto'")
    if int8 or dtype not in (torch.bfloat16, torch.float16):
        raise SpecdecError("captured passes run bf16 or fp16 weights (flash attention); pass dtype='bf16'")
    if vocab or vocab_corpus:
        raise SpecdecError("captured passes score the whole vocabulary; drop the drafter vocabulary options")
    if prompt_cache:
        raise SpecdecError("captured passes keep no prompt cache yet; load without one")


def _load_adapted(prefix: str, folder: str, dtype, role: str,
                  load_base: Callable[[str], TransformersModel]) -> TransformersModel:
    """`distilled:DIR` or `parallel:DIR`: the drafter an adapter checkpoint (adapters/lora.py, adapters/pard.py)
    was trained on, with it attached."""
    from ..adapters.lora import load_distilled
    from ..adapters.pard import load_parallel

    kind = "a distilled" if prefix == DISTILLED else "a parallel"
    if role != "drafter":
        raise SpecdecError(f"{prefix}{folder} is a drafter ({kind} adapter on a drafter model), not a {role}")
    if dtype in GGUF_WEIGHTS:
        raise SpecdecError(f"{prefix}{folder}: {kind} drafter runs on transformers' weights, not --drafter-dtype "
                           f"{dtype} (use auto, bf16, fp32 or int8)")
    return (load_distilled if prefix == DISTILLED else load_parallel)(folder, load_base)


def _is_encoder_decoder(directory) -> bool:
    """Whether a model directory's config is an encoder-decoder's; False where it cannot be read
    (the loader then says what is wrong with it)."""
    from transformers import AutoConfig

    try:
        return bool(getattr(AutoConfig.from_pretrained(directory), "is_encoder_decoder", False))
    except Exception:  # transformers raises several types for a config it cannot take
        return False


def load_seq2seq(path: str | Path, dtype: str | torch.dtype = "fp32", device: str | torch.device = "auto",
                 say: Callable[[str], None] = lambda msg: None):
    """A local Hugging Face encoder-decoder directory (T5, BART) -> `backends.seq2seq.Seq2SeqModel`
    with its tokenizer (`encode(text)` -> ids, `decode(ids)` -> text). dtype: "fp32" (default),
    "bf16" or "fp16"; nothing here is row-exact, and the loop is the chain loop."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from ..backends.seq2seq import Seq2SeqModel

    directory = Path(str(path)).expanduser()
    if not (directory / "config.json").exists():
        raise SpecdecError(f"{directory} is not a Hugging Face model directory (no config.json)")
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    torch_dtype = dtypes.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if not isinstance(torch_dtype, torch.dtype):
        raise SpecdecError(f"dtype for an encoder-decoder model is one of {', '.join(dtypes)}, not {dtype!r}")
    say(f"loading {directory.name} (encoder-decoder, {str(torch_dtype).removeprefix('torch.')})")
    part = "tokenizer"
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
        part = "weights"
        model = AutoModelForSeq2SeqLM.from_pretrained(directory, dtype=torch_dtype)
        return Seq2SeqModel(model.to(resolve_device(device)), tokenizer, name=directory.name)
    except SpecdecError as exc:
        raise SpecdecError(f"could not load {path}: {exc}") from exc
    except Exception as exc:
        raise SpecdecError(f"could not load {path} ({part}): {_one_line(exc)}") from exc


DISTILLED = "distilled:"  # --drafter distilled:DIR, a drafter with a distilled adapter (adapters/lora.py)
PARALLEL = "parallel:"  # --drafter parallel:DIR, a drafter adapted to propose k tokens a pass (adapters/pard.py)
GGUF_WEIGHTS = ("gguf",)  # the dtype names that mean "the GGUF file's own quantized weights, on llama.cpp"
GGUF_KERNELS = ("auto", "plain")  # ggml's repacked weights, or its stock per-row kernels


def _load_gguf(name_or_path: str | Path, device, role: str, vocab: int | None,
               say: Callable[[str], None], exact_rows: bool | None = None, kernels: str = "auto", sequences: int = 1,
               prompt_cache: bool = False):
    """A registry model's GGUF file, or a .gguf path, on the llama.cpp backend (backends/llamacpp.py).
    kernels: "auto" (ggml's repacked weights) or "plain" (not repacked: `LlamaCppModel.repack`)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from ..backends.llamacpp import LlamaCppModel, import_llama_cpp

    import_llama_cpp()  # before anything loads: a missing extra is the first thing to say
    if kernels not in GGUF_KERNELS:
        raise SpecdecError(f"kernels for GGUF weights are {' or '.join(GGUF_KERNELS)}, not {kernels!r}")
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
                          exact_rows=exact_rows, repack=kernels == "auto", sequences=sequences,
                          prompt_cache=prompt_cache)
    say(f"loaded {name} in {time.perf_counter() - start:.1f} s")
    return model

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
