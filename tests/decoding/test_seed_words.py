"""Issue 69: the seeds' words kept (romsto's argument order, --gamma as a fixed γ, EGAG's
defaults, lenience everywhere)."""

from __future__ import annotations

import pytest

from conftest import tiny_model
from specdec.errors import SpecdecError
from specdec.decoding.loop import speculative_generate


def test_swapped_roles_are_refused():
    # romsto's order, speculative_generate(inputs, drafter, target), on models the loader marked
    target = tiny_model(0, vocab=16, name="big", role="target")
    drafter = tiny_model(1, vocab=16, name="small", role="drafter")
    with pytest.raises(SpecdecError, match="swapped"):
        speculative_generate([2, 3], drafter, target, max_new_tokens=4)
    assert len(speculative_generate([2, 3], target, drafter, max_new_tokens=4).tokens) == 4


def test_a_drafter_larger_than_the_target_is_refused_unless_allowed():
    small = tiny_model(0, vocab=16, layers=1, name="small")
    large = tiny_model(1, vocab=16, layers=2, name="large")  # both loaded as targets: only sizes tell
    with pytest.raises(SpecdecError, match="larger than the target.*allow_larger_drafter=True"):
        speculative_generate([2, 3], small, large, max_new_tokens=4)
    result = speculative_generate([2, 3], small, large, max_new_tokens=4, allow_larger_drafter=True)
    assert len(result.tokens) == 4
    assert len(speculative_generate([2, 3], large, small, max_new_tokens=4).tokens) == 4


def test_a_model_free_drafter_and_self_drafting_pass_the_role_check():
    from specdec.drafters import LookupDrafter

    target = tiny_model(0, vocab=16, role="drafter")
    assert len(speculative_generate([2, 3, 2, 3], target, LookupDrafter(), max_new_tokens=4).tokens) == 4
    assert len(speculative_generate([2, 3], target, target, max_new_tokens=4).tokens) == 4


def _tiny_pair_with_text(monkeypatch):
    """generate's loader swapped for two tiny models that read text (a SentencePiece-style vocabulary)."""
    from test_server_openai import sentencepiece_tokenizer

    from specdec.cli import generate as generate_cli

    tokenizer = sentencepiece_tokenizer()
    target = tiny_model(0, vocab=len(tokenizer), name="tiny-target")
    drafter = tiny_model(0, vocab=len(tokenizer), layers=1, name="tiny-drafter", role="drafter")
    target.tokenizer = drafter.tokenizer = tokenizer
    monkeypatch.setattr(generate_cli, "_load_pair", lambda config, *args: (target, drafter))


