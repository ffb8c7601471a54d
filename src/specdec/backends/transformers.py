"""The transformers backend: a Hugging Face causal LM run one sequence at a time with a croppable
KV cache, its passes row-exact where they decide the output (backends/rows.py), its linears picked per
CPU kind (backends/kernels.py), its logits fp32 (`TransformersModel._logits`).

`specdec.load` builds it (models/loading.py); the decoding loops and drafters use it through the
`Backend` protocol (backends/__init__.py).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..errors import SpecdecError
from .heads import check_output_transform, max_row_norm, output_transform
from .kernels import (PACKED_BF16_LABELS, TILED_LABELS, Int8Linear, PackedBf16Linear, PackedLinear, bf16_rows_exact,
                       fast_bf16, fix_norm_rows, fp32_matmul, has_onednn, int8_fits, int8_label, int8_short_rows, int8_supported, pack_bf16_linears,
                       pack_linears, packed_bf16_label, packed_bf16_least_rows, packed_bf16_supported, pad_single_rows, quantize_linears,
                       row_stable, row_stable_linear, tiled_bf16_supported)
from .merged import merge_projections
from .layer_ops import fuse_norms
from .rows import PREFIX, Causal, install_attention, key_spans, row_exact, segmented, widen_and_refine
from .text import decode_ids, encode_text, eos_ids
from ..core.trees import tree_attention
from . import Features, Segment
from . import lean, native
from .cache import SegmentedCache, cache_length
from .prompts import SHARED_PREFILL


class TransformersModel:
    """A causal LM with its tokenizer, run one sequence at a time with a croppable KV cache."""

    tree_masks = True  # `forward` takes `parents` (sdpa or eager attention; see `_tree_inputs`)

    def __init__(self, hf_model, tokenizer=None, name: str = "model", role: str = "target", kernels: str = "auto",
                 exact_rows: bool | None = None, int8: bool = False):
        """Wrap a transformers causal LM.

        role: "target" or "drafter". On the CPU it picks the linear kernels (backends/kernels.py): a
            target in fp32 gets oneDNN-packed linears; a drafter in bf16 on a CPU without native
            bf16 gets hybrid ones. A target's logits are fp32-exact where they decide the output
            (see `_logits`); a drafter's need not be (they only steer acceptance).
        kernels: "auto" (as above) or "stock" (leave transformers' linear layers alone).
            Packed weights live in oneDNN's layout: move or cast `hf_model` before wrapping it,
            not after (`.to()` cannot move them).
        exact_rows: compute every row of a multi-token pass bit for bit as a one-token pass
            would (backends/rows.py), so that greedy speculative output is token-identical to greedy AR
            by construction. None: on for a bf16 target on the CPU (nearly free there); off for
            fp32 (where it slows 1-token passes), for drafters and on CUDA (where every GEMM and
            norm then runs on CUDA_ROWS rows: backends/kernels.py).
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
        # counted before packing, which moves weights out of parameters (`roles.check_roles`)
        self.num_parameters = sum(p.numel() for p in hf_model.parameters())
        self.tokenizer = tokenizer
        self.prompt_store = None  # a PromptStore (`use_prompt_cache`)
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
        self._packed_head: PackedBf16Linear | None = None  # a bf16 target's head, packed (`_logits`)
        self._head_row_norm = None
        self.kernels = "stock"
        self.merged_groups = 0  # sibling projections run as one (stacked, or apart behind parts: backends/merged.py)
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
        elif on_cpu and role == "drafter" and not fast_bf16() and (int8 or self._dtype == torch.bfloat16):
            # int8 beat packed fp32 up to 16 rows (docs/kernels.md#the-drafter-int8-weights-and-a-frequent-token-head);
            # emulated bf16 beats packed fp32 only up to 2
            pack_linears(self._decoder, dense_rows=0 if int8 else 2, int8_rows=16 if int8 else 0)
            self.kernels = f"{int8_label(self._decoder)}+onednn-packed-fp32" if int8 else "bf16+onednn-packed-fp32"
        elif on_cpu and self._dtype == torch.bfloat16 and fast_bf16() and (tiled_bf16_supported() or packed_bf16_supported()):
            # bf16 weights reordered once for oneDNN (vLLM's CPU linears): the same results as
            # F.linear's, faster (docs/kernels.md#packed-bf16-linears); a drafter's int8 short path stays in front.
            # In tiles for our kernel wherever it runs, AVX512 without BF16 and AVX2 too (docs/kernels.md#tiled-bf16-linears)
            pack_bf16_linears(self._decoder, int8_rows=int8_short_rows() if int8 else 0)
            # q/k/v and gate/up each one GEMM where that changes no bit (an int8 drafter's where our kernel runs them),
            # else apart behind one merged output where the fused rotation or SwiGLU middle reads it
            self.merged_groups = merge_projections(self._decoder, hf_model.config.model_type)
            fuse_norms(self._decoder)
            self.kernels = (f"{int8_label(self._decoder)}+" if int8 else "") + packed_bf16_label()
            if role == "target":
                self._packed_head = PackedBf16Linear(weight, None, packed_bf16_least_rows())
        elif int8:
            # native bf16 grows slowly with rows on AMX, where int8 wins for 1-2 rows; up to 8 without
            quantize_linears(self._decoder, short_rows=int8_short_rows())
            self.kernels = f"{int8_label(self._decoder)}+{str(self._dtype).removeprefix('torch.')}"
        self.int8 = bool(int8)
        self._vocab_ids: torch.Tensor | None = None
        self._draft_head: torch.nn.Module | None = None
        self.exact_logits = role == "target"
        if self.exact_logits and self._head is None and self._dtype != torch.float32 and self._device.type == "cpu":
            self._head_row_norm = max_row_norm(weight)
        if exact_rows is None:
            # on where it is nearly free: bf16 linears give row-invariant results at any row count,
            # so only attention changes. Packed fp32 needs 1-row passes computed as 2-row ones,
            # which slows the 1-token pass (docs/kernels.md#row-exact-passes).
            exact_rows = role == "target" and self._device.type == "cpu" and self._dtype == torch.bfloat16 and \
                (bf16_rows_exact() or self.kernels in TILED_LABELS) and \
                hf_model.config._attn_implementation in ("sdpa", "eager")
        if exact_rows or hf_model.config._attn_implementation in ("sdpa", "eager"):
            install_attention(hf_model)  # row-exact passes, and cheaper one-query ones either way
        if exact_rows and self.kernels == "stock":
            pad_single_rows(self._decoder)
            if self._device.type == "cuda":
                fix_norm_rows(self._decoder)
        self.exact_rows = bool(exact_rows)
        self._vocab_size = weight.shape[0]
        self.last_hidden: torch.Tensor | None = None  # [num_logits, H] of the last `forward`
        self.pass_hidden: torch.Tensor | None = None  # [T, H] every input's, of the last `forward` or `prefill`
        # a distilled drafter (adapters/lora.py): the adapter merged into its weights, its own weights
        # kept aside, the target it was trained for, and an online learner updating it; a parallel
        # drafter's tokens a pass (adapters/pard.py). Both reach the loops through `features()`.
        self.adapter: torch.nn.Module | None = None
        self.base_weights: dict[str, torch.Tensor] | None = None
        self.adapter_target: str | None = None
        self.online = None
        self.parallel_k: int | None = None
        self.source: str | None = None  # what `load` takes to load it again (models/loading.py sets it)
        self._parallel_hooks: tuple = ()  # the hooks adapters/pard.py `install`s, until `remove`
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
        # the head's long path: packed as the layers are (int8 beats it up to `int8_short_rows`
        # rows), else plain bf16 (int8 beats that up to 8 rows: docs/kernels.md#the-drafter-int8-weights-and-a-frequent-token-head)
        if self.kernels.endswith(PACKED_BF16_LABELS):
            long = PackedBf16Linear(weight, bias, packed_bf16_least_rows())
        else:
            long = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=self.device,
                                   dtype=weight.dtype)
            long.weight = torch.nn.Parameter(weight, requires_grad=False)
            if bias is not None:
                long.bias = torch.nn.Parameter(bias, requires_grad=False)
        short_rows = int8_short_rows() if fast_bf16() else 8
        self._draft_head = Int8Linear(weight, bias, long, short_rows) if self.int8 and int8_fits(long) else long

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def weights(self) -> str:
        """Which weights run, for reports: the torch dtype's name, or "int8" (int8 linears)."""
        return "int8" if self.int8 else str(self._dtype).removeprefix("torch.")

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
    def rows_invariant(self) -> bool:
        """Whether every row of a pass, batched ones included, is bit for bit the row a one-token pass
        computes: row-exact attention and no layer that switches kernels by row count (the int8
        short path, a bf16 short path over packed fp32, a frequent-token head)."""
        return self.exact_rows and self.kernels in ("stock", "onednn-packed", *PACKED_BF16_LABELS) and \
            self._draft_head is None

    def features(self) -> Features:
        """What this model does beyond `Backend` (`backends.Features`): batched passes, trees, its prompt cache,
        a parallel drafter's k and an online learner."""
        return Features(batched=True, exact_rows=bool(self.exact_rows), rows_invariant=self.rows_invariant,
                        tree_masks=self.tree_masks, prompt_cache=self.prompt_cache, keeps_prompts=True,
                        kv_bytes_per_token=self.kv_bytes_per_token, parallel_k=self.parallel_k, online=self.online,
                        embedded=self.hf.get_input_embeddings().num_embeddings, shared_prefill=self.shared_prefill,
                        shared_chunks=self.shared_chunks)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one cached position takes: keys and values of every layer (the engine's budget)."""
        config = self.hf.config.get_text_config()
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return 2 * config.num_hidden_layers * heads * head_dim * self.dtype.itemsize

    @property
    def eos_token_ids(self) -> list[int]:
        """All ids that end a generation: the generation config's and the tokenizer's EOS."""
        return eos_ids([getattr(self.hf, "generation_config", None), self.hf.config, self.tokenizer])

    def new_cache(self, prompt: Sequence[int] | None = None, chunk: int | None = None, salt: str = ""):
        """An empty KV cache that `crop` can roll back.

        Sliding-window layers (Mistral, Gemma 2/3) drop keys older than their window as they go,
        after which they cannot be cropped; with past recording on (as in transformers' assisted
        generation) they keep a pass's keys until the next `crop` trims them back to the window.
        `cache_length` counts every position of the sequence either way. Full-attention layers
        keep their keys in slabs (slab.py): a pass copies only its own keys in.
        With a prompt cache (`use_prompt_cache`), `prompt` and `chunk` (the ids this cache's prompt
        is fed in calls of `chunk`, `Decoding.prefill_step`): the cache starts with the kept
        entries it can reuse (prompts.py), of prompts kept under the same `salt` (a tenant's).
        """
        from .slab import slab_cache

        cache = slab_cache(self.hf.config)
        cache.activate_past_recording()
        if self.prompt_store is not None:
            self.reuse_prompt(cache, prompt or [], chunk or 0, salt)
        return cache

    def reuse_prompt(self, cache, prompt: Sequence[int], chunk: int, salt: str = "") -> int:
        """Give the empty `cache` the kept entries `prompt` can reuse when it is fed in calls of
        `chunk` ids (with a prompt cache; prompts.py) -> how many positions it now holds."""
        return self.prompt_store.restore(cache, prompt, chunk, salt) if self.prompt_store is not None else 0

    @property
    def prompt_cache(self) -> bool:
        """Whether finished prompts are kept for later ones (`use_prompt_cache`)."""
        return self.prompt_store is not None

    def use_prompt_cache(self, memory: int) -> None:
        """Keep copies of prompts' cache entries, up to `memory` bytes (0: none), for later prompts
        that start with the same feeding calls: `keep_prompt` once a prompt is in, `new_cache(prompt,
        chunk)` to reuse. Needs row-exact passes (the prompt fed in fixed calls, `prefill`)."""
        from .prompts import PromptStore

        if memory and not self.exact_rows:
            raise SpecdecError(f"a prompt cache reuses the calls a prompt is fed in, which row-exact passes fix; "
                               f"{self.name} runs without them")
        tokens = memory // self.kv_bytes_per_token
        self.prompt_store = PromptStore(tokens) if tokens > 0 else None

    def keep_prompt(self, cache) -> None:
        """The prompt `cache` holds is in: keep a copy of its entries (with a prompt cache)."""
        if self.prompt_store is not None:
            self.prompt_store.keep(cache)

    @torch.inference_mode()
    def forward(self, input_ids: Sequence[int] | torch.Tensor, cache=None, num_logits: int = 1,
                parents: Sequence[int] | None = None, tree_start: int | None = None) -> torch.Tensor:
        """Run new tokens through the model, extending `cache` (if given).

        Args:
            input_ids: [T] new token ids, following what `cache` already holds.
            cache: a cache from `new_cache()`, or None for a cache-free pass.
            num_logits: how many of the last positions to return logits for.
            parents: [T] a token tree over the inputs (core/trees.py, `input_parents`): each token's
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

    @torch.inference_mode()
    def forward_batch(self, segments: Sequence[Segment]) -> list[torch.Tensor]:
        """Several sequences' new tokens in one pass (`BatchedBackend`): their rows go through every
        linear layer together, and attention runs each row over its own sequence's cache and tree
        (`rows.segmented`), so each sequence's logits are bit for bit what `forward` returns for it
        alone, whatever shares the pass. Each cache grows by its segment's tokens.

        segments: per sequence, its new ids [T_i], cache, num_logits, and optional tree (`Segment`).
        Returns: per segment, logits [num_logits_i, V] fp32.
        Needs row-exact passes (`exact_rows`: attention a row at a time over its own cache);
        the rows equal each sequence's own pass bit for bit where the model is `rows_invariant`
        (bf16 and packed fp32 linears, cut to calls of 2..32 rows: tests/engine/test_batch.py). Otherwise
        (an int8 drafter) each sequence's rows are its own but rounded as the batch has them: by its
        width, and where an int8 layer rounds its input with one scale a call, by the other rows too.
        """
        self._check_segments(segments)
        if not segments:
            return []
        return self._scores(segments, self._segmented_pass(segments))

    def _check_segments(self, segments: Sequence[Segment]) -> None:
        """SpecdecError where a batched pass cannot score `segments` as `forward` would alone."""
        if not self.exact_rows:
            raise SpecdecError(f"batched passes are row-exact passes; {self.name} runs without them "
                               "(load it with exact_rows=True)")
        for segment in segments:
            new = len(segment.input_ids)
            if new < 1 or not 1 <= segment.num_logits <= new:
                raise SpecdecError(f"a segment needs >= 1 new token and 1..{new} logits, got {new} and "
                                   f"{segment.num_logits}")

    def _scores(self, segments: Sequence[Segment], hidden: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each segment's logits [num_logits_i, V] fp32 from its final hidden states [T_i, H]."""
        with row_exact(True):
            rows = torch.cat([part[len(part) - s.num_logits:] for part, s in zip(hidden, segments)])
            logits = self._logits(rows)
        return list(logits.split([s.num_logits for s in segments]))

    def _segmented_pass(self, segments: Sequence[Segment], causal: Sequence[int] = ()) -> list[torch.Tensor]:
        """One pass over several sequences' new ids, each cache growing by its own -> each
        segment's final hidden states [T_i, H] (`forward_batch`, `prefill_batch`). Every row is
        row-exact but those of the segments at indices `causal`: a long prompt's chunk each, fed
        as `prefill` feeds it alone (`rows.Causal`)."""
        self._check_no_sliding_window("batched passes", "run its sequences one at a time")
        ids, positions, parts, start = [], [], [], 0
        for index, segment in enumerate(segments):
            new = len(segment.input_ids)
            cached = cache_length(segment.cache)
            if segment.parents is None:
                position = torch.arange(cached, cached + new, device=self.device).view(1, -1)
                spans = Causal(new, cached) if index in causal else [slice(0, cached + t + 1) for t in range(new)]
            else:
                tree = self._tree_inputs(segment.parents, segment.cache, new, segment.tree_start)
                position, mask = tree["position_ids"], tree["attention_mask"]
                spans = key_spans(mask, new, mask.shape[-1])
            ids.append(torch.as_tensor(list(segment.input_ids), dtype=torch.long, device=self.device))
            positions.append(position.view(-1))
            parts.append((start, spans))
            start += new
        cache = SegmentedCache([s.cache for s in segments], [len(s.input_ids) for s in segments])
        # a prepared 4D mask is passed through as it is; attention reads each row's keys from `parts`
        unused_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)
        ids, positions = torch.cat(ids).view(1, -1), torch.cat(positions).view(1, -1)
        with segmented(cache, parts):
            # our layer loop where every module would take its fused path: the same bits, without
            # the modules' machinery (lean.py); else the decoder's own forward
            hidden = lean.forward(self._decoder, ids, positions, cache, unused_mask)
            if hidden is None:
                hidden = self._decoder(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True,
                                       attention_mask=unused_mask).last_hidden_state
            hidden = hidden[0]
        self.last_hidden = self.pass_hidden = None  # per-sequence hidden states are not kept for a batch
        return list(hidden.split([len(s.input_ids) for s in segments]))

    @property
    def shared_prefill(self) -> int:
        """Prompts of at most this many ids are fed row-exactly (`prefill`), so several can share
        one pass (`prefill_batch`); 0 where attention does not run in our kernel (its rows would
        cost an sdpa call each: no kernel built, fp16, over 16 query heads per key/value head,
        soft-capped scores or attention sinks), rows round otherwise in a wider pass, or a sliding
        window stops batched passes."""
        config = self.hf.config.get_text_config()
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        kernel = (native.one_query_kernel() is not None and self.dtype in (torch.bfloat16, torch.float32)
                  and heads % kv_heads == 0 and heads // kv_heads <= 16
                  and not getattr(config, "attn_logit_softcapping", None) and config.model_type != "gpt_oss")
        if not (kernel and self.exact_rows and self.rows_invariant and self.device.type == "cpu"
                and self.hf.config._attn_implementation == PREFIX + "sdpa" and not self._sliding_window()):
            return 0
        return SHARED_PREFILL

    @property
    def shared_chunks(self) -> bool:
        """Whether prompts longer than `shared_prefill` may share a pass too (`prefill_batch`, their
        chunks attending causally as alone): where every linear rounds a row alike in calls of any
        size (our tiled bf16 kernels; oneDNN's and torch's agree only within 2..32 rows, where a
        chunk alone is one call of up to 256) and the decoder's layers run our fused norms and
        rotation (`lean.DECODERS`), so that a chunk's queries, keys and values are its pass alone's."""
        return bool(self.shared_prefill) and self.kernels in TILED_LABELS and \
            type(self._decoder).__name__ in lean.DECODERS and self._linears_tiled()

    def _linears_tiled(self) -> bool:
        """Whether every linear layer of the decoder runs on our tiles: under a tiled label, a layer
        of odd input width stays on oneDNN, and one an adapter wraps is the adapter's."""
        kinds = (torch.nn.Linear, PackedLinear, PackedBf16Linear, Int8Linear)
        return all(type(m) is PackedBf16Linear and m.tiled for m in self._decoder.modules() if isinstance(m, kinds))

    def _sliding_window(self) -> bool:
        """Whether the model has sliding-window layers."""
        config = self.hf.config
        return bool(getattr(config, "sliding_window", None) and (getattr(config, "use_sliding_window", True) or
                    "sliding_attention" in (getattr(config, "layer_types", None) or ())))

    def _check_no_sliding_window(self, what: str, instead: str) -> None:
        """SpecdecError for a model with sliding-window layers: their keys would need a window in
        each row's span (not built yet)."""
        if self._sliding_window():
            raise SpecdecError(f"{what} are not supported for {self.name}: its sliding-window attention would need "
                               f"a window in each row's keys; {instead}")

    def _tree_inputs(self, parents: Sequence[int], cache, new: int, tree_start: int | None) -> dict:
        """The 4D attention mask and position ids of a tree pass; SpecdecError where the model
        cannot take them."""
        config = self.hf.config
        implementation = config._attn_implementation.removeprefix(PREFIX)
        if implementation not in ("sdpa", "eager"):
            raise SpecdecError(f"token trees need sdpa or eager attention (a custom 4D mask), not "
                               f"{implementation!r}; load the model with attn_implementation='sdpa'")
        self._check_no_sliding_window("token trees", "use a chain drafter")
        cached = 0 if cache is None else cache_length(cache)
        past = cached if tree_start is None else tree_start
        if past + len(parents) != cached + new:
            raise SpecdecError(f"tree region of {len(parents)} tokens from position {past} does not end where "
                               f"the {new} new tokens after {cached} cached ones do")
        mask, positions = tree_attention(parents, past, self.dtype, self.device, additive=implementation == "eager",
                                         new=new)
        return {"attention_mask": mask, "position_ids": positions}

    @torch.inference_mode()
    def prefill(self, prompt: Sequence[int], cache) -> list[int]:
        """Feed all of `prompt` but its last token into `cache` in one batched pass (no logits) and
        return what is left to score, [prompt[-1]].

        Both decoding loops start this way, so the prompt's cache entries come from one identical
        call, and the first token (or first draft) is scored by a row-exact pass like every later
        one. A long prompt is fed in a plain pass (row-exact attention grows with the square of its
        length); a short one (`shared_prefill`) row-exactly, so that it may share a pass with
        others (`prefill_batch`) and get the same bits. Without
        `exact_rows` nothing is fed here and the whole prompt is left to the first scoring pass.
        Where `cache` already holds the prompt's first tokens, only the rest is fed (a prompt
        prefilled in chunks, `Decoding.prefill_step`). The fed positions' final hidden states are
        kept in `pass_hidden` ([0, H] when none).
        """
        prompt = list(prompt)
        self.pass_hidden = torch.zeros(0, self.hidden_size, dtype=self.dtype, device=self.device)
        if not self.exact_rows:
            return prompt
        fed = cache_length(cache)  # a prompt fed in chunks (`Decoding.prefill_step`): what the cache lacks
        if len(prompt) - 1 > fed:
            ids = torch.as_tensor(prompt[fed:-1], dtype=torch.long, device=self.device).view(1, -1)
            # a short prompt row-exactly, as `prefill_batch` feeds it among others (a chunk of a
            # long one is never this short: `Decoding.prefill_step` passes its first 257+ ids)
            with row_exact(len(prompt) <= self.shared_prefill):
                self.pass_hidden = self._decoder(input_ids=ids, past_key_values=cache, use_cache=True).last_hidden_state[0]
            _record_fed(cache, prompt, fed)
        return prompt[-1:]

    @torch.inference_mode()
    def prefill_batch(self, prompts: Sequence[tuple[Sequence[int], object]],
                      segments: Sequence[Segment] = ()) -> list[torch.Tensor]:
        """`prefill` for several prompts in one pass (where `shared_prefill` > 0): each (prompt,
        cache) gets all of its prompt but the last token, the bits its own `prefill` gives it: a
        short prompt (at most `shared_prefill` ids) row-exactly; a longer one (where
        `shared_chunks`) with its rows attending causally over its cache in one call as its pass
        alone does (`rows.Causal`; one row alone: the one-query kernel, as alone), every linear and
        norm rounding each row alike in a pass of any size. A pass streams the weights once for all
        of them, and for `segments` too: other sequences' new tokens scored in the same pass, each
        one's logits bit for bit what `forward_batch` (and `forward` alone) returns for it.
        Returns: per segment, logits [num_logits_i, V] fp32 (none without segments). Hidden states
        are not kept."""
        if not self.shared_prefill:
            raise SpecdecError(f"{self.name} cannot share a prompt pass between sequences (its rows would round "
                               "otherwise, or attention does not run in our kernel); feed each with prefill")
        self._check_segments(segments)
        limit, feeds, fed, causal = self.shared_prefill, [], [], []
        for prompt, cache in prompts:
            prompt = list(prompt)
            if not prompt:
                raise SpecdecError("a shared prompt pass takes prompts of at least one id")
            if len(prompt) > limit and not self.shared_chunks:  # its rows would round otherwise than alone
                raise SpecdecError(f"a shared prompt pass on {self.kernels} kernels takes prompts of 1..{limit} ids, "
                                   f"not {len(prompt)}")
            start = cache_length(cache)
            if len(prompt) - 1 > start:
                if len(prompt) > limit and len(prompt) - 1 - start > 1:
                    causal.append(len(feeds))
                feeds.append(Segment(prompt[start:-1], cache, 0))
                fed.append((prompt, start))
        logits = []
        if feeds or segments:
            hidden = self._segmented_pass([*feeds, *segments], causal)
            for segment, (prompt, start) in zip(feeds, fed):
                _record_fed(segment.cache, prompt, start)
            logits = self._scores(segments, hidden[len(feeds):]) if segments else []
        self.last_hidden = self.pass_hidden = None
        return logits

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
            head = self._packed_head if self._packed_head is not None else \
                (lambda rows: row_stable_linear(rows, self._head_weight))
            logits = widen_and_refine(head(flat), flat, self._head_weight, self._head_row_norm)
            logits = logits.view(*hidden.shape[:-1], -1)
        elif self.dtype != torch.float32 and exact:
            logits = row_stable(lambda rows: fp32_matmul(rows, self._head_weight), hidden)
        elif self.device.type == "cuda":
            logits = row_stable_linear(hidden, self._head_weight).float()
        elif self._packed_head is not None:
            logits = self._packed_head(hidden).float()
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


def _record_fed(cache, prompt: list[int], start: int) -> None:
    """Tell a prompt cache's record (`prompts.Held`) that `prompt` but its last id was fed from
    `start`; caches without one keep no record."""
    if hasattr(cache, "held"):
        cache.held.fed(prompt, start)
