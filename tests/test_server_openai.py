"""`specdec serve`'s text as OpenAI's clients read it: text streams in work linear in its tokens
whatever they decode to (a token that is a lone byte, which a client can ask for with
`logit_bias`). Real tokenizers at the end.
"""

from __future__ import annotations

import random

import pytest

from specdec.server.app import _Text

PARTIAL = 3  # the U+FFFD an incomplete character at the end of a text may show: held back


# -- detokenising tokens that never decode cleanly ---------------------------------------------

class _Counted(list):
    """A list that counts the items read from it (by index or by iterating)."""

    reads = 0

    def __getitem__(self, k):
        _Counted.reads += 1
        return super().__getitem__(k)

    def __iter__(self):
        _Counted.reads += len(self)
        return super().__iter__()


def _byte_decode(pieces: list[bytes], counter: list[int]):
    def decode(ids):
        counter[0] += len(ids)
        return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")
    return decode


def _stream(token: int, n: int, pieces: list[bytes]) -> tuple[int, _Text]:
    """n copies of `token` one at a time -> (ids decoded in all, the _Text); checks on the way
    that the text sent keeps up with the tokens and that the tokens counted as sent do too."""
    counter = [0]
    text = _Text(_byte_decode(pieces, counter), stops=[], offsets=True)
    text.ends = _Counted()
    _Counted.reads = 0
    for k in range(1, n + 1):
        text.add([token])
        assert text.sent >= k - PARTIAL  # not held back to the end
        assert text.released() >= k - PARTIAL
    return counter[0], text


def test_lone_byte_tokens_cost_what_plain_ones_do_and_stream_as_they_come():
    """A token that decodes alone to U+FFFD (a byte that starts or continues no character) settles
    like any other: a client's `logit_bias` towards it costs linear work, and its text streams."""
    pieces = [b"a", b"\x80", b"\xe2"]
    n = 1500
    plain, _ = _stream(0, n, pieces)
    assert _Counted.reads < 10 * n  # tokens counted as sent on from the last count, not all again
    for lone in (1, 2):
        work, text = _stream(lone, n, pieces)
        assert work <= 1.5 * plain  # a whole decode per token: ~n² / 2 = 1.1 million ids
        assert _Counted.reads < 10 * n
        assert text.add([], final=True) == "\ufffd" * PARTIAL
        assert text.text == (pieces[lone] * n).decode(errors="replace")
    assert plain < 40 * n


@pytest.mark.parametrize("seed", range(3))
def test_text_with_stray_and_split_bytes_streams_the_whole_decode(seed):
    """Streamed in chunks of random sizes, a mix of whole characters, characters split across
    tokens, stray continuation bytes and cut sequences gives the whole decode's text, and each
    token's end offset never decreases."""
    rng = random.Random(seed)
    pieces = [b"a", b" b", "é".encode(), "€".encode()[:1], "€".encode()[1:2], "€".encode()[2:], b"\x80",
              "🦜".encode()[:2], "🦜".encode()[2:], b"\xff"]
    ids = [rng.randrange(len(pieces)) for _ in range(2000)]
    counter = [0]
    text = _Text(_byte_decode(pieces, counter), stops=[], offsets=True)
    sent, k = [], 0
    while k < len(ids):
        step = rng.randrange(1, 5)
        sent.append(text.add(ids[k:k + step]))
        k += step
    sent.append(text.add([], final=True))
    whole = b"".join(pieces[i] for i in ids).decode(errors="replace")
    assert "".join(sent) == whole and text.text == whole
    assert text.ends == sorted(text.ends) and text.ends[-1] == len(whole)
    assert counter[0] < 40 * len(ids)


# -- real tokenizers ---------------------------------------------------------------------------

def _real_tokenizer(name: str):
    from transformers import AutoTokenizer

    from specdec import registry

    if not registry.is_installed(name):
        pytest.skip(f"{name} is not installed (run `make models`)")
    return AutoTokenizer.from_pretrained(registry.require_installed(name))


@pytest.mark.real
def test_real_qwen_lone_byte_token_costs_what_a_plain_one_does():
    """Qwen2.5's id 94 decodes alone to U+FFFD: n of them cost the decoding of n plain tokens,
    and their text streams as they come."""
    tokenizer = _real_tokenizer("qwen2.5-coder-0.5b")
    assert tokenizer.decode([94]) == "\ufffd"
    costs = []
    for token in (94, tokenizer.convert_tokens_to_ids("a")):
        counter = [0]

        def decode(ids):
            counter[0] += len(ids)
            return tokenizer.decode(ids)

        text = _Text(decode, stops=[])
        for k in range(1, 401):
            text.add([token])
            assert text.sent >= k - PARTIAL
        costs.append(counter[0])
    assert costs[0] <= 1.5 * costs[1]
