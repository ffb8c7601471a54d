"""Captured passes: a Llama-family decoder (Llama, Qwen2, Qwen3, Mistral without a sliding
window) run from static buffers, on CUDA replayed as CUDA graphs, one per row bucket.

transformers' eager layers launch some 1,500 small kernels a pass, and on a GPU launching them
costs far more than reading the weights (docs/kernels.md#captured-passes-on-cuda---kernels-captured).
A CUDA graph replays the whole pass as one launch, which needs every shape and address fixed. So here:

- the KV cache is one slab per layer, [(slots + 1) x capacity, kv_heads, D], a sequence owning
  a slot (`SlotCache`); a pass writes each row's keys at slot x capacity + position (the last
  slot takes the padding rows' writes) and rollback is a length change;
- a pass's rows are padded to a bucket (`BUCKETS`); every GEMM and norm runs in calls of exactly
  `kernels.CUDA_ROWS` rows, so a row's result cannot depend on what else the pass holds;
- attention is one varlen flash-attention call over all slots, causal from the bottom right,
  each slot's key count read from device memory (`seqused_k`), its host-side sizes fixed
  (`QUERY_ROWS` rows a slot at most, `capacity` keys): the kernel computes each query row over
  its own slot's keys in one fixed order, whatever the other rows are;
- the output head runs after the replay on the rows that need logits, in CUDA_ROWS-row calls
  with fp32 accumulation (most rows of a prompt's chunk need none).

So every row of every pass is computed as a one-token pass computes it: greedy speculative
output is token-identical to greedy AR on this backend (rowprobe measures the row gaps on the
GPU). Chains only: a token tree's mask is no causal one (`tree_masks` False; the CLI picks a
chain method). On the CPU the same code runs eagerly (attention by sdpa per slot): the tests'
check of the arithmetic against transformers' model, not a fast path.
"""

from __future__ import annotations

import weakref
from typing import Sequence

import torch

