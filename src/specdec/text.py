"""Token ids and text: prompts to ids (chat templates, BOS), ids to text, the EOS ids a model
names, and whether two models share one vocabulary (`check_pair`). Every backend uses these.
"""

from __future__ import annotations

import weakref
from typing import Sequence

from .errors import SpecdecError


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
