"""A retrieval datastore (REST, He et al. 2023): a token corpus and its suffix array, built once and
memory-mapped at load, searched for the context's longest suffix.

Files in the datastore's folder: `tokens.npy` (int32: the corpus's documents tokenized, each
followed by `SEPARATOR`), `suffixes.npy` (int64: every position, sorted by the `depth` tokens
from it), `meta.json` (format, the tokenizer's fingerprint, vocabulary size, depth, corpus,
counts). A search for a key of up to `depth` tokens is a binary search of the suffix array, so
it costs O(key · log n) and reads a few pages of the files, whatever the corpus size.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from .suffix import SEPARATOR
from ..errors import SpecdecError
from ..models.vocab import tokenizer_key

FORMAT = 1
DEPTH = 16  # the longest key a search matches (REST: 16 tokens down to 2)
MIN_MATCH = 2
CORPORA = ("python-stdlib",)  # built-in corpora; otherwise a text file


def sort_suffixes(tokens: np.ndarray, depth: int) -> np.ndarray:
    """Positions of `tokens` [n] sorted by the (up to) `depth` tokens from each, shorter first
    where one is a prefix of another (past the end counts below every token); ties by position.
    Prefix doubling: each round sorts by twice as many tokens, from the ranks of the last."""
    n = len(tokens)
    rank = tokens.astype(np.int64) + 2  # separators (-1) -> 1, ids -> 2.., past the end -> 0
    order = np.argsort(rank, kind="stable")
    width = 1
    while width < depth and n > 1:
        following = np.zeros(n, dtype=np.int64)
        if width < n:
            following[:n - width] = rank[width:]
        order = np.lexsort((following, rank))  # stable: ties stay in position order
        first, second = rank[order], following[order]
        changed = np.empty(n, dtype=bool)
        changed[0] = True
        changed[1:] = (first[1:] != first[:-1]) | (second[1:] != second[:-1])
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.cumsum(changed)
        width *= 2
    return order.astype(np.int64)


def corpus_documents(corpus: str) -> tuple[list[str], str]:
    """(documents, description) of `python-stdlib` (its .py files, whole) or a text file (one document)."""
    if corpus == "python-stdlib":
        from ..models.vocab import stdlib_files

        files = stdlib_files()
        if not files:
            raise SpecdecError("no standard-library sources found; name a corpus file")
        texts = [f.read_bytes().decode("utf-8", errors="ignore") for f in files]
        return texts, f"python-stdlib {sys.version_info.major}.{sys.version_info.minor} ({len(files)} files)"
    path = Path(corpus).expanduser()
    if not path.is_file():
        raise SpecdecError(f"corpus not found: {path} (a text file, or one of: {', '.join(CORPORA)})")
    text = path.read_bytes().decode("utf-8", errors="ignore")
    if not text.strip():
        raise SpecdecError(f"corpus {path} is empty")
    return [text], f"file {path.name}"


def build(documents: Iterable[Sequence[int]], out: str | Path, tokenizer_id: str, vocab_size: int,
          corpus: str, depth: int = DEPTH) -> dict:
    """Write a datastore of these token documents to folder `out` -> its meta."""
    pieces = []
    for document in documents:
        ids = np.asarray(document, dtype=np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
            raise SpecdecError(f"a document holds token ids outside the vocabulary of {vocab_size}")
        pieces += [ids, np.array([SEPARATOR], dtype=np.int64)]
    if not pieces:
        raise SpecdecError("the corpus holds no tokens")
    tokens = np.concatenate(pieces).astype(np.int32)
    suffixes = sort_suffixes(tokens, depth)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "tokens.npy", tokens)
    np.save(out / "suffixes.npy", suffixes)
    meta = {"format": FORMAT, "tokenizer": tokenizer_id, "vocab_size": int(vocab_size), "depth": int(depth),
            "corpus": corpus, "tokens": int(len(tokens)), "documents": len(pieces) // 2}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


def build_from_corpus(corpus: str, tokenizer, vocab_size: int, out: str | Path,
                      on_document: Callable[[int, int], None] = lambda done, total: None) -> dict:
    """Tokenize `corpus` (`corpus_documents`) with `tokenizer` and write its datastore to `out`."""
    texts, description = corpus_documents(corpus)

    def documents():
        for i, text in enumerate(texts):
            yield tokenizer(text, add_special_tokens=False)["input_ids"]
            on_document(i + 1, len(texts))

    return build(documents(), out, tokenizer_key(tokenizer), vocab_size, description)


class Datastore:
    """A built datastore, memory-mapped. `occurrences` reads like `SuffixIndex.occurrences`, so
    `SuffixDrafter` drafts from it as from its other indexes (REST as a chain drafter)."""

    def __init__(self, directory: str | Path, window: int = 64):
        directory = Path(directory).expanduser()
        where = f"datastore {directory}"
        try:
            meta = json.loads((directory / "meta.json").read_text())
        except FileNotFoundError:
            raise SpecdecError(f"{where}: no meta.json (build one with `specdec datastore build`)") from None
        except (OSError, ValueError) as exc:
            raise SpecdecError(f"{where}: meta.json is unreadable ({exc})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise SpecdecError(f"{where}: format {meta.get('format') if isinstance(meta, dict) else '?'} is not "
                               f"{FORMAT}; build it again")
        try:
            self.tokens = np.load(directory / "tokens.npy", mmap_mode="r")
            self.suffixes = np.load(directory / "suffixes.npy", mmap_mode="r")
        except (OSError, ValueError) as exc:
            raise SpecdecError(f"{where}: its arrays are missing or damaged ({exc}); build it again") from None
        if (self.tokens.ndim != 1 or self.suffixes.ndim != 1 or len(self.tokens) != len(self.suffixes)
                or len(self.tokens) != meta.get("tokens") or self.tokens.dtype != np.int32
                or self.suffixes.dtype != np.int64):
            raise SpecdecError(f"{where}: tokens.npy and suffixes.npy do not match meta.json; build it again")
        self.meta, self.directory, self.window = meta, directory, window
        self.depth = int(meta["depth"])
        self.name = f"datastore {directory.name} ({meta['tokens']:,} tokens, {meta['corpus']})"

    def check_tokenizer(self, tokenizer, vocab_size: int) -> None:
        """Refuse a target whose tokenizer is not the one the datastore was built with."""
        if tokenizer is None:
            raise SpecdecError(f"{self.name}: the target has no tokenizer to check it against")
        if tokenizer_key(tokenizer) != self.meta["tokenizer"] or vocab_size < self.meta["vocab_size"]:
            raise SpecdecError(f"{self.name} was built with another tokenizer than this target's; build one for it "
                               "(`specdec datastore build --target …`)")

    def _key(self, position: int, length: int) -> tuple:
        return tuple(int(t) for t in self.tokens[position:position + length])

    def _bounds(self, key: tuple) -> tuple[int, int]:
        """The range of the suffix array whose suffixes start with `key`."""
        length, suffixes = len(key), self.suffixes
        lo, hi = 0, len(suffixes)
        while lo < hi:  # first suffix >= key
            mid = (lo + hi) // 2
            if self._key(int(suffixes[mid]), length) < key:
                lo = mid + 1
            else:
                hi = mid
        start, hi = lo, len(suffixes)
        while lo < hi:  # first suffix > key
            mid = (lo + hi) // 2
            if self._key(int(suffixes[mid]), length) <= key:
                lo = mid + 1
            else:
                hi = mid
        return start, lo

    def longest_match(self, context: Sequence[int]) -> tuple[int, int, int]:
        """(length, low, high): the longest suffix of `context` (up to `depth` tokens, at least
        MIN_MATCH) that occurs in the corpus, and the suffix-array range of its occurrences;
        (0, 0, 0) if none does. A suffix occurs only if every shorter one does, so the length
        is found by bisection: a few binary searches."""
        found, shortest, longest = (0, 0, 0), MIN_MATCH, min(self.depth, len(context))
        while shortest <= longest:
            length = (shortest + longest) // 2
            low, high = self._bounds(tuple(int(t) for t in context[len(context) - length:]))
            if low < high:
                found, shortest = (length, low, high), length + 1
            else:
                longest = length - 1
        return found

    def occurrences(self, context: Sequence[int]) -> list[tuple[int, int]]:
        """(where the continuation starts, match length) for up to `window` occurrences of the
        context's longest matching suffix: evenly spaced over its range, which is sorted by what
        follows, so the sample keeps the continuations' shares (the range's first `window` would
        hold the lowest token ids)."""
        length, low, high = self.longest_match(context)
        if not length:
            return []
        end = len(self.tokens)
        picked = np.unique(np.linspace(low, high - 1, min(self.window, high - low)).astype(np.int64))
        starts = (int(p) + length for p in self.suffixes[picked])
        return [(q, length) for q in starts if q < end]
