"""Token ids and text: prompts to ids (chat templates, BOS), ids to text, the EOS ids a model
names, and whether two models share one vocabulary (`check_pair`). Every backend uses these.
"""

from __future__ import annotations

import weakref
from typing import Sequence

from ..errors import SpecdecError


def encode_text(tokenizer, name: str, text: str, chat: bool = False) -> list[int]:
    """Text -> prompt token ids; with chat=True, wrapped in the model's chat template.

    Plain text starts with BOS where the tokenizer's own default encoding adds one (Llama,
    Gemma; not Qwen or SmolLM2), once even if the text already starts with it; never EOS.
    """
    if tokenizer is None:
        raise SpecdecError(f"{name} has no tokenizer; pass token ids instead of text")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise SpecdecError(f"{name} has no chat template; drop --chat")
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    ids = tokenizer.encode(text, add_special_tokens=False)
    bos = tokenizer.bos_token_id
    if bos is not None and ids[:1] != [bos]:
        default = tokenizer.encode(text)  # the tokenizer's own choice of special tokens
        if default[:1] == [bos] and default[1:len(ids) + 1] == ids:
            ids = [bos] + ids
    return ids


def decode_ids(tokenizer, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    if tokenizer is None:
        return " ".join(map(str, ids))
    return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's bytes_to_unicode table, inverted: byte-level BPE spells byte b as the character
    chr(b) where that is printable, else as chr(256 + k) for the k-th byte that is not."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {chr(b): b for b in printable}, 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)], extra = b, extra + 1
    return table


UNICODE_TO_BYTE = _unicode_to_byte()


def token_bytes_reader(tokenizer):
    """A function: token id -> that token's own bytes (OpenAI's `logprobs[].bytes`), such that a
    text's tokens' bytes, joined, are the text's UTF-8, also where a character's bytes span tokens
    (decoded alone, such a token is U+FFFD). It replays the tokenizer's decoder on the token's
    string as Hugging Face's tokenizers do, step by step: byte-level BPE (Qwen2.5, SmolLM2, Llama 3)
    maps the string back through GPT-2's byte table; SentencePiece-style (Gemma) replaces '▁' by a
    space and reads <0xHH> tokens as that byte. A decoder it does not know (or a tokenizer without
    one) falls back to the token decoded alone. Steps that act on the joined text (after `Fuse`,
    such as Llama 2's strip of the first space) are left out: they are not one token's."""
    import json
    import re

    if tokenizer is None:
        return lambda token: decode_ids(None, [token]).encode()
    fallback = lambda token: tokenizer.decode([token], skip_special_tokens=False).encode()  # noqa: E731
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    try:
        state = json.loads(decoder.__getstate__()) if decoder is not None else None
    except (TypeError, ValueError, AttributeError):
        state = None
    if state is None:
        steps = [{"type": "ByteLevel"}] if getattr(tokenizer, "byte_decoder", None) else None  # a slow GPT-2
    else:
        steps = state.get("decoders", []) if state.get("type") == "Sequence" else [state]
    known = {"Replace", "ByteFallback", "ByteLevel", "Metaspace", "Fuse", "Strip"}
    if not steps or any(step.get("type") not in known for step in steps):
        return fallback
    byte_token = re.compile(r"<0x([0-9A-Fa-f]{2})>")

    def read(token: int) -> bytes:
        piece = tokenizer.convert_ids_to_tokens(token)
        if not isinstance(piece, str):
            return fallback(token)
        for step in steps:
            kind = step["type"]
            if kind == "Fuse" or kind == "Strip":
                break  # from here on the decoder acts on the joined text
            if kind == "Replace":
                pattern = step.get("pattern", {})
                if "String" not in pattern:
                    return fallback(token)
                piece = piece.replace(pattern["String"], step.get("content", ""))
            elif kind == "Metaspace":
                piece = piece.replace(step.get("replacement", "▁"), " ")
            elif kind == "ByteFallback":
                match = byte_token.fullmatch(piece)
                if match:
                    return bytes([int(match.group(1), 16)])
            else:  # ByteLevel: a string with a character outside the table (an added token) is itself
                if all(c in UNICODE_TO_BYTE for c in piece):
                    return bytes(UNICODE_TO_BYTE[c] for c in piece)
        return piece.encode()

    return read


# Special tokens that end a text or a turn, wherever a vocabulary holds them as special tokens. A
# config may name one EOS while the model ends its texts with another: the embedded
# Qwen2.5-Coder-Instruct configs (converted from their GGUF) name <|im_end|>, and a plain
# completion ends in <|endoftext|>, after which the model runs on into fill-in-the-middle text
# (the original release lists both; llama.cpp stops at every end-of-generation token).
END_TOKENS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>", "<eos>")


def eos_ids(sources) -> list[int]:
    """The EOS ids that `sources` (generation config, model config, tokenizer; None skipped) name,
    and a tokenizer's special tokens among END_TOKENS."""
    ids: list[int] = []
    for source in sources:
        value = getattr(source, "eos_token_id", None) if source is not None else None
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        added = getattr(source, "added_tokens_decoder", None)  # a tokenizer
        if isinstance(added, dict):
            values += [i for i, token in sorted(added.items()) if getattr(token, "special", False)
                       and getattr(token, "content", None) in END_TOKENS]
        for v in values:
            if isinstance(v, int) and v not in ids:
                ids.append(v)
    return ids


def pair_mode(target, drafter) -> str:
    """How `drafter` (a model) can draft for `target`: "shared" (one vocabulary: token ids as they
    are, `ModelDrafter`) or "retokenize" (two tokenizers: through text, `OtherTokenizerDrafter`,
    exact through a one-hot law). Raises what `check_pair` raises where neither applies."""
    if target.tokenizer is not None and drafter.tokenizer is not None and (
            len(target.tokenizer) != len(drafter.tokenizer) or not _same_vocabulary(target.tokenizer, drafter.tokenizer)):
        return "retokenize"  # its devices are checked by the drafter (`OtherTokenizerDrafter.check_target`)
    check_pair(target, drafter)
    return "shared"


def check_pair(target, drafter) -> None:
    """Raise a clear error unless the drafter proposes tokens in the target's vocabulary.

    With both tokenizers at hand, their token -> id maps must be equal; the output heads may be
    padded to different widths (Qwen2.5-7B: 152,064 rows, 0.5B: 151,936), since `ModelDrafter`
    gives q over the target's ids. Without a tokenizer on either side, the widths must be equal.
    """
    if target.tokenizer is not None and drafter.tokenizer is not None:
        if len(target.tokenizer) != len(drafter.tokenizer) or not _same_vocabulary(target.tokenizer, drafter.tokenizer):
            raise SpecdecError(
                f"tokenizers differ: target {target.name} and drafter {drafter.name} map tokens to different ids "
                "(a drafter model passed as it is drafts through text: `OtherTokenizerDrafter`)"
            )
    elif target.vocab_size != drafter.vocab_size:
        raise SpecdecError(
            f"vocabularies differ: target {target.name} has {target.vocab_size} ids, "
            f"drafter {drafter.name} has {drafter.vocab_size}; speculative decoding needs one shared vocabulary"
        )
    if target.device != drafter.device:
        raise SpecdecError(f"target is on {target.device} but drafter on {drafter.device}; load both on one device")


# tokenizer -> the tokenizers (and their lengths) found to map every token to the same id: building
# two 151,665-entry vocabularies took 0.17 s, at every generation (a chat turn, a bench run)
_SAME_VOCABULARY: "weakref.WeakKeyDictionary[object, weakref.WeakKeyDictionary[object, int]]" = \
    weakref.WeakKeyDictionary()


def _same_vocabulary(a, b) -> bool:
    """a.get_vocab() == b.get_vocab(), remembered for the pair while neither grows (tokens added)."""
    try:
        known = _SAME_VOCABULARY.setdefault(a, weakref.WeakKeyDictionary())
        if known.get(b) == len(a) == len(b):
            return True
    except TypeError:  # a tokenizer that cannot be weakly referenced: compare every time
        return a.get_vocab() == b.get_vocab()
    same = a.get_vocab() == b.get_vocab()
    if same:
        known[b] = len(a)
    return same
