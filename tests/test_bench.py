"""The benchmark harness's bookkeeping: summaries, ratios, identity checks, reports, datasets."""

import json

import pytest

from specdec import SpecdecError
from specdec.bench.datasets import load_prompts, parse_dataset
from specdec.bench.methods import Record, check_methods
from specdec.bench.report import render_markdown, render_plot
from specdec.bench.run import group_summaries, summarize


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
    assert s["sd"]["tokens_per_target_forward"] == pytest.approx(8 / 4)
    assert s["sd"]["accepted_histogram"] == {1: 2, 3: 1}
    # identity is judged on greedy prompts only
    assert s["sd"]["identical_to_ar"] == 1 and s["sd"]["greedy_prompts"] == 2
    assert s["sd"]["mismatched_prompts"] == ["h/1@t0"]
    assert s["hf"]["identical_to_ar"] == 2
    assert s["hf"]["tokens_per_target_forward"] is None  # not reported by that method
    assert s["ar"]["acceptance_rate"] is None and "identical_to_ar" not in s["ar"]
    json.dumps(s)  # the JSON report holds it as is


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
    assert "greedy outputs differing from ar: {'sd': ['h/1@t0']}" in text
    assert "### spec-bench / qa, temperature 1" in text
    assert "| h/1@t0 | 2.00 | 3.00 | 4.00 |" in text
    assert "| sd | 0 | 2 | 0 | 1 |" in text  # histogram row
    render_plot(result, str(tmp_path / "plot.png"))
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"


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
