"""The specdec command: JSON output, coloured text, and one-line errors with a non-zero exit."""

import json

import pytest
from typer.testing import CliRunner

from specdec import SpecdecError
from specdec.models import catalogue as registry
from specdec.cli import app

from conftest import bf16_rows

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
    common = ["generate", "def add(a, b):", "--target", "smollm2-135m", "--max-new-tokens", "12", "--json",
              "--dtype", "fp32"]
    # a fixed γ: with the target drafting for itself the cost schedule would rightly draft nothing;
    # the drafter on the target's own weights (auto would give it int8 ones, which may disagree)
    sd = _json(common + ["--drafter", "smollm2-135m", "--drafter-dtype", "fp32", "--gamma", "3", "--schedule", "fixed"])
    ar = _json(common + ["--method", "ar"])
    assert sd["tokens"] == ar["tokens"] and len(sd["tokens"]) == 12
    assert sd["text"] == ar["text"] and sd["text"]
    for key in ("target_passes", "drafter_passes", "drafted", "accepted", "acceptance_rate", "wall_seconds",
                "tokens_per_second"):
        assert key in sd["stats"]
    assert sd["stats"]["acceptance_rate"] == 1.0  # the drafter is the target itself, weights and all
    assert ar["stats"]["acceptance_rate"] is None and ar["stats"]["target_passes"] == 12


def test_generate_text_output_has_a_summary_line(need_smollm2):
    result = runner.invoke(app, ["generate", "Hi", "--target", "smollm2-135m", "--drafter", "smollm2-135m",
                                 "--max-new-tokens", "6", "--chat", "--schedule", "fixed"])
    assert result.exit_code == 0, result.output
    assert "tok/s" in result.output and "acceptance" in result.output and "target passes" in result.output


