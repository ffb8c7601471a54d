"""The benchmark harness's bookkeeping: summaries, ratios, identity checks, reports, datasets."""

import json
import statistics
from collections import Counter

import pytest

from specdec import SpecdecError
from specdec.bench.datasets import load_prompts, parse_dataset
from specdec.bench.runners import Record, check_methods, merge_samples
from specdec.bench.report import render_markdown, render_paired, render_plot, render_table
from specdec.bench.run import bootstrap_median_interval, group_summaries, method_orders, summarize


def _records():
    # prompt 0: sd twice as fast as ar, identical; prompt 1: sd 1.5x, one token differs;
    # prompt 2 is sampled (temperature 1): counted in speed, not in identity
    r = [
        Record("h/0@t0", "ar", [1, 2, 3, 4], 4, 2.0, 4),
        Record("h/0@t0", "sd", [1, 2, 3, 4], 4, 1.0, 2, drafted=4, accepted=3, accepted_per_step=[3]),
        Record("h/0@t0", "hf", [1, 2, 3, 4], 4, 2.0, 4),
        Record("h/1@t0", "ar", [5, 6], 2, 1.0, 2),
        Record("h/1@t0", "sd", [5, 7], 2, 2 / 3, 1, drafted=2, accepted=1, accepted_per_step=[1]),
        Record("h/1@t0", "hf", [5, 6], 2, 0.5, None),
        Record("s/0@t1", "ar", [8, 8], 2, 1.0, 2, temperature=1.0),
        Record("s/0@t1", "sd", [8, 9], 2, 0.5, 1, drafted=3, accepted=1, accepted_per_step=[1], temperature=1.0),
        Record("s/0@t1", "hf", [9, 9], 2, 1.0, None, temperature=1.0),
    ]
    for x in r:
        x.dataset, x.task = ("humaneval", "humaneval") if x.prompt_id.startswith("h") else ("spec-bench", "qa")
    return r


def test_summary_ratios_acceptance_histogram_and_identity():
    s = summarize(_records(), ["ar", "sd", "hf"])
    assert s["sd"]["median_speedup_vs_ar"] == pytest.approx(2.0)  # median of 2.0, 1.5 and 2.0
    assert s["sd"]["faster_than_ar"] == [3, 3]
    assert s["sd"]["median_speedup_vs_hf"] == pytest.approx(2.0)  # median of 2.0, 0.75 and 2.0
    assert s["sd"]["faster_than_hf"] == [2, 3]
    assert "median_speedup_vs_hf-assisted" not in s["sd"]  # not in this run
    assert s["sd"]["median_tokens_per_second"] == pytest.approx(4.0)  # median of 4, 3 and 4
    assert s["sd"]["aggregate_tokens_per_second"] == pytest.approx(8 / (1 + 2 / 3 + 0.5))
    assert s["sd"]["acceptance_rate"] == pytest.approx(5 / 9)
    assert s["sd"]["tokens_per_target_pass"] == pytest.approx(8 / 4)
    assert s["sd"]["accepted_histogram"] == {1: 2, 3: 1}
    # identity is judged on greedy prompts only
    assert s["sd"]["identical_to_ar"] == 1 and s["sd"]["greedy_prompts"] == 2
    assert s["sd"]["mismatched_prompts"] == ["h/1@t0"]
    assert s["hf"]["identical_to_ar"] == 2
    assert s["hf"]["tokens_per_target_pass"] is None  # not reported by that method
    assert s["ar"]["acceptance_rate"] is None and "identical_to_ar" not in s["ar"]
    json.dumps(s)  # the JSON report holds it as is


def test_speculative_beam_search_is_judged_against_beam_search():
    records = [Record("h/0@t0", "ar", [1, 2], 2, 1.0, 2), Record("h/0@t0", "beam", [1, 3], 2, 2.0, 2),
               Record("h/0@t0", "beam-sd", [1, 3], 2, 1.0, 1, drafted=3, accepted=1)]
    for x in records:
        x.dataset, x.task = "humaneval", "humaneval"
    s = summarize(records, ["ar", "beam", "beam-sd"])
    assert s["beam-sd"]["identical_to_beam"] == 1 and "identical_to_ar" not in s["beam-sd"]
    assert s["beam-sd"]["median_speedup_vs_beam"] == pytest.approx(2.0)
    assert s["beam"]["identical_to_ar"] == 0  # beam search is not greedy decoding
    from rich.console import Console

    console = Console(record=True, width=250)
    console.print(render_table(s, "t"))
    assert "1/1 (to beam)" in console.export_text()


