"""Structured output in the bench and the CLI: the json-tasks data, the bench's schema validator,
the constrained bench run (validity, forced tokens, mask cost), and generate's grammar flags."""

import json
import re
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from specdec import SpecdecError
from specdec.bench.datasets import load_prompts
from specdec.bench.runners import Record, check_grammar_methods
from specdec.bench.report import render_markdown
from specdec.bench.run import check_schema_output, summarize
from specdec.bench.schemas import check_output, check_supported, validate
from specdec.cli import app

runner = CliRunner()

INVOICE = {"type": "object", "properties": {
    "number": {"type": "string", "maxLength": 12}, "total": {"type": "number", "minimum": 0},
    "paid": {"type": "boolean"}, "currency": {"type": "string", "enum": ["EUR", "USD"]},
    "lines": {"type": "array", "items": {"type": "integer"}, "maxItems": 2}},
    "required": ["number", "total", "currency"], "additionalProperties": False}


# the data set

def test_json_tasks_load_with_a_supported_schema_each():
    prompts = load_prompts("json-tasks")
    assert len(prompts) >= 30
    assert {p.task for p in prompts} == {"extraction", "function-call"}
    assert all(p.chat and p.schema is not None for p in prompts)
    for p in prompts:
        check_supported(p.schema)  # the validator checks every keyword the data uses
        assert p.schema["type"] == "object" and p.schema["additionalProperties"] is False
    assert len({p.text for p in prompts}) == len(prompts)
    assert [p.task for p in load_prompts("json-tasks", tasks=["function-call"])] == ["function-call"] * sum(
        p.task == "function-call" for p in prompts)


def test_a_jsonl_rows_schema_is_read_and_checked(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"prompt": "x", "schema": INVOICE}) + "\n" + json.dumps({"prompt": "y"}) + "\n")
    assert [p.schema for p in load_prompts(str(path))] == [INVOICE, None]
    path.write_text(json.dumps({"prompt": "x", "schema": "object"}) + "\n")
    with pytest.raises(SpecdecError, match=":1: 'schema' must be a JSON Schema"):
        load_prompts(str(path))


def test_json_tasks_schemas_compile_for_a_real_tokenizer(smollm2):
    from specdec.core.grammar import Grammar

    for p in load_prompts("json-tasks"):
        Grammar.json_schema(p.schema).check(smollm2)


# the validator

def test_the_validator_accepts_valid_instances():
    assert validate({"number": "A-1", "total": 12.5, "currency": "EUR"}, INVOICE) == []
    assert validate({"number": "A-1", "total": 3, "paid": False, "currency": "USD", "lines": [1, 2.0]}, INVOICE) == []


@pytest.mark.parametrize("instance,problem", [
    ({"number": "A-1", "currency": "EUR"}, "$: missing required 'total'"),
    ({"number": "A-1", "total": "12", "currency": "EUR"}, "$.total: expected number, got string"),
    ({"number": "A-1", "total": 1, "currency": "EUR", "note": "x"}, "$: property 'note' not allowed"),
    ({"number": "A-1", "total": 1, "currency": "GBP"}, "$.currency: \"GBP\" not one of"),
    ({"number": "A-1", "total": 1, "currency": "EUR", "paid": 1}, "$.paid: expected boolean, got number"),
    ({"number": "A-1", "total": 1, "currency": "EUR", "lines": [1.5]}, "$.lines[0]: expected integer"),
    ({"number": "A-1", "total": 1, "currency": "EUR", "lines": [True]}, "$.lines[0]: expected integer, got boolean"),
    ({"number": "A-1", "total": 1, "currency": "EUR", "lines": [1, 2, 3]}, "$.lines: 3 items, more than 2"),
    ({"number": "A-1", "total": -1, "currency": "EUR"}, "$.total: -1 below the minimum 0"),
    ({"number": "A-1234567890123", "total": 1, "currency": "EUR"}, "$.number: longer than 12 characters"),
    (["number"], "$: expected object, got array"),
])
def test_the_validator_rejects_invalid_instances(instance, problem):
    assert any(found.startswith(problem) for found in validate(instance, INVOICE)), validate(instance, INVOICE)


