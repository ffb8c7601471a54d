"""Constrained output: a grammar (a JSON Schema, any JSON object, a regular expression, or
llguidance's Lark text) that every generated token must keep the text inside.

The constrained law is p_g(x) ∝ p(x) · [x allowed after the output so far]. A verification pass
scores γ+1 positions at once, row j after the draft's first j tokens, so row j is masked with the
grammar's state after those j tokens (the matcher advanced over the draft, then rolled back):
exactly the mask autoregressive decoding would apply there. A draft token the grammar forbids has
p_g = 0 and can never be accepted; a token the grammar forces (the only one allowed, as in a JSON
key or punctuation) has p_g = 1 and is always accepted, so such runs are drafted for free
(`Constraint.forced`). The rows, the sampler and the acceptance rule are otherwise the unconstrained
ones: greedy output is token for token the constrained greedy AR output, a seed pins the
constrained AR output whatever drafted, and sampling follows p_g.

Built on llguidance (the matcher vLLM and SGLang use): it compiles a grammar per request in
milliseconds, computes a 151,936-token mask in ~0.02 ms, rolls a matcher back token by token,
and needs no other package (xgrammar, the other choice, pulls in triton and a TVM runtime).
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Sequence

import torch

from ..errors import ModelFault, SpecdecError

KINDS = ("json_schema", "json", "regex", "lark")
ANY_JSON = {"type": "object"}  # "json": any JSON object (OpenAI's json_object mode)
# json.dumps's separators, fixed: how models have seen JSON written, and every separator forced
JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


@dataclass(frozen=True)
class Grammar:
    """What the output must match. kind: "json_schema" (source: the schema, a dict), "json" (any
    JSON object), "regex" (source: the pattern, matching the whole output) or "lark" (source:
    llguidance's Lark text). Build with `Grammar.parse` or the class methods."""

    kind: str
    source: object = None

    @classmethod
    def json_schema(cls, schema: dict | str) -> "Grammar":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as error:
                raise SpecdecError(f"the JSON schema is not valid JSON: {error}") from None
        if not isinstance(schema, dict):
            raise SpecdecError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
        return cls("json_schema", schema)

    @classmethod
    def json(cls) -> "Grammar":
        return cls("json")

    @classmethod
    def regex(cls, pattern: str) -> "Grammar":
        if not isinstance(pattern, str) or not pattern:
            raise SpecdecError("a regex grammar needs a non-empty pattern")
        return cls("regex", pattern)

    @classmethod
    def lark(cls, text: str) -> "Grammar":
        if not isinstance(text, str) or not text.strip():
            raise SpecdecError("a Lark grammar needs its text")
        return cls("lark", text)

    @classmethod
    def parse(cls, spec) -> "Grammar | None":
        """A grammar from what `speculative_generate(grammar=...)` takes: a `Grammar`, "json" (any
        JSON object), a dict (a JSON Schema), or None (no constraint)."""
        if spec is None or isinstance(spec, Grammar):
            return spec
        if spec == "json":
            return cls.json()
        if isinstance(spec, dict):
            return cls.json_schema(spec)
        raise SpecdecError(f"grammar must be a Grammar, 'json' or a JSON schema (a dict), got {spec!r}"[:200])

    def text(self) -> str:
        """The grammar in llguidance's form."""
        from llguidance import LLMatcher

        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_STYLE)
        if self.kind == "json":
            return LLMatcher.grammar_from_json_schema(ANY_JSON, defaults=JSON_STYLE)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.source)
        if self.kind == "lark":
            return LLMatcher.grammar_from_lark(self.source)
        raise SpecdecError(f"unknown grammar kind {self.kind!r}; one of {', '.join(KINDS)}")

    def check(self, model=None) -> None:
        """SpecdecError naming the problem where this grammar cannot constrain `model` (a grammar
        that does not compile, a keyword it does not support, a model without a tokenizer); with
        no model, the grammar alone is checked (before any model loads)."""
        from llguidance import LLMatcher

        try:
            message = LLMatcher.validate_grammar(self.text(), None if model is None else _tokenizer(model))
        except ValueError as error:
            message = str(error)
        if message:
            lines = message.strip().splitlines()  # llguidance's first line, and the parser's own "error: ..." line
            reason = " ".join([lines[0]] + [line.strip() for line in lines[1:] if line.strip().startswith("error:")][:1])
            raise SpecdecError(f"the {self.kind} grammar is not valid: {reason}"[:500])

    def constraint(self, model, ends: Sequence[int]) -> "Constraint":
        """One sequence's matcher of this grammar on `model`'s vocabulary. ends: the sequence's
        end tokens, allowed once the grammar is satisfied (and forced once nothing else may come)."""
        from llguidance import LLMatcher

        try:
            text = self.text()
        except ValueError as error:
            raise SpecdecError(f"the {self.kind} grammar is not valid: {error}") from None
        matcher = LLMatcher(_tokenizer(model), text, log_level=0)
        if matcher.is_error():
            raise SpecdecError(f"the {self.kind} grammar is not valid: {matcher.get_error()}"[:500])
        # llguidance allows the model's own end token once the grammar is satisfied; where this
        # sequence does not end on it (ignore_eos with stop_token_ids), it is not allowed
        foreign = [t for t in model.eos_token_ids if t not in ends]
        return Constraint(matcher, model.vocab_size, list(ends), foreign)


_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> its LLTokenizer (~2 s to make)
_LOCK = threading.Lock()


