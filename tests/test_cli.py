"""The specdec command: JSON output, coloured text, and one-line errors with a non-zero exit."""

import json

import pytest
from typer.testing import CliRunner

from specdec import registry
from specdec.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def need_smollm2():
    if not registry.is_installed("smollm2-135m"):
        pytest.skip("smollm2-135m is not installed (run `make models`)")


def _json(args):
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_generate_json_sd_equals_ar(need_smollm2):
    common = ["generate", "def add(a, b):", "--target", "smollm2-135m", "--max-new-tokens", "12", "--json"]
    sd = _json(common + ["--drafter", "smollm2-135m", "--gamma", "3"])
    ar = _json(common + ["--method", "ar"])
    assert sd["tokens"] == ar["tokens"] and len(sd["tokens"]) == 12
    assert sd["text"] == ar["text"] and sd["text"]
    for key in ("target_forwards", "drafter_forwards", "drafted", "accepted", "acceptance_rate", "wall_seconds",
                "tokens_per_second"):
        assert key in sd["stats"]
    assert sd["stats"]["acceptance_rate"] == 1.0  # the drafter is the target itself
    assert ar["stats"]["acceptance_rate"] is None and ar["stats"]["target_forwards"] == 12


def test_generate_text_output_has_a_summary_line(need_smollm2):
    result = runner.invoke(app, ["generate", "Hi", "--target", "smollm2-135m", "--drafter", "smollm2-135m",
                                 "--max-new-tokens", "6", "--chat"])
    assert result.exit_code == 0, result.output
    assert "tok/s" in result.output and "acceptance" in result.output and "target forwards" in result.output


@pytest.mark.parametrize("args,message", [
    (["generate", "x", "--gamma", "0"], "--gamma must be >= 1"),
    (["generate", "   "], "empty prompt"),
    (["generate", "x", "--temperature", "-1"], "temperature must be"),
    (["generate", "x", "--target", "no-such-model"], "unknown model 'no-such-model'"),
])
def test_errors_are_one_line_and_exit_non_zero(args, message):
    result = runner.invoke(app, args)
    assert result.exit_code == 1
    assert message in result.output
    assert "Traceback" not in result.output
    assert len([line for line in result.output.splitlines() if line.startswith("error:")]) == 1


def test_models_lists_the_registry():
    result = runner.invoke(app, ["models"])
    assert result.exit_code == 0
    for name in registry.MODELS:
        assert name in result.output
