"""A GGUF model on its own quantized weights, run by llama.cpp (through llama-cpp-python).

The transformers path dequantizes a GGUF into bf16 or fp32 and reads 3-6x the bytes the file
holds on every pass; here ggml runs the file's Q4_K / Q6_K / Q8_0 ... blocks as they are. The
object has the surface the decoding loops use (`forward` over a croppable cache, `prefill`,
`encode` / `decode`, ...), so AR, speculative decoding and every chain drafter run on it
unchanged, and it can serve as target or drafter beside a transformers model.

Exactness. Greedy speculative output is token-identical to greedy AR only if a k-token pass
gives each row the logits a 1-token pass would. ggml's CPU kernels mostly compute each output
row alone, whatever the batch, with these exceptions (ggml-cpu in llama-cpp-python 0.3.36):
- repacked weights (the "extra buffer types" that interleave Q4_K / Q4_0 / IQ4_NL rows for
  AVX2 / AVX512) run a GEMM on 4 rows at a time and a GEMV on the rest, which round differently:
  the GEMV scales a super block's integer sum once, the GEMM each pair of its sub blocks;
- the tiled K-quant matmul takes over from 8 rows;
- attention without flash attention; with it, for an f16/f32 KV cache, the keys of a 1-row
  query are split across threads from 512 cached keys on, and queries tiled from 64 rows.
A target therefore scores at most `rows_per_call()` tokens per llama_decode call (a longer
verification pass is fed in pieces) under flash attention with a bf16 KV cache: 3 on a stock
build (below the GEMM), 31 on the build `make peers` makes. Its patch
(patches/llama.cpp-row-exact.patch) makes the x86 Q4_K GEMV accumulate as the GEMM does, so GEMM
and GEMV rows agree bit for bit, and moves the tiled matmul's start from 8 rows to 32 (prompts
still take it). Every scored row then is what a 1-token pass gives, bit for bit
(tests/backends/test_llamacpp.py checks this on real weights after a 600-token prefix), and a 4-row pass
costs about 2 one-row passes instead of 3.3 (docs/kernels.md). The prompt (no logits) is fed
in the same calls by every loop (`prefill`,
in `Decoding.prefill_step`'s chunks), and a drafter's rounding only steers acceptance: drafters
take any batch. With `prompt_cache`, a later prompt reuses an earlier one's entries only where
they came from the very calls it would be fed in (`reusable`).

Several sequences (`sequences` > 1, the engine's and the server's batches): each sequence gets
a KV stream of its own (llama.cpp's non-unified cache), and `forward_batch` feeds the rows of
all of them, still at most `rows_per_call()` a call; every row then is what a 1-token pass of
its sequence alone gives (attention reads its own stream; keys past its length are masked and
skipped), so each sequence's logits are bit for bit its own (tests/backends/test_llamacpp.py).

Limits: chains only (no tree masks), CPU only in this build, optional dependency
(`pip install -e .[peers]`). With one sequence, a new cache clears the old one.
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import os
import platform
import weakref
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from . import Features, Segment
from .prompts import Held, evictee, reusable
from ..errors import ModelFault, SpecdecError
from .text import decode_ids, encode_text

INSTALL_HINT = "make peers, or pip install -e '.[peers]' (builds llama.cpp from source; docs/models.md)"
MAX_CONTEXT = 32768  # KV cells allocated: ~28 KB a token for the 1.5B target, ~12 KB for the 0.5B
SEQUENCE_CONTEXT = 4096  # with several sequences, the least context each gets by default
BATCH = 512  # tokens per llama_decode call (longer prompts are fed in pieces)
GGML_TYPE_BF16 = 30  # ggml's type id (ggml.h)
ROWS_PER_CALL = 3  # a target's scored tokens per call on a stock build: below the repacked GEMM's 4
PATCHED_ROWS_PER_CALL = 31  # patched: below the tiled K-quant matmul's 32 (module doc)
PATCH_MARKER = "SPECDEC_ROW_EXACT"  # the file `make peers` puts beside the patched llama_cpp module


def available() -> bool:
    """Whether llama-cpp-python can be imported (the optional `peers` extra)."""
    try:
        import_llama_cpp()
    except SpecdecError:
        return False
    return True


def import_llama_cpp():
    """The llama_cpp module (its logging silenced), or a SpecdecError saying how to install it."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise SpecdecError(f"the llama.cpp backend needs llama-cpp-python: {INSTALL_HINT}") from exc
    _silence(llama_cpp)
    return llama_cpp


