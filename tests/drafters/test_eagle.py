"""EAGLE: the feature drafter's training, checkpoints and drafting (EAGLE-2 trees from its layer)."""

import json
import subprocess
import sys

import pytest
import torch

from specdec import Sampler, autoregressive_generate, speculative_generate
from specdec.adapters.checkpoints import head_rows, target_fingerprint
from specdec.drafters.eagle import EagleDrafter
from specdec.adapters.eagle_layer import Eagle, EagleLayer, EagleShape, load_eagle, save_eagle
from specdec.training.fit_eagle import EagleTrainConfig, train_eagle
from specdec.errors import SpecdecError
from specdec.adapters.medusa_heads import save_heads

from conftest import tiny_model
from test_sampling_exactness import ALPHA, chi_square_pvalue
from test_self_drafting import PROMPTS, _off_main_chain, _own_text, _random_heads, _Reference, _wide


def _random_eagle(target, scale: float = 0.2, seed: int = 0, **info) -> Eagle:
    """An untrained layer moved off its identity start by noise, for `target` (every id scored)."""
    torch.manual_seed(seed)
    layer = EagleLayer(EagleShape.for_target(target))
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.add_(torch.randn_like(parameter) * scale)
    return Eagle(layer.requires_grad_(False), torch.arange(target.vocab_size),
                 {"hidden_size": target.hidden_size, "target": target.name,
                  "target_sha256": target_fingerprint(target), **info})


def _quiet(message):
    pass


# ---------------------------------------------------------------- training and checkpoints


