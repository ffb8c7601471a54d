"""Self-drafting: Medusa heads (training, checkpoints, drafting) and layer-skip self-speculation."""

import json
import subprocess
import sys

import pytest
import torch

from specdec import Sampler, autoregressive_generate, speculative_generate
from specdec.drafters.layerskip import LayerSkipModel, choose_skipped, self_skip_drafter
from specdec.drafters.medusa import MedusaDrafter
from specdec.drafters import ModelDrafter, SidesDrafter
from specdec.errors import SpecdecError
from specdec.adapters.checkpoints import target_fingerprint
from specdec.adapters.medusa_heads import CONFIG, WEIGHTS, Heads, MedusaHeads, load_heads, save_heads
from specdec.training.fit_medusa import TrainConfig, train_medusa
from specdec.sizing.schedules import TreeCost

from conftest import tiny_model
from test_sampling_exactness import ALPHA, chi_square_pvalue

PROMPTS = ([2, 5, 7, 9, 11, 5, 7], [3, 3, 4, 8, 3, 3, 4])


def _wide(nodes: int = 16) -> TreeCost:
    """A policy that grows wide trees whatever the costs (the loop must be exact anyway)."""
    return TreeCost(threshold=0.02, node_threshold=1e-4, max_nodes=nodes, warmup=10**9)


def _random_heads(target, num_heads: int = 3, scale: float = 0.3, seed: int = 0) -> Heads:
    """Untrained heads with random blocks, for `target` (every id scored)."""
    torch.manual_seed(seed)
    heads = MedusaHeads(target.hidden_size, num_heads)
    with torch.no_grad():
        for block in heads.blocks:
            block.weight.normal_(0, scale / target.hidden_size ** 0.5)
    info = {"hidden_size": target.hidden_size, "num_heads": num_heads, "target": target.name,
            "target_sha256": target_fingerprint(target)}
    return Heads(heads.requires_grad_(False), torch.arange(target.vocab_size), info)


def _own_text(model, length: int = 1200, seed: int = 0) -> list[int]:
    """A corpus the model wrote itself (sampled), so that heads have something to learn."""
    out = autoregressive_generate([2, 3], model, Sampler(1.0), max_new_tokens=length, seed=seed, eos_token_ids=[])
    return [2, 3] + out.tokens


def _off_main_chain(result) -> int:
    return sum(1 for s in result.steps if s.path and s.path != list(range(len(s.path))))


# ---------------------------------------------------------------- training and checkpoints


