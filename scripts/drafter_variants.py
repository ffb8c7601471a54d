"""A cheaper drafter (issue 13): what int8 weights and a truncated head vocabulary cost in
acceptance, and what they save per drafting pass.

Acceptance is measured teacher-forced along the target's own greedy output (made once per prompt
by greedy speculative decoding, which equals greedy AR): at each output position, with p the
target's distribution and q a drafter variant's (both at T = 1),
  top-1 agreement: argmax q == argmax p (what greedy drafting needs),
  α: Σ min(p, q) (the chance one sampled draft token is accepted).
The int8 variant runs its int8 kernels on every row here (its usual cut-over to bf16 for long
passes is lifted), so the numbers are those of its 1-token drafting passes.

Pass cost: median ms of a 1-token pass after a 128-token cache, each variant and the target timed
in turns, repeated; c = drafter pass / target pass. Usage:
    .venv/bin/python scripts/drafter_variants.py out.json [--humaneval 5] [--spec-bench 1]
"""
import argparse
import contextlib
import json
import statistics
import time

import torch

from specdec import load, speculative_generate
from specdec.bench.datasets import load_prompts
from specdec.kernels import Int8Linear
from specdec.vocab import frequent_ids

SIZES = (0, 65536, 32768, 16384, 8192)  # 0: the whole vocabulary


def one_token_ms(model, reps: int = 9) -> float:
    cache = model.new_cache()
    model.forward(list(range(100, 228)), cache)
    times = []
    for i in range(reps + 2):
        start = time.perf_counter()
        model.forward([500 + i], cache)
        times.append(time.perf_counter() - start)
        model.crop(cache, 128)
    return statistics.median(times[2:]) * 1e3


@contextlib.contextmanager
def int8_on_every_row(model):
    """Within: the model's Int8Linear layers take inputs of any row count."""
    layers = [m for m in [*model.hf.modules(), model._draft_head] if isinstance(m, Int8Linear)]
    usual = [m.short_rows for m in layers]
    for m in layers:
        m.short_rows = 1 << 30
    try:
        yield
    finally:
        for m, rows in zip(layers, usual):
            m.short_rows = rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--humaneval", type=int, default=5)
    parser.add_argument("--spec-bench", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    target = load("qwen2.5-coder-1.5b")
    drafters = {"bf16": load("qwen2.5-coder-0.5b", dtype="bf16", role="drafter", vocab=0),
                "int8": load("qwen2.5-coder-0.5b", dtype="int8", role="drafter", vocab=0)}
    ranked = {n: frequent_ids(target.tokenizer, target.vocab_size, n) for n in SIZES if n}
    prompts = load_prompts("humaneval", args.humaneval) + load_prompts("spec-bench", args.spec_bench)
    rows = []
    for prompt in prompts:
        ids = target.encode(prompt.text, chat=prompt.dataset == "spec-bench")
        out = speculative_generate(ids, target, drafters["int8"], max_new_tokens=args.max_new_tokens, seed=0).tokens
        full = ids + out
        p = torch.softmax(target.forward(full, None, num_logits=len(out) + 1)[:-1], -1)  # [len(out), V]
        row = {"dataset": prompt.dataset, "task": prompt.task, "tokens": len(out)}
        for kind, drafter in drafters.items():
            with int8_on_every_row(drafter):
                logits = drafter.forward(full, None, num_logits=len(out) + 1)[:-1]
            for n in SIZES:
                masked = logits
                if n:
                    masked = torch.full_like(logits, float("-inf"))
                    masked[:, ranked[n]] = logits[:, ranked[n]]
                q = torch.softmax(masked, -1)
                row[f"{kind}/{n or 'all'}"] = {
                    "top1": float((q.argmax(-1) == p.argmax(-1)).float().mean()),
                    "alpha": float(torch.minimum(p, q).sum(-1).mean()),
                    "covered": float(torch.isin(torch.tensor(out), ranked[n]).float().mean()) if n else 1.0}
        rows.append(row)
        print(prompt.task, {k: (round(v["top1"], 3), round(v["alpha"], 3)) for k, v in row.items()
                            if isinstance(v, dict)}, flush=True)
    timings = {"target": [], **{f"{k}/{n or 'all'}": [] for k in drafters for n in SIZES}}
    for _ in range(3):
        timings["target"].append(one_token_ms(target))
        for kind, drafter in drafters.items():
            for n in SIZES:
                drafter.restrict_vocabulary(ranked[n] if n else None)
                timings[f"{kind}/{n or 'all'}"].append(one_token_ms(drafter))
    ms = {k: statistics.median(v) for k, v in timings.items()}
    summary = {}
    for key in ms:
        if key == "target":
            continue
        summary[key] = {"ms": ms[key], "c": ms[key] / ms["target"],
                        **{m: statistics.mean(r[key][m] for r in rows) for m in ("top1", "alpha", "covered")}}
        for group in ("humaneval", "spec-bench"):
            picked = [r[key]["alpha"] for r in rows if r["dataset"] == group]
            summary[key][f"alpha_{group}"] = statistics.mean(picked) if picked else None
            picked = [r[key]["top1"] for r in rows if r["dataset"] == group]
            summary[key][f"top1_{group}"] = statistics.mean(picked) if picked else None
        print(key, {k: round(v, 3) if isinstance(v, float) else v for k, v in summary[key].items()})
    print("target ms", round(ms["target"], 1))
    with open(args.out, "w") as f:
        json.dump({"target_ms": ms["target"], "summary": summary, "prompts": rows, "timings": timings}, f, indent=1)


if __name__ == "__main__":
    main()