@pytest.mark.parametrize("args,message", [
    (["generate", "x", "--gamma", "0"], "--gamma must be >= 1"),
    (["generate", "   "], "empty prompt"),
    (["generate", "x", "--temperature", "-1"], "temperature must be"),
    (["generate", "x", "--target", "no-such-model"], "unknown model 'no-such-model'"),
    (["generate", "x", "--dtype", "int8"], "int8 weights are for drafters only"),
    (["generate", "x", "--dtype", "gguf", "--tree", "mixed"], "tree cannot run on --dtype gguf"),
    (["generate", "x", "--dtype", "gguf", "--drafter", "self-skip"], "self-skip cannot run on --dtype gguf"),
    (["chat", "--dtype", "gguf", "--drafter", "self-skip"], "self-skip cannot run on --dtype gguf"),
    (["bench", "--drafter-vocab", "-5"], "must be a number of ids >= 0"),
    (["measure", "--drafter-vocab-corpus", "no/such/corpus.txt"], "vocabulary corpus not found"),
    (["distill-drafter", "--out", "x", "--tokens", "0"], "--tokens must be >= 1"),
    (["distill-drafter", "--out", "x", "--loss", "kl"], "--loss tvd or fkl"),
    (["distill-drafter", "--out", "x", "--corpus", "no/such/corpus.txt"], "corpus not found"),
    (["distill-drafter", "--out", "x", "--drafter", "distilled:y"], "distil the plain drafter"),
    (["distill-drafter", "--out", "x", "--drafter-dtype", "gguf"], "needs the drafter's hidden states"),
    (["generate", "x", "--online"], "--online updates a drafter model between prompts"),
    (["serve", "--online", "--drafter", "none", "--method", "ar"], "--online trains the drafter model's adapter"),
    (["bench", "--methods", "sd-distilled"], "--distilled DIR"),
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


@pytest.mark.parametrize("extra", [["--drafter", "ngram"], ["--drafter", "lookup", "--gamma", "3"], ["--drafter", "suffix"],
                                   ["--drafter", "smollm2-135m", "--schedule", "egag", "--gamma-max", "6"],
                                   ["--drafter", "smollm2-135m", "--schedule", "confidence", "--confidence", "0.6"]])
def test_generate_with_other_drafters_and_schedules_equals_ar(need_smollm2, extra):
    common = ["generate", "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1,", "--target", "smollm2-135m", "--max-new-tokens", "12",
              "--json"]
    ar = _json(common + ["--method", "ar"])
    sd = _json(common + extra)
    assert sd["tokens"] == ar["tokens"]
    assert sd["schedule"] and sd["steps"]


@pytest.mark.parametrize("dtype", ["fp32", pytest.param("bf16", marks=bf16_rows)])
def test_bench_writes_json_markdown_and_plot(need_smollm2, tmp_path, dtype):
    """Both target dtypes `auto` may pick (fp32 on AVX2-only CPUs, bf16 on native-bf16 CPUs and CUDA).
    Our methods must be token-identical to our AR; transformers' peers compute their logits their
    own way (bf16 logits in bf16), so their mismatches are reported, never failed on."""
    out = tmp_path / "r"
    temperatures = "0,1" if dtype == "fp32" else "0"  # sampling in bf16 adds time, not coverage
    result = runner.invoke(app, ["bench", "--dataset", "humaneval", "--limit", "2", "--target", "smollm2-135m",
                                 "--drafter", "smollm2-135m", "--methods", "ar,sd,lookup,hf,hf-assisted-fixed",
                                 "--max-new-tokens", "6", "--temperature", temperatures, "--json", f"{out}.json",
                                 "--markdown", f"{out}.md", "--plot", f"{out}.png", "--dtype", dtype,
                                 "--samples", "2"])
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "r.json").read_text())
    for m in ("ar", "sd", "lookup", "hf", "hf-assisted-fixed"):
        for key in ("median_tokens_per_second", "acceptance_rate", "tokens_per_target_pass"):
            assert key in data["summary"][m]
    assert data["info"]["target_dtype"] == {"fp32": "float32", "bf16": "bfloat16"}[dtype]
    assert data["summary"]["sd"]["identical_to_ar"] == 2 == data["summary"]["lookup"]["identical_to_ar"]
    for m in ("hf", "hf-assisted-fixed"):  # a peer's flip is reported: where, and how close the call was
        entry = data["summary"][m]
        assert entry["identical_to_ar"] + len(entry.get("mismatched_prompts", [])) == 2
        for prompt in entry.get("mismatched_prompts", []):
            assert {"position", "top2_logit_gap"} <= set(entry["divergences"][prompt])
    groups = len(temperatures.split(","))
    assert len(data["records"]) == 2 * 5 * groups and len(data["groups"]) == groups
    for r in data["records"]:  # two generations at T = 1, summed into one record; greedy ones run once
        assert r["samples"] == (2 if r["temperature"] > 0 else 1) and r["new_tokens"] == len(r["tokens"]), r
    assert groups == 1 or "### humaneval, temperature 1" in (tmp_path / "r.md").read_text()
    assert (tmp_path / "r.png").stat().st_size > 1000
    assert "median tok/s" in result.output  # a log, not a terminal: the table is not wrapped at 80 columns
    for r in data["records"]:  # every method, ours and transformers', notes its time to first token
        assert 0 < r["first_token_seconds"] <= r["wall_seconds"], r
    assert data["summary"]["ar"]["median_decode_speedup_vs_hf"] > 0
    assert "95% interval" in result.output and "Paired speedups" in (tmp_path / "r.md").read_text()


def test_measure_on_a_self_drafting_pair(need_smollm2, tmp_path):
    result = runner.invoke(app, ["measure", "--limit", "1", "--target", "smollm2-135m", "--drafter", "smollm2-135m",
                                 "--dtype", "fp32", "--drafter-dtype", "fp32", "--gammas", "1,3",
                                 "--max-new-tokens", "8", "--json", str(tmp_path / "m.json"),
                                 "--plot", str(tmp_path / "m.png"), "--tree-nodes", "1,3"])
    assert result.exit_code == 0, result.output
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["alpha"] > 0.95  # the drafter is the target: p = q up to kernel rounding
    assert m["c"] > 0  # a ratio of two timings: its size is the machine's business, not a test's
    assert [r["gamma"] for r in m["rows"]] == [1, 3]
    assert m["rows"][1]["expected_tokens"] == pytest.approx((1 - m["alpha"] ** 4) / (1 - m["alpha"]), rel=1e-6) \
        if m["alpha"] < 1 else m["rows"][1]["expected_tokens"] == 4
    assert (tmp_path / "m.png").stat().st_size > 1000
    # trees: the drafter's top token is the target's, so the best 3-node tree is a chain of 3
    assert m["rank_acceptance"][0] > 0.95 and [t["nodes"] for t in m["trees"]] == [1, 3]
    assert m["trees"][1]["predicted_tokens"] == pytest.approx(1 + sum(m["rank_acceptance"][0] ** k for k in (1, 2, 3)))
    assert all(t["measured_tokens"] > 1.5 for t in m["trees"])
    from specdec.sizing.theory import flat_verification

    for t in m["trees"]:  # the projections follow from the measured tokens, depth, c and pass costs
        assert t["depth"] >= 1 and t["verification_cost"] > 0
        assert t["predicted_flat"] == pytest.approx(
            t["measured_tokens"] / (t["depth"] * m["c"] + flat_verification(t["shape_nodes"])))
    assert all(r["predicted_flat"] > 0 for r in m["rows"]) and "Projections:" in result.output
    assert [p["c"] for p in m["flat_projections"]][1:] == [0.12, 0.05]
    assert all(p["tree_speedup"] >= p["chain_speedup"] - 1e-9 for p in m["flat_projections"])  # a chain is a tree


