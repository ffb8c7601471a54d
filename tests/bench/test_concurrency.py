"""The bench's concurrency levels (bench/concurrency.py): every method at every level over one
prompt set, identity with level 1, and the figures' arithmetic."""

import copy
import json

import pytest
import torch
from typer.testing import CliRunner

from specdec.bench.concurrency import (LevelRun, LoadRecord, percentile, render_levels, run_levels,
                                       summarize_level)
from specdec.bench.datasets import load_prompts
from specdec.bench.runners import Settings
from specdec.bench.run import method_orders
from specdec.cli import app
from specdec.core.samplers import Sampler

from test_rows import _ids, qwen_like

VOCAB = 4096


@pytest.fixture(scope="module")
def models():
    target = qwen_like(torch.bfloat16, exact_rows=True, layers=1)
    return target, copy.deepcopy(target)  # a drafter that agrees: drafts are accepted


@pytest.mark.slow
def test_every_level_keeps_every_greedy_output_of_ours_identical_to_ar_alone(models):
    target, drafter = models
    prompts = [(_ids(5, VOCAB, i) * 3)[:6 + 3 * i] for i in range(5)]
    methods = ["ar", "sd-cost", "lookup", "tree-mixed", "hf-cb", "hf-padded"]
    summaries, runs = run_levels(prompts, [1, 2, 4], methods, target, drafter, Settings(max_new_tokens=8),
                                 Sampler(), 0, method_orders(methods))
    assert len(summaries) == 18 and all(s["requests"] == 5 for s in summaries)
    for s in summaries:
        if s["method"] in ("ar", "sd-cost", "lookup", "tree-mixed"):
            assert s["identical"] == 5, s
        assert s["output_tokens"] == 40  # no EOS in a random model's ids here: max_new_tokens each
    # level 4 ran at most 4 sequences a pass: fewer passes than level 1 for plain decoding
    passes = {(r.method, r.level): r.target_passes for r in runs}
    assert passes["ar", 4] < passes["ar", 1]
    assert "| 4 | sd-cost |" in render_levels(summaries)


@pytest.mark.slow
def test_seeded_sampled_outputs_at_every_level_equal_level_one(models):
    target, drafter = models
    prompts = [_ids(4 + i, VOCAB, 10 + i) for i in range(4)]
    methods = ["ar", "sd-cost", "tree-mixed"]
    summaries, _ = run_levels(prompts, [1, 3], methods, target, drafter, Settings(max_new_tokens=6),
                              Sampler(temperature=1.0), 7, method_orders(methods))
    assert all(s["identical"] == 4 for s in summaries)
    # without level 1 the reference is `ar` at the lowest level run, itself each prompt's output alone
    later, _ = run_levels(prompts, [3, 2], methods, target, drafter, Settings(max_new_tokens=6),
                          Sampler(temperature=1.0), 7, method_orders(methods))
    assert all(s["identical"] == 4 for s in later)


def test_repeats_run_each_level_again_in_the_next_order_and_sum_into_one_figure(models):
    target, drafter = models
    prompts = [_ids(4 + i, VOCAB, 20 + i) for i in range(2)]
    methods = ["ar", "sd-cost"]
    summaries, runs = run_levels(prompts, [2], methods, target, drafter, Settings(max_new_tokens=4), Sampler(), 0,
                                 method_orders(methods), repeats=2)
    orders = method_orders(methods)
    first, second = next(orders), next(orders)
    assert first != second  # power: the repeats' order shows
    assert [(r.method, r.repeat) for r in runs] == [(m, 0) for m in first] + [(m, 1) for m in second]
    assert len(summaries) == 2
    for s in summaries:
        mine = [r for r in runs if r.method == s["method"]]
        assert s["requests"] == 4 and s["identical"] == 4 and s["output_tokens"] == 16
        assert s["wall_seconds"] == sum(r.wall_seconds for r in mine)
        assert s["target_passes"] == sum(r.target_passes for r in mine)
        assert s["repeat_tokens_per_second"] == [8 / r.wall_seconds for r in mine]


def test_each_methods_first_run_at_a_level_follows_its_untimed_warm_up_at_that_width(models, monkeypatch):
    import specdec.bench.concurrency as concurrency

    target, drafter = models
    prompts = [_ids(4 + i, VOCAB, 30 + i) * 12 for i in range(3)]  # 48-59 ids: longer than a warm-up's 32
    methods = ["ar", "sd-cost"]
    calls = []
    real = concurrency.run_method_at

    def counted(method, level, batch, *args):
        run = real(method, level, batch, *args)
        calls.append((method, level, len(batch), max(map(len, batch)), sum(len(r.tokens) for r in run.records)))
        return run

    monkeypatch.setattr(concurrency, "run_method_at", counted)
    summaries, runs = run_levels(prompts, [1, 4], methods, target, drafter, Settings(max_new_tokens=10), Sampler(), 0,
                                 method_orders(methods), warmup=True)
    warm = [c for c in calls if c[3] == 32]
    timed = [c for c in calls if c[3] > 32]
    # each method's warm-up at a level right before its run there: `level` prompts (cycled), cut to
    # 32 ids, 8 tokens each
    assert len(calls) == 8 and len(timed) == 4
    for first, then in zip(calls[::2], calls[1::2]):
        assert first[3] == 32 and then[3] > 32 and first[:2] == then[:2], (first, then)
        assert first[2] == first[1] and then[2] == 3
    assert [c[1] for c in timed] == [1, 1, 4, 4] and {c[0] for c in timed[:2]} == {c[0] for c in timed[2:]} == set(methods)
    assert [c[4] for c in warm] == [8, 8, 32, 32]
    # the warm-ups are neither runs nor figures
    assert len(runs) == 4 and all(s["requests"] == 3 and s["output_tokens"] == 30 for s in summaries)
    calls.clear()
    run_levels(prompts, [1], methods, target, drafter, Settings(max_new_tokens=10), Sampler(), 0, method_orders(methods))
    assert len(calls) == 2 and all(c[3] > 32 for c in calls)  # off by default


