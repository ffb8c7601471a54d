"""Terminal rendering: the streamed pieces spell exactly the decoded output, in time linear in its length."""

import io
import random

import pytest
from rich.console import Console

from specdec.models import catalogue as registry
from specdec.ui.display import StepPrinter
from specdec.decoding.results import Step

TEXT = "Café naïve façade — über Straße 😀🎉 日本語 👩‍👩‍👧 ok. ñ"


class _ByteTokenizer:
    """Token ids are UTF-8 bytes and decoding replaces incomplete characters by U+FFFD, as a
    byte-level BPE decoder does; `decoded` counts every id it is asked to decode."""

    name = "bytes"

    def __init__(self):
        self.decoded = 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return bytes(ids).decode("utf-8", errors="replace")


class _RealTokenizer:
    """The real smollm2 tokenizer behind the one method StepPrinter uses."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, ids, skip_special_tokens=True):
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _steps(ids, seed, rejections):
    """Split `ids` into steps of 1-5 emitted tokens (accepted drafts, then the target's token);
    with `rejections`, some steps also carry a rejected draft token."""
    rng, steps, i = random.Random(seed), [], 0
    while i < len(ids):
        emitted = ids[i:i + rng.randint(1, 5)]
        accepted = emitted[:-1]
        drafts = accepted + ([rng.randrange(256)] if rejections and rng.random() < 0.5 else [])
        steps.append(Step(drafts, len(accepted), emitted[-1], emitted))
        i += len(emitted)
    return steps


def _render(model, steps):
    console = Console(file=io.StringIO(), color_system=None, width=10_000)
    printer = StepPrinter(model, console)
    for step in steps:
        printer(step)
    printer.flush()
    return printer, console.file.getvalue()


@pytest.mark.parametrize("seed", range(4))
def test_pieces_spell_the_decoded_output_with_characters_split_over_tokens(seed):
    ids = list(TEXT.encode())  # every accented letter, emoji and CJK character spans 2-4 tokens
    model = _ByteTokenizer()
    _, shown = _render(model, _steps(ids, seed, rejections=False))
    assert shown == TEXT
    printer, _ = _render(model, _steps(ids, seed, rejections=True))
    assert printer.text == TEXT  # rejected drafts are shown but are not part of the text


def test_an_output_that_ends_inside_a_character_is_flushed_as_decoded():
    ids = list(TEXT.encode())[:-1]  # cut inside the final "ñ"
    _, shown = _render(_ByteTokenizer(), _steps(ids, 0, rejections=False))
    assert shown == bytes(ids).decode("utf-8", errors="replace")


def test_rendering_decodes_a_bounded_tail_per_token():
    ids = list(TEXT.encode()) * 40  # about 2,800 tokens
    model = _ByteTokenizer()
    _, shown = _render(model, _steps(ids, 0, rejections=True))
    assert shown.replace("\ufffd", "")  # something was shown
    # decoding the whole history per token would decode ~n²/2 = 4 million ids
    assert model.decoded < 40 * len(ids)


def test_pieces_spell_the_decoded_output_on_the_real_smollm2_tokenizer():
    if not registry.is_installed("smollm2-135m"):
        pytest.skip("smollm2-135m is not installed (run `make models`)")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(registry.converted_dir("smollm2-135m"))
    text = TEXT + "\ndef naïve_sum(xs):  # ∑ über alle 🐍\n        return sum(xs)  ✓ "
    ids = tokenizer.encode(text, add_special_tokens=False)
    model = _RealTokenizer(tokenizer)
    split = [tokenizer.decode([t]) for t in ids]
    assert any("\ufffd" in piece for piece in split)  # some characters really are split over tokens
    for seed in range(3):
        _, shown = _render(model, _steps(ids, seed, rejections=False))
        assert shown == tokenizer.decode(ids) == text