@pytest.mark.parametrize("args,message", [
    (["bench", "--methods", "ar,magic"], "unknown method"),
    (["bench", "--temperature", "hot"], "--temperature takes"),
    (["bench", "--samples", "0"], "samples must be an integer >= 1"),
    (["bench", "--dataset", "spec-bench", "--tasks", "poetry"], "no task poetry"),
    (["generate", "x", "--schedule", "sometimes"], "unknown schedule"),
    (["measure", "--gammas", "0,2"], "--gammas must be"),
    (["measure", "--tree-nodes", "4,x"], "--tree-nodes takes"),
])
def test_bench_measure_and_schedule_errors(args, message):
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    assert message in result.output and "Traceback" not in result.output


def test_debug_view_and_lenience(need_smollm2):
    args = ["generate", "def add(a, b):", "--target", "smollm2-135m", "--drafter", "smollm2-135m",
            "--max-new-tokens", "8", "--schedule", "egag"]
    result = runner.invoke(app, args + ["--debug"])
    assert result.exit_code == 0, result.output
    assert "step 1: drafted" in result.output and "H_norm" in result.output and "accept" in result.output
    sampled = _json(args + ["--debug", "--json", "--temperature", "1", "--seed", "0", "--lenience", "0.5"])
    assert sampled["stats"]["lossy"] is True and sampled["stats"]["lenience"] == 0.5
    drafted = [s for s in sampled["steps"] if s["drafted"]]
    assert drafted and all(len(s["u"]) == len(s["drafted"]) == len(s["p"]) == len(s["q"]) for s in drafted)
    text = runner.invoke(app, args + ["--temperature", "1", "--lenience", "0.5"])
    assert "LOSSY" in text.output
    default = runner.invoke(app, args[:-2] + ["--max-new-tokens", "24", "--debug"])  # the cost schedule
    assert default.exit_code == 0, default.output
    assert "θ = " in default.output


def test_chat_switches_settings_and_counts_tokens(need_smollm2):
    script = "\n".join(["/help", "/gamma 3", "/schedule confidence", "/drafter lookup", "/temperature 0",
                        "Say hi.", "/stats", "/method ar", "Say hi again.", "/bogus", "/gamma zero", "/quit"])
    result = runner.invoke(app, ["chat", "--target", "smollm2-135m", "--drafter", "smollm2-135m",
                                 "--max-new-tokens", "8"], input=script + "\n")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "/schedule NAME" in out and "sd · drafter lookup · confidence" in out
    assert "last reply: 8 tokens" in out and "session: 8 tokens" in out and "1 turns" in out
    assert "unknown command /bogus" in out and "/gamma takes a number" in out
    assert "ar · greedy" in out


def test_generate_with_a_tree_draws_it_and_reports_the_path(need_smollm2):
    args = ["generate", "def add(a, b):", "--target", "smollm2-135m", "--drafter", "smollm2-135m", "--dtype", "fp32",
            "--drafter-dtype", "fp32", "--max-new-tokens", "12", "--tree", "mixed", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout.strip().splitlines()[-1])
    drafted = [s for s in data["steps"] if s["drafted"]]
    assert drafted and all(len(s["parents"]) == len(s["drafted"]) for s in drafted)
    assert data["stats"]["nodes_per_step"]
    debug = runner.invoke(app, args[:-1] + ["--debug"])
    assert debug.exit_code == 0 and "accept" in debug.output, debug.output


