"""vLLM's CPU build as a bench peer (bench/vllm_peer.py, bench/vllm_worker.py).

The plumbing is tested against a stand-in worker that speaks the same protocol (every tier); the
tests marked `vllm` run vLLM's CPU build itself from `.peers/vllm` (`make test-vllm`) and skip
where it is not built.
"""

import json
import sys
import textwrap
from pathlib import Path

import pytest

from specdec.bench.vllm_peer import VllmWorker, speculative_config, vllm_python, worker_env
from specdec.errors import SpecdecError

# A worker that answers as vllm_worker.py does: each prompt's "output" is its ids reversed, cut to
# max_tokens; it reports its environment, and fails on load where its settings ask it to.
STAND_IN = textwrap.dedent('''
    import json, os, sys, time
    settings = json.loads(sys.argv[1])
    if settings["model"] == "broken":
        print(json.dumps({"ok": False, "error": "ValueError: no such model"}), flush=True)
        sys.exit(0)
    if settings["model"] == "dies":
        print("Traceback: the worker fell over", file=sys.stderr, flush=True)
        sys.exit(3)
    print("vLLM prints this to stderr", file=sys.stderr, flush=True)
    env = {k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS", "LD_PRELOAD")}
    print(json.dumps({"ok": True, "ready": True, "vllm": "stand-in", "env": env,
                      "speculative_config": settings["speculative_config"]}), flush=True)
    for line in sys.stdin:
        message = json.loads(line)
        if message["op"] == "exit":
            break
        records = [{"tokens": p[::-1][:message["max_tokens"]], "seconds": 0.5, "first_token_seconds": 0.1}
                   for p in message["prompts"]]
        print(json.dumps({"ok": True, "wall_seconds": 1.0, "records": records, "iterations": 7,
                          "drafted": 10 * len(records), "accepted": 4 * len(records),
                          "level": message["level"]}), flush=True)
''')


@pytest.fixture
def stand_in(tmp_path) -> Path:
    path = tmp_path / "worker.py"
    path.write_text(STAND_IN)
    return path


def test_a_worker_is_driven_over_its_pipes(stand_in):
    worker = VllmWorker("vllm-ngram", "model", python=Path(sys.executable), worker=stand_in)
    try:
        assert worker.version == "stand-in"
        answer = worker.run([[1, 2, 3], [4, 5]], level=2, max_tokens=2, stop_token_ids=[0])
        assert [r["tokens"] for r in answer["records"]] == [[3, 2], [5, 4]]
        assert (answer["iterations"], answer["drafted"], answer["accepted"]) == (7, 20, 8)
    finally:
        worker.close()
    assert worker.process.poll() is not None  # it ended when told to


def test_tuned_threads_bind_every_core_and_preload_intel_openmp(tmp_path):
    python = tmp_path / "venv" / "bin" / "python"
    (tmp_path / "venv" / "lib").mkdir(parents=True)
    (tmp_path / "venv" / "lib" / "libiomp5.so").write_text("")
    cores = sorted(__import__("os").sched_getaffinity(0))
    env = worker_env("tuned", python)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, cores))
    assert env["OMP_NUM_THREADS"] == str(len(cores))
    assert env["LD_PRELOAD"].split(":")[0] == str(tmp_path / "venv" / "lib" / "libiomp5.so")
    default = worker_env("default", python)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in default or default["VLLM_CPU_OMP_THREADS_BIND"] == \
        __import__("os").environ.get("VLLM_CPU_OMP_THREADS_BIND")
    with pytest.raises(SpecdecError, match="tuned or default"):
        worker_env("fast", python)


def test_our_openmp_spin_setting_is_not_passed_to_vllm(monkeypatch, tmp_path):
    import specdec

    monkeypatch.setitem(specdec.OWN_ENV, "GOMP_SPINCOUNT", "20000")
    monkeypatch.setenv("GOMP_SPINCOUNT", "20000")
    for threads in ("tuned", "default"):
        assert "GOMP_SPINCOUNT" not in worker_env(threads, tmp_path / "bin" / "python")


def test_the_methods_map_to_vllms_speculative_configs():
    assert speculative_config("vllm", None) is None
    assert speculative_config("vllm-draft", "/d") == {"method": "draft_model", "model": "/d",
                                                      "num_speculative_tokens": 4}
    assert speculative_config("vllm-ngram", None) == {"method": "ngram", "num_speculative_tokens": 4}
    with pytest.raises(SpecdecError, match="drafter"):
        speculative_config("vllm-draft", None)
    with pytest.raises(SpecdecError, match="not a vLLM method"):
        speculative_config("vllm-eagle", None)


def test_our_proposers_are_custom_class_configs_and_their_worker_imports_this_package(stand_in):
    import specdec
    from specdec.bench.vllm_peer import PROPOSERS, specdec_path

    assert speculative_config("vllm-specdec-suffix", None) == {
        "method": "custom_class", "model": "specdec.vllm.SuffixProposer", "num_speculative_tokens": 8}
    for method, name in PROPOSERS.items():
        assert speculative_config(method, None)["model"] == f"specdec.vllm.{name}"
        assert hasattr(__import__("specdec.vllm", fromlist=[name]), name)
    folder = specdec_path()  # what goes on the worker's PYTHONPATH: this package and nothing else
    assert [p.name for p in folder.iterdir()] == ["specdec"]
    assert (folder / "specdec").resolve() == Path(specdec.__file__).parent.resolve()
    with pytest.raises(SpecdecError, match="needs a datastore"):
        VllmWorker("vllm-specdec-retrieval", "model", python=Path(sys.executable), worker=stand_in)