from ..errors import SpecdecError
from .kernels import CUDA_ROWS, fixed_row_calls, fp32_matmul
from .text import decode_ids, encode_text, eos_ids
from . import Features, Segment
from . import fused as fused_kernels

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
QUERY_ROWS = 256  # the most rows of one sequence in a pass (a prompt is fed in chunks of this many)
BUCKETS = (64, 128, 256, 512)  # rows of a pass, padded up; wider work is cut into several passes


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama/Qwen RMSNorm: x [N, H] -> [N, H] in x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Layer:
    """One decoder layer's weights, q/k/v and gate/up fused (one GEMM each)."""

    def __init__(self, layer, dtype: torch.dtype):
        attention, mlp = layer.self_attn, layer.mlp
        projections = (attention.q_proj, attention.k_proj, attention.v_proj)
        self.qkv = torch.cat([p.weight for p in projections]).to(dtype)
        biases = [p.bias for p in projections]
        self.qkv_bias = None if any(b is None for b in biases) else torch.cat(biases).to(dtype)
        self.o = attention.o_proj.weight
        self.o_bias = attention.o_proj.bias
        self.gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        self.down = mlp.down_proj.weight
        self.act = mlp.act_fn
        self.norms = [(n.weight, n.variance_epsilon) for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        self.qk_norms = [(n.weight, n.variance_epsilon) for n in (getattr(attention, "q_norm", None),
                                                                   getattr(attention, "k_norm", None)) if n is not None]


class StaticDecoder:
    """A Llama-family decoder's pass over static buffers (see the module's docstring).

    slots: sequences held at once; capacity: positions per sequence. graphs: capture each bucket
    as a CUDA graph (CUDA only; False runs the same pass eagerly, as the CPU always does).
    rows: the rows of every GEMM and norm call (CUDA_ROWS); None makes each call on the pass's
    whole bucket, which is not row-exact (rowprobe's power check and its "plain" rows).
    buckets: the row counts passes are padded to (ascending; the last at least QUERY_ROWS).
    fused: run the ops between GEMMs as fused kernels (backends/fused.py); None: where they run
    (CUDA with Triton) and the model has no q/k norms (Qwen3's, which they do not take).
    """

    def __init__(self, hf_model, slots: int, capacity: int, graphs: bool = True, rows: int | None = CUDA_ROWS,
                 buckets: Sequence[int] = BUCKETS, fused: bool | None = None):
        config = hf_model.config.get_text_config()
        family = getattr(config, "model_type", "")
        if family not in FAMILIES:
            raise SpecdecError(f"captured passes run the {', '.join(FAMILIES)} families, not {family!r}")
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", family == "mistral"):
            raise SpecdecError("captured passes do not take sliding-window attention")
        if slots < 1 or capacity < 1:
            raise SpecdecError(f"captured passes need slots >= 1 and capacity >= 1, got {slots} and {capacity}")
        base = getattr(hf_model, hf_model.base_model_prefix)
        self.device, self.dtype = base.embed_tokens.weight.device, base.embed_tokens.weight.dtype
        if self.device.type == "cuda" and self.dtype not in (torch.bfloat16, torch.float16):
            raise SpecdecError(f"captured passes on CUDA run bf16 or fp16 weights (flash attention), not {self.dtype}")
        self.graphs = bool(graphs) and self.device.type == "cuda"
        self.rows = rows
        self.buckets = tuple(sorted(buckets))
        if self.buckets[-1] < QUERY_ROWS:
            raise SpecdecError(f"the widest bucket must hold a prompt's chunk of {QUERY_ROWS} rows")
        self.slots, self.capacity = slots, capacity
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.hidden_size = config.hidden_size
        self.scale = self.head_dim ** -0.5
        self.embed = base.embed_tokens.weight
        self.layers = [_Layer(layer, self.dtype) for layer in base.layers]
        self.norm = (base.norm.weight, base.norm.variance_epsilon)
        can_fuse = fused_kernels.available(self.device) and fused_kernels.supports(self.head_dim) and \
            not any(layer.qk_norms for layer in self.layers)
        if fused and not can_fuse:
            raise SpecdecError("fused kernels need Triton on CUDA (or its interpreter), a power-of-two head size "
                               "and no q/k norms")
        self.fused = can_fuse if fused is None else bool(fused)
        with torch.no_grad():
            positions = torch.arange(capacity, device=self.device).view(1, -1)
            cos, sin = base.rotary_emb(self.embed[:1].view(1, 1, -1), positions)
        self.cos, self.sin = cos[0], sin[0]  # [capacity, D]
        shape = ((slots + 1) * capacity, self.kv_heads, self.head_dim)
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        # per pass: how many rows each slot has (cumulated) and how many keys it reads
        self.cu_q = torch.zeros(slots + 1, dtype=torch.int32, device=self.device)
        self.cu_k = torch.arange(0, (slots + 1) * capacity, capacity, dtype=torch.int32, device=self.device)
        self.used = torch.zeros(slots, dtype=torch.int32, device=self.device)
        self._inputs: dict[int, torch.Tensor] = {}  # bucket -> [3, R] ids, cache rows, positions
        self._outputs: dict[int, torch.Tensor] = {}  # bucket -> [R, H] final hidden states
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = None
        self._host_lengths: tuple[list[int], list[int]] | None = None  # eager attention's cu_q, used

    @property
    def kv_bytes(self) -> int:
        """Bytes of the slabs (keys and values of every slot and layer)."""
        return 2 * sum(k.numel() * k.element_size() for k in self.keys)

    def bucket(self, rows: int) -> int:
        """The captured size a pass of `rows` rows runs at."""
        for size in self.buckets:
            if rows <= size:
                return size
        raise SpecdecError(f"a captured pass holds at most {self.buckets[-1]} rows, not {rows}")

    @torch.inference_mode()
    def run(self, ids: Sequence[int], slots: Sequence[int], positions: Sequence[int],
            lengths: dict[int, tuple[int, int]]) -> torch.Tensor:
        """One pass: row i is token ids[i] of sequence slots[i] at positions[i]; rows come slot by
        slot in ascending slot order, each slot's at consecutive positions. lengths: slot ->
        (its rows, its key count after the pass). Returns the final hidden states [n, H] (a view
        of a static buffer, valid until the next pass)."""
        n = len(ids)
        size = self.bucket(n)
        pad = size - n
        scratch = self.slots * self.capacity
        rows = torch.tensor([list(ids) + [0] * pad,
                             [s * self.capacity + p for s, p in zip(slots, positions)] +
                             [scratch + i % self.capacity for i in range(pad)],
                             list(positions) + [0] * pad], dtype=torch.long)
        counts, used = [0] * self.slots, [0] * self.slots
        for slot, (count, keys) in lengths.items():
            counts[slot], used[slot] = count, keys
        cumulated = [0]
        for count in counts:
            cumulated.append(cumulated[-1] + count)
        if size not in self._inputs:
            self._inputs[size] = torch.zeros(3, size, dtype=torch.long, device=self.device)
        self._inputs[size].copy_(rows, non_blocking=True)
        self.cu_q.copy_(torch.tensor(cumulated, dtype=torch.int32), non_blocking=True)
        self.used.copy_(torch.tensor(used, dtype=torch.int32), non_blocking=True)
        if self.graphs:
            if size not in self._graphs:
                self._capture(size)
            self._graphs[size].replay()
        else:
            self._host_lengths = (cumulated, used)
            self._outputs[size] = self._pass(self._inputs[size])
        return self._outputs[size][:n]

    def _capture(self, size: int) -> None:
        """Capture the pass of `size` rows (warmed up on a side stream first, as CUDA graphs ask),
        its inputs and outputs this bucket's static buffers; rows written go to the scratch slot."""
        saved = (self._inputs[size].clone(), self.cu_q.clone(), self.used.clone())
        self._inputs[size][1].copy_(self.slots * self.capacity + torch.arange(size, device=self.device) % self.capacity)
        self.cu_q.zero_()
        self.used.zero_()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._pass(self._inputs[size])
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._outputs[size] = self._pass(self._inputs[size])
        self._graphs[size] = graph
        for buffer, value in zip((self._inputs[size], self.cu_q, self.used), saved):
            buffer.copy_(value)

    def _calls(self, function, x: torch.Tensor) -> torch.Tensor:
        """function over x's rows [N, K] in calls of `rows` rows (all at once where rows is None)."""
        return function(x) if self.rows is None else fixed_row_calls(function, x, self.rows)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self._calls(lambda rows: torch.nn.functional.linear(rows, weight, bias), x)

    def _norm(self, x: torch.Tensor, norm: tuple[torch.Tensor, float]) -> torch.Tensor:
        return self._calls(lambda rows: _rms_norm(rows, *norm), x)

    def _pass(self, inputs: torch.Tensor) -> torch.Tensor:
        """inputs [3, R] (ids, cache rows, positions) -> final hidden states [R, H]."""
        if self.fused:
            return self._fused_pass(inputs)
        ids, where, positions = inputs
        size = ids.shape[0]
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [R, 1, D]
        x = self.embed[ids]
        q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        for layer, keys, values in zip(self.layers, self.keys, self.values):
            h = self._norm(x, layer.norms[0])
            q, k, v = self._linear(h, layer.qkv, layer.qkv_bias).split([q_width, kv_width, kv_width], dim=-1)
            q = q.reshape(size, self.heads, self.head_dim)
            k = k.reshape(size, self.kv_heads, self.head_dim)
            if layer.qk_norms:
                q = self._norm(q.reshape(-1, self.head_dim), layer.qk_norms[0]).view_as(q)
                k = self._norm(k.reshape(-1, self.head_dim), layer.qk_norms[1]).view_as(k)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            keys.index_copy_(0, where, k)
            values.index_copy_(0, where, v.reshape(size, self.kv_heads, self.head_dim))
            attended = self._attend(q, keys, values).reshape(size, q_width)
            x = x + self._linear(attended, layer.o, layer.o_bias)
            h = self._norm(x, layer.norms[1])
            gate, up = self._linear(h, layer.gate_up, None).chunk(2, dim=-1)
            x = x + self._linear(layer.act(gate) * up, layer.down, None)
        return self._norm(x, self.norm)

    def _fused_pass(self, inputs: torch.Tensor) -> torch.Tensor:
        """`_pass` with the ops between GEMMs fused (backends/fused.py): 9 kernels a layer."""
        ids, where, positions = inputs
        size = ids.shape[0]
        h, x = fused_kernels.rms_norm(self.embed[ids], *self.layers[0].norms[0])
        for i, (layer, keys, values) in enumerate(zip(self.layers, self.keys, self.values)):
            qkv = self._linear(h, layer.qkv, layer.qkv_bias)
            q = fused_kernels.rope_store(qkv, positions, where, self.cos, self.sin, keys, values, self.heads)
            attended = self._attend(q, keys, values).reshape(size, self.heads * self.head_dim)
            h, x = fused_kernels.rms_norm(x, *layer.norms[1], add=self._linear(attended, layer.o, layer.o_bias))
            down = self._linear(fused_kernels.silu_mul(self._linear(h, layer.gate_up, None)), layer.down, None)
            after = self.layers[i + 1].norms[0] if i + 1 < len(self.layers) else self.norm
            h, x = fused_kernels.rms_norm(x, *after, add=down)
        return h

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """q [R, heads, D] over each row's slot's keys, causal -> [R, heads, D]."""
        if self.device.type == "cuda":
            return torch.ops.aten._flash_attention_forward(
                q, keys, values, self.cu_q, self.cu_k, QUERY_ROWS, self.capacity, 0.0, True, False,
                scale=self.scale, seqused_k=self.used)[0]
        out = torch.zeros_like(q)  # eager (CPU): slot by slot, the lengths known on the host
        cumulated, used = self._host_lengths
        groups = self.heads // self.kv_heads
        for slot in range(self.slots):
            first, last, length = cumulated[slot], cumulated[slot + 1], used[slot]
            if last == first:
                continue
            base = slot * self.capacity
            k = keys[base:base + length].transpose(0, 1).repeat_interleave(groups, 0)  # [heads, L, D]
            v = values[base:base + length].transpose(0, 1).repeat_interleave(groups, 0)
            rows = last - first
            mask = torch.ones(rows, length, dtype=torch.bool, device=q.device).tril(length - rows)
            out[first:last] = torch.nn.functional.scaled_dot_product_attention(
                q[first:last].transpose(0, 1), k, v, attn_mask=mask, scale=self.scale).transpose(0, 1)
        return out


class SlotCache:
    """One sequence's place in a `CapturedModel`'s slabs: its slot and how many positions it holds.
    Rolling back is a length change; the slot is freed when the cache is dropped."""

    def __init__(self, model: "CapturedModel", slot: int):
        self.slot, self.length = slot, 0
        self._release = weakref.finalize(self, model._free.append, slot)

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, max_length: int) -> None:
        """Keep the first `max_length` positions (negative: drop that many from the end)."""
        self.length = max(0, self.length + max_length) if max_length < 0 else min(self.length, max_length)