@pytest.mark.parametrize("args,message", [
    (["generate", "x", "--tree", "forest"], "unknown tree"),
    (["generate", "x", "--tree", "sides", "--tree-scheme", "random"], "unknown sibling scheme"),
    (["generate", "x", "--tree", "lookup", "--tree-nodes", "0"], "tree_nodes must be"),
    (["generate", "x", "--tree", "mixed", "--typical"], "typical acceptance applies to chain drafts only"),
    (["generate", "x", "--typical", "--typical-epsilon", "0"], "typical acceptance needs 0 < epsilon <= 1"),
    (["generate", "x", "--typical", "--method", "ar"], "--method ar drafts nothing"),
    (["generate", "x", "--cascade", "ngram"], "unknown cascade stage 'ngram'"),
    (["generate", "x", "--cascade", "suffix", "--drafter", "lookup"], "--cascade drafts for a drafter model's chain"),
    (["generate", "x", "--cascade", "suffix", "--tree", "mixed"], "--cascade drafts for a drafter model's chain"),
    (["generate", "x", "--tree", "lookahead", "--lookahead-shape", "3,3"], "--lookahead-shape takes W,N,G"),
    (["generate", "x", "--tree", "lookahead", "--lookahead-shape", "0,2,1"], "lookahead needs window >= 1"),
    (["generate", "x", "--tree", "lookup", "--lookahead-shape", "3,3,3"], "a lookahead shape applies to the lookahead method"),
    (["bench", "--methods", "lookahead", "--lookahead-shape", "a,b,c"], "--lookahead-shape takes W,N,G"),
])
def test_tree_option_errors_are_clear(need_smollm2, args, message):
    result = runner.invoke(app, args + ["--target", "smollm2-135m", "--dtype", "fp32"])
    assert result.exit_code == 1, result.output
    assert message in result.output and "Traceback" not in result.output


def test_chat_drafts_with_the_target_itself(need_smollm2):
    script = "\n".join(["/drafter self-skip:5,10,15", "/temperature 0", "Say hi.", "/drafter medusa:nowhere", "/quit"])
    result = runner.invoke(app, ["chat", "--target", "smollm2-135m", "--drafter", "smollm2-135m",
                                 "--max-new-tokens", "8"], input=script + "\n")
    assert result.exit_code == 0, result.output
    assert "sd · drafter self-skip:5,10,15" in result.output and "medusa.json is missing" in result.output


def test_a_drafter_follows_a_gguf_target_onto_its_gguf_weights_only_where_it_can():
    from specdec.cli import _drafter_weights

    drafter = registry.DEFAULT_DRAFTER
    assert _drafter_weights("gguf", drafter, "auto", False) == "gguf"
    assert _drafter_weights("gguf", "other/drafter.gguf", "auto", False) == "gguf"
    assert _drafter_weights("gguf", drafter, "auto", True) == "auto"  # a restricted vocabulary: transformers
    assert _drafter_weights("gguf", "ngram", "auto", False) == "auto"  # no model
    assert _drafter_weights("gguf", drafter, "int8", False) == "int8"  # asked for: kept
    assert _drafter_weights("auto", drafter, "auto", False) == "auto"
    assert _drafter_weights("bf16", drafter, "auto", False) == "auto"


@pytest.fixture
def llama_cpp_installed(monkeypatch):
    """llama-cpp-python 'installed' (faked: the suite need not build it), and failing if anything loads
    a model on it: under --dtype auto nothing may."""
    import specdec.backends.llamacpp as backend

    def refuse():
        raise AssertionError("--dtype auto loaded a model on llama.cpp")

    monkeypatch.setattr(backend, "available", lambda: True)
    monkeypatch.setattr(backend, "import_llama_cpp", refuse)