def test_groups_and_markdown_report(tmp_path):
    records = _records()
    methods = ["ar", "sd", "hf"]
    groups = group_summaries(records, methods)
    assert [(g["dataset"], g["task"], g["temperature"]) for g in groups] == [
        ("humaneval", "humaneval", 0.0), ("spec-bench", "qa", 1.0)]
    assert groups[1]["summary"]["sd"]["median_speedup_vs_ar"] == pytest.approx(2.0)
    result = {"info": {"datasets": ["humaneval", "spec-bench"], "prompts": 3, "limit": 2, "temperatures": [0.0, 1.0],
                       "seed": 0, "settings": {"max_new_tokens": 4, "gamma": 3, "gamma_min": 1, "gamma_max": 10,
                                               "confidence": 0.4, "egag_beta": 0.0, "ngram_n": 4},
                       "target": "t", "drafter": "d", "target_dtype": "float32", "target_kernels": "k",
                       "drafter_dtype": "bfloat16", "drafter_kernels": "k", "machine": "m", "command": "specdec bench"},
              "summary": summarize(records, methods), "groups": groups,
              "records": [dict(vars(r), tokens_per_second=r.tokens_per_second) for r in records]}
    text = render_markdown(result)
    assert "greedy outputs differing from their reference (ar; beam for beam-sd): {'sd': ['h/1@t0']}" in text
    assert "### spec-bench / qa, temperature 1" in text
    assert "| h/1@t0 | 2.00 | 3.00 | 4.00 |" in text
    assert "| sd | 0 | 2 | 0 | 1 |" in text  # histogram row
    assert text.count("| method | vs |") == 1  # paired table for all 3 prompts; none for 2- or 1-prompt groups
    assert "Where the time goes" not in text  # these records carry no time split
    render_plot(result, str(tmp_path / "plot.png"))
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"


def test_the_time_split_covers_our_methods_and_skips_the_peers():
    records = _records()
    for r in records:
        if r.method != "hf":  # peers do not report where their time went
            r.target_seconds, r.drafter_seconds = 0.5 * r.wall_seconds, (0.25 * r.wall_seconds if r.method == "sd" else 0.0)
    s = summarize(records, ["ar", "sd", "hf"])
    assert s["sd"]["time_in_target"] == pytest.approx(0.5) and s["sd"]["time_in_drafter"] == pytest.approx(0.25)
    assert s["sd"]["time_in_loop"] == pytest.approx(0.25)
    # loop time over target passes: 0.25 of (1 + 2/3 + 0.5) s over 4 passes
    assert s["sd"]["loop_ms_per_step"] == pytest.approx(1e3 * 0.25 * (1 + 2 / 3 + 0.5) / 4)
    assert s["ar"]["time_in_drafter"] == 0 and s["ar"]["time_in_loop"] == pytest.approx(0.5)
    assert "time_in_target" not in s["hf"]


def test_dataset_specs_carry_their_own_limit_and_temperatures():
    assert parse_dataset("humaneval", 20, [0.0]) == ("humaneval", 20, [0.0])
    assert parse_dataset("humaneval:5", 20, [0.0, 1.0]) == ("humaneval", 5, [0.0, 1.0])
    assert parse_dataset("spec-bench:1:0+1", 20, [0.0]) == ("spec-bench", 1, [0.0, 1.0])
    assert parse_dataset("spec-bench::0.7", None, [0.0]) == ("spec-bench", None, [0.7])
    for bad in ("humaneval:x", "humaneval:2:hot", "a:1:0:2", ":3"):
        with pytest.raises(SpecdecError, match="dataset"):
            parse_dataset(bad, None, [0.0])


