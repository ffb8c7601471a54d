"""Tool calls in the syntax of Qwen2.5's and Hermes' chat templates: each call is
`<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`, several separated by newlines.

The chat template renders the tools into the prompt and asks for that syntax; where a call is
required (`tool_choice` "required" or a named function) the output is held to it by a grammar
(`call_grammar`), and whatever came is parsed back into OpenAI's `tool_calls` (`CallParser`), the
same way whole or streamed. Pure functions of the request and the tokenizer: tested alone.
"""

from __future__ import annotations

import json
import uuid

from ..core.grammar import JSON_STYLE, Grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # OpenAI: no parameters


def template_offers_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template asks for tool calls in this syntax."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: any of them
        template = " ".join(t for t in template.values() if isinstance(t, str))
    return isinstance(template, str) and OPEN in template


def _tag(tokenizer, text: str) -> str:
    """A tag in llguidance's Lark: a token of its own where the tokenizer added one for it (its
    matcher takes added tokens as special, reached only by name), else the literal text."""
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    return text if text in added else json.dumps(text)


def call_grammar(tools: list[dict], choice, parallel: bool, tokenizer) -> Grammar:
    """The grammar of a required call: one call (a named function's, or any tool's), or with
    `parallel` and no name, one or more of any tools, each call's `name` one of the tools' and its
    `arguments` that tool's `parameters`."""
    named = choice["function"]["name"] if isinstance(choice, dict) else None
    functions = [tool["function"] for tool in tools if named is None or tool["function"]["name"] == named]
    # each call written as json.dumps writes {"name": NAME, "arguments": {...}}; each tool's
    # arguments a %json rule of their own, so that its schema's $defs resolve from its own root
    rules = []
    for k, function in enumerate(functions):
        head = json.dumps({"name": function["name"]})[:-1] + ', "arguments": '
        schema = {**(function.get("parameters") or NO_PARAMETERS), "x-guidance": JSON_STYLE}
        rules.append(f"body{k}: {json.dumps(head)} args{k} \"}}\"\nargs{k}: %json {json.dumps(schema)}\n")
    more = ' ("\\n" call)*' if parallel and named is None else ""
    return Grammar.lark(f"start: call{more}\n"
                        f'call: {_tag(tokenizer, OPEN)} "\\n" body "\\n" {_tag(tokenizer, CLOSE)}\n'
                        f"body: {' | '.join(f'body{k}' for k in range(len(functions)))}\n" + "".join(rules))


def template_message(message: dict) -> dict:
    """A checked message as chat templates take it: a call's `arguments` as an object (OpenAI
    sends a JSON string; templates write it with `tojson`)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    return {**message, "tool_calls": [{**call, "function": {**call["function"],
                                                            "arguments": json.loads(call["function"]["arguments"])}}
                                      for call in calls]}


class CallParser:
    """One choice's text -> (content, calls) as it comes: text outside the tags is content, each
    complete `<tool_call>...</tool_call>` holding {"name": one of `names`, "arguments": an object}
    is a call (`{"id", "type", "function": {"name", "arguments"}}`, arguments as a JSON string),
    and a block that is not one is given back as content, verbatim. Whitespace next to a call is
    dropped. `one`: after the first call, the rest of the output is dropped (parallel_tool_calls
    false). Fed in any pieces, the concatenated output is the same."""

    def __init__(self, names: set[str], one: bool = False):
        self.names, self.one = names, one
        self.buffer, self.inside, self.done = "", False, False
        self.space = ""  # whitespace held back: sent if content follows, dropped next to a call
        self.after_call = False  # the last thing seen was a call
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """The content to send now and the calls completed by `text`."""
        if self.done:
            return "", []
        self.buffer += text
        content, calls = [], []
        while not self.done:
            if self.inside:
                end = self._close()
                if end is None:
                    break
                raw, self.buffer, self.inside = self.buffer[:end], self.buffer[end + len(CLOSE):], False
                call = self._call(raw)
                if call is None:
                    content.append(self._text(OPEN + raw + CLOSE))
                    continue
                calls.append(call)
                self.space, self.after_call, self.calls = "", True, self.calls + 1
                self.done = self.one
                continue
            start = self.buffer.find(OPEN)
            if start >= 0:
                content.append(self._text(self.buffer[:start]))
                self.buffer, self.inside, self.space = self.buffer[start + len(OPEN):], True, ""
                continue
            keep = next((k for k in range(min(len(OPEN) - 1, len(self.buffer)), 0, -1)
                         if OPEN.startswith(self.buffer[-k:])), 0)  # a tag may be arriving
            content.append(self._text(self.buffer[:len(self.buffer) - keep]))
            self.buffer = self.buffer[len(self.buffer) - keep:]
            break
        return "".join(content), calls

    def _close(self) -> int | None:
        """Where the open call's closing tag starts in the buffer, None while it has not come: after
        the JSON value the call holds (a closing tag inside one of its strings does not close it),
        else at the first closing tag (a block that is not JSON is content)."""
        start = len(self.buffer) - len(self.buffer.lstrip())
        try:
            _, end = json.JSONDecoder().raw_decode(self.buffer, start)
        except json.JSONDecodeError as error:  # JSON still arriving (cut inside a string, or at the end): wait
            if error.msg.startswith("Unterminated string") or error.pos >= len(self.buffer.rstrip()):
                return None
            end = None
        if end is not None:
            rest = self.buffer[end:]
            gap = len(rest) - len(rest.lstrip())
            if rest[gap:].startswith(CLOSE):
                return end + gap
            if CLOSE.startswith(rest[gap:]):  # the tag (or the space before it) still arriving
                return None
        found = self.buffer.find(CLOSE)
        return None if found < 0 else found

    def finish(self) -> str:
        """The content left once the output ended (a tag never closed is content)."""
        if self.done:
            return ""
        rest = (OPEN if self.inside else "") + self.buffer
        self.buffer, self.inside = "", False
        text = self._text(rest)
        if not self.after_call:  # whitespace after the last call is dropped, other trailing whitespace kept
            text, self.space = text + self.space, ""
        return text

    def _text(self, text: str) -> str:
        """Content to send now: held-back whitespace before it, its own trailing whitespace held."""
        if not text:
            return ""
        body = text.rstrip()
        if not body:
            self.space += text
            return ""
        sent = body.lstrip() if self.after_call else self.space + body
        self.space, self.after_call = text[len(body):], False
        return sent

    def _call(self, raw: str) -> dict | None:
        try:
            call = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(call, dict) or set(call) != {"name", "arguments"} or not isinstance(call["name"], str) \
                or call["name"] not in self.names or not isinstance(call["arguments"], dict):
            return None
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}