@pytest.mark.parametrize("drafter", [
    ["--drafter", "smollm2-135m", "--schedule", "fixed", "--gamma", "3"], ["--drafter", "ngram"],
    ["--drafter", "lookup"], ["--drafter", "smollm2-135m", "--tree", "mixed"], ["--drafter", "lookup", "--tree", "lookup"],
    ["--drafter", "smollm2-135m", "--tree", "eagle2"], ["--drafter", "self-skip:10,20"],
    ["--drafter", "lookup", "--tree", "suffix"], ["--drafter", "smollm2-135m", "--tree", "mixed-suffix"],
    ["--drafter", "lookup", "--tree", "lookahead"],
    ["--drafter", "smollm2-135m", "--cascade", "suffix"], ["--drafter", "smollm2-135m", "--typical"],
])
def test_auto_runs_one_set_of_weights_for_ar_and_every_drafter(need_smollm2, llama_cpp_installed, drafter):
    """With the `peers` extra installed, --dtype auto still means transformers' weights for every
    method, so a drafter's greedy output is AR's, token for token, and both name the same weights."""
    common = ["generate", "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1,", "--target", "smollm2-135m", "--max-new-tokens",
              "12", "--json"]
    ar = _json(common + ["--method", "ar"])
    sd = _json(common + drafter)
    assert sd["tokens"] == ar["tokens"] and len(ar["tokens"]) == 12
    assert sd["weights"]["target"] == ar["weights"]["target"] != "gguf"
    assert ar["weights"]["drafter"] is None
    model_drafted = drafter[1] not in ("ngram", "lookup")  # a drafter model, or the target's own layers
    assert (sd["weights"]["drafter"] is not None) == model_drafted and sd["weights"]["drafter"] != "gguf"