def test_the_table_shows_each_repeats_ratio_beside_the_summed_one():
    def level(method, seconds):
        return {"method": method, "concurrency": 4, "requests": 2, "output_tokens_per_second": 20 / sum(seconds),
                "repeat_tokens_per_second": [10 / s for s in seconds], "per_sequence_tokens_per_second": None,
                "ttft_p50": None, "ttft_p99": None, "tpot_p50": None, "tpot_p99": None,
                "tokens_per_target_pass": None}
    table = render_levels([level("ar", [1.0, 1.0]), level("lookup", [1.25, 0.8])])
    assert "× ar by repeat" in table and "| 4 | lookup | 9.76 | 0.98 | 0.80–1.25 |" in table
    assert "by repeat" not in render_levels([level("ar", [1.0])])


def test_level_figures():
    records = [LoadRecord("ar", 2, 0, [1, 2, 3], 1.0, 0.2), LoadRecord("ar", 2, 1, [4, 5], 0.5, 0.1),
               LoadRecord("ar", 2, 2, [6], 0.4, 0.4)]
    s = summarize_level(LevelRun("ar", 2, 2.0, records), {0: [1, 2, 3], 1: [4, 0], 2: [6]})
    assert s["output_tokens_per_second"] == 3.0 and s["identical"] == 2
    assert s["ttft_p50"] == 0.2 and abs(s["tpot_p50"] - 0.4) < 1e-12  # (1.0-0.2)/2 and (0.5-0.1)/1
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert percentile([None], 50) is None


@pytest.mark.parametrize("args,message", [
    (["--concurrency", "0"], "integers >= 1"), (["--concurrency", "a"], "integers >= 1"),
    (["--concurrency", "1", "--methods", "ar,medusa"], "with --concurrency, methods are"),
    (["--concurrency", "1", "--temperature", "0,1"], "one --temperature"),
    (["--concurrency", "1", "--drafter-vocab", "100"], "none of --plot, --batched-rows, --drafter-vocab"),
    (["--concurrency", "1", "--repeats", "0"], "--repeats takes an integer >= 1"),
    (["--repeats", "2"], "--repeats goes with --concurrency"),
    (["--concurrency", "1", "--methods", "ar,vllm", "--vllm-threads", "fast"], "--vllm-threads is tuned or default"),
    (["--methods", "ar,vllm", "--vllm-threads", "fast"], "--vllm-threads is tuned or default"),
    (["--concurrency", "1", "--methods", "ar,vllm", "--vllm-dtype", "fp16"], "--vllm-dtype is bfloat16 or float32"),
    (["--methods", "ar,vllm,vllm-ngram"], "one vLLM method a bench run without --concurrency"),
])
def test_concurrency_options_are_checked_before_loading(args, message):
    result = CliRunner().invoke(app, ["bench", "--target", "no-such-model"] + args)
    assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output


def test_a_jsonl_datasets_rows_may_ask_for_the_chat_template(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"prompt": "hi", "chat": True}) + "\n" + json.dumps({"prompt": "def f():"}) + "\n")
    assert [p.chat for p in load_prompts(str(path))] == [True, False]
    path.write_text(json.dumps({"prompt": "hi", "chat": "yes"}) + "\n")
    with pytest.raises(Exception, match="'chat' must be true or false"):
        load_prompts(str(path))


@pytest.mark.parametrize("without_avx512,dtype,warned", [(True, "bfloat16", True), (True, "float32", False),
                                                        (False, "bfloat16", False)])
def test_vllm_in_bf16_on_a_cpu_without_avx512_is_pointed_to_fp32(monkeypatch, tmp_path, without_avx512, dtype,
                                                                   warned):
    """vLLM builds no oneDNN bf16 matmul without AVX512: a run asking bf16 there is told to take fp32."""
    from specdec.backends import kernels
    from specdec.bench.vllm_peer import VllmPeers

    monkeypatch.setattr(kernels, "x86_without_avx512", lambda: without_avx512)
    (tmp_path / "config.json").write_text("{}")
    said = []
    peers = VllmPeers.for_run(["vllm"], str(tmp_path), str(tmp_path), "tuned", 1, said.append, dtype=dtype)
    assert peers.dtype == dtype and any("--vllm-dtype float32" in line for line in said) == warned