def test_a_worker_that_fails_says_so_in_one_error(stand_in, tmp_path):
    with pytest.raises(SpecdecError, match=r"vllm: ValueError: no such model"):
        VllmWorker("vllm", "broken", python=Path(sys.executable), worker=stand_in)
    with pytest.raises(SpecdecError, match=r"vllm-draft: vLLM's worker ended: Traceback: the worker fell over"):
        VllmWorker("vllm-draft", "dies", drafter_dir="d", python=Path(sys.executable), worker=stand_in)
    with pytest.raises(SpecdecError, match="make vllm"):
        VllmWorker("vllm", "model", python=tmp_path / "no-venv" / "bin" / "python")


def test_the_concurrency_bench_reads_a_vllm_run(stand_in):
    """A vLLM run at a level becomes records and figures like ours: its drafts and passes are the
    engine's totals (vLLM does not count them per request), its acceptance their ratio."""
    from specdec import Sampler
    from specdec.bench.concurrency import run_vllm, summarize_level
    from specdec.bench.runners import Settings

    from specdec.bench.vllm_peer import VllmPeers

    class Target:
        eos_token_ids = [0]

    peers = VllmPeers("model", None, python=Path(sys.executable), worker=stand_in)
    try:
        settings = Settings(max_new_tokens=3)
        settings.vllm = peers
        run = run_vllm("vllm-ngram", 2, [[1, 2, 3, 4], [5, 6]], Target(), settings, Sampler(), [None, None])
    finally:
        peers.close()
    assert [r.tokens for r in run.records] == [[4, 3, 2], [6, 5]]
    assert run.target_passes == 7 and run.wall_seconds == 1.0
    summary = summarize_level(run, {0: [4, 3, 2], 1: [6, 6]})
    assert summary["acceptance_rate"] == pytest.approx(8 / 20)
    assert summary["identical"] == 1 and summary["output_tokens"] == 5
    assert summary["ttft_p50"] == pytest.approx(0.1)


def test_one_vllm_worker_is_alive_at_a_time_and_theirs_run_back_to_back(stand_in):
    """Each worker holds ~8 GB for the 1.5B target: a method's is ended before another's starts, and
    a level's order runs vLLM's methods back to back, the loaded one first (one swap a level)."""
    import specdec.bench.vllm_peer as vllm_peer
    from specdec.bench.vllm_peer import VllmPeers

    peers = VllmPeers("model", "drafter", python=Path(sys.executable), worker=stand_in)
    try:
        assert peers.grouped(["vllm", "ar", "vllm-draft", "sd-cost"]) == ["vllm", "vllm-draft", "ar", "sd-cost"]
        plain = peers.worker("vllm")
        assert peers.loaded == "vllm" and peers.worker("vllm") is plain
        assert peers.grouped(["ar", "vllm-draft", "sd-cost", "vllm"]) == ["ar", "vllm", "vllm-draft", "sd-cost"]
        peers.worker("vllm-draft")
        assert plain.process.poll() is not None and peers.loaded == "vllm-draft"
        assert set(peers.describe()) == {"vllm", "vllm-draft"}
        # a report names preloaded libraries by file name, never by a local path
        assert vllm_peer._reported({"LD_PRELOAD": "/a/lib/libiomp5.so:/b/libtcmalloc.so", "OMP_NUM_THREADS": "2"}) == \
            {"LD_PRELOAD": "libiomp5.so:libtcmalloc.so", "OMP_NUM_THREADS": "2"}
        assert peers.grouped(["ar", "sd-cost"]) == ["ar", "sd-cost"]
    finally:
        peers.close()


def test_vllm_methods_are_offered_by_both_benches():
    from specdec.bench.concurrency import LOAD_METHODS
    from specdec.bench.runners import BENCH_METHODS as METHODS, is_peer

    for method in ("vllm", "vllm-draft", "vllm-ngram"):
        assert method in METHODS and method in LOAD_METHODS and is_peer(method)


needs_vllm = pytest.mark.skipif(not vllm_python().exists(), reason="vLLM's CPU build is not built (`make vllm`)")


@pytest.mark.vllm
@needs_vllm
def test_vllm_runs_beside_ours_at_every_level(smollm2, tmp_path):
    """vLLM's CPU build, plain and with its n-gram drafts, beside our AR on SmolLM2-135M at 1 and 2
    in flight: every request answered with tokens, the figures filled in, our outputs identical."""
    from specdec.bench.concurrency import run_load_benchmark
    from specdec.bench.runners import Settings

    result = run_load_benchmark(["humaneval"], 2, ["ar", "vllm", "vllm-ngram"], [1, 2], "smollm2-135m",
                                "smollm2-135m", Settings(max_new_tokens=12), json_path=str(tmp_path / "r.json"))
    rows = {(s["method"], s["concurrency"]): s for s in result["levels"]}
    assert set(rows) == {(m, c) for m in ("ar", "vllm", "vllm-ngram") for c in (1, 2)}
    for (method, level), row in rows.items():
        assert row["requests"] == 2 and row["output_tokens"] > 0 and row["ttft_p50"] is not None, (method, level)
        if method == "ar":
            assert row["identical"] == 2
    assert rows["vllm", 1]["target_passes"] >= 12  # one iteration a token, alone
    assert result["info"]["vllm"]["vllm"]["threads"] == "tuned"
    assert json.loads((tmp_path / "r.json").read_text())["levels"]
