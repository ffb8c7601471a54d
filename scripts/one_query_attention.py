"""One-query attention (docs/KERNELS.md, "One-query attention"): transformers' CPU call for one
query with grouped heads (sdpa's `enable_gqa`) against the same attention with each key/value
head's query heads packed as query rows (`specdec.rows.one_query_attention`), alone and inside
the default pair's passes after a Spec-Bench summarization prompt.

Kernel table: bf16, one query of 12 heads over 2 key/value heads, head size 128; best of 3 × 100
calls. Pass table: the target (row-exact bf16) over 1..16 tokens and the drafter over 1, each the
min of 4 passes after the prompt is cached, first with every one-query call of our passes sent
through `enable_gqa` (the path before), then packed. Usage:
    .venv/bin/python scripts/one_query_attention.py
"""
import time

import torch
import torch.nn.functional as F

import specdec.rows as rows
from specdec import load
from specdec.bench.datasets import load_prompts


def best_ms(call, n: int = 100) -> float:
    for _ in range(5):
        call()
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(n):
            call()
        runs.append((time.perf_counter() - start) / n * 1e3)
    return min(runs)


def kernels() -> None:
    print("keys | enable_gqa (ms) | packed (ms)")
    for keys in (16, 128, 512, 2048):
        query = torch.randn(1, 12, 1, 128, dtype=torch.bfloat16)
        key, value = (torch.randn(1, 2, keys, 128, dtype=torch.bfloat16) for _ in range(2))
        stock = best_ms(lambda: F.scaled_dot_product_attention(query, key, value, enable_gqa=True))
        packed = best_ms(lambda: rows.one_query_attention(query, key, value))
        print(f"{keys} | {stock:.3f} | {packed:.3f}")


def enable_gqa(query, key, value, scale=None):
    return F.scaled_dot_product_attention(query, key, value, scale=scale, enable_gqa=True).transpose(1, 2)


def passes() -> None:
    prompt = next(p for p in load_prompts("spec-bench") if p.task == "summarization")
    target, drafter = load("qwen2.5-coder-1.5b", role="target"), load("qwen2.5-coder-0.5b", role="drafter")
    ids = target.encode(prompt.text)  # the text alone (680 tokens), no chat template

    def pass_ms(model, width: int) -> float:
        cache = model.new_cache()
        model.forward(model.prefill(ids, cache), cache, 1)
        cached, times = model.cache_length(cache), []
        for _ in range(4):
            start = time.perf_counter()
            model.forward(ids[100:100 + width], cache, width)
            times.append((time.perf_counter() - start) * 1e3)
            model.crop(cache, cached)
        return min(times)

    packed = rows.one_query_attention
    print(f"{len(ids)} prompt tokens cached")
    for name, attention in (("enable_gqa (before)", enable_gqa), ("packed", packed)):
        rows.one_query_attention = attention
        target_ms = {w: round(pass_ms(target, w)) for w in (1, 2, 4, 8, 16)}
        print(name, "target ms by width", target_ms, "drafter 1 token ms", round(pass_ms(drafter, 1)))
    rows.one_query_attention = packed


if __name__ == "__main__":
    kernels()
    passes()
