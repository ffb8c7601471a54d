"""A bigram drafter from token counts alone (Leviathan et al. 2023, §3.6: even trivial
approximation models help, since their cost c is close to 0).

The counts come from a corpus, never from the text being generated: a table of next-token
counts after each token, with the corpus's unigram counts where a token was never seen before
another. A proposal walks the table γ tokens deep: greedy takes the most frequent next token,
sampling draws it from the normalised counts q, and q goes to verification with the draft, so
rejection sampling keeps the output exact.

The default corpus is Python's standard library (the same as the drafter vocabulary's, in
models/vocab.py): code, carried by every Python install, and disjoint from the benchmark prompts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from ..errors import SpecdecError
from ..core.samplers import Sampler, draw
from .base import Capabilities, Draft, Drafter, KeepGoing


class BigramTable:
    """Unigram and bigram counts of a token sequence over a vocabulary of `vocab_size` ids.

    The bigram counts are held sorted by previous token (`starts` [V + 1] offsets into `nexts`
    and `counts`), so a row is a slice and a batch of rows one gather.
    """

    def __init__(self, tokens: Sequence[int] | torch.Tensor, vocab_size: int, boundaries: Sequence[int] = ()):
        ids = torch.as_tensor(list(tokens) if not isinstance(tokens, torch.Tensor) else tokens, dtype=torch.long)
        if ids.numel() < 2:
            raise SpecdecError("a bigram table needs a corpus of at least 2 tokens")
        if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise SpecdecError(f"corpus token ids must lie in 0..{vocab_size - 1}")
        self.vocab_size = vocab_size
        self.unigram = torch.bincount(ids, minlength=vocab_size).float()
        keep = torch.ones(ids.numel() - 1, dtype=torch.bool)
        for b in boundaries:  # no pair across the end of one document and the start of the next
            if 0 < b < ids.numel():
                keep[b - 1] = False
        pairs = (ids[:-1] * vocab_size + ids[1:])[keep]
        keys, counts = torch.unique(pairs, return_counts=True)  # sorted: grouped by previous token
        self.nexts, self.counts = keys % vocab_size, counts.float()
        self.starts = torch.zeros(vocab_size + 1, dtype=torch.long)
        self.starts[1:] = torch.bincount(keys // vocab_size, minlength=vocab_size).cumsum(0)
        self.tokens = int(ids.numel())

    def row(self, previous: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(next ids, their counts) after `previous`; the unigram counts where it was never followed."""
        start, end = int(self.starts[previous]), int(self.starts[previous + 1])
        if start == end:
            seen = self.unigram.nonzero().view(-1)
            return seen, self.unigram[seen]
        return self.nexts[start:end], self.counts[start:end]

    def bigram_probs(self, previous: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """previous [n] ids -> q [n, V] fp32: the normalised bigram counts after each (unigram
        where a token was never followed)."""
        previous = torch.as_tensor(previous, dtype=torch.long).view(-1)
        q = torch.zeros(previous.numel(), self.vocab_size)
        for i, token in enumerate(previous.tolist()):
            ids, counts = self.row(token)
            q[i, ids] = counts / counts.sum()
        return q

    def unigram_probs(self) -> torch.Tensor:
        """q [V] fp32: the normalised unigram counts."""
        return self.unigram / self.unigram.sum()


def corpus_documents(corpus: str | Path | None) -> tuple[list[str], str]:
    """(texts, identity) of a bigram corpus: None for Python's standard library, a JSONL file
    (each row's 'text', 'prompt' or first of 'turns') or a plain text file."""
    from ..models.vocab import corpus_texts, jsonl_rows

    if corpus is None or not str(corpus).endswith(".jsonl"):
        return corpus_texts(corpus)
    path = Path(corpus).expanduser()
    if not path.is_file():
        raise SpecdecError(f"bigram corpus not found: {path}")
    texts = []
    for number, row in jsonl_rows(path.read_text(errors="ignore"), path):
        row = row if isinstance(row, dict) else {}
        text = row.get("text") or row.get("prompt") or (row.get("turns") or [None])[0]
        if not isinstance(text, str):
            raise SpecdecError(f"{path}:{number}: a corpus row needs 'text', 'prompt' or 'turns'")
        texts.append(text)
    if not texts:
        raise SpecdecError(f"bigram corpus {path} is empty")
    import hashlib

    return texts, "jsonl-" + hashlib.sha256(path.read_bytes()).hexdigest()[:16]


_TABLES: dict[tuple, BigramTable] = {}  # tables by (tokenizer, vocabulary, corpus), built once a process


def corpus_table(tokenizer, vocab_size: int, corpus: str | Path | None = None) -> BigramTable:
    """The bigram table of `corpus` (`corpus_documents`) under `tokenizer`, built once a process."""
    from ..models.vocab import tokenizer_key

    if tokenizer is None:
        raise SpecdecError("the bigram drafter counts its corpus with the target's tokenizer, and this target has "
                           "none; pass corpus token ids (BigramDrafter(corpus_tokens=...))")
    texts, identity = corpus_documents(corpus)
    key = (tokenizer_key(tokenizer), vocab_size, identity)
    if key not in _TABLES:
        rows = tokenizer(texts, add_special_tokens=False)["input_ids"]
        ids, boundaries = [], []
        for row in rows:
            boundaries.append(len(ids))
            ids += [i for i in row if 0 <= i < vocab_size]
        _TABLES[key] = BigramTable(ids, vocab_size, boundaries)
    return _TABLES[key]


class BigramDrafter(Drafter):
    """Drafts by walking a bigram table γ tokens deep (see the module docstring).

    corpus_tokens: token ids to count (e.g. a tokenized corpus); else `corpus` (a text or JSONL
    file; None: the standard library) is counted with the target's tokenizer at `check_target`.
    table: a `BigramTable` already built (shared by many drafters).
    """

    capabilities = Capabilities()

    def __init__(self, corpus_tokens: Sequence[int] | None = None, corpus: str | Path | None = None,
                 table: BigramTable | None = None):
        self.name = "bigram"
        self.passes = 0
        self.table = table
        self._corpus_tokens, self._corpus = corpus_tokens, corpus

    def check_target(self, target) -> None:
        if self.table is not None and self.table.vocab_size != target.vocab_size:
            raise SpecdecError(f"the bigram table covers {self.table.vocab_size} ids, the target "
                               f"{target.vocab_size}")
        if self.table is None:
            if self._corpus_tokens is not None:
                self.table = BigramTable(self._corpus_tokens, target.vocab_size)
            else:
                self.table = corpus_table(target.tokenizer, target.vocab_size, self._corpus)

    def start(self, prompt: Sequence[int]) -> None:
        pass

    def propose(self, context: Sequence[int], max_tokens: int, sampler: Sampler, generator: torch.Generator,
                keep_going: KeepGoing) -> Draft:
        if self.table is None:
            raise SpecdecError("BigramDrafter.check_target(target) must run before propose (it builds the table)")
        if not context:
            return Draft([], None)
        tokens, probs = [], []
        previous = int(context[-1])
        while len(tokens) < max_tokens:
            ids, counts = self.table.row(previous)
            q = torch.zeros(self.table.vocab_size, device=generator.device)
            q[ids.to(generator.device)] = (counts / counts.sum()).to(generator.device)
            if sampler.is_greedy:
                token = int(ids[int(counts.argmax())])  # the most frequent; ties to the smallest id
            else:
                token = draw(q, generator, len(context) + len(tokens))
                probs.append(q)
            tokens.append(token)
            previous = token
            if not keep_going(len(tokens), q.log()):
                break
        return Draft(tokens, torch.stack(probs) if probs else None)

    def rollback(self, length: int) -> None:
        pass  # the table never changes during a generation