def row_exact_build() -> bool:
    """Whether llama-cpp-python was built by `make peers`, with the patch that makes ggml's x86
    Q4_K GEMV round as its GEMM does and starts the tiled matmul at 32 rows (its marker file sits
    beside the module; x86 only: the patch touches the AVX2 GEMV, the one x86 CPUs run)."""
    llama_cpp = import_llama_cpp()
    return (platform.machine().lower() in ("x86_64", "amd64")
            and Path(llama_cpp.__file__).with_name(PATCH_MARKER).is_file())


def rows_per_call() -> int:
    """A row-exact target's scored tokens per llama_decode call on this build (module doc)."""
    return PATCHED_ROWS_PER_CALL if row_exact_build() else ROWS_PER_CALL


_LOG_SINK = None  # the ctypes callback must outlive every call into the library


def _silence(llama_cpp) -> None:
    """Drop llama.cpp's log lines but errors (it prints hundreds per model load)."""
    global _LOG_SINK
    if _LOG_SINK is None:
        def sink(level, text, _user):
            if level == getattr(llama_cpp, "GGML_LOG_LEVEL_ERROR", 4) and text:
                os.write(2, text)

        _LOG_SINK = llama_cpp.llama_log_callback(sink)
        llama_cpp.llama_log_set(_LOG_SINK, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()


def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def _no_beams(name: str) -> SpecdecError:
    return SpecdecError(f"beam search is not supported on the llama.cpp backend ({name}: one sequence per "
                        "context); use --dtype bf16 or fp32")


class LlamaCache:
    """The KV cache of one sequence of a `LlamaCppModel`: its sequence id in the llama.cpp context.

    Duck-typed like transformers' DynamicCache where the loops touch it (`get_seq_length`,
    `crop`), so `backends.cache` serves both backends. The sequence goes back to the model when
    the cache is dropped.
    """

    def __init__(self, model: "LlamaCppModel", seq: int, held: "Held | None" = None):
        self.model = model
        self.seq = seq
        self.held = held or Held([], [])
        self.length = len(self.held.tokens)

    def get_seq_length(self) -> int:
        return self.length

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise _no_beams(self.model.name)

    def __deepcopy__(self, memo):  # a forked beam's copy: llama.cpp's streams are not copied here
        raise _no_beams(self.model.name)

    def crop(self, max_length: int) -> None:
        """Keep the first `max_length` positions (negative: drop that many from the end)."""
        keep = self.length + max_length if max_length < 0 else min(max_length, self.length)
        self.model._check_live(self)
        if keep < self.length:
            if not self.model._lib.llama_memory_seq_rm(self.model._memory, self.seq, keep, -1):
                raise SpecdecError(f"{self.model.name}: llama.cpp could not drop cached positions {keep}..")
            self.length = keep
            self.held.keep(keep)


class LlamaCppModel:
    """A causal LM from a .gguf file on llama.cpp, with up to `sequences` live caches.

    path: the .gguf file. tokenizer: a transformers tokenizer for the same vocabulary (the loops
    and `check_pair` compare tokenizers; ids must match the GGUF's, which `load` checks).
    eos_token_ids: ids that end a generation (default: the GGUF's EOS and EOT).
    role: "target" or "drafter". A target's scored rows are row-exact (`exact_rows`, module doc).
    threads: CPU threads for llama.cpp (default: the cores this process may use).
    exact_rows: score at most `rows_per_call()` tokens per call (default: for a target).
    sequences: how many sequences (caches) may be live at once, each in its own KV stream of
    `context` cells (default: MAX_CONTEXT for one, else max(SEQUENCE_CONTEXT, MAX_CONTEXT //
    sequences), at most what the model was trained on).
    prompt_cache: keep a finished sequence's prompt entries in its stream (until the stream is
    needed) for a later cache whose prompt starts with the same feeding calls (`new_cache`); with
    several sequences it takes one more stream, which `_compact` swaps kept prompts through.
    repack: let ggml repack Q4_K / Q4_0 / IQ4_NL weights for its AVX2/AVX512 kernels (default);
    off, every quantized matmul runs ggml's stock per-row dot products (and its tiled K-quant
    matmul from 8 rows). docs/kernels.md measures both.
    """

    kernels = "llama.cpp"
    tree_masks = False  # one sequence, no custom attention mask: `speculative_generate` refuses trees
    draft_vocabulary = None
    last_hidden = pass_hidden = None  # llama.cpp's hidden states are not read: no self-drafting heads here

    def __init__(self, path: str | Path, tokenizer=None, name: str | None = None, role: str = "target",
                 eos_token_ids: Sequence[int] | None = None, threads: int | None = None,
                 context: int | None = None, exact_rows: bool | None = None, repack: bool = True,
                 sequences: int = 1, prompt_cache: bool = False):
        if role not in ("target", "drafter"):
            raise SpecdecError(f"role must be 'target' or 'drafter', got {role!r}")
        if isinstance(sequences, bool) or not isinstance(sequences, int) or sequences < 1:
            raise SpecdecError(f"sequences must be an integer >= 1, got {sequences!r}")
        path = Path(path)
        if not path.is_file():
            raise SpecdecError(f"GGUF file not found: {path}")
        lib = self._lib = import_llama_cpp()
        self.name = name or path.stem
        self.path = path
        self.role = role
        self.tokenizer = tokenizer
        self.exact_rows = role == "target" if exact_rows is None else bool(exact_rows)
        self.rows_per_call = rows_per_call()  # scored rows a call while exact_rows is on
        self.threads = threads or default_threads()
        model_params = lib.llama_model_default_params()
        self.repack = bool(repack)
        model_params.use_extra_bufts = self.repack  # repacked weights: the fastest 1-token passes
        self._model = lib.llama_model_load_from_file(str(path).encode(), model_params)
        if not self._model:
            raise SpecdecError(f"llama.cpp could not load {path} (not a GGUF model it supports?)")
        self._vocab = lib.llama_model_get_vocab(self._model)
        self._vocab_size = int(lib.llama_vocab_n_tokens(self._vocab))
        trained = int(lib.llama_model_n_ctx_train(self._model)) or MAX_CONTEXT
        self.sequences = sequences
        default = MAX_CONTEXT if sequences == 1 else max(SEQUENCE_CONTEXT, MAX_CONTEXT // sequences)
        self._context = min(trained, context or default)
        self.prompt_cache = bool(prompt_cache)
        # a spare stream, never live: compaction swaps a kept prompt out through it (`_compact`)
        self._spare = sequences if self.prompt_cache and sequences > 1 else None
        streams = sequences + (self._spare is not None)
        context_params = lib.llama_context_default_params()
        context_params.n_ctx = self._context * streams  # split evenly into the streams
        context_params.n_batch = context_params.n_ubatch = BATCH
        context_params.n_seq_max = streams
        # a stream per sequence: its attention reads its own keys, as when it runs alone
        context_params.kv_unified = sequences == 1
        context_params.n_threads = context_params.n_threads_batch = self.threads
        context_params.no_perf = True
        # without flash attention a 2-row pass already rounds differently from a 1-row one
        context_params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
        if self.exact_rows:
            # flash attention splits a 1-row query's keys across threads from 512 cached keys on,
            # and tiles queries from 64 rows, both only for an f16/f32 cache: a bf16 cache keeps
            # every row on the one per-row path (module doc)
            context_params.type_k = context_params.type_v = GGML_TYPE_BF16
        self._ctx = lib.llama_init_from_model(self._model, context_params)
        if not self._ctx:
            lib.llama_model_free(self._model)
            raise SpecdecError(f"llama.cpp could not create a context of {sequences} x {self._context} tokens for {path}")
        self._memory = lib.llama_get_memory(self._ctx)
        self._batch = lib.llama_batch_init(BATCH, 0, 1)
        self._owners: dict[int, tuple[int, weakref.ref]] = {}  # live sequence id -> (ticket, its cache)
        self._live: dict[int, int] = {}  # ticket -> sequence id: a cache's finalizer knows it by ticket
        self._tickets = itertools.count()
        self._kept: dict[int, Held] = {}  # free streams that still hold a prompt, oldest first
        if eos_token_ids is None:
            eos_token_ids = [int(lib.llama_vocab_eos(self._vocab)), int(lib.llama_vocab_eot(self._vocab))]
        self._eos = [i for i in dict.fromkeys(eos_token_ids) if 0 <= i < self._vocab_size]
        if tokenizer is not None:
            self._check_tokenizer(tokenizer)

    @property
    def num_parameters(self) -> int:
        """The model's weights, as llama.cpp counts them (`roles.check_roles`)."""
        return int(self._lib.llama_model_n_params(self._model))

    def __del__(self):
        lib = getattr(self, "_lib", None)
        if lib is None:
            return
        if getattr(self, "_batch", None) is not None:
            lib.llama_batch_free(self._batch)
        if getattr(self, "_ctx", None):
            lib.llama_free(self._ctx)
        if getattr(self, "_model", None):
            lib.llama_model_free(self._model)

    def _check_tokenizer(self, tokenizer) -> None:
        """The tokenizer must give the GGUF's own ids (a mismatch would score the wrong tokens)."""
        text = "def f(x):\n    return x  # ok"
        ours = tokenizer.encode(text, add_special_tokens=False)
        buffer = (self._lib.llama_token * 256)()
        raw = text.encode()
        count = self._lib.llama_tokenize(self._vocab, raw, len(raw), buffer, 256, False, False)
        if count < 0 or list(buffer[:count]) != list(ours):
            raise SpecdecError(f"{self.name}: the tokenizer's ids differ from the GGUF's own vocabulary")

    # -- what the loops read ------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        """The logits' dtype (the weights stay in the file's formats: `weights`)."""
        return torch.float32

    @property
    def weights(self) -> str:
        return "gguf"

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def max_context(self) -> int:
        return self._context

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self._eos)

    def new_cache(self, prompt: Sequence[int] | None = None, chunk: int | None = None, salt: str = "") -> LlamaCache:
        """An empty cache on a free sequence; with one sequence it replaces any earlier cache.
        With `prompt_cache`, `prompt` and `chunk` (the ids this cache's prompt is fed in calls of
        `chunk`, `Decoding.prefill_step`): the free stream holding the most reusable entries for
        it (`reusable`) is taken with them, and the cache starts that long. SpecdecError when all
        `sequences` are live."""
        free = [seq for seq in range(self.sequences) if seq not in self._owners]
        if not free and self.sequences > 1:
            gc.collect()  # caches held only by reference cycles give their sequences back
            free = [seq for seq in range(self.sequences) if seq not in self._owners]
            if not free:
                raise ModelFault(f"{self.name}: all {self.sequences} sequences are in use (load it with more "
                                   "sequences, or run fewer at once)")
        held, seq = None, None
        if prompt is not None and chunk and self._kept:
            reuse, seq = max(((reusable(kept, prompt, chunk, salt), -seq) for seq, kept in self._kept.items()))
            seq = -seq
            if reuse > 0:
                held = self._kept.pop(seq)
                held.keep(reuse)
            else:
                seq = None
        if seq is None:
            empty = [seq for seq in free if seq not in self._kept]
            # else a kept prompt goes: the oldest of the tenant keeping the most (`evictee`)
            victim = evictee(self._kept, salt) if self._kept else None
            seq = empty[0] if empty else victim if victim is not None else next(iter(self._kept), 0)
            self._kept.pop(seq, None)
            if seq in self._owners:  # one sequence: the earlier cache loses it
                self._live.pop(self._owners.pop(seq)[0])
        self._lib.llama_memory_seq_rm(self._memory, seq, len(held.tokens) if held else -1, -1)
        cache = LlamaCache(self, seq, held or Held([], [], salt))
        ticket = next(self._tickets)
        self._owners[seq], self._live[ticket] = (ticket, weakref.ref(cache)), seq
        # not into a library shutting down
        weakref.finalize(cache, self._release, ticket, cache.held).atexit = False
        return cache

    def _release(self, ticket: int, held: Held) -> None:
        """A dropped cache's sequence, free again: emptied, or with `prompt_cache` holding its
        prompt's entries for a later cache."""
        seq = self._live.pop(ticket, None)
        if seq is None or not getattr(self, "_ctx", None):
            return
        del self._owners[seq]
        if self.prompt_cache and held.calls:
            held.keep(held.calls[-1])
            self._kept[seq] = held
        self._lib.llama_memory_seq_rm(self._memory, seq, len(held.tokens) if seq in self._kept else -1, -1)

    def _compact(self) -> None:
        """Move the highest live sequences into the free ids below them, so the live ones are
        0..n-1: llama.cpp computes a call's rows together only for consecutive sequence ids
        (its streams are viewed as one range), else in one compute per run of them. A move copies
        the sequence's whole KV stream (llama.cpp's cross-stream seq_cp, done in order at the next
        decode): each cell keeps its index, so its attention adds the same keys in the same order.
        A prompt kept in the free id is swapped into the id the sequence leaves, through the spare
        stream, rather than overwritten: a request that took its kept prompt from a high id would
        otherwise cost another prompt its cache at each step that compacts."""
        lib, memory = self._lib, self._memory
        live = [seq for seq, (_, ref) in self._owners.items() if ref() is not None]
        holes = [seq for seq in range(len(live)) if seq not in self._owners]
        movers = sorted((seq for seq in live if seq >= len(live)), reverse=True)
        for hole, seq in zip(holes, movers):
            swap = hole in self._kept and self._spare is not None
            if swap:
                lib.llama_memory_seq_cp(memory, hole, self._spare, -1, -1)
            ticket, ref = self._owners.pop(seq)
            cache = ref()
            lib.llama_memory_seq_cp(memory, seq, hole, -1, -1)
            lib.llama_memory_seq_rm(memory, seq, -1, -1)
            cache.seq, self._owners[hole], self._live[ticket] = hole, (ticket, ref), hole
            if swap:
                lib.llama_memory_seq_cp(memory, self._spare, seq, -1, -1)
                lib.llama_memory_seq_rm(memory, self._spare, -1, -1)
                # the same age: the oldest kept prompt still goes first
                self._kept = {seq if kept == hole else kept: held for kept, held in self._kept.items()}
            else:
                self._kept.pop(hole, None)  # without a spare stream a kept prompt there is overwritten

    def _check_live(self, cache: LlamaCache) -> None:
        owner = self._owners.get(cache.seq) if cache.model is self else None
        if owner is None or owner[1]() is not cache:
            raise SpecdecError(f"{self.name}: this cache was replaced by a newer one (llama.cpp keeps one sequence)")

    def prefill(self, prompt: Sequence[int], cache: LlamaCache) -> list[int]:
        """Feed the prompt but its last token (no logits) and return [prompt[-1]], as the row-exact
        transformers path does: the first scored row then comes from a short pass in every loop.
        Where `cache` already holds the prompt's first tokens (a prompt fed in chunks,
        `Decoding.prefill_step`), only the rest is fed."""
        prompt = list(prompt)
        if len(prompt) - 1 > cache.length:
            prompt_only = cache.length == (cache.held.calls[-1] if cache.held.calls else 0)
            self._decode(prompt[cache.length:-1], cache, 0, BATCH)
            if prompt_only:  # entries a later prompt may reuse (`reusable`)
                cache.held.calls.append(cache.length)
        return prompt[-1:]

    def forward(self, input_ids: Sequence[int] | torch.Tensor, cache: LlamaCache | None = None,
                num_logits: int = 1, parents: Sequence[int] | None = None,
                tree_start: int | None = None) -> torch.Tensor:
        """Run new tokens after what `cache` holds, extending it.

        input_ids: [T] token ids. cache: from `new_cache()`; None runs a cache-free pass (it
        clears any live cache). Returns logits [num_logits, V] fp32 for the last positions; with
        `exact_rows`, each row bit for bit what a 1-token pass at its position returns.
        """
        if parents is not None or tree_start is not None:
            raise SpecdecError(f"token trees are not supported on the llama.cpp backend ({self.name}); "
                               "use a chain method, or --dtype bf16/fp32 for trees")
        ids = [int(t) for t in (input_ids.tolist() if isinstance(input_ids, torch.Tensor) else input_ids)]
        if not ids:
            raise SpecdecError("forward needs at least one new token")
        num_logits = max(1, min(int(num_logits), len(ids)))
        piece = self.rows_per_call if self.exact_rows else BATCH
        if cache is None:
            return self._decode(ids, self.new_cache(), num_logits, piece)  # its sequence is freed on return
        return self._decode(ids, cache, num_logits, piece)

    def features(self) -> Features:
        """What this model does beyond `Backend` (`backends.Features`): batched passes over its
        streams, each row exact where `exact_rows`; no token trees."""
        return Features(batched=True, exact_rows=self.exact_rows, rows_invariant=self.exact_rows, tree_masks=False,
                        prompt_cache=self.prompt_cache, sequences=self.sequences)

    def forward_batch(self, segments: Sequence[Segment]) -> list[torch.Tensor]:
        """Several sequences' new tokens, their rows fed together (`BatchedBackend`): at most
        `rows_per_call` rows a llama_decode call with `exact_rows`, each sequence attending to its own
        KV stream, so each sequence's logits are bit for bit what `forward` returns for it alone
        (module doc). Each cache grows by its segment's tokens.

        segments: per sequence, its new ids [T_i], cache (of this model) and num_logits; chains only.
        Returns: per segment, logits [num_logits_i, V] fp32.
        """
        if not segments:
            return []
        feeds = []
        for segment in segments:
            if segment.parents is not None or segment.tree_start is not None:
                raise SpecdecError(f"token trees are not supported on the llama.cpp backend ({self.name})")
            ids = [int(t) for t in (segment.input_ids.tolist() if isinstance(segment.input_ids, torch.Tensor)
                                    else segment.input_ids)]
            if not ids or not 1 <= segment.num_logits <= len(ids):
                raise SpecdecError(f"a segment needs >= 1 new token and 1..{len(ids)} logits, got {len(ids)} and "
                                   f"{segment.num_logits}")
            feeds.append((segment.cache, ids, int(segment.num_logits)))
        if len({id(cache) for cache, _, _ in feeds}) < len(feeds):
            raise SpecdecError("each segment of a batched pass needs a cache of its own")
        if len(feeds) > 1:  # `_feed` checks that each cache is live
            self._compact()
        return self._feed(feeds, self.rows_per_call if self.exact_rows else BATCH)

    @property
    def rows_invariant(self) -> bool:
        """Whether a sequence's rows in `forward_batch` equal its own pass's whatever shares it."""
        return self.exact_rows

    def forward_rows(self, input_ids: torch.Tensor, cache) -> torch.Tensor:
        raise _no_beams(self.name)

    def _decode(self, ids: list[int], cache: LlamaCache, num_logits: int, piece_size: int) -> torch.Tensor:
        """Feed `ids` in calls of at most `piece_size` tokens; logits [num_logits, V] of the last ids."""
        return self._feed([(cache, ids, num_logits)], piece_size)[0]

    def _feed(self, feeds: list[tuple[LlamaCache, list[int], int]], piece_size: int) -> list[torch.Tensor]:
        """Feed each (cache, ids, num_logits) after what its cache holds, in llama_decode calls of at
        most `piece_size` rows: the sequences' first new tokens, then their second ones, ..., each
        round in sequence order (llama.cpp puts consecutive sequences' rows in one compute) ->
        per feed, logits [num_logits, V] of its last ids."""
        lib, batch, vocab = self._lib, self._batch, self._vocab_size
        for cache, ids, _ in feeds:
            self._check_live(cache)
            if cache.length + len(ids) > self._context:
                raise SpecdecError(f"{self.name}: {cache.length + len(ids)} tokens exceed its context of {self._context}")
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise SpecdecError(f"token id {bad} is outside {self.name}'s vocabulary of {vocab}")
        outs = [torch.empty((num_logits, vocab), dtype=torch.float32) for _, _, num_logits in feeds]
        base = [cache.length for cache, _, _ in feeds]
        by_seq = sorted(range(len(feeds)), key=lambda k: feeds[k][0].seq)
        rows = [(k, t) for t in range(max(len(ids) for _, ids, _ in feeds)) for k in by_seq if t < len(feeds[k][1])]
        for start in range(0, len(rows), piece_size):
            call = rows[start:start + piece_size]
            batch.n_tokens = len(call)
            for i, (k, t) in enumerate(call):
                cache, ids, num_logits = feeds[k]
                batch.token[i] = ids[t]
                batch.pos[i] = base[k] + t
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = cache.seq
                batch.logits[i] = t >= len(ids) - num_logits
            status = lib.llama_decode(self._ctx, batch)
            if status != 0:
                # a failed decode may leave part of the call cached: drop it so every cache stays whole
                for (cache, ids, _), first in zip(feeds, base):
                    lib.llama_memory_seq_rm(self._memory, cache.seq, cache.length, -1)
                    cache.held.tokens.extend(ids[:cache.length - first])
                raise ModelFault(f"llama.cpp failed to decode {len(call)} tokens for {self.name} (status {status})")
            for i, (k, t) in enumerate(call):
                cache, ids, num_logits = feeds[k]
                cache.length += 1
                scored = t - (len(ids) - num_logits)
                if scored >= 0:
                    row = np.ctypeslib.as_array(lib.llama_get_logits_ith(self._ctx, i), shape=(vocab,))
                    outs[k][scored] = torch.from_numpy(row)
        for cache, ids, _ in feeds:
            cache.held.tokens.extend(ids)
        return outs

    # -- text --------------------------------------------------------------------------------
    def encode(self, text: str, chat: bool = False) -> list[int]:
        return encode_text(self.tokenizer, self.name, text, chat)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return decode_ids(self.tokenizer, ids, skip_special_tokens)