def test_datasets_tasks_limits_and_errors(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"turns": ["b", "c"]}) + "\n")
    assert [p.text for p in load_prompts(str(path))] == ["a", "b"]
    assert len(load_prompts("humaneval", limit=3)) == 3
    spec = load_prompts("spec-bench", limit=2)
    assert [p.task for p in spec] == ["mt_bench"] * 2 + [t for t in ["translation", "summarization", "qa",
                                                                      "math_reasoning", "rag"] for _ in range(2)]
    assert {p.task for p in load_prompts("spec-bench", tasks=["qa", "rag"])} == {"qa", "rag"}
    with pytest.raises(SpecdecError, match="no task poetry"):
        load_prompts("spec-bench", tasks=["poetry"])
    with pytest.raises(SpecdecError, match="unknown dataset"):
        load_prompts("nope")
    path.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(SpecdecError, match="neither 'prompt' nor 'turns'"):
        load_prompts(str(path))
    with pytest.raises(SpecdecError, match="unknown method"):
        check_methods(["sd", "magic"])


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 7])
def test_method_orders_are_counterbalanced(k):
    """Every block of orders puts each method in each position, and right after each other
    method, equally often; so a steadily drifting machine favours none of them."""
    methods = [f"m{i}" for i in range(k)]
    block = k if k % 2 == 0 else 2 * k
    orders = method_orders(methods, seed=3)
    for _ in range(3):  # several blocks, each relabelled afresh
        rows = [next(orders) for _ in range(block)]
        assert all(sorted(r) == methods for r in rows)
        for position in range(k):
            assert Counter(r[position] for r in rows) == {m: block // k for m in methods}
        follows = Counter((a, b) for r in rows for a, b in zip(r, r[1:]))
        if k > 1:
            assert set(follows.values()) == {block // k} and len(follows) == k * (k - 1)
    # the seed decides the orders, reproducibly
    assert [next(method_orders(methods, 1)) for _ in range(2)] == [next(method_orders(methods, 1)) for _ in range(2)]


def test_bench_serve_counterbalances_which_variant_loads_a_level_first(monkeypatch):
    """On one server the variant that runs first at a level also pays for the batch policy's
    learning of the new sizes: over the levels each must go first equally often."""
    import specdec.bench.serving as serve

    calls = []

    async def run_level(url, prompts, concurrency, requests, settings, api_key=None, timeout=600.0):
        calls.append((concurrency, "ar" if "speculative" in settings else "default"))
        return [], 1.0

    monkeypatch.setattr(serve, "run_level", run_level)
    monkeypatch.setattr(serve, "_metrics", lambda url, api_key: None)
    levels = [1, 2, 4, 8, 16, 32]
    summaries = serve.bench_servers([serve.Server(None, "http://127.0.0.1:9", {})], [("x", False)], levels, 1,
                                    variants={"default": {}, "ar": {"speculative": False}})
    firsts = Counter(variant for (level, variant), (before, _) in zip(calls, [(None, None)] + calls) if level != before)
    assert firsts == {"default": 3, "ar": 3}
    # the report keeps the order given, whatever ran first
    assert [(s["concurrency"], s["variant"]) for s in summaries] == [(n, v) for n in levels for v in ("default", "ar")]


def test_bootstrap_interval_brackets_the_median_and_narrows_with_more_prompts():
    import random

    rng = random.Random(0)
    few = [1 + rng.gauss(0, 0.05) for _ in range(8)]
    many = [1 + rng.gauss(0, 0.05) for _ in range(200)]
    lo, hi = bootstrap_median_interval(few)
    assert lo <= statistics.median(few) <= hi
    lo2, hi2 = bootstrap_median_interval(many)
    assert hi2 - lo2 < (hi - lo) / 2 and lo2 < 1 < hi2
    assert bootstrap_median_interval([1.0, 2.0]) is None  # too few prompts to say anything
    assert bootstrap_median_interval([1.0] * 5) == [1.0, 1.0]
    s = summarize(_records(), ["ar", "sd", "hf"])
    assert s["sd"]["speedup_vs_ar_interval95"] == [1.5, 2.0]  # medians of resampled 2.0, 1.5, 2.0


def test_reports_show_only_the_baselines_that_ran_and_the_paired_intervals():
    from rich.console import Console

    s = summarize(_records(), ["ar", "sd", "hf"])
    console = Console(width=200, record=True)
    console.print(render_table(s))
    console.print(render_paired(s))
    text = console.export_text()
    assert "vs hf-assisted" not in text  # not in this run: no empty column
    assert "median speedup vs hf" in text
    assert "1.50–2.00" in text  # sd vs ar, with its interval


def test_decoding_rate_leaves_out_the_time_to_first_token():
    r = Record("h/0@t0", "ar", [1] * 11, 11, 3.0, 11, first_token_seconds=1.0)
    assert r.decode_tokens_per_second == pytest.approx(10 / 2.0)
    assert Record("h/0@t0", "ar", [1], 1, 1.0, 1, first_token_seconds=1.0).decode_tokens_per_second is None
    assert Record("h/0@t0", "hf", [1, 2], 2, 1.0, 2).decode_tokens_per_second is None  # not measured
    records = [r, Record("h/0@t0", "hf", [1] * 11, 11, 2.0, 11, first_token_seconds=0.5)]
    s = summarize(records, ["ar", "hf"])
    assert s["ar"]["median_first_token_seconds"] == 1.0
    assert s["ar"]["median_decode_speedup_vs_hf"] == pytest.approx(5.0 / (10 / 1.5))
    assert s["ar"]["median_speedup_vs_hf"] == pytest.approx((11 / 3) / (11 / 2))


def test_sampled_generations_are_summed_into_one_record():
    a = Record("s/0@t1", "sd", [1, 2, 3], 3, 2.0, 2, drafted=4, accepted=1, accepted_per_step=[1, 0],
               first_token_seconds=0.5, target_seconds=1.5, drafter_seconds=0.4, widths_per_step=[3, 3],
               drafter_passes_per_step=[2, 2], temperature=1.0)
    b = Record("s/0@t1", "sd", [4] * 9, 9, 2.0, 3, drafted=6, accepted=5, accepted_per_step=[5],
               first_token_seconds=0.5, target_seconds=1.2, drafter_seconds=0.7, widths_per_step=[7],
               drafter_passes_per_step=[6], temperature=1.0)
    m = merge_samples([a, b])
    assert (m.samples, m.new_tokens, m.tokens, m.target_passes) == (2, 12, [1, 2, 3] + [4] * 9, 5)
    assert (m.drafted, m.accepted, m.accepted_per_step, m.widths_per_step) == (10, 6, [1, 0, 5], [3, 3, 7])
    assert m.wall_seconds == 4.0 and m.target_seconds == pytest.approx(2.7) and m.drafter_seconds == pytest.approx(1.1)
    # total tokens over total time, not the mean of the two rates (1.5 and 4.5 tok/s)
    assert m.tokens_per_second == pytest.approx(12 / 4.0)
    assert m.first_token_seconds == pytest.approx(0.5)  # the time to first token: the mean, not the sum
    assert m.decode_tokens_per_second == pytest.approx((12 - 2) / (4.0 - 1.0))  # each sample's first token out
    assert merge_samples([m, a]).first_token_seconds == pytest.approx(0.5)  # weighed by samples
    assert merge_samples([m, a]).decode_tokens_per_second == pytest.approx((15 - 3) / (6.0 - 1.5))
    assert merge_samples([a]).decode_tokens_per_second == a.decode_tokens_per_second
    peer = Record("s/0@t1", "hf", [1], 1, 1.0, None)
    assert merge_samples([peer, peer]).target_passes is None  # not reported stays not reported
    with pytest.raises(SpecdecError, match="one method on one prompt"):
        merge_samples([a, peer])


def test_the_assisted_peer_runs_without_transformers_own_config_warning():
    """transformers warns on every assisted run (its own call of the assistant's `generate` passes a
    config and arguments); the bench drops that one message and nothing else."""
    import logging

    import torch
    from conftest import tiny_model
    from transformers.utils import logging as hf_logging

    from specdec import GREEDY
    from specdec.bench.runners import Settings, hf_generate

    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("transformers.generation.utils")
    logger.addHandler(handler)
    target, drafter = tiny_model(0, vocab=32), tiny_model(1, vocab=32)
    try:
        hf_logging.get_logger().warning_once.cache_clear()
        record = hf_generate("hf-assisted", target, [2, 3, 4], Settings(max_new_tokens=8), GREEDY, None, drafter)
        assert record.new_tokens == 8 and not any("together with" in m for m in messages)
        inputs = torch.tensor([[2, 3, 4]], device=target.device)  # the power check: the same call without the filter warns
        hf_logging.get_logger().warning_once.cache_clear()  # transformers says it once per process
        target.hf.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=8, do_sample=False,
                           assistant_model=drafter.hf, pad_token_id=0)
        assert any("together with" in m for m in messages)
    finally:
        logger.removeHandler(handler)


def test_typical_divergence_is_the_first_token_laws_distance_from_p():
    """On tiny models: the mean over output positions of TV(r, p), r the law typical acceptance
    gives a step's first token; zero under greedy (None), and what theory computes position by position."""
    import torch

    from conftest import tiny_model
    from specdec import Sampler
    from specdec.bench.runners import typical_divergence
    from specdec.sizing.theory import total_variation, typical_first_token_law
    from specdec.core.verify import Typical

    target, drafter = tiny_model(1, vocab=32), tiny_model(2, vocab=32)
    prompt, output, sampler = [3, 5, 7], [9, 2, 4, 4], Sampler(1.0)
    assert typical_divergence(target, drafter, prompt, output, Sampler(0.0), Typical()) is None
    got = typical_divergence(target, drafter, prompt, output, sampler, Typical())
    expected = []
    for k in range(len(output)):
        context = prompt + output[:k]
        p = sampler.probs(target.forward(context, None, 1)[-1])
        q = sampler.probs(drafter.forward(context, None, 1)[-1])
        expected.append(float(total_variation(typical_first_token_law(p, q), p)))
    assert got == pytest.approx(sum(expected) / len(expected), rel=1e-4) and got > 0.01
