"""A drafter's frequent-token vocabulary (FR-Spec, Zhao et al. 2025).

A 0.5B drafter's 151,936-row output head is a third of its weights, read on every drafting pass.
Scoring only the N most frequent ids cuts that traffic by V/N; q is then exactly 0 on the other
ids, which the target's verification handles like any other q (the output stays exact; only
acceptance can drop, when the target would have accepted a rare token).

Frequencies are counted once per tokenizer and corpus and cached under specdec's home. The default
corpus is what every Python install carries: the standard library's sources (code, docstrings,
comments), the first 8 KB of each module. Ids the corpus never shows are ranked by id, which for
byte-level BPE tokenizers (Qwen, Llama 3, SmolLM2) is the order of their merges, a frequency
order of the tokenizer's own training text. Special tokens (end of turn, end of text) are always
kept, so the drafter can still propose the end.
"""

from __future__ import annotations

import hashlib
import sys
import sysconfig
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from . import catalogue as registry
from ..errors import SpecdecError

FILE_BYTES = 8192  # per standard-library module: many modules rather than a few long ones
BATCH = 64


def stdlib_files() -> list[Path]:
    """The standard library's .py files, tests and site-packages left out, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "site-packages", "idlelib", "lib2to3"}
    return sorted(f for f in root.rglob("*.py") if not skip & set(f.relative_to(root).parts))


def jsonl_rows(text: str, path: Path) -> Iterator[tuple[int, object]]:
    """(line number, parsed value) of each non-blank line of JSONL `text` read from `path`;
    SpecdecError naming the file and line where one is not JSON."""
    import json

    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as exc:
            raise SpecdecError(f"{path}:{number}: not JSON ({exc.msg})") from None


def corpus_texts(corpus: str | Path | None) -> tuple[list[str], str]:
    """(texts, identity) of a corpus: None for the standard library, else a text file's path.

    The identity names the corpus in the cache key: the Python version for the standard library,
    the content's sha256 for a file.
    """
    if corpus is None:
        files = stdlib_files()
        if not files:
            raise SpecdecError("no standard-library sources found to count token frequencies; "
                               "name a corpus file (--drafter-vocab-corpus)")
        texts = [f.read_bytes()[:FILE_BYTES].decode("utf-8", errors="ignore") for f in files]
        return texts, f"stdlib-{sys.version_info.major}.{sys.version_info.minor}-{len(files)}"
    path = Path(corpus).expanduser()
    if not path.is_file():
        raise SpecdecError(f"vocabulary corpus not found: {path}")
    data = path.read_bytes()
    if not data.strip():
        raise SpecdecError(f"vocabulary corpus {path} is empty")
    text = data.decode("utf-8", errors="ignore")
    # pieces of ~8 KB at line ends, so the tokenizer sees batches rather than one huge string
    lines, texts, size = text.splitlines(keepends=True), [], 0
    for line in lines:
        if not texts or size >= FILE_BYTES:
            texts.append("")
            size = 0
        texts[-1] += line
        size += len(line)
    return texts, "file-" + hashlib.sha256(data).hexdigest()[:16]


def count_tokens(tokenizer, texts: Sequence[str], vocab_size: int,
                 on_batch: Callable[[int], None] = lambda done: None) -> torch.Tensor:
    """counts [vocab_size] int64: how often each id occurs in `texts` tokenized without specials."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for start in range(0, len(texts), BATCH):
        batch = tokenizer(list(texts[start:start + BATCH]), add_special_tokens=False)["input_ids"]
        ids = torch.tensor([i for row in batch for i in row if 0 <= i < vocab_size], dtype=torch.long)
        counts += torch.bincount(ids, minlength=vocab_size)
        on_batch(min(start + BATCH, len(texts)))
    return counts


def rank_ids(counts: torch.Tensor) -> torch.Tensor:
    """counts [V] -> ids [V] by falling count, ties (and ids never seen) by rising id."""
    ids = torch.arange(len(counts))
    # a stable sort by count after ids are in rising order keeps ties by id
    return ids[torch.sort(-counts, stable=True).indices]


def tokenizer_key(tokenizer) -> str:
    """A fingerprint of a tokenizer's vocabulary and rules."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def token_counts(tokenizer, vocab_size: int, corpus: str | Path | None = None,
                 say: Callable[[str], None] = lambda msg: None) -> torch.Tensor:
    """counts [vocab_size] of the corpus under `tokenizer`, from specdec's cache when counted before."""
    texts, identity = corpus_texts(corpus)
    path = registry.home() / "vocab" / f"{tokenizer_key(tokenizer)}-{vocab_size}-{identity}.pt"
    if path.is_file():
        try:
            counts = torch.load(path, weights_only=True)
            if isinstance(counts, torch.Tensor) and counts.shape == (vocab_size,):
                return counts
        except (OSError, RuntimeError, EOFError):
            pass  # a damaged cache file is counted again and replaced
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    say(f"counting token frequencies over {identity} (once; cached in {path.parent})")
    with Progress(TextColumn("token frequencies"), BarColumn(), MofNCompleteColumn(), transient=True) as progress:
        task = progress.add_task("count", total=len(texts))
        counts = count_tokens(tokenizer, texts, vocab_size, lambda done: progress.update(task, completed=done))
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".part")
    torch.save(counts, partial)
    partial.replace(path)
    return counts


def frequent_ids(tokenizer, vocab_size: int, n: int, corpus: str | Path | None = None,
                 say: Callable[[str], None] = lambda msg: None) -> torch.Tensor:
    """ids [<= n + specials], sorted: the n most frequent ids of the corpus plus every special token."""
    if not isinstance(n, int) or n < 1:
        raise SpecdecError(f"--drafter-vocab must be a positive number of ids, got {n!r}")
    if tokenizer is None:
        raise SpecdecError("a drafter vocabulary needs the drafter's tokenizer")
    ranked = rank_ids(token_counts(tokenizer, vocab_size, corpus, say))[:n]
    specials = [i for i in getattr(tokenizer, "all_special_ids", []) if 0 <= i < vocab_size]
    specials += [i for i in getattr(tokenizer, "added_tokens_decoder", {}) if 0 <= i < vocab_size]
    return torch.cat([ranked, torch.tensor(specials, dtype=torch.long)]).unique()


def check_vocab_options(n: int | None, corpus: str | Path | None) -> None:
    """SpecdecError for a bad --drafter-vocab / --drafter-vocab-corpus, before any model loads."""
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
        raise SpecdecError(f"the drafter vocabulary must be a number of ids >= 0 (0: all), got {n!r}")
    if corpus is not None and not Path(corpus).expanduser().is_file():
        raise SpecdecError(f"vocabulary corpus not found: {corpus}")


def restrict_drafter_vocabulary(model, n: int | None, corpus: str | Path | None = None,
                                say: Callable[[str], None] = lambda msg: None) -> None:
    """Make `model` (a drafter TransformersModel) score only its n most frequent ids; None or 0: all."""
    if not n or n >= model.vocab_size:
        if corpus is not None and not n:
            raise SpecdecError("--drafter-vocab-corpus needs --drafter-vocab N")
        model.restrict_vocabulary(None)
        return
    model.restrict_vocabulary(frequent_ids(model.tokenizer, model.vocab_size, n, corpus, say))