def _tokenizer(model):
    """llguidance's view of `model`'s tokenizer, made once per model."""
    with _LOCK:
        made = _TOKENIZERS.get(model)
        if made is None:
            tokenizer = model.tokenizer
            if tokenizer is None:
                raise SpecdecError(f"{model.name} has no tokenizer, which a grammar needs")
            import llguidance.hf

            eos = (model.eos_token_ids or [None])[0]
            made = _TOKENIZERS[model] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=model.vocab_size,
                                                                    eos_token=eos)
        return made


class Constraint:
    """One sequence's grammar state: the masks of a verification pass's rows, the runs the grammar
    forces, and the committed output. The matcher holds the committed output; every speculative
    advance over a draft is rolled back before a method returns."""

    def __init__(self, matcher, vocab: int, ends: list[int], foreign: Sequence[int] = ()):
        self.matcher, self.vocab, self.ends = matcher, vocab, ends
        self._foreign = [t for t in foreign if t < vocab]  # end tokens of the model this sequence does not end on
        self._words = torch.empty((vocab + 31) // 32, dtype=torch.int32)
        self._bits = torch.arange(32, dtype=torch.int32)
        self.mask_calls = 0  # masks computed (what the bench reports a cost per token of)
        self.single: list[bool] = []  # of the last `masks`' rows, those that allowed one token alone
        self.mask_seconds = 0.0  # inside `masks`: the matcher's speculative advance, masks and rollback

    def _mask(self) -> torch.Tensor:
        """[V] bool: the tokens allowed in the matcher's state (the end tokens once it accepts)."""
        self.matcher.unsafe_compute_mask_ptr(self._words.data_ptr(), self._words.numel() * 4)
        self.mask_calls += 1
        allowed = ((self._words.unsqueeze(-1) >> self._bits) & 1).view(-1)[:self.vocab].bool()
        if self.matcher.is_accepting():
            allowed[[t for t in self.ends if t < self.vocab]] = True
        allowed[self._foreign] = False
        return allowed

    def valid(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, from the committed state, the grammar allows in a row (an end
        token where the grammar is satisfied, and nothing after it)."""
        count = self.matcher.validate_tokens(list(tokens))
        if count < len(tokens) and tokens[count] in self.ends:
            self.matcher.consume_tokens(list(tokens[:count]))
            accepting = self.matcher.is_accepting()
            if count:
                self.matcher.rollback(count)
            count += accepting
        return count

    def masks(self, draft: Sequence[int], rows: int) -> torch.Tensor:
        """[rows, V] bool: row j the tokens allowed after the committed output and draft[:j]. Rows
        past the first token the grammar forbids repeat that row's mask (they are never used: that
        token is rejected)."""
        began = time.perf_counter()
        body = list(draft[:rows - 1])
        body = body[:next((i for i, t in enumerate(body) if t in self.ends), len(body))]  # rows past an end: unused
        keep = self.matcher.validate_tokens(body)
        out = torch.empty(rows, self.vocab, dtype=torch.bool)
        for j in range(keep + 1):
            if j:
                self.matcher.consume_token(draft[j - 1])
            out[j] = self._mask()
        if keep:
            self.matcher.rollback(keep)
        out[keep + 1:] = out[keep]
        self.single = [alone and j <= keep for j, alone in enumerate((out.sum(1) == 1).tolist())]
        self.mask_seconds += time.perf_counter() - began
        return out

    def mask_after(self, after: Sequence[int]) -> torch.Tensor:
        """[V] bool: the tokens allowed after the committed output and `after`, a draft made under
        these masks (none of its tokens an end token: nothing follows one)."""
        began = time.perf_counter()
        if any(t in self.ends for t in after) or self.matcher.validate_tokens(list(after)) < len(after):
            raise ModelFault("a draft under a grammar went past its end or out of the grammar")  # a bug of ours
        self.matcher.consume_tokens(list(after))
        try:
            return self._mask()
        finally:
            if after:
                self.matcher.rollback(len(after))
            self.mask_seconds += time.perf_counter() - began

    def forced(self, after: Sequence[int], most: int) -> list[int]:
        """The tokens the grammar forces after the committed output and `after` (the only ones it
        allows, one after another), at most `most` of them; none where `after` leaves the grammar."""
        if most <= 0 or any(t in self.ends for t in after) or self.valid(after) < len(after):
            return []
        self.matcher.consume_tokens(list(after))
        forced = list(self.matcher.compute_ff_tokens())[:most]
        if self.matcher.is_stopped() and len(forced) < most and len(self.ends) == 1:
            forced.append(self.ends[0])  # nothing more may come: the one end is forced too
        if after:
            self.matcher.rollback(len(after))
        return forced[:most]

    def commit(self, tokens: Sequence[int]) -> None:
        """The output grew by `tokens` (each allowed where it came: the masks saw to it)."""
        ends = set(self.ends)
        body = [t for t in tokens if t not in ends]
        if body and not self.matcher.consume_tokens(body):  # the masks never allow it: a bug of ours
            raise ModelFault(f"a committed token left the grammar: {self.matcher.get_error()}"[:300])

    def mask_logits(self, logits: torch.Tensor, draft: Sequence[int]) -> torch.Tensor:
        """logits [R, V] of R consecutive positions, row j after draft[:j] -> those logits (fp32)
        with every token the grammar forbids there at -inf."""
        allowed = self.masks(draft, len(logits)).to(logits.device)
        return logits.float().masked_fill(~allowed, float("-inf"))
