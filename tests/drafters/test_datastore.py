"""The retrieval datastore (drafters/datastore.py): its suffix array against a brute-force scan, what a
damaged or foreign datastore gets, and drafting from it (greedy identity, the sampled law)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from specdec import Sampler, SpecdecError, autoregressive_generate, speculative_generate
from specdec.drafters.datastore import MIN_MATCH, Datastore, build, sort_suffixes, tokenizer_key
from specdec.drafters import SuffixDrafter

from conftest import TableModel, tiny_model
from test_sampling_exactness import ALPHA, chi_square_pvalue, exact_joint


def test_suffixes_are_sorted_by_their_first_tokens_as_a_plain_sort_would():
    rng = np.random.default_rng(0)
    tokens = rng.integers(-1, 3, size=300).astype(np.int32)
    for depth in (1, 3, 8):
        order = sort_suffixes(tokens, depth).tolist()
        keys = [tuple(tokens[p:p + depth].tolist()) for p in order]  # past the end sorts first, as a shorter tuple
        assert sorted(order) == list(range(len(tokens))) and keys == sorted(keys)
    order = sort_suffixes(tokens, 8).tolist()  # a power of two: sorted by exactly 8 tokens, ties by position
    assert order == sorted(range(len(tokens)), key=lambda p: tuple(tokens[p:p + 8].tolist()))


def brute_longest(documents: list[list[int]], context: list[int], depth: int) -> tuple[int, set[int]]:
    """The longest suffix of context (MIN_MATCH..depth tokens) found inside a document, and
    where its continuations start (as positions in the concatenated tokens with separators)."""
    for length in range(min(depth, len(context)), MIN_MATCH - 1, -1):
        key, starts, offset = context[len(context) - length:], set(), 0
        for doc in documents:
            for i in range(len(doc) - length + 1):
                if doc[i:i + length] == key:
                    starts.add(offset + i + length)
            offset += len(doc) + 1
        if starts:
            return length, starts
    return 0, set()


@pytest.fixture
def random_store(tmp_path):
    rng = random.Random(3)
    documents = [[rng.randrange(4) for _ in range(rng.randrange(5, 60))] for _ in range(6)]
    build(documents, tmp_path / "ds", "tok", 4, "random", depth=6)
    return Datastore(tmp_path / "ds", window=10_000), documents


def test_a_search_finds_every_occurrence_a_scan_finds(random_store):
    store, documents = random_store
    rng = random.Random(5)
    contexts = [documents[0][:20], documents[3]] + [[rng.randrange(4) for _ in range(rng.randrange(1, 12))]
                                                    for _ in range(40)]
    for context in contexts:
        length, starts = brute_longest(documents, context, 6)
        found = store.occurrences(context)
        assert {matched for _, matched in found} <= {length}
        # a continuation at the very end of the corpus has nothing to draft: left out
        assert {q for q, _ in found} == {q for q in starts if q < len(store.tokens)}, context


class Vocabulary:
    """A stand-in tokenizer: what `tokenizer_key` reads."""

    def __init__(self, words: list[str]):
        self.words = words

    def get_vocab(self) -> dict:
        return {word: i for i, word in enumerate(self.words)}


def test_a_window_over_a_frequent_key_keeps_the_continuations_shares(tmp_path):
    """Key (1, 2) is followed by 0 ten times and by 3 thirty times; the suffix array lists the 0s
    first, so a window of 4 read from the range's start would draft 0."""
    build([[1, 2, 0]] * 10 + [[1, 2, 3]] * 30, tmp_path / "ds", "test", 4, "test")
    store = Datastore(tmp_path / "ds", window=4)
    assert sorted(store.tokens[q] for q, _ in store.occurrences([1, 2])) == [0, 3, 3, 3]
    store.check_tokenizer = lambda tokenizer, vocab_size: None
    assert SuffixDrafter(datastore=store).candidates([1, 2], 1)[0] == [3]


def test_damaged_and_foreign_datastores_are_refused_with_a_clear_error(tmp_path):
    ours, theirs = Vocabulary(["a", "b", "c", "d"]), Vocabulary(["a", "b", "c", "e"])
    build([[0, 1, 2, 3, 1, 2]], tmp_path / "ds", tokenizer_key(ours), 4, "test")
    store = Datastore(tmp_path / "ds")
    store.check_tokenizer(ours, 4)
    with pytest.raises(SpecdecError, match="another tokenizer"):
        store.check_tokenizer(theirs, 4)
    with pytest.raises(SpecdecError, match="another tokenizer"):
        store.check_tokenizer(ours, 3)  # a smaller vocabulary than the one it was built for
    with pytest.raises(SpecdecError, match="no tokenizer"):
        store.check_tokenizer(None, 4)
    with pytest.raises(SpecdecError, match="no meta.json"):
        Datastore(tmp_path / "nowhere")
    folder = store.directory
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps({**meta, "format": 99}))
    with pytest.raises(SpecdecError, match="format 99"):
        Datastore(folder)
    (folder / "meta.json").write_text(json.dumps({**meta, "tokens": meta["tokens"] + 1}))
    with pytest.raises(SpecdecError, match="do not match meta.json"):
        Datastore(folder)
    (folder / "meta.json").write_text(json.dumps(meta))
    (folder / "suffixes.npy").write_bytes(b"not an array")
    with pytest.raises(SpecdecError, match="missing or damaged"):
        Datastore(folder)
    (folder / "meta.json").write_text("{")
    with pytest.raises(SpecdecError, match="unreadable"):
        Datastore(folder)
    with pytest.raises(SpecdecError, match="outside the vocabulary"):
        build([[1, 2, 9]], tmp_path / "bad", "tok", 4, "bad")