def test_profile_prints_pass_costs_and_the_time_split(need_smollm2, tmp_path):
    out = tmp_path / "profile.json"
    result = runner.invoke(app, ["profile", "def add(a, b):", "--target", "smollm2-135m", "--drafter", "smollm2-135m",
                                 "--max-new-tokens", "8", "--widths", "1,2,4", "--ops", "1,3", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "ms per added row" in result.output and "drafter passes" in result.output
    assert "where a target pass goes" in result.output
    data = json.loads(out.read_text())
    for split in data["ops"].values():  # the kinds add up to the pass, GEMMs and attention among them
        assert split["linears"] > 0 and split["attention"] > 0
        assert sum(split[k] for k in ("linears", "attention", "other ops", "host")) == pytest.approx(split["pass"])
    assert sorted(data["ops"]) == ["1", "3"]
    assert sorted(data["passes"]["target_ms"]) == ["1", "2", "4"] and data["passes"]["drafter_ms"]
    assert data["method"] == "sd-cost" and data["generation"]["new_tokens"] == 8
    assert data["target_weights"] != "gguf" and data["drafter_weights"] and data["machine"]
    stats = data["generation"]  # the split covers the wall time
    parts = stats["target_seconds"] + stats["drafter_seconds"] + stats["loop_seconds"]
    assert abs(parts - stats["wall_seconds"]) < 1e-6


@pytest.mark.parametrize("args,message", [
    (["profile", "--widths", "2,4"], "--widths must be comma-separated integers rising from 1"),
    (["profile", "--widths", "1,x"], "--widths must be"),
    (["profile", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["profile", "--tree", "forest"], "unknown tree"),
    (["profile", "--tree", "mixed", "--dtype", "gguf"], "cannot run on --dtype gguf"),
    (["profile", "--batches", "0"], "--batches must be comma-separated integers >= 1"),
    (["profile", "--batches", "2", "--dtype", "gguf"], "runs on --dtype auto weights"),
    (["profile", "--kv-storage", "0,256"], "--kv-storage must be comma-separated integers >= 1"),
    (["profile", "--kv-storage", "256", "--dtype", "gguf"], "--kv-storage times the engine's batched pass"),
    (["profile", "--ops", "1,0"], "--ops must be comma-separated integers >= 1"),
])
def test_profile_errors_are_one_line(args, message):
    result = runner.invoke(app, args)
    assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output


def test_generate_prompts_file_gives_each_prompt_its_single_output(need_smollm2, tmp_path):
    rows = [{"prompt": "def add(a, b):"}, {"prompt": "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1,", "max_new_tokens": 6},
            {"prompt": "Hello", "chat": True, "temperature": 0.8, "seed": 3}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    common = ["--target", "smollm2-135m", "--drafter", "smollm2-135m", "--max-new-tokens", "10", "--json"]
    result = runner.invoke(app, ["generate", "--prompts", str(path), "--batch-size", "2", "--kv-memory", "64MiB"]
                           + common)
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.strip().splitlines()]
    assert len(lines) == 3 and all(line["batch_size"] == 2 for line in lines)
    for row, line in zip(rows, lines):
        extra = (["--chat"] if row.get("chat") else []) + (["--temperature", "0.8", "--seed", "3"] if "seed" in row else [])
        alone = _json(["generate", row["prompt"]] + common[:-3] + ["--max-new-tokens", str(row.get("max_new_tokens", 10)),
                                                                  "--json"] + extra)
        assert line["tokens"] == alone["tokens"] and line["text"] == alone["text"]


def test_a_seed_prints_the_same_tokens_whatever_drafts_and_in_a_batch_of_8(need_smollm2, tmp_path):
    """The seeded AR output, token for token, from the default method (which may draft nothing
    where the pair's measured costs say drafting does not pay: a 135M model drafting for itself),
    a fixed draft length, a tree, prompt lookup and eight copies of the prompt decoded together
    (Gumbel-max coupling: docs/exactness.md#seeds)."""
    prompt = "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1,"
    common = ["--target", "smollm2-135m", "--drafter", "smollm2-135m", "--max-new-tokens", "16", "--json"]
    sampled = ["--temperature", "0.8", "--seed", "7"]
    ar = _json(["generate", prompt, "--method", "ar"] + sampled + common)
    for extra in ([], ["--schedule", "fixed", "--gamma", "3"], ["--tree", "mixed"], ["--drafter", "lookup"]):
        out = _json(["generate", prompt] + sampled + common + extra)
        assert out["tokens"] == ar["tokens"], extra
        assert out["stats"]["drafted"] > 0 or not extra, extra
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": prompt, "temperature": 0.8, "seed": 7}) + "\n" for _ in range(8)))
    result = runner.invoke(app, ["generate", "--prompts", str(path), "--batch-size", "8"] + common)
    assert result.exit_code == 0, result.output
    assert [json.loads(line)["tokens"] for line in result.stdout.strip().splitlines()] == [ar["tokens"]] * 8


def test_sizes_parse_in_the_units_users_write():
    from specdec.cli import parse_bytes

    assert parse_bytes("2GiB", "--kv-memory") == 2 * 2**30 and parse_bytes("1.5 GB", "--kv-memory") == 1.5e9
    assert parse_bytes("512mib", "--kv-memory") == 512 * 2**20 and parse_bytes("1000", "--kv-memory") == 1000
    with pytest.raises(SpecdecError, match="--kv-memory takes a size"):
        parse_bytes("2 parsecs", "--kv-memory")
    assert runner.invoke(app, ["generate", "x", "--kv-memory", "1GiB"]).output.count("use it with --prompts") == 1


@pytest.mark.parametrize("content,message", [
    ("", "holds no prompt"), ("not json\n", ":1: not a JSON object"), ('{"text": "x"}\n', "needs a non-empty string"),
    ('{"prompt": "x", "colour": 1}\n', "unknown field(s) colour"), ('{"prompt": "x", "seed": "a"}\n', "'seed' must be"),
    ('{"prompt": "x", "temperature": -1}\n', ":1: temperature must be"),
])
def test_generate_prompts_file_errors_name_the_line(tmp_path, content, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text(content)
    result = runner.invoke(app, ["generate", "--prompts", str(path)])
    assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("args,message", [
    (["x"], "give a prompt or --prompts FILE, not both"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--debug"], "drop it with --prompts"),
    (["--drafter", "self-skip"], "batched passes do not keep yet"),
    (["--kv-memory", "lots"], "--kv-memory takes a size such as 2GiB"),
    (["--kv-memory", "0MiB"], "--kv-memory takes a size"),
])
def test_generate_prompts_option_errors_come_before_loading(tmp_path, args, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "x"}\n')
    result = runner.invoke(app, ["generate", "--prompts", str(path), "--target", "no-such-model"] + args)
    assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output


def test_a_drafter_model_gets_row_exact_passes_where_its_passes_can_batch():
    """A chain's drafter is row-exact alone and in a batch (its passes batch, and a seeded prompt
    drafts the same in both); a tree's only where the run batches (alone, its depth passes would
    pay a call per row); --batched-rows turns both off."""
    from specdec.cli.common import _drafter_rows
    from specdec.decoding.speculation import resolve

    chain, tree = resolve("default"), resolve("tree-mixed")
    assert _drafter_rows(chain, None) is True and _drafter_rows(chain, True) is True
    assert _drafter_rows(tree, None) is None and _drafter_rows(tree, True) is True
    assert _drafter_rows(chain, False) is None and _drafter_rows(tree, False) is None
