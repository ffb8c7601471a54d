"""Where a step's time goes, and whether a static KV cache or a compiled step would win it back
(issue 13, item 4). On the default pair, greedy, the first HumanEval prompts:

1. the generation stats' split of the wall clock (target passes, drafter, our loop) for `sd-cost`
   and AR, and torch's profiler over one `sd-cost` generation: the share of the three kernel
   families (dense linears, int8 linears, attention) against everything else;
2. --cache: a position-indexed cache (`SlabLayer` below: each layer writes into a buffer reserved
   ahead, rollback only narrows the views) against transformers' `DynamicLayer` (torch.cat per
   pass): the cache update alone, then whole target passes at several cached lengths;
3. --compile: `torch.compile` of the drafter's decoder (the drafter's rounding never changes the
   output, so only its speed matters): compile time, and 1- and 2-token passes against eager;
   --compile-target: the same for the target's 1-token pass (plain attention, not row-exact).

Usage: .venv/bin/python scripts/step_overhead.py [--prompts 3] [--max-new-tokens 128] [--cache] [--compile]
       [--compile-target]
"""
import argparse
import statistics
import time

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from specdec import autoregressive_generate, load, speculative_generate
from specdec.bench.datasets import load_prompts
from specdec.schedules import make_schedule

# profiler op names (self time) by kernel family; aten::linear itself only dispatches to addmm/mm
KERNELS = {"_weight_int8pack_mm": "int8 linears", "addmm": "dense linears", "aten::mm": "dense linears",
           "mkldnn_linear": "dense linears", "scaled_dot_product": "attention", "_flash_attention": "attention"}