class CapturedModel:
    """A Llama-family causal LM run by a `StaticDecoder` (the `Backend` and `BatchedBackend`
    protocols; chains only). `models.load(..., kernels="captured")` builds one on CUDA."""

    tree_masks = False
    exact_rows = True
    rows_invariant = True

    def __init__(self, hf_model, tokenizer=None, name: str = "model", role: str = "target", sequences: int = 16,
                 capacity: int | None = None, graphs: bool = True, rows: int | None = CUDA_ROWS,
                 buckets: Sequence[int] = BUCKETS, fused: bool | None = None):
        """hf_model: a transformers causal LM of a supported family, on its device and dtype (its
        weights are shared, the fused ones copied). sequences: caches live at once (slots);
        capacity: positions each (default: the model's context, at most 4096). graphs, rows,
        buckets, fused: as `StaticDecoder`'s (rows=None: plain passes, not row-exact)."""
        config = hf_model.config.get_text_config()
        if capacity is None:
            capacity = min(getattr(config, "max_position_embeddings", 4096) or 4096, 4096)
        self.hf = hf_model.eval()
        self.num_parameters = sum(p.numel() for p in hf_model.parameters())  # roles.check_roles
        self.tokenizer = tokenizer
        self.name, self.role = name, role
        self.decoder = StaticDecoder(hf_model, sequences, capacity, graphs=graphs, rows=rows, buckets=buckets,
                                     fused=fused)
        self.exact_rows = rows is not None
        self.rows_invariant = self.exact_rows
        self._head = hf_model.get_output_embeddings().weight
        self._head_bias = getattr(hf_model.get_output_embeddings(), "bias", None)
        self.kernels = ("cuda-graphs" if self.decoder.graphs else "static-eager") + \
            ("+fused" if self.decoder.fused else "")
        self._free = list(range(sequences - 1, -1, -1))
        self.last_hidden: torch.Tensor | None = None
        self.pass_hidden: torch.Tensor | None = None

    device = property(lambda self: self.decoder.device)
    dtype = property(lambda self: self.decoder.dtype)
    weights = property(lambda self: str(self.decoder.dtype).removeprefix("torch."))
    hidden_size = property(lambda self: self.decoder.hidden_size)
    vocab_size = property(lambda self: self._head.shape[0])
    max_context = property(lambda self: self.decoder.capacity)
    sequences = property(lambda self: self.decoder.slots)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * len(self.decoder.layers) * self.decoder.kv_heads * self.decoder.head_dim * self.dtype.itemsize

    @property
    def eos_token_ids(self) -> list[int]:
        return eos_ids([getattr(self.hf, "generation_config", None), self.hf.config, self.tokenizer])

    def features(self) -> Features:
        return Features(batched=True, exact_rows=self.exact_rows, rows_invariant=self.rows_invariant,
                        tree_masks=False, sequences=self.sequences, kv_bytes_per_token=self.kv_bytes_per_token,
                        embedded=self.hf.get_input_embeddings().num_embeddings)

    def new_cache(self, prompt: Sequence[int] | None = None, chunk: int | None = None, salt: str = "") -> SlotCache:
        """A free slot (SpecdecError when all `sequences` are in use)."""
        if not self._free:
            raise SpecdecError(f"{self.name} holds {self.sequences} sequences at once and all are in use; "
                               f"load it with more sequences")
        return SlotCache(self, self._free.pop())

    def prefill(self, prompt: Sequence[int], cache: SlotCache) -> list[int]:
        """Feed all of `prompt` but its last token (what `cache` lacks of it) -> [prompt[-1]]."""
        prompt = list(prompt)
        fed = cache.get_seq_length()
        hidden = [torch.zeros(0, self.hidden_size, dtype=self.dtype, device=self.device)]
        if len(prompt) - 1 > fed:
            hidden += self._feed([(cache, prompt[fed:-1], 0)])[1]
        self.pass_hidden = torch.cat(hidden)
        return prompt[-1:]

    def forward(self, input_ids: Sequence[int] | torch.Tensor, cache: SlotCache | None = None, num_logits: int = 1,
                parents: Sequence[int] | None = None, tree_start: int | None = None) -> torch.Tensor:
        """[T] new ids after what `cache` holds -> logits [num_logits, V] fp32 of the last positions,
        each row bit for bit what a one-token pass gives (`Backend.forward`; chains only)."""
        if parents is not None:
            raise SpecdecError(f"{self.name} runs captured passes, which take chains, not token trees; "
                               "use a chain method")
        ids = [int(t) for t in (input_ids.tolist() if torch.is_tensor(input_ids) else input_ids)]
        if not 1 <= num_logits <= len(ids):
            raise SpecdecError(f"a pass of {len(ids)} tokens has 1..{len(ids)} logits, not {num_logits}")
        temporary = cache is None
        cache = self.new_cache() if temporary else cache
        try:
            logits, hidden = self._feed([(cache, ids, num_logits)])
        finally:
            if temporary:
                cache._release()
        self.pass_hidden = torch.cat(hidden)
        self.last_hidden = self.pass_hidden[-num_logits:]
        return logits[0]

    def forward_batch(self, segments: Sequence[Segment]) -> list[torch.Tensor]:
        """Several sequences' new tokens in as few passes as their rows allow (`BatchedBackend`);
        each sequence's logits bit for bit what `forward` returns for it alone."""
        for segment in segments:
            if segment.parents is not None:
                raise SpecdecError(f"{self.name} runs captured passes, which take chains, not token trees")
            if not 1 <= segment.num_logits <= len(segment.input_ids):
                raise SpecdecError(f"a segment needs >= 1 new token and 1..{len(segment.input_ids)} logits")
        logits, _ = self._feed([(s.cache, [int(t) for t in s.input_ids], s.num_logits) for s in segments])
        self.last_hidden = self.pass_hidden = None
        return logits

    @torch.inference_mode()
    def _feed(self, parts: list[tuple[SlotCache, list[int], int]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Run every part's ids after its cache (extending it) -> (per part logits [num_logits, V]
        fp32, per part final hidden states [T, H]). A part longer than QUERY_ROWS goes in chunks,
        in successive passes; the chunks of one round share passes of the widest bucket's rows."""
        slots = [cache.slot for cache, _, _ in parts]
        if len(set(slots)) != len(slots):
            raise SpecdecError("a batched pass takes each sequence once")
        for cache, ids, _ in parts:
            if cache.length + len(ids) > self.max_context:
                raise SpecdecError(f"{self.name} holds {self.max_context} positions a sequence; this one would "
                                   f"reach {cache.length + len(ids)}")
        hidden: list[list[torch.Tensor]] = [[] for _ in parts]
        offsets = [0] * len(parts)
        while any(offset < len(ids) for offset, (_, ids, _) in zip(offsets, parts)):
            batch: list[tuple[int, int]] = []  # (part, rows this round), in slot order
            for i in sorted(range(len(parts)), key=lambda i: slots[i]):
                take = min(QUERY_ROWS, len(parts[i][1]) - offsets[i])
                if take and sum(t for _, t in batch) + take > self.decoder.buckets[-1]:
                    self._run_pass(parts, batch, offsets, hidden)
                    batch = []
                if take:
                    batch.append((i, take))
            self._run_pass(parts, batch, offsets, hidden)
        states = [torch.cat(h) for h in hidden]
        rows = torch.cat([h[len(h) - want:] for h, (_, _, want) in zip(states, parts)])
        if not len(rows):  # prompt chunks: no logits wanted
            return [rows.new_zeros(0)] * len(parts), states
        return list(self._logits(rows).split([want for _, _, want in parts])), states

    def _run_pass(self, parts, batch: list[tuple[int, int]], offsets: list[int], hidden) -> None:
        """One pass over `batch`'s rows (part index, rows), advancing offsets and caches."""
        if not batch:
            return
        ids, slots, positions, lengths = [], [], [], {}
        for i, take in batch:
            cache, part_ids, _ = parts[i]
            start = cache.length
            ids += part_ids[offsets[i]:offsets[i] + take]
            slots += [cache.slot] * take
            positions += list(range(start, start + take))
            lengths[cache.slot] = (take, start + take)
        out = self.decoder.run(ids, slots, positions, lengths).clone()
        first = 0
        for i, take in batch:
            hidden[i].append(out[first:first + take])
            parts[i][0].length += take
            offsets[i] += take
            first += take

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] fp32: the head in calls of CUDA_ROWS rows with fp32
        accumulation (row-exact as the layers are)."""
        def head(rows: torch.Tensor) -> torch.Tensor:
            out = fp32_matmul(rows, self._head)
            return out if self._head_bias is None else out + self._head_bias.float()
        return fixed_row_calls(head, hidden, CUDA_ROWS) if self.exact_rows else head(hidden)

    def encode(self, text: str, chat: bool = False) -> list[int]:
        return encode_text(self.tokenizer, self.name, text, chat)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return decode_ids(self.tokenizer, ids, skip_special_tokens)