def _generate_json(*args: str) -> dict:
    import json

    from typer.testing import CliRunner

    from specdec.cli import app

    result = CliRunner().invoke(app, ["generate", "abc", "--max-new-tokens", "40", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_generate_refuses_a_larger_drafter_in_one_line_unless_allowed(monkeypatch):
    from typer.testing import CliRunner

    from specdec.cli import app
    from specdec.cli import generate as generate_cli

    from test_server_openai import sentencepiece_tokenizer

    tokenizer = sentencepiece_tokenizer()
    small = tiny_model(0, vocab=len(tokenizer), layers=1, name="tiny-small")
    large = tiny_model(1, vocab=len(tokenizer), layers=2, name="tiny-large")
    small.tokenizer = large.tokenizer = tokenizer
    monkeypatch.setattr(generate_cli, "_load_pair", lambda config, *args: (small, large))
    runner = CliRunner()
    result = runner.invoke(app, ["generate", "abc", "--max-new-tokens", "4"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "larger than the target" in result.output and "--allow-larger-drafter" in result.output
    assert "allow_larger_drafter=True" not in result.output  # the command's flag, not the library's keyword
    assert runner.invoke(app, ["generate", "abc", "--max-new-tokens", "4", "--allow-larger-drafter"]).exit_code == 0


def test_gamma_alone_is_a_fixed_gamma(monkeypatch):
    _tiny_pair_with_text(monkeypatch)
    out = _generate_json("--gamma", "3")
    drafted = [len(step["drafted"]) for step in out["steps"]]
    assert max(drafted) == 3 and len(out["tokens"]) == 40
    assert all(n == 3 for n in drafted[1:-3])  # after the target's first token, 3 a step (fewer near the end)


def test_gamma_with_a_schedule_that_reads_none_bounds_its_drafts(monkeypatch):
    _tiny_pair_with_text(monkeypatch)
    # τ = 0: the confidence schedule drafts to its ceiling, which --gamma sets
    out = _generate_json("--gamma", "3", "--schedule", "confidence", "--confidence", "0")
    assert max(len(step["drafted"]) for step in out["steps"]) == 3
    out = _generate_json("--gamma", "3", "--gamma-max", "2", "--schedule", "confidence", "--confidence", "0")
    assert max(len(step["drafted"]) for step in out["steps"]) == 2  # the lower bound of the two


def test_gamma_in_python_follows_the_same_rule():
    from specdec.decoding.speculation import from_options, resolve
    from specdec.decoding.config import SpecConfig

    assert from_options("default", gamma=3).schedule == "fixed"  # the command line's --gamma 3 alone
    assert from_options("sd-heuristic", gamma=3).schedule == "heuristic"  # a schedule that reads it keeps it
    assert from_options("default", gamma=3, schedule="cost").effective_gamma_max() == 3
    assert SpecConfig(gamma=3).effective_gamma_max() == 3  # the cost schedule: bounded, not ignored
    assert SpecConfig("tree", gamma=3, gamma_max=4).effective_gamma_max() == 3
    assert SpecConfig(schedule="heuristic", gamma=3).effective_gamma_max() == 20  # its start, not its bound
    assert resolve("sd", gamma=3).effective_gamma() == 3
    assert SpecConfig().effective_gamma_max() == 20 and SpecConfig(schedule="fixed").effective_gamma() == 5


def test_gamma_alone_on_the_server_is_a_fixed_gamma():
    from specdec.server.schema import parse_job
    from specdec.server.service import Service

    target = tiny_model(0, vocab=16)
    drafter = tiny_model(1, vocab=16, layers=1, role="drafter")
    service = Service(target, drafter, default="default")

    def config(block):
        return parse_job({"prompt": [1], "speculative": block}, False, target.name, service.default,
                         service.default_method).speculation

    assert config({"gamma": 3}).schedule == "fixed"
    assert config({"method": "sd-egag"}).effective_gamma_max() == 5


def test_egag_reaches_at_most_gamma_where_gamma_max_is_not_given():
    from specdec.decoding.speculation import Parts, build, from_options

    target = tiny_model(0, vocab=16)
    drafter = tiny_model(0, vocab=16, layers=1, role="drafter")
    for gamma, ceiling in ((None, 5), (3, 3)):
        config = from_options("sd-egag", gamma=gamma)
        assert config.effective_gamma_max() == ceiling
        schedule = build(config, Parts(target, drafter)).schedule()
        assert schedule.gamma_max == ceiling
        result = speculative_generate([2, 3], target, drafter, max_new_tokens=40, schedule=schedule)
        assert max(len(step.draft_tokens) for step in result.steps) <= ceiling
    assert from_options("sd-egag", gamma_max=7).effective_gamma_max() == 7
    assert from_options("sd-cost").effective_gamma_max() == 20  # the others keep theirs


def test_the_lenient_first_token_law_matches_verify_drafts_samples():
    import torch

    from specdec.sizing.theory import lenient_first_token_law, total_variation
    from specdec.core.verify import verify_draft

    generator = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    q = torch.tensor([0.1, 0.2, 0.3, 0.2, 0.2])
    n = 200_000
    for lenience in (1.0, 0.5, 0.2):
        draft = torch.multinomial(q, n, replacement=True, generator=generator)  # [n]
        accepted, next_token = verify_draft(p.expand(n, 2, 5), q.expand(n, 1, 5), draft[:, None], generator,
                                            lenience=lenience)
        first = torch.where(accepted > 0, draft, next_token)  # the step's first emitted token
        observed = torch.bincount(first, minlength=5).float() / n
        law = lenient_first_token_law(p, q, lenience)
        # 5 ids, 200k samples: each frequency's sd is at most 0.0012; 0.006 is 5 sd
        assert (observed - law).abs().max() < 0.006, (lenience, observed, law)
        assert float(law.sum()) == pytest.approx(1.0)
    assert float(total_variation(p, lenient_first_token_law(p, q, 1.0))) < 1e-6  # exact: r = p
    assert float(total_variation(p, lenient_first_token_law(p, q, 0.2))) > 0.05  # lenient: lossy


def _tiny_models_with_text():
    from test_server_openai import sentencepiece_tokenizer

    tokenizer = sentencepiece_tokenizer()
    target = tiny_model(0, vocab=len(tokenizer), name="tiny-target")
    drafter = tiny_model(3, vocab=len(tokenizer), layers=1, name="tiny-drafter", role="drafter")
    target.tokenizer = drafter.tokenizer = tokenizer
    return target, drafter


def test_measure_with_lenience_reports_the_tv_it_costs(tmp_path, monkeypatch):
    import json

    from typer.testing import CliRunner

    from specdec.cli import app
    from specdec.cli import bench as bench_cli

    target, drafter = _tiny_models_with_text()
    monkeypatch.setattr(bench_cli, "_load", lambda name, dtype, device, role, **options:
                        target if role == "target" else drafter)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "abc"}\n{"prompt": "hello"}\n')
    args = ["measure", "--dataset", str(prompts), "--gammas", "2", "--max-new-tokens", "12", "--temperature", "1"]
    results = {}
    for lenience in ("1", "0.5"):
        out = tmp_path / f"measure-{lenience}.json"
        result = CliRunner().invoke(app, args + ["--lenience", lenience, "--json", str(out)])
        assert result.exit_code == 0, result.output
        results[lenience] = json.loads(out.read_text())
    assert results["1"]["lenience_tv"] < 1e-6  # exact: the first token's law is p
    assert results["0.5"]["lenience"] == 0.5 and results["0.5"]["lenience_tv"] > 1e-3  # lenient: lossy
    assert "lenience l = 0.5" in CliRunner().invoke(app, args + ["--lenience", "0.5"]).output
    refused = CliRunner().invoke(app, args + ["--lenience", "0"])
    assert refused.exit_code != 0 and "--lenience must be in (0, 1]" in refused.output


def test_sd_lenient_presets_resolve_and_run_in_the_bench():
    from specdec import Sampler
    from specdec.bench.runners import (BENCH_METHODS as METHODS, NEEDS_DRAFTER, Settings, check_methods, is_lossy,
                                       run_method)
    from specdec.decoding.speculation import resolve

    config = resolve("sd-lenient:0.5")
    assert (config.method, config.schedule, config.effective_lenience()) == ("chain", "fixed", 0.5)
    for bad in ("sd-lenient:1", "sd-lenient:0", "sd-lenient:x"):
        with pytest.raises(SpecdecError, match="sd-lenient:L takes a lenience L in"):
            resolve(bad)
    check_methods(["ar", "sd-lenient:0.5", "sd-lenient:0.02"])
    assert {"sd-lenient:0.5", "sd-lenient:0.02"} <= NEEDS_DRAFTER and "LOSSY" in METHODS["sd-lenient:0.5"]
    assert is_lossy("sd-lenient:0.5") and not is_lossy("sd-cost")
    target = tiny_model(1, vocab=32)
    drafter = tiny_model(1, vocab=32, logit_scale=0.3, name="softer", role="drafter")  # the target, softened
    settings, sampler = Settings(max_new_tokens=64), Sampler(1.0)
    rates = {}
    for method in ("sd", "sd-lenient:0.02"):
        records = [run_method(method, [3, 5, 7], target, drafter, settings, sampler, seed=seed) for seed in range(4)]
        assert all(r.new_tokens > 0 for r in records)
        rates[method] = sum(r.accepted for r in records) / sum(r.drafted for r in records)
    assert rates["sd-lenient:0.02"] > rates["sd"] + 0.1, rates
    print(rates)  # the lenience reached the run


def test_theory_with_lenience_bounds_the_lenient_alpha():
    import torch
    from typer.testing import CliRunner

    from specdec.cli import app
    from specdec.sizing.theory import acceptance_beta, lenient_alpha_range

    generator = torch.Generator().manual_seed(1)
    for lenience in (0.9, 0.5, 0.1):
        p = torch.rand(500, 8, generator=generator).pow(4).softmax(-1)
        q = (torch.rand(500, 8, generator=generator) * 3).softmax(-1)
        alpha = float(acceptance_beta(p, q).mean())
        lenient = float(acceptance_beta(p, q, lenience).mean())
        low, high = lenient_alpha_range(alpha, lenience)
        assert low <= lenient <= high and lenient > alpha  # the range holds, and lenience accepts more
    assert lenient_alpha_range(0.6, 0.5) == (0.6, 1.0)
    result = CliRunner().invoke(app, ["theory", "--alpha", "0.6", "--lenience", "0.8"])
    assert result.exit_code == 0 and "lies in [0.600, 0.750]" in result.output
    refused = CliRunner().invoke(app, ["theory", "--lenience", "1.5"])
    assert refused.exit_code != 0 and "--lenience must be in (0, 1]" in refused.output


def test_make_schedule_gives_egag_gamma_as_its_ceiling_by_default():
    from specdec.sizing.schedules import make_schedule

    assert make_schedule("egag", gamma=4).gamma_max == 4 and make_schedule("egag").gamma_max == 5
    assert make_schedule("egag", gamma=4, gamma_max=9).gamma_max == 9
    assert make_schedule("confidence").gamma == 10  # the others keep theirs


def test_generate_many_refuses_a_swapped_pair_too():
    from specdec import generate_many

    small = tiny_model(0, vocab=16, layers=1, name="small", exact_rows=True)  # the engine's batches need it
    large = tiny_model(1, vocab=16, layers=2, name="large", exact_rows=True)
    with pytest.raises(SpecdecError, match="larger than the target"):
        generate_many([[2, 3]], small, large, max_new_tokens=4)
    assert len(generate_many([[2, 3]], small, large, max_new_tokens=4, allow_larger_drafter=True)[0].tokens) == 4


def test_gamma_with_a_preset_that_names_its_own_sizing_bounds_it_and_keeps_it():
    """`--method sd-confidence --gamma 3` stays the confidence schedule, bounded at 3, as in the
    bench; only a plain method's chain turns fixed (the review found every preset turned fixed)."""
    from specdec.decoding.speculation import from_options, gamma_means_fixed, preset

    for name in ("sd-cost", "sd-confidence", "tree-sides"):
        config = from_options(name, gamma=3)
        assert config.schedule == preset(name).schedule and config.effective_gamma_max() == 3, name
    assert from_options("lookup", gamma=3).schedule == "fixed"  # a plain method: fixed, as romsto's
    assert not gamma_means_fixed("sd-cost", preset("sd-cost")) and gamma_means_fixed("default", preset("default"))


def test_a_multi_draft_drafter_is_checked_member_by_member():
    from specdec.drafters import ModelDrafter
    from specdec.drafters.multi import MultiDrafter
    from specdec.models.roles import check_roles

    target = tiny_model(0, vocab=16, role="drafter")
    swapped = tiny_model(1, vocab=16, layers=1, role="target")
    fine = tiny_model(2, vocab=16, layers=1, role="drafter")
    with pytest.raises(SpecdecError, match="swapped"):
        check_roles(target, MultiDrafter([ModelDrafter(fine), ModelDrafter(swapped)]))
    check_roles(tiny_model(0, vocab=16, role="target"), MultiDrafter([ModelDrafter(fine), ModelDrafter(fine)]))
