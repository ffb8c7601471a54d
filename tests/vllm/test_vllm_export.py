"""`specdec export` into vLLM's CPU build (`make test-vllm`; skipped without `.peers/vllm`): what is
trained here on SmolLM2-135M (in seconds, on a few thousand tokens of this repository's own
sources), exported, and run by
vLLM 0.32 as its speculative_config: drafts proposed and accepted, the greedy output vLLM's plain
output token for token, and the acceptance beside ours with the same drafter.

vLLM runs in a subprocess of its own environment (one at a time: each holds a few GB)."""

from __future__ import annotations

import json
import subprocess
import textwrap

import pytest
import torch

from specdec.models import catalogue as registry
from specdec.bench.vllm_peer import vllm_python, worker_env

from test_vllm import needs_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.real, needs_vllm]

K = 4  # num_speculative_tokens
MAX_TOKENS = 32
PROMPTS = ["def fibonacci(n):\n", "import os\n\ndef list_files(path):\n",
           "class Stack:\n    def __init__(self):\n", "def is_prime(n):\n    \"\"\""]

# Runs inside vLLM's environment: one LLM, greedy over the prompts, the tokens and vLLM's draft
# counters as the last line of stdout (vLLM re-imports the main module in its workers: guarded).
SCRIPT = textwrap.dedent('''
    import json, sys

    def main():
        settings = json.loads(sys.argv[1])
        from vllm import LLM, SamplingParams, TokensPrompt
        try:
            llm = LLM(model=settings["model"], dtype="float32", seed=0, max_model_len=512, max_num_seqs=2,
                      enforce_eager=True, enable_prefix_caching=False, disable_log_stats=False,
                      speculative_config=settings["speculative_config"])
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in settings["prompts"]],
                                   SamplingParams(max_tokens=settings["max_tokens"], temperature=0.0, detokenize=False))
        except Exception as error:
            print("RESULT " + json.dumps({"error": f"{type(error).__name__}: {error}"}), flush=True)
            return
        counts = {"drafted": 0, "accepted": 0}
        for metric in llm.get_metrics():
            if metric.name == "vllm:spec_decode_num_draft_tokens":
                counts["drafted"] += int(metric.value)
            elif metric.name == "vllm:spec_decode_num_accepted_tokens":
                counts["accepted"] += int(metric.value)
        print("RESULT " + json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outputs], **counts}), flush=True)

    if __name__ == "__main__":
        main()
''')