@pytest.mark.slow
def test_training_reduces_the_held_out_loss_and_records_provenance(tmp_path):
    target = tiny_model(1, vocab=32, max_positions=2048)
    config = TrainConfig(num_heads=2, tokens=1200, vocab=32, seq_len=64, epochs=4, batch=32, lr=3e-3)
    trained = train_medusa(target, _own_text(target), tmp_path / "heads", config, say=lambda m: None)
    info = trained.info
    assert info["heldout_loss"] < 0.95 * info["heldout_loss_untrained"]
    assert len(info["heldout_top1"]) == 2 and all(0 <= a <= 1 for a in info["heldout_top1"])
    assert info["target_sha256"] == target_fingerprint(target)
    assert info["steps"] == 4 * -(-(1200 // 64 - 1) * (64 - 2) // 32)
    for key in ("corpus", "tokens", "train_loss", "seconds", "seed"):
        assert key in info
    assert sorted(p.name for p in (tmp_path / "heads").iterdir()) == [WEIGHTS, CONFIG]  # no leftovers
    reloaded = load_heads(tmp_path / "heads")
    for a, b in zip(reloaded.heads.parameters(), trained.heads.parameters()):
        assert torch.equal(a, b.float())


@pytest.mark.slow
def test_a_stopped_training_resumes_to_the_same_heads(tmp_path, monkeypatch):
    target = tiny_model(1, vocab=32, max_positions=2048)
    corpus = _own_text(target, 700)
    config = TrainConfig(num_heads=2, tokens=700, vocab=32, seq_len=64, epochs=3, batch=32)
    whole = train_medusa(target, corpus, tmp_path / "whole", config, say=lambda m: None)

    calls = {"n": 0}
    real_step = torch.optim.AdamW.step

    def stop_midway(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 40:  # inside the second epoch
            raise KeyboardInterrupt
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", stop_midway)
    with pytest.raises(KeyboardInterrupt):
        train_medusa(target, corpus, tmp_path / "resumed", config, say=lambda m: None)
    monkeypatch.setattr(torch.optim.AdamW, "step", real_step)
    said = []
    resumed = train_medusa(target, corpus, tmp_path / "resumed", config, say=said.append)
    assert any("resuming" in m for m in said)
    for a, b in zip(whole.heads.parameters(), resumed.heads.parameters()):
        assert torch.equal(a, b)


def _saved(tmp_path, target, **info_changes):
    heads = _random_heads(target)
    heads.info.update(info_changes)
    save_heads(tmp_path / "h", heads)
    return tmp_path / "h"


def test_checkpoints_for_another_target_are_refused(tmp_path):
    target, other = tiny_model(1, vocab=32), tiny_model(2, vocab=32)
    folder = _saved(tmp_path, other)
    with pytest.raises(SpecdecError, match="trained for tiny-2"):
        speculative_generate([2, 3], target, MedusaDrafter(folder), max_new_tokens=4)
    info = json.loads((folder / CONFIG).read_text())
    (folder / CONFIG).write_text(json.dumps({**info, "hidden_size": 64}))
    with pytest.raises(SpecdecError, match="does not match"):  # the blocks are 32 wide, the json says 64
        load_heads(folder)


def test_another_hidden_size_is_refused_by_name(tmp_path):
    target = tiny_model(1, vocab=32)
    heads = _random_heads(target)
    heads.info["hidden_size"] = 48
    with pytest.raises(SpecdecError, match="hidden size 48"):
        speculative_generate([2, 3], target, MedusaDrafter(heads), max_new_tokens=4)


@pytest.mark.parametrize("damage", ["missing", "json", "weights", "kind"])
def test_a_damaged_checkpoint_is_a_clear_error(tmp_path, damage):
    folder = _saved(tmp_path, tiny_model(1, vocab=32))
    if damage == "missing":
        (folder / CONFIG).unlink()
    elif damage == "json":
        (folder / CONFIG).write_text("{not json")
    elif damage == "weights":
        (folder / WEIGHTS).write_bytes((folder / WEIGHTS).read_bytes()[:100])
    else:
        (folder / CONFIG).write_text(json.dumps({**json.loads((folder / CONFIG).read_text()), "kind": "eagle"}))
    with pytest.raises(SpecdecError, match="heads"):
        load_heads(folder)


@pytest.mark.slow
def test_cli_refuses_bad_heads_before_loading_any_model(tmp_path):
    for args, message in ((["generate", "x", "--drafter", f"medusa:{tmp_path}"], "medusa.json is missing"),
                          (["train-heads", "--out", str(tmp_path), "--heads", "0"], "--heads must be >= 1"),
                          (["train-heads", "--out", str(tmp_path), "--corpus", str(tmp_path / "no.txt")],
                           "corpus not found"),
                          (["generate", "x", "--drafter", "self-skip:a,b"], "layer numbers")):
        run = subprocess.run([sys.executable, "-m", "specdec", *args, "--target", "no-such-model"],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 1, run.stderr
        assert message in run.stderr and "Traceback" not in run.stderr


# ---------------------------------------------------------------- drafting with heads


class _Spy(MedusaDrafter):
    """Records what the loop hands over: (tokens emitted so far, hidden state)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []
        self._length = 0

    def propose(self, context, max_depth, sampler, generator, keep_going=None):
        self._length = len(context)
        return super().propose(context, max_depth, sampler, generator)

    def observe(self, hidden):
        self.seen.append(hidden.clone())
        super().observe(hidden)


@pytest.mark.parametrize("exact_rows", [True, False])
@pytest.mark.parametrize("first_target", [True, False])
def test_the_loop_hands_over_the_hidden_states_of_every_committed_position(first_target, exact_rows):
    """Over the prefill and every pass, the drafter must receive the target's hidden state at each
    position of the output but the last, once, in order: checked against a cache-free pass over
    the output (a wrong row would be another position's, or a rejected node's)."""
    target = tiny_model(1, vocab=32, exact_rows=exact_rows)
    prompt = PROMPTS[0]
    spy = _Spy(_random_heads(target), width=3, policy=_wide())
    result = speculative_generate(prompt, target, spy, gamma=4, max_new_tokens=30, first_target=first_target)
    sequence = prompt + result.tokens
    target.forward(sequence, None, num_logits=len(sequence))
    reference = target.last_hidden
    seen = torch.cat(spy.seen)
    # the last token emitted is never fed to the target
    assert seen.shape[0] == len(sequence) - 1
    assert torch.allclose(seen, reference[:-1], atol=1e-5)
    assert _off_main_chain(result) > 0


@pytest.mark.parametrize("kernels", ["auto", "stock"])
def test_greedy_medusa_decoding_equals_greedy_ar_on_tiny_models(kernels):
    target = tiny_model(1, vocab=32, kernels=kernels)
    accepted = off_main_chain = 0
    for prompt in PROMPTS:
        expected = autoregressive_generate(prompt, target, max_new_tokens=40).tokens
        result = speculative_generate(prompt, target, MedusaDrafter(_random_heads(target), 3, policy=_wide()),
                                      gamma=8, max_new_tokens=40)
        assert result.tokens == expected
        accepted += result.stats.accepted
        off_main_chain += _off_main_chain(result)
    assert accepted > 0 and off_main_chain > 0


class _Reference:
    """A tiny model's law p(. | context) computed without a cache (for `exact_joint`)."""

    def __init__(self, model):
        self.model = model

    def next_probs(self, context, sampler):
        return sampler.probs(self.model.forward(list(context), None, 1)[-1])


@pytest.mark.slow
def test_sampled_medusa_generation_matches_the_target_joint_distribution():
    """The joint law of the first 3 tokens against the enumerated target law (chi-square, 1e-4).
    Medusa trees are deterministic given the hidden state: the one-hot law keeps them exact."""
    from test_sampling_exactness import exact_joint

    target = tiny_model(3, vocab=6, logit_scale=0.25)
    sampler, prompt, length, runs = Sampler(1.0), [2, 3, 2], 3, 2_000
    joint = exact_joint(_Reference(target), prompt, length, sampler)
    heads = _random_heads(target, scale=1.0)
    samples, accepted = [], 0
    for seed in range(runs):
        out = speculative_generate(prompt, target, MedusaDrafter(heads, 2, policy=_wide(6)), gamma=3,
                                   sampler=sampler, max_new_tokens=length, seed=seed,
                                   seed_rule="stream", eos_token_ids=[])
        samples.append(tuple(out.tokens))
        accepted += out.stats.accepted
    assert chi_square_pvalue(samples, joint) > ALPHA
    assert accepted > runs // 4


def test_medusa_on_real_smollm2_is_greedy_identical_with_trained_heads(smollm2, tmp_path):
    """Heads trained for a few seconds on the standard library still get drafts accepted."""
    from test_generate import SMOLLM2_PROMPTS

    config = TrainConfig(num_heads=2, tokens=2048, vocab=8192, seq_len=128, epochs=1)
    heads = train_medusa(smollm2, "stdlib", tmp_path / "heads", config, say=lambda m: None)
    assert heads.info["heldout_loss"] < heads.info["heldout_loss_untrained"]
    accepted = 0
    for prompt in SMOLLM2_PROMPTS:
        ids = smollm2.encode(prompt)
        expected = autoregressive_generate(ids, smollm2, max_new_tokens=24).tokens
        result = speculative_generate(ids, smollm2, MedusaDrafter(tmp_path / "heads", 3, policy=_wide(12)),
                                      gamma=8, max_new_tokens=24)
        assert result.tokens == expected
        accepted += result.stats.accepted
    assert accepted > 0


# ---------------------------------------------------------------- layer skip


def test_a_skipped_layer_model_equals_the_target_with_those_layers_removed():
    from specdec import TransformersModel

    target = tiny_model(1, vocab=32, layers=4, kernels="stock")
    skip = LayerSkipModel(target, [1, 2])
    ids = PROMPTS[0]
    hf = tiny_model(1, vocab=32, layers=4, kernels="stock").hf  # the same weights, cut
    hf.model.layers = torch.nn.ModuleList([hf.model.layers[0], hf.model.layers[3]])
    hf.config.num_hidden_layers = 2
    reference = TransformersModel(hf, None, "cut", role="drafter", kernels="stock")
    assert torch.allclose(skip.forward(ids, None, len(ids)), reference.forward(ids, None, len(ids)), atol=1e-5)
    # and the target itself is whole again afterwards
    assert len(target._decoder.layers) == 4
    assert torch.equal(target.forward(ids, None, 1),
                       tiny_model(1, vocab=32, layers=4, kernels="stock").forward(ids, None, 1))


@pytest.mark.parametrize("tree", [False, True])
def test_greedy_self_skip_decoding_equals_greedy_ar_on_tiny_models(tree):
    target = tiny_model(1, vocab=32, layers=4)
    accepted = 0
    for prompt in PROMPTS:
        expected = autoregressive_generate(prompt, target, max_new_tokens=40).tokens
        model = LayerSkipModel(target, [2])
        drafter = SidesDrafter(model, 3, policy=_wide()) if tree else ModelDrafter(model)
        result = speculative_generate(prompt, target, drafter, gamma=4, max_new_tokens=40)
        assert result.tokens == expected
        accepted += result.stats.accepted
    assert accepted > 0


def test_self_skip_rejects_bad_layers_and_models_without_layers():
    target = tiny_model(1, vocab=32, layers=4)
    for skip in ([0], [4], [-1]):
        with pytest.raises(SpecdecError, match="layers to skip"):
            LayerSkipModel(target, skip)
    with pytest.raises(SpecdecError, match=">= 3 layers"):
        LayerSkipModel(tiny_model(1, vocab=32, layers=2), [1])


def test_self_skip_on_real_smollm2_chooses_layers_and_stays_greedy_identical(smollm2):
    from test_generate import SMOLLM2_PROMPTS

    skip, search = choose_skipped(smollm2)
    assert 0 not in skip and len(smollm2._decoder.layers) - 1 not in skip
    assert len(search["trials"]) >= 2 and all(0 <= t["alpha"] <= 1 for t in search["trials"])
    # a quarter of the layers skipped agrees more with the whole model than half of them
    assert search["trials"][0]["alpha"] > search["trials"][2]["alpha"]
    for prompt in SMOLLM2_PROMPTS:
        ids = smollm2.encode(prompt)
        expected = autoregressive_generate(ids, smollm2, max_new_tokens=24).tokens
        result = speculative_generate(ids, smollm2, self_skip_drafter(smollm2, skip), gamma=3, max_new_tokens=24)
        assert result.tokens == expected
        assert result.stats.accepted > 0


class _ClaimsSampled(MedusaDrafter):
    """Power check: the same trees, verified as if the heads' top tokens had been drawn i.i.d. from
    the heads' q (they were not), which biases the output."""

    def propose(self, context, max_depth, sampler, generator, keep_going=None):
        from specdec.core.trees import Tree

        tree = super().propose(context, max_depth, sampler, generator)
        if not tree.tokens:
            return tree
        scored = self.head_probs(self._hidden)
        probs = torch.zeros(self.heads.heads.num_heads, self.heads.vocab_ids.max() + 1, device=scored.device)
        probs[:, self._ids] = scored
        rows = torch.stack([probs[d - 1] for d in tree.depths])
        return Tree(tree.tokens, tree.parents, rows, tree.values, "iid")


@pytest.mark.slow
def test_the_joint_test_catches_trees_verified_with_the_wrong_law():
    from test_sampling_exactness import exact_joint

    target = tiny_model(3, vocab=6, logit_scale=0.25)
    sampler, prompt, length = Sampler(1.0), [2, 3, 2], 3
    joint = exact_joint(_Reference(target), prompt, length, sampler)
    heads = _random_heads(target, scale=1.0)
    samples = [tuple(speculative_generate(prompt, target, _ClaimsSampled(heads, 2, policy=_wide(6)), gamma=3,
                                          sampler=sampler, max_new_tokens=length, seed=seed,
                                          seed_rule="stream", eos_token_ids=[]).tokens)
               for seed in range(2_000)]
    assert chi_square_pvalue(samples, joint) < ALPHA


def test_bench_runs_the_self_drafting_methods(smollm2, tmp_path):
    from specdec.bench.runners import Settings
    from specdec.bench.run import run_benchmark

    heads = _random_heads(smollm2, scale=0.0)  # zero blocks: each head guesses the next token again
    save_heads(tmp_path / "heads", heads)
    settings = Settings(max_new_tokens=6, heads=str(tmp_path / "heads"), skip_layers=[5, 10, 15])
    methods = ["ar", "medusa", "medusa-uncalibrated", "self-skip"]
    result = run_benchmark(["humaneval:1:0"], None, methods, "smollm2-135m", "smollm2-135m", settings, dtype="fp32")
    for method in methods[1:]:
        assert result["summary"][method]["identical_to_ar"] == 1
    assert result["info"]["medusa_heads"]["target_sha256"] == target_fingerprint(smollm2)
    with pytest.raises(SpecdecError, match="--heads DIR"):
        run_benchmark(["humaneval:1:0"], None, ["medusa"], "smollm2-135m", "smollm2-135m", Settings())


def test_cli_generates_with_medusa_heads_and_with_skipped_layers(smollm2, tmp_path):
    save_heads(tmp_path / "heads", _random_heads(smollm2, scale=0.0))
    outputs = []
    for drafter in (f"medusa:{tmp_path / 'heads'}", "self-skip:5,10,15", None):
        args = ["generate", "def add(a, b):", "--target", "smollm2-135m", "--dtype", "fp32", "--max-new-tokens", "8",
                "--json"] + (["--drafter", drafter] if drafter else ["--method", "ar"])
        run = subprocess.run([sys.executable, "-m", "specdec", *args], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        outputs.append(json.loads(run.stdout))
    assert outputs[0]["drafter"] == "medusa3" and outputs[1]["drafter"] == "smollm2-135m-skip3of30"
    assert outputs[0]["tokens"] == outputs[1]["tokens"] == outputs[2]["tokens"]
    assert "parents" in outputs[0]["steps"][-1]  # Medusa drafts trees


def test_backends_without_hidden_states_or_layers_are_refused():
    """The llama.cpp backend gives neither hidden states nor layers: both drafters say so."""
    from types import SimpleNamespace

    gguf = SimpleNamespace(name="qwen-gguf", kernels="llama.cpp", vocab_size=32)
    with pytest.raises(SpecdecError, match="hidden states"):
        MedusaDrafter(_random_heads(tiny_model(1, vocab=32))).check_target(gguf)
    with pytest.raises(SpecdecError, match="no.*to skip|>= 3 layers"):
        LayerSkipModel(gguf, [1])


@pytest.mark.slow
def test_both_self_drafters_are_greedy_identical_on_a_row_exact_bf16_target():
    """The path native-bf16 CPUs take (`auto` gives them bf16 targets with row-exact passes), forced
    here whatever the CPU: heads and head rows in bf16, tree passes row-exact."""
    from test_rows import qwen_like

    target = qwen_like(torch.bfloat16, exact_rows=True, vocab=512, layers=3)
    assert target.exact_rows and target.dtype == torch.bfloat16
    medusa_accepted = off_main_chain = skip_accepted = 0
    for prompt in PROMPTS:
        expected = autoregressive_generate(prompt, target, max_new_tokens=30, eos_token_ids=[]).tokens
        # zero blocks guess the next token again: right wherever this random model repeats itself
        medusa = speculative_generate(prompt, target, MedusaDrafter(_random_heads(target, scale=0.0), 3, policy=_wide()),
                                      gamma=6, max_new_tokens=30, eos_token_ids=[])
        skip = speculative_generate(prompt, target, ModelDrafter(LayerSkipModel(target, [1])), gamma=4,
                                    max_new_tokens=30, eos_token_ids=[])
        assert medusa.tokens == expected and skip.tokens == expected
        medusa_accepted += medusa.stats.accepted
        off_main_chain += _off_main_chain(medusa)
        skip_accepted += skip.stats.accepted
    assert medusa_accepted > 0 and off_main_chain > 0 and skip_accepted > 0