def test_an_output_is_checked_whole_and_a_truncated_one_is_invalid():
    assert check_output('{"number": "A", "total": 2, "currency": "USD"}', INVOICE) is None
    assert check_output('{"number": "A", "total": 2, "currency": "USD"} and more', INVOICE).startswith("not JSON")
    assert check_output('{"number": "A", "total": 2', INVOICE).startswith("not JSON")
    assert check_output('{"number": "A", "total": 2, "currency": "USD"}', INVOICE, truncated=True).startswith(
        "truncated")
    with pytest.raises(SpecdecError, match=r"\$.total: keyword\(s\) pattern not supported"):
        check_supported({"type": "object", "properties": {"total": {"type": "string", "pattern": "x"}}})


def test_an_output_without_its_end_token_counts_as_truncated():
    target = SimpleNamespace(eos_token_ids=[2], decode=lambda ids: "".join({5: '{"number": "A", ', 6: '"total": 1, ',
                                                                            7: '"currency": "EUR"}'}.get(i, "") for i in ids))
    ended, cut = Record("", "ar", [5, 6, 7, 2], 4, 1.0, 4), Record("", "ar", [5, 6, 7], 3, 1.0, 3)
    check_schema_output(ended, INVOICE, target)
    check_schema_output(cut, INVOICE, target)
    assert ended.valid and ended.problem is None
    assert not cut.valid and cut.problem.startswith("truncated")  # the text parses, but the output was cut off


# the report

def test_the_summary_reports_validity_forced_tokens_and_mask_cost():
    def record(method, prompt, valid, forced, problem=None):
        return Record(f"json-tasks/{prompt}@t0", method, [1, 2, 3, 4], 10, 1.0, 6, forced=forced, mask_calls=12,
                      mask_seconds=0.02, valid=valid, problem=problem, dataset="json-tasks", task="extraction")

    records = [record("ar", 0, True, 0), record("ar", 1, False, 0, "truncated: the token limit came first"),
               record("forced", 0, True, 4), record("forced", 1, True, 3)]
    summary = summarize(records, ["ar", "forced"])
    ar, forced = summary["ar"], summary["forced"]
    assert (ar["valid_outputs"], ar["checked_outputs"], ar["truncated_outputs"]) == (1, 2, 1)
    assert ar["invalid_outputs"] == {"json-tasks/1@t0": "truncated: the token limit came first"}
    assert (forced["valid_outputs"], forced["forced_tokens"], forced["forced_per_token"]) == (2, 7, 0.35)
    assert forced["masks_per_token"] == pytest.approx(1.2) and forced["mask_ms_per_token"] == pytest.approx(2.0)
    assert forced["identical_to_ar"] == 2
    result = {"info": {"datasets": ["json-tasks"], "prompts": 2, "temperatures": [0.0], "seed": 0,
                       "settings": {"max_new_tokens": 64}, "target": "t", "drafter": None, "target_dtype": "fp32",
                       "target_kernels": "auto", "drafter_dtype": None, "drafter_kernels": None, "machine": "m"},
              "summary": summary, "groups": [], "records": [dict(vars(r), tokens_per_second=10.0) for r in records]}
    text = render_markdown(result)
    assert "### Structured output" in text and "| forced | 2/2 | 0 | 7 | 35.0% | 1.20 | 2.000 |" in text
    assert "- ar, json-tasks/1@t0: truncated" in text
    plain = summarize([Record("humaneval/0@t0", "ar", [1], 1, 1.0, 1)], ["ar"])
    assert "valid_outputs" not in plain["ar"]  # prompts without a schema: no such figures


def test_methods_that_cannot_take_a_grammar_are_refused_before_loading():
    check_grammar_methods(["ar", "sd-cost", "forced", "lookup", "sd"])
    for method in ("hf", "beam", "tree-mixed", "lookahead"):
        with pytest.raises(SpecdecError, match=f"{method} cannot constrain output to a schema"):
            check_grammar_methods(["ar", method])
    result = runner.invoke(app, ["bench", "--dataset", "json-tasks", "--methods", "ar,hf", "--target", "no-such-model"])
    assert result.exit_code == 1 and "hf cannot constrain output to a schema" in result.output
    result = runner.invoke(app, ["bench", "--dataset", "json-tasks", "--methods", "ar", "--concurrency", "1",
                                 "--target", "no-such-model"])
    assert result.exit_code == 1 and "run without --concurrency" in result.output