def test_drafts_from_a_datastore_keep_greedy_output_identical(tmp_path):
    target = tiny_model(0, vocab=32, layers=2, name="tiny-target")
    prompt = [3, 7, 9, 3, 7, 11]
    ar = autoregressive_generate(prompt, target, max_new_tokens=30, eos_token_ids=[])
    store = _unchecked(tmp_path, [prompt + ar.tokens, [5, 6, 7, 8] * 10], 32)  # the answer, and noise
    drafter = SuffixDrafter(datastore=store)
    assert drafter.name == "retrieval"
    sd = speculative_generate(prompt, target, drafter, max_new_tokens=30, eos_token_ids=[])
    assert sd.tokens == ar.tokens and sd.stats.accepted >= 20  # the corpus held the answer


@pytest.mark.slow
def test_drafts_from_a_datastore_keep_the_sampled_law(tmp_path):
    """Joint law of 3 tokens (chi-square at 1e-4) with a datastore of sequences the target often
    but not always produces, so drafts are accepted and rejected alike."""
    target, sampler, prompt = TableModel(vocab=5, seed=0), Sampler(1.0), [2, 3, 4, 2]
    joint = exact_joint(target, prompt, 3, sampler)
    store = _unchecked(tmp_path, [[2, 3, 4, 2, 3, 4, 2, 1, 0], [4, 2, 0, 1, 2, 3]], 5)
    samples, drafted = [], 0
    for seed in range(4_000):
        out = speculative_generate(prompt, target, SuffixDrafter(datastore=store, factor=4.0), sampler=sampler,
                                   max_new_tokens=3, seed=seed, seed_rule="stream", first_target=False)
        samples.append(tuple(out.tokens))
        drafted += out.stats.drafted
    assert drafted >= 2_000
    assert chi_square_pvalue(samples, joint) > ALPHA


def _unchecked(tmp_path, documents, vocab: int) -> Datastore:
    """A datastore for a test model, which has no tokenizer to check it against."""
    build(documents, tmp_path / "store", "test", vocab, "test")
    store = Datastore(tmp_path / "store")
    store.check_tokenizer = lambda tokenizer, vocab_size: None
    return store


@pytest.mark.real
def test_the_cli_builds_a_datastore_and_generate_drafts_from_it(tmp_path):
    """`specdec datastore build` on a text file, then `generate --drafter retrieval:DIR`: greedy
    output identical to AR, drafts taken from the corpus."""
    from typer.testing import CliRunner

    from specdec.models import catalogue as registry
    from specdec.cli import app

    if not registry.is_installed("smollm2-135m"):
        pytest.skip("smollm2-135m is not installed (run `make models`)")
    corpus = tmp_path / "corpus.py"
    corpus.write_text("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n" * 3)
    runner = CliRunner()
    built = runner.invoke(app, ["datastore", "build", "--corpus", str(corpus), "--out", str(tmp_path / "ds"),
                                "--target", "smollm2-135m"])
    assert built.exit_code == 0, built.output
    assert json.loads((tmp_path / "ds" / "meta.json").read_text())["documents"] == 1
    common = ["generate", "def add(a, b):\n", "--target", "smollm2-135m", "--max-new-tokens", "24", "--json"]
    outputs = []
    for drafter in (["--method", "ar"], ["--drafter", f"retrieval:{tmp_path / 'ds'}"]):
        result = runner.invoke(app, common + drafter)
        assert result.exit_code == 0, result.output
        outputs.append(json.loads(result.stdout.strip().splitlines()[-1]))
    assert outputs[1]["tokens"] == outputs[0]["tokens"] and outputs[1]["stats"]["drafted"] > 0
    again = runner.invoke(app, ["datastore", "build", "--corpus", str(corpus), "--out", str(tmp_path / "ds")])
    assert again.exit_code == 1 and "not an empty folder" in again.output


@pytest.mark.parametrize("args, message", [
    (["datastore", "build", "--corpus", "no-such-file.txt", "--out", "x"], "corpus not found"),
    (["generate", "x", "--drafter", "retrieval"], "needs a datastore"),
    (["generate", "x", "--drafter", "retrieval:no-such-folder"], "no meta.json"),
    (["profile", "x", "--drafter", "retrieval"], "needs a datastore"),
    (["serve", "--drafter", "retrieval:somewhere"], "no meta.json"),
])
def test_datastore_options_are_checked_before_loading(args, message):
    from typer.testing import CliRunner

    from specdec.cli import app

    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output