@pytest.mark.slow
def test_training_reduces_the_held_out_loss_and_records_provenance(tmp_path):
    target = tiny_model(1, vocab=32, max_positions=2048)
    config = EagleTrainConfig(tokens=1200, vocab=32, seq_len=64, epochs=6, batch=2, lr=3e-3)
    trained = train_eagle(target, _own_text(target), tmp_path / "eagle", config, say=_quiet)
    info = trained.info
    assert info["heldout_loss"] < 0.8 * info["heldout_loss_untrained"]
    assert len(info["heldout_top1"]) == config.unroll and all(0 <= a <= 1 for a in info["heldout_top1"])
    assert info["target_sha256"] == target_fingerprint(target)
    assert info["steps"] == 6 * -(-(1200 // 64 - 1) // 2)
    for key in ("corpus", "tokens", "train_loss", "seconds", "seed", "parameters", "unroll"):
        assert key in info
    assert sorted(p.name for p in (tmp_path / "eagle").iterdir()) == ["eagle.json", "eagle.safetensors"]
    # the trained layer drafts better than chance: its depth-1 guess is often the target's token
    assert info["heldout_top1"][0] > 0.2


@pytest.mark.slow
def test_a_stopped_eagle_training_resumes_to_the_same_layer(tmp_path, monkeypatch):
    target = tiny_model(1, vocab=32, max_positions=2048)
    corpus = _own_text(target, 700)
    config = EagleTrainConfig(tokens=700, vocab=32, seq_len=64, epochs=3, batch=2)
    whole = train_eagle(target, corpus, tmp_path / "whole", config, say=_quiet)
    calls = {"n": 0}
    real_step = torch.optim.AdamW.step

    def stop_midway(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 8:  # inside the second epoch (5 steps per epoch)
            raise KeyboardInterrupt
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", stop_midway)
    with pytest.raises(KeyboardInterrupt):
        train_eagle(target, corpus, tmp_path / "resumed", config, say=_quiet)
    monkeypatch.setattr(torch.optim.AdamW, "step", real_step)
    said = []
    resumed = train_eagle(target, corpus, tmp_path / "resumed", config, say=said.append)
    assert any("resuming" in m for m in said)
    for a, b in zip(whole.layer.parameters(), resumed.layer.parameters()):
        assert torch.equal(a, b)


def test_checkpoints_round_trip_and_are_refused_for_another_target(tmp_path):
    target, other = tiny_model(1, vocab=32), tiny_model(2, vocab=32)
    eagle = _random_eagle(target)
    save_eagle(tmp_path / "e", eagle)
    loaded = load_eagle(tmp_path / "e")
    for a, b in zip(loaded.layer.parameters(), eagle.layer.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(SpecdecError, match="trained for tiny-1"):
        speculative_generate([2, 3], other, EagleDrafter(tmp_path / "e"), max_new_tokens=4)
    wide = _random_eagle(target, hidden_size=48)
    with pytest.raises(SpecdecError, match="hidden size 48"):
        speculative_generate([2, 3], target, EagleDrafter(wide), max_new_tokens=4)
    info = json.loads((tmp_path / "e" / "eagle.json").read_text())
    (tmp_path / "e" / "eagle.json").write_text(json.dumps({**info, "intermediate": 8}))
    with pytest.raises(SpecdecError, match="does not match"):
        load_eagle(tmp_path / "e")


@pytest.mark.parametrize("damage", ["missing", "json", "weights", "medusa"])
def test_a_damaged_or_other_kind_checkpoint_is_a_clear_error(tmp_path, damage):
    target = tiny_model(1, vocab=32)
    folder = tmp_path / "e"
    if damage == "medusa":
        save_heads(folder, _random_heads(target))
    else:
        save_eagle(folder, _random_eagle(target))
    if damage == "missing":
        (folder / "eagle.json").unlink()
    elif damage == "json":
        (folder / "eagle.json").write_text("{not json")
    elif damage == "weights":
        (folder / "eagle.safetensors").write_bytes((folder / "eagle.safetensors").read_bytes()[:100])
    messages = {"missing": "eagle.json is missing", "json": "damaged", "weights": "cannot be read",
                "medusa": "it holds a Medusa heads checkpoint"}
    with pytest.raises(SpecdecError, match=messages[damage]):
        load_eagle(folder)


@pytest.mark.slow
def test_cli_trains_an_eagle_drafter_and_refuses_bad_options_before_loading(tmp_path):
    for args, message in ((["generate", "x", "--drafter", f"eagle:{tmp_path}"], "eagle.json is missing"),
                          (["train-heads", "--out", str(tmp_path), "--kind", "hydra"], "medusa or eagle"),
                          (["train-heads", "--out", str(tmp_path), "--kind", "eagle", "--unroll", "0"],
                           "--unroll must be >= 1")):
        run = subprocess.run([sys.executable, "-m", "specdec", *args, "--target", "no-such-model"],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 1, run.stderr
        assert message in run.stderr and "Traceback" not in run.stderr


# ---------------------------------------------------------------- drafting


class _RootSpy(EagleDrafter):
    """Records (context, the layer's q logits at the tree's root) at every step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.roots = []

    def _feed_root(self, context):
        logits = yield from super()._feed_root(context)
        self.roots.append((list(context), logits.clone()))
        return logits


@pytest.mark.parametrize("first_target", [True, False])
def test_the_root_reads_the_targets_features_as_a_cache_free_pass_would(first_target):
    """At every step the layer's root logits must equal one cache-free pass of the layer over the
    whole context, input t being [token t; the target's feature at t-1]: the tree of the step
    before, read and dropped, must leave no trace, and no feature may be off by a position."""
    target = tiny_model(1, vocab=32, exact_rows=True)
    eagle = _random_eagle(target)
    spy = _RootSpy(eagle, 3, policy=_wide())
    off_main_chain = 0
    for prompt in PROMPTS:
        result = speculative_generate(prompt, target, spy, gamma=4, max_new_tokens=30, first_target=first_target)
        off_main_chain += _off_main_chain(result)
    assert len(spy.roots) > 6 and off_main_chain > 0
    layer, ids = eagle.layer_for(target.device, target.dtype), torch.arange(target.vocab_size)
    for context, logits in spy.roots:
        target.forward(context, None, num_logits=len(context))
        features = torch.cat([torch.zeros(1, target.hidden_size, device=target.device), target.last_hidden[:-1]])
        embeds = target.hf.get_input_embeddings()(torch.tensor(context, device=target.device))
        predicted = layer(embeds[None], features[None], torch.arange(len(context), device=target.device)[None])[0, -1]
        expected = predicted @ head_rows(target, ids).T
        assert torch.allclose(logits, expected, atol=1e-4)


@pytest.mark.parametrize("exact_rows", [None, False])
def test_greedy_eagle_decoding_equals_greedy_ar_on_tiny_models(exact_rows):
    target = tiny_model(1, vocab=32, exact_rows=exact_rows)
    eagle = _random_eagle(target)
    accepted = off_main_chain = 0
    for first_target in (True, False):
        for prompt in PROMPTS:
            expected = autoregressive_generate(prompt, target, max_new_tokens=40).tokens
            result = speculative_generate(prompt, target, EagleDrafter(eagle, 3, policy=_wide()), gamma=6,
                                          max_new_tokens=40, first_target=first_target)
            assert result.tokens == expected
            accepted += result.stats.accepted
            off_main_chain += _off_main_chain(result)
    assert accepted > 0 and off_main_chain > 0


@pytest.mark.slow
def test_sampled_eagle_generation_matches_the_target_joint_distribution():
    """The joint law of the first 3 tokens against the enumerated target law (chi-square, 1e-4):
    the trees are deterministic given the features, so the one-hot law keeps them exact."""
    from test_sampling_exactness import exact_joint

    target = tiny_model(3, vocab=6, logit_scale=0.25)
    sampler, prompt, length, runs = Sampler(1.0), [2, 3, 2], 3, 2_000
    joint = exact_joint(_Reference(target), prompt, length, sampler)
    eagle = _random_eagle(target, scale=0.5)
    samples, accepted = [], 0
    for seed in range(runs):
        out = speculative_generate(prompt, target, EagleDrafter(eagle, 2, policy=_wide(6)), gamma=3,
                                   sampler=sampler, max_new_tokens=length, seed=seed,
                                   seed_rule="stream", eos_token_ids=[])
        samples.append(tuple(out.tokens))
        accepted += out.stats.accepted
    assert chi_square_pvalue(samples, joint) > ALPHA
    assert accepted > runs // 4


def test_eagle_on_a_row_exact_bf16_target_is_greedy_identical():
    """The path native-bf16 CPUs take, forced here whatever the CPU: layer and head rows in bf16."""
    from test_rows import qwen_like

    target = qwen_like(torch.bfloat16, exact_rows=True, vocab=512, layers=3)
    eagle = _random_eagle(target, scale=0.0)  # the identity start: guesses the next token again
    accepted = 0
    for prompt in PROMPTS:
        expected = autoregressive_generate(prompt, target, max_new_tokens=30, eos_token_ids=[]).tokens
        result = speculative_generate(prompt, target, EagleDrafter(eagle, 3, policy=_wide()), gamma=6,
                                      max_new_tokens=30, eos_token_ids=[])
        assert result.tokens == expected
        accepted += result.stats.accepted
    assert accepted > 0


def test_eagle_on_real_smollm2_trained_here_is_greedy_identical_and_exact(smollm2, tmp_path):
    """A layer trained for seconds on the standard library gets drafts accepted; greedy output is
    the target's token for token, and sampled output keeps the target's first-token law."""
    from test_generate import SMOLLM2_PROMPTS

    config = EagleTrainConfig(tokens=3072, vocab=8192, seq_len=128, epochs=2, batch=2, lr=2e-3, intermediate=256)
    eagle = train_eagle(smollm2, "stdlib", tmp_path / "eagle", config, say=_quiet)
    assert eagle.info["heldout_loss"] < eagle.info["heldout_loss_untrained"]
    accepted = 0
    for prompt in SMOLLM2_PROMPTS:
        ids = smollm2.encode(prompt)
        expected = autoregressive_generate(ids, smollm2, max_new_tokens=24).tokens
        result = speculative_generate(ids, smollm2, EagleDrafter(tmp_path / "eagle", 3, policy=_wide(12)),
                                      gamma=8, max_new_tokens=24)
        assert result.tokens == expected
        accepted += result.stats.accepted
    assert accepted > 0
    # sampled: the joint law of three tokens, the first from the prompt pass, the second drafted by
    # the layer from that pass's features (a depth-1 tree: one token is left for the bonus) and
    # verified under the one-hot law (chi-square, 1e-4). The layer at its identity start on a
    # repetitive prompt: its drafts are accepted often, which gives the test its power.
    from test_sampling_exactness import exact_joint

    ids = smollm2.encode("#" * 24)
    sampler = Sampler(1.0, top_k=3)
    joint = exact_joint(_Reference(smollm2), ids, 3, sampler)
    drafter = EagleDrafter(_random_eagle(smollm2, scale=0.0), 3, policy=_wide(8))
    samples, accepted = [], 0
    for seed in range(300):
        out = speculative_generate(ids, smollm2, drafter, gamma=4, sampler=sampler, max_new_tokens=3, seed=seed,
                                   seed_rule="stream",
                                   eos_token_ids=[])
        samples.append(tuple(out.tokens))
        accepted += out.stats.accepted
    assert chi_square_pvalue(samples, joint) > ALPHA
    assert accepted > 150


def test_bench_and_cli_run_eagle(smollm2, tmp_path):
    from specdec.bench.runners import Settings
    from specdec.bench.run import run_benchmark

    save_eagle(tmp_path / "eagle", _random_eagle(smollm2, scale=0.0))
    settings = Settings(max_new_tokens=6, eagle=str(tmp_path / "eagle"))
    result = run_benchmark(["humaneval:1:0"], None, ["ar", "eagle", "eagle-uncalibrated"], "smollm2-135m",
                           "smollm2-135m", settings, dtype="fp32")
    assert result["summary"]["eagle"]["identical_to_ar"] == result["summary"]["eagle-uncalibrated"]["identical_to_ar"] == 1
    assert result["info"]["eagle_drafter"]["target_sha256"] == target_fingerprint(smollm2)
    for method in ("eagle", "eagle-uncalibrated"):  # the checkpoint is checked before any model loads
        with pytest.raises(SpecdecError, match="--eagle DIR"):
            run_benchmark(["humaneval:1:0"], None, [method], "smollm2-135m", "smollm2-135m", Settings())
    outputs = []
    for extra in (["--drafter", f"eagle:{tmp_path / 'eagle'}"], ["--method", "ar"]):
        args = ["generate", "def add(a, b):", "--target", "smollm2-135m", "--dtype", "fp32", "--max-new-tokens", "8",
                "--json"] + extra
        run = subprocess.run([sys.executable, "-m", "specdec", *args], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        outputs.append(json.loads(run.stdout))
    assert outputs[0]["drafter"].startswith("eagle") and outputs[0]["tokens"] == outputs[1]["tokens"]
    assert "parents" in outputs[0]["steps"][-1]
