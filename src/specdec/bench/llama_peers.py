"""llama.cpp as a peer in the same run: its plain decoding and its speculative decoding, through
llama-cpp-python's own `Llama` API on the very GGUF files our models come from.

`llama-cpp`: `Llama.generate`, one token per pass (ggml's repacked kernels, its defaults).
`llama-cpp-spec`: `Llama(draft_model=...)`, llama-cpp-python's speculative loop (it evaluates the
pending token plus the draft in one batch and keeps the prefix its sampler agrees with).
`llama-cpp-lookup`: the same loop with the package's own prompt-lookup draft model
(`LlamaPromptLookupDecoding`, its defaults: 2-token n-grams, 10 tokens copied).
The package ships no model drafter, so the drafter model is wrapped here the way
llama.cpp's own speculative example drafts: greedy, at most 16 tokens, stopping below a top
probability of 0.75 (`common_params_speculative`'s defaults). That loop keeps logits for every
position (`logits_all`), prompt included, as llama-cpp-python requires for speculation; it is
passed explicitly, as 0.3.36 otherwise sizes its logits buffer for one batch (512 tokens) and
fails on longer prompts.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from ..models import catalogue as registry
from ..backends.llamacpp import default_threads, import_llama_cpp
from ..errors import SpecdecError
from ..core.samplers import Sampler

DRAFT_MAX, DRAFT_P_MIN = 16, 0.75  # llama.cpp's speculative defaults (common_params_speculative)
CONTEXT = 4096  # tokens per generation; the speculative peer keeps 4096 x V fp32 logits (2.5 GB at 151,936 ids)


def gguf_path(name: str) -> Path:
    """The GGUF file behind a registry model name or a .gguf path."""
    path = Path(name).expanduser()
    if name in registry.MODELS:
        path = registry.model_root(name) / registry.spec(name).gguf_name
    elif path.suffix != ".gguf":
        raise SpecdecError(f"the llama-cpp methods run GGUF files: {name} is neither a registry model nor a .gguf file")
    if not path.is_file():
        raise SpecdecError(f"GGUF file not found: {path} (run `specdec install {name}`?)")
    return path


class _GreedyDrafter:
    """A `LlamaDraftModel` over a second `Llama`: greedy drafts, reusing its cache across calls."""

    def __init__(self, llm, n_max: int = DRAFT_MAX, p_min: float = DRAFT_P_MIN):
        self.llm, self.n_max, self.p_min = llm, n_max, p_min
        self.lib = import_llama_cpp()

    def __call__(self, input_ids: np.ndarray, **kwargs) -> np.ndarray:
        llm, ids = self.llm, input_ids.tolist()
        common = 0
        cached = llm.input_ids[:llm.n_tokens].tolist()
        while common < min(len(cached), len(ids) - 1) and cached[common] == ids[common]:
            common += 1
        llm.n_tokens = common  # eval drops the cache from here on
        llm.eval(ids[common:])
        draft: list[int] = []
        vocab = llm.n_vocab()
        while len(draft) < self.n_max:
            logits = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))
            token = int(logits.argmax())
            top = 1.0 / float(np.exp(logits - logits[token]).sum())
            if top < self.p_min:
                break
            draft.append(token)
            llm.eval([token])
        return np.array(draft, dtype=np.intc)


class LlamaPeers:
    """llama.cpp's plain and speculative decoding for a target (and drafter) GGUF. drafter: the
    drafter model of `llama-cpp-spec` (None: no such method); lookup: whether `llama-cpp-lookup`
    runs. The speculative methods share one `Llama` that keeps every position's logits."""

    def __init__(self, target: str, drafter: str | None, threads: int | None = None, lookup: bool = False):
        llama_cpp = import_llama_cpp()
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        threads = threads or default_threads()
        common = dict(n_ctx=CONTEXT, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False)
        self.paths = {"target": str(gguf_path(target))}
        self.plain = llama_cpp.Llama(model_path=self.paths["target"], **common)
        self.drafts = {"llama-cpp-lookup": LlamaPromptLookupDecoding()} if lookup else {}
        if drafter is not None:
            self.paths["drafter"] = str(gguf_path(drafter))
            self.drafts["llama-cpp-spec"] = _GreedyDrafter(llama_cpp.Llama(model_path=self.paths["drafter"], **common))
        self.spec = llama_cpp.Llama(model_path=self.paths["target"], logits_all=True, **common) if self.drafts else None

    def generate(self, method: str, ids: list[int], max_new_tokens: int, sampler: Sampler,
                 eos_token_ids: list[int], seed: int | None) -> tuple[list[int], float, float | None]:
        """(tokens, wall seconds, seconds to the first token) for `method` on prompt `ids`."""
        if method == "llama-cpp":
            llm = self.plain
        elif method in self.drafts:
            llm = self.spec
            llm.draft_model = self.drafts[method]
        else:
            raise SpecdecError(f"{method} was not loaded (llama-cpp-spec needs a drafter model)")
        if len(ids) + max_new_tokens > CONTEXT:
            raise SpecdecError(f"{method}: a {len(ids)}-token prompt and {max_new_tokens} new tokens exceed "
                               f"its context of {CONTEXT}")
        llm.reset()  # no prompt reuse from the previous generation: every method pays its prompt pass
        if seed is not None:
            llm.set_seed(seed)
        if sampler.is_greedy:
            options = dict(temp=0.0, top_k=1, top_p=1.0)
        else:
            options = dict(temp=sampler.temperature, top_k=sampler.top_k or 0, top_p=sampler.top_p or 1.0)
        tokens: list[int] = []
        first = None
        start = time.perf_counter()
        for token in llm.generate(ids, min_p=0.0, typical_p=1.0, repeat_penalty=1.0, reset=True, **options):
            if first is None:
                first = time.perf_counter() - start
            tokens.append(int(token))
            if token in eos_token_ids or len(tokens) >= max_new_tokens:
                break
        return tokens, time.perf_counter() - start, first