class SlabLayer(DynamicLayer):
    """keys/values are views of the first `length` positions of a reserved buffer that doubles when
    full: a pass writes its positions in place, `crop` (inherited) narrows the views."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.slabs = None
        length = 0 if self.slabs is None else self.keys.shape[-2]
        end = length + key_states.shape[-2]
        if self.slabs is None or end > self.slabs[0].shape[-2]:
            old = self.slabs
            self.slabs = [s.new_empty((*s.shape[:2], max(256, 2 * end), s.shape[-1])) for s in (key_states, value_states)]
            if old is not None:
                for new, cached in zip(self.slabs, (self.keys, self.values)):
                    new[..., :length, :].copy_(cached)
        self.slabs[0][..., length:end, :].copy_(key_states)
        self.slabs[1][..., length:end, :].copy_(value_states)
        self.keys, self.values = self.slabs[0][..., :end, :], self.slabs[1][..., :end, :]
        return self.keys, self.values


def slab_cache(config) -> DynamicCache:
    cache = DynamicCache(config=config)
    cache.layers = [SlabLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def time_split(target, drafter, prompts, n: int) -> None:
    for prompt in prompts:
        ids = target.encode(prompt.text)
        runs = {"sd-cost": lambda: speculative_generate(ids, target, drafter, max_new_tokens=n,
                                                        schedule=make_schedule("cost", 5, 1, 20)),
                "ar": lambda: autoregressive_generate(ids, target, max_new_tokens=n)}
        for name, run in runs.items():
            s = run().stats
            print(f"{prompt.task} {name}: wall {s.wall_seconds:.2f} s = target passes {s.target_seconds:.2f} s + "
                  f"drafter {s.drafter_seconds:.2f} s + loop {s.loop_seconds:.3f} s ({s.loop_ms_per_step:.1f} ms per "
                  f"step over {s.target_forwards} steps, {100 * s.loop_seconds / s.wall_seconds:.2f}% of wall)",
                  flush=True)
    ids = target.encode(prompts[0].text)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        speculative_generate(ids, target, drafter, max_new_tokens=n, schedule=make_schedule("cost", 5, 1, 20))
        wall = time.perf_counter() - start
    shares: dict[str, float] = {}
    for event in prof.key_averages():
        kind = next((v for k, v in KERNELS.items() if k in event.key), None)
        if kind:
            shares[kind] = shares.get(kind, 0.0) + event.self_cpu_time_total / 1e6
    rest = wall - sum(shares.values())
    print("profiler, one sd-cost generation: " + ", ".join(f"{k} {v / wall:.1%}" for k, v in shares.items())
          + f", everything else (norms, rotary, copies, module calls, Python) {rest / wall:.1%} of {wall:.1f} s",
          flush=True)


def cache_probe(target, drafter) -> None:
    for model, role in ((target, "target"), (drafter, "drafter")):
        config = model.hf.config.get_text_config()
        heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
        for length in (128, 700, 2000):
            costs = []
            for kind in (DynamicLayer, SlabLayer):
                layers = [kind() for _ in range(config.num_hidden_layers)]
                for layer in layers:
                    filler = torch.randn(1, heads, length, dim, dtype=model.dtype)
                    layer.update(filler, filler)
                one = torch.randn(1, heads, 1, dim, dtype=model.dtype)

                def step():
                    for layer in layers:
                        layer.update(one, one)
                        layer.crop(-1)
                costs.append(median_ms(step, 50))
            print(f"{role} cache update, {length} cached: dynamic (cat) {costs[0]:.2f} ms, slab {costs[1]:.2f} ms "
                  f"per pass", flush=True)
    for length in (128, 700, 2000):
        prompt = list(range(1000, 1000 + length))
        costs = {}
        for rounds in range(2):  # interleaved: the machine's drift hits both
            for name, make in (("dynamic", target.new_cache), ("slab", lambda: slab_cache(target.hf.config))):
                cache = make()
                target.prefill(prompt, cache)
                target.forward(prompt[-1:], cache)

                def step():
                    target.forward([7], cache)
                    target.crop(cache, target.cache_length(cache) - 1)
                costs.setdefault(name, []).append(median_ms(step, 8))
        print(f"target 1-token pass after {length} tokens: dynamic {min(costs['dynamic']):.1f} ms, slab "
              f"{min(costs['slab']):.1f} ms (best of 2 medians of 8)", flush=True)


def compile_probe(model, prompt_ids, role: str, rows_list=(1, 2)) -> None:
    """torch.compile of `model`'s decoder: compile time per row count, then passes against eager."""
    decoder = model._decoder

    def passes(fn, rows: int, repeats: int = 12) -> float:
        cache = model.new_cache()
        with torch.inference_mode():
            decoder(input_ids=torch.tensor([prompt_ids]), past_key_values=cache, use_cache=True)

            def step():
                fn(input_ids=torch.tensor([[7] * rows]), past_key_values=cache, use_cache=True)
                cache.crop(-rows)
            step()
            return median_ms(step, repeats)
    compiled = torch.compile(decoder, dynamic=True)
    for rows in rows_list:
        start = time.perf_counter()
        passes(compiled, rows, 1)
        print(f"{role} compile for {rows}-token passes: {time.perf_counter() - start:.0f} s", flush=True)
    for rows in rows_list:
        print(f"{role} {rows}-token pass: eager {passes(decoder, rows):.1f} ms, compiled {passes(compiled, rows):.1f} ms",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--cache", action="store_true", help="also compare a static (slab) KV cache")
    parser.add_argument("--compile", action="store_true", help="also compile the drafter's decoder")
    parser.add_argument("--compile-target", action="store_true",
                        help="also compile the target's decoder (plain attention, not row-exact; ~3 min)")
    args = parser.parse_args()
    target, drafter = load("qwen2.5-coder-1.5b"), load("qwen2.5-coder-0.5b", role="drafter")
    prompts = load_prompts("humaneval", args.prompts)
    time_split(target, drafter, prompts, args.max_new_tokens)
    if args.cache:
        cache_probe(target, drafter)
    if args.compile:
        compile_probe(drafter, target.encode(prompts[0].text), "drafter")
    if args.compile_target:  # a compiled graph rounds its own way: measured here, kept nowhere
        del drafter
        plain = load("qwen2.5-coder-1.5b", exact_rows=False)
        compile_probe(plain, target.encode(prompts[0].text)[:300], "target", rows_list=(1,))


if __name__ == "__main__":
    main()
