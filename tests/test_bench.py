"""The benchmark harness's bookkeeping: summaries, ratios, identity checks, reports."""

import json

import pytest

from specdec.bench.datasets import load_prompts
from specdec.bench.run import Record, render_markdown, summarize
from specdec import SpecdecError


def _records():
    # prompt 0: sd twice as fast as ar, identical; prompt 1: sd 1.5x, one token differs
    return [
        Record(0, "ar", [1, 2, 3, 4], 4, 2.0, 4),
        Record(0, "sd", [1, 2, 3, 4], 4, 1.0, 2, drafted=4, accepted=3, accepted_per_step=[3]),
        Record(0, "hf", [1, 2, 3, 4], 4, 2.0, 4),
        Record(1, "ar", [5, 6], 2, 1.0, 2),
        Record(1, "sd", [5, 7], 2, 2 / 3, 1, drafted=2, accepted=1, accepted_per_step=[1]),
        Record(1, "hf", [5, 6], 2, 0.5, None),
    ]


def test_summary_ratios_acceptance_and_identity():
    s = summarize(_records(), ["ar", "sd", "hf"])
    assert s["sd"]["median_speedup_vs_ar"] == pytest.approx(1.75)  # median of 2.0 and 1.5
    assert s["sd"]["median_tokens_per_second"] == pytest.approx(3.5)  # median of 4 and 3
    assert s["sd"]["aggregate_tokens_per_second"] == pytest.approx(6 / (5 / 3))
    assert s["sd"]["acceptance_rate"] == pytest.approx(4 / 6)
    assert s["sd"]["tokens_per_target_forward"] == pytest.approx(6 / 3)
    assert s["sd"]["identical_to_ar"] == 1 and s["sd"]["mismatched_prompts"] == [1]
    assert s["hf"]["identical_to_ar"] == 2
    assert s["hf"]["tokens_per_target_forward"] is None  # not reported by that method
    assert s["ar"]["acceptance_rate"] is None


def test_markdown_lists_mismatches_and_per_prompt_rows():
    records = _records()
    summary = summarize(records, ["ar", "sd", "hf"])
    info = {"dataset": "humaneval", "prompts": 2, "max_new_tokens": 4, "gamma": 3, "target": "t", "drafter": "d",
            "target_dtype": "float32", "target_kernels": "k", "drafter_dtype": "bfloat16", "drafter_kernels": "k",
            "machine": "m", "command": "specdec bench"}
    text = render_markdown(summary, records, info)
    assert "outputs differing from ar: {'sd': [1]}" in text
    assert "| 1 | 2.00 | 3.00 | 4.00 |" in text


def test_jsonl_prompts_and_errors(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"turns": ["b", "c"]}) + "\n")
    assert load_prompts(str(path)) == ["a", "b"]
    assert len(load_prompts("humaneval", limit=3)) == 3
    with pytest.raises(SpecdecError, match="unknown dataset"):
        load_prompts("nope")
    path.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(SpecdecError, match="neither 'prompt' nor 'turns'"):
        load_prompts(str(path))