def run_vllm(tmp_path, prompts: list[list[int]], speculative_config: dict | None) -> dict:
    """vLLM's CPU build on SmolLM2-135M with `speculative_config` -> {"tokens", "drafted",
    "accepted"} or {"error": vLLM's own error in one line}."""
    script = tmp_path / "run_vllm.py"
    script.write_text(SCRIPT)
    python = vllm_python()
    settings = {"model": str(registry.require_installed("smollm2-135m")), "prompts": prompts,
                "max_tokens": MAX_TOKENS, "speculative_config": speculative_config}
    done = subprocess.run([str(python), str(script), json.dumps(settings)], capture_output=True, text=True,
                          env=worker_env("tuned", python), cwd=tmp_path, timeout=420)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"vLLM's run ended without a result ({done.returncode}): {done.stderr[-2000:]}"
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:
    return [smollm2.tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def corpus(smollm2) -> list[int]:
    """Token ids of specdec's own sources: a few thousand tokens of Python to train on."""
    from pathlib import Path

    import specdec

    text = "".join(path.read_text() for path in sorted(Path(specdec.__file__).parent.glob("*.py")))
    return smollm2.tokenizer.encode(text)


@pytest.fixture(scope="module")
def plain(smollm2, prompts, tmp_path_factory) -> dict:
    result = run_vllm(tmp_path_factory.mktemp("plain"), prompts, None)
    assert "error" not in result, result["error"]
    return result


def our_acceptance(target, drafter, prompts) -> float:
    """Ours, greedy, K tokens a draft: accepted / drafted over the prompts."""
    from specdec.decoding.loop import speculative_generate

    drafted = accepted = 0
    for ids in prompts:
        result = speculative_generate(ids, target, drafter, gamma=K, max_new_tokens=MAX_TOKENS)
        drafted, accepted = drafted + result.stats.drafted, accepted + result.stats.accepted
    return accepted / drafted


def check_speculative_run(result: dict, plain: dict) -> float:
    assert "error" not in result, result["error"]
    assert result["drafted"] > 0 and result["accepted"] > 0, result
    assert result["tokens"] == plain["tokens"]  # lossless: greedy output as vLLM's plain output
    return result["accepted"] / result["drafted"]


def test_exported_medusa_heads_draft_in_vllm(smollm2, prompts, plain, corpus, tmp_path):
    from specdec.adapters.export import export_heads
    from specdec.training.fit_medusa import TrainConfig, train_medusa

    heads = train_medusa(smollm2, corpus, tmp_path / "heads", TrainConfig(
        num_heads=K, tokens=8192, vocab=8192, seq_len=128, epochs=2, batch=64), say=lambda m: None)
    folder = export_heads(heads, smollm2, tmp_path / "medusa")
    result = run_vllm(tmp_path, prompts, {"method": "medusa", "model": str(folder), "num_speculative_tokens": K})
    acceptance = check_speculative_run(result, plain)
    print(f"medusa: vLLM acceptance {acceptance:.3f} ({result['accepted']}/{result['drafted']})")


def _drafter_folder(smollm2, tmp_path, layers: int = 24):
    """SmolLM2-135M's first `layers` layers as a drafter folder: there is no smaller model of its vocabulary."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(registry.converted_dir("smollm2-135m"), dtype=torch.float32)
    hf.model.layers = hf.model.layers[:layers]
    hf.config.num_hidden_layers = layers
    folder = tmp_path / f"smollm2-first{layers}"
    hf.save_pretrained(folder)
    smollm2.tokenizer.save_pretrained(folder)
    return folder


def test_an_exported_distilled_drafter_drafts_in_vllm_as_ours_does(smollm2, prompts, plain, corpus, tmp_path):
    """Acceptance of the exported drafter in vLLM within 10% of ours with the same drafter."""
    from specdec.adapters.lora import load_adapter
    from specdec.training.fit_distilled import DistillConfig, distill_drafter
    from specdec.adapters.export import export_drafter
    from specdec.models.loading import load

    drafter = load(str(_drafter_folder(smollm2, tmp_path)), dtype="fp32", device="cpu", role="drafter",
                   kernels="stock", vocab=0)
    distill_drafter(smollm2, drafter, corpus, tmp_path / "adapter", DistillConfig(
        tokens=1024, context=32, continuation=32, rank=4, epochs=1, batch=4, lr=1e-3), say=lambda m: None)
    distilled = load_adapter(tmp_path / "adapter")
    folder = export_drafter(drafter, distilled, tmp_path / "exported", dtype=torch.float32)
    result = run_vllm(tmp_path, prompts, {"method": "draft_model", "model": str(folder), "num_speculative_tokens": K})
    theirs = check_speculative_run(result, plain)
    from specdec.adapters.lora import attach

    attach(drafter, distilled.adapter)
    ours = our_acceptance(smollm2, drafter, prompts)
    print(f"distilled drafter: acceptance vLLM {theirs:.3f} ({result['accepted']}/{result['drafted']}), ours {ours:.3f}")
    assert abs(theirs - ours) <= 0.1 * ours


def test_an_exported_parallel_drafter_in_vllm(smollm2, prompts, plain, corpus, tmp_path):
    """vLLM's draft_model with parallel_drafting, the mask id from the exported config; where
    vLLM's CPU build cannot run it, the test skips with vLLM's own error."""
    from specdec.adapters.export import export_parallel
    from specdec.models.loading import load
    from specdec.adapters.pard import load_adapter
    from specdec.training.fit_parallel import ParallelConfig, train_parallel_drafter

    drafter = load(str(_drafter_folder(smollm2, tmp_path)), dtype="fp32", device="cpu", role="drafter",
                   kernels="stock", vocab=0)
    train_parallel_drafter(drafter, corpus, tmp_path / "parallel", ParallelConfig(
        k=K, tokens=2048, seq_len=128, groups=16, rank=4, batch=2), say=lambda m: None)
    folder = export_parallel(drafter, load_adapter(tmp_path / "parallel"), tmp_path / "exported", dtype=torch.float32)
    assert json.loads((folder / "config.json").read_text())["pard_token"] == 49151  # SmolLM2's tokenizer fills its table
    result = run_vllm(tmp_path, prompts, {"method": "draft_model", "model": str(folder), "num_speculative_tokens": K,
                                          "parallel_drafting": True})
    if "error" in result:
        pytest.skip(f"vLLM 0.32's CPU build cannot run parallel drafting: {result['error']}")
    theirs = check_speculative_run(result, plain)
    # ours differs by design (its LoRA on the mask rows alone): printed beside vLLM's, not compared
    from specdec.adapters.pard import make_parallel

    make_parallel(drafter, load_adapter(tmp_path / "parallel").adapter)
    ours = our_acceptance(smollm2, drafter, prompts)
    print(f"parallel drafter: acceptance vLLM {theirs:.3f} ({result['accepted']}/{result['drafted']}), ours {ours:.3f}")
