"""What one more row of a target pass costs, and where (docs/BENCHMARKS.md, "Token trees: the
eighth look"): the default target as `auto` loads it, a chain of k rows after a cached prompt.

Per k: the whole pass (`LanguageModel.forward` with a tree mask, as a tree step runs it), its
decoder layers alone, and its output head alone (k rows of random hidden states through
`_logits`, fp32 re-scoring included). Then torch's profiler over one pass of the widest k: the
self time of the dense linears against attention and everything else. On the AVX512-BF16 EPYC
the extra rows went to the layers' linears, not the head. Last, one of those linears alone
(bf16 1536 -> 8960, the MLP's up projection) by row count: flat where it reads its weights, growing
where it computes.

--drafter: instead, the default drafter's (int8) pass of k tokens after the cached prompt with its
int8 layers taking at most 2 rows (longer passes on its bf16 path, as on AMX) and at most 16 (all
of these on int8): where int8 stops paying on this CPU (`models.int8_short_rows`).

Usage: .venv/bin/python scripts/row_cost.py [--context 300] [--widths 1,2,4,8,12,16,24] [--repeats 7]
       [--drafter]
"""
import argparse
import statistics
import time

import torch

from specdec import load
from specdec.kernels import Int8Linear
from specdec.rows import row_exact

FAMILIES = {"aten::mm": "dense linears", "aten::addmm": "dense linears", "scaled_dot_product": "attention"}


def median_ms(run, repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=300, help="cached prompt tokens before the timed passes")
    parser.add_argument("--widths", default="1,2,4,8,12,16,24")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--drafter", action="store_true", help="the drafter's int8 and bf16 paths by rows instead")
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    if args.drafter:
        drafter_rows(widths, args.context, args.repeats)
        return
    target = load("qwen2.5-coder-1.5b")
    print(f"{target.name}: {str(target.dtype).removeprefix('torch.')}, row-exact {target.exact_rows}, "
          f"kernels {target.kernels}, {torch.get_num_threads()} threads, {args.context} cached tokens")
    cache = target.new_cache()
    target.prefill(list(range(1000, 1000 + args.context)), cache)
    cached = target.cache_length(cache)

    def chain(k: int):
        ids, parents = list(range(2000, 2000 + k)), list(range(-1, k - 1))

        def whole():
            target.forward(ids, cache, num_logits=k, parents=parents)
            target.crop(cache, cached)

        @torch.inference_mode()
        def layers():
            with row_exact(target.exact_rows):
                target._decoder(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True,
                                **target._tree_inputs(parents, cache, k, None))
            target.crop(cache, cached)
        return whole, layers

    print("rows | whole pass ms | layers ms | head ms | whole, per row past 1")
    first = None
    for k in widths:
        whole, layers = chain(k)
        hidden = torch.randn(k, target.hidden_size, dtype=target.dtype)

        @torch.inference_mode()
        def head():
            with row_exact(target.exact_rows):
                target._logits(hidden)
        costs = [median_ms(run, args.repeats) for run in (whole, layers, head)]
        first = first if first is not None else costs[0]
        extra = f"{(costs[0] - first) / (k - 1):.2f}" if k > 1 else "–"
        print(f"{k} | {costs[0]:.1f} | {costs[1]:.1f} | {costs[2]:.1f} | {extra}", flush=True)

    whole, _ = chain(widths[-1])
    with torch.profiler.profile() as profile:
        whole()
    shares: dict[str, float] = {}
    total = 0.0
    for event in profile.key_averages():
        total += event.self_cpu_time_total
        family = next((name for key, name in FAMILIES.items() if key in event.key), "everything else")
        shares[family] = shares.get(family, 0.0) + event.self_cpu_time_total
    print(f"profiler, one pass of {widths[-1]} rows: " +
          ", ".join(f"{name} {value / 1000:.1f} ms ({value / total:.0%})" for name, value in shares.items()))

    weight = torch.randn(8960, 1536, dtype=torch.bfloat16)
    times = []
    for rows in (1, 2, 4, 8, 12, 16, 24, 32):
        x = torch.randn(rows, 1536, dtype=torch.bfloat16)
        times.append(f"{rows}: {median_ms(lambda: torch.nn.functional.linear(x, weight), 15):.2f}")
    print("one bf16 1536 -> 8960 linear, ms by rows: " + ", ".join(times))


def drafter_rows(widths: list[int], context: int, repeats: int) -> None:
    drafter = load("qwen2.5-coder-0.5b", role="drafter")
    layers = [m for m in drafter.hf.modules() if isinstance(m, Int8Linear)]
    print(f"{drafter.name}: kernels {drafter.kernels}, {len(layers)} int8 layers, {context} cached tokens")
    cache = drafter.new_cache()
    drafter.forward(list(range(1000, 1000 + context)), cache)
    cached = drafter.cache_length(cache)
    print("tokens | int8 up to 2 rows (else bf16) ms | int8 up to 16 rows ms")
    for k in widths:
        ids = list(range(2000, 2000 + k))

        def one_pass():
            drafter.forward(ids, cache, num_logits=1)
            drafter.crop(cache, cached)
        costs = []
        for limit in (2, 16):
            for layer in layers:
                layer.short_rows = limit
            costs.append(median_ms(one_pass, repeats))
        print(f"{k} | {costs[0]:.1f} | {costs[1]:.1f}", flush=True)


if __name__ == "__main__":
    main()