def test_the_bench_runs_json_tasks_constrained_valid_and_identical(need_smollm2):
    """ar and forced (through the speculative loop, as every drafter) on one task: every output
    valid against its schema, the same tokens as constrained ar, forced tokens counted, and the
    masks' cost reported. (A drafter model's chain: the CLI test below.)"""
    from rich.console import Console

    from specdec.bench.runners import Settings
    from specdec.bench.run import run_benchmark

    result = run_benchmark(["json-tasks:1"], None, ["ar", "forced"], "smollm2-135m", "smollm2-135m",
                           Settings(max_new_tokens=96), tasks=["function-call"],
                           console=Console(quiet=True), exact_rows=True)
    summary = result["summary"]
    for method in ("ar", "forced"):
        s = summary[method]
        assert (s["valid_outputs"], s["checked_outputs"]) == (1, 1), s.get("invalid_outputs")
        assert s["masks_per_token"] >= 1 and s["mask_ms_per_token"] > 0
    assert summary["ar"]["forced_tokens"] == 0  # plain decoding drafts nothing, forced or not
    assert summary["forced"]["forced_tokens"] > 0 and summary["forced"]["identical_to_ar"] == 1
    assert summary["forced"]["tokens_per_target_pass"] > 1  # the forced runs cost no target pass of their own
    assert all(r["valid"] and r["problem"] is None for r in result["records"])
    json.dumps(result)  # what --json writes


# the CLI

@pytest.fixture(scope="module")
def need_smollm2():
    from specdec.models import catalogue as registry

    if not registry.is_installed("smollm2-135m"):
        pytest.skip("smollm2-135m is not installed (run `make models`)")


def _generate(args):
    result = runner.invoke(app, ["generate", *args, "--target", "smollm2-135m", "--json", "--max-new-tokens", "64"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


CALL = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}


def test_generate_json_schema_output_is_valid_and_constrained_ar(need_smollm2, tmp_path):
    path = tmp_path / "call.json"
    path.write_text(json.dumps(CALL))
    prompt = ["What is the weather in Paris, in celsius? Answer as JSON.", "--chat", "--json-schema", str(path)]
    ar = _generate(prompt + ["--method", "ar"])
    forced = _generate(prompt + ["--method", "forced"])
    chain = _generate(prompt + ["--drafter", "smollm2-135m", "--schedule", "fixed", "--gamma", "3"])
    assert validate(json.loads(ar["text"]), CALL) == [] and ar["stop_reason"] != "max_new_tokens"
    assert forced["tokens"] == ar["tokens"] == chain["tokens"]
    assert forced["stats"]["forced"] > 0 and forced["stats"]["target_passes"] < ar["stats"]["target_passes"]


def test_generate_json_object_regex_and_lark_grammar(need_smollm2, tmp_path):
    obj = _generate(["List two fruits as JSON.", "--chat", "--json-object", "--method", "ar"])
    assert isinstance(json.loads(obj["text"]), dict)
    date = _generate(["The date today is", "--regex", "[0-9]{4}-[0-9]{2}-[0-9]{2}", "--method", "ar"])
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", date["text"])
    lark = tmp_path / "answer.lark"
    lark.write_text('start: "The answer is " ("yes" | "no") "."\n')
    answer = _generate(["Is 7 a prime number?", "--chat", "--grammar", str(lark), "--method", "forced"])
    assert answer["text"] in ("The answer is yes.", "The answer is no.")


@pytest.mark.parametrize("args,message", [
    (["--json-schema", "no/such/schema.json"], "cannot read --json-schema no/such/schema.json"),
    (["--json-schema", "{bad}"], "the JSON schema is not valid JSON"),
    (["--json-schema", '{"type": "strin"}'], "--json-schema: the json_schema grammar is not valid: Invalid type: strin"),
    (["--json-schema", "[1, 2]"], "a JSON schema must be a JSON object"),
    (["--json-object", "--regex", "a+"], "--json-object and --regex each constrain the whole output"),
    (["--regex", "a(b"], "--regex: the regex grammar is not valid"),
    (["--grammar", 'start: foo'], "--grammar: the lark grammar is not valid"),
    (["--grammar", "no/such/grammar.lark"], "cannot read --grammar"),
    (["--json-object", "--method", "tree-mixed"], "a grammar constrains chain drafts only"),
])
def test_generate_grammar_errors_are_one_line_before_loading(tmp_path, args, message):
    files = {"{bad}": "{bad", '{"type": "strin"}': '{"type": "strin"}', "[1, 2]": "[1, 2]", "start: foo": "start: foo"}
    given = []
    for arg in args:  # inline contents stand for a file holding them
        if arg in files:
            path = tmp_path / "given"
            path.write_text(files[arg])
            arg = str(path)
        given.append(arg)
    result = runner.invoke(app, ["generate", "x", "--target", "no-such-model", *given])
    assert result.exit_code == 1 and message in result.output, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
