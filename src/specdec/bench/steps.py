"""Leviathan et al. 2023, Fig. 1 on our models: one generation step by step, from the steps the
decoding loop records (`generate.Step`, what `specdec generate --debug` prints): each step's
drafted tokens, those the target accepted (green), the one it rejected (red) and the token the
target added itself (blue)."""

from __future__ import annotations

import html
from typing import Callable, Sequence

COLORS = {"accepted": "#1a7f37", "rejected": "#cf222e", "target": "#0969da"}


def step_rows(steps: Sequence, decode: Callable[[list[int]], str]) -> list[dict]:
    """Each chain step as {"accepted": [text], "rejected": text or None, "target": text, "kind"}:
    the accepted drafts, the first rejected one, and the target's own token (after a rejection:
    resampled; after a full acceptance: the bonus token; with no draft: its token alone)."""
    rows = []
    for step in steps:
        rejected = step.rejected_token
        rows.append({"accepted": [decode([t]) for t in step.accepted_tokens],
                     "rejected": None if rejected is None else decode([rejected]),
                     "target": decode([step.next_token]), "kind": step.next_kind})
    return rows


def _code(text: str) -> str:
    shown = text.replace("\n", "↵").replace("`", "ˋ") or "∅"
    return f"`{shown}`"


def steps_markdown(rows: list[dict]) -> str:
    """One line a step, markdown without colour: accepted drafts plain, the rejected one struck
    out, the target's own token in bold."""
    lines = ["Accepted drafts as they are, ~~rejected~~ draft struck out, **target's own token** in bold.", ""]
    for i, row in enumerate(rows, 1):
        parts = [_code(t) for t in row["accepted"]]
        if row["rejected"] is not None:
            parts.append(f"~~{_code(row['rejected'])}~~")
        parts.append(f"**{_code(row['target'])}**")
        lines.append(f"{i}. " + " ".join(parts))
    return "\n".join(lines) + "\n"


def steps_html(rows: list[dict]) -> str:
    """The same as a standalone HTML page in the paper's colours: accepted green, rejected red
    (struck out), the target's token blue; one line a step."""
    def span(text: str, kind: str, strike: bool = False) -> str:
        style = f"color:{COLORS[kind]}" + (";text-decoration:line-through" if strike else "")
        return f'<span style="{style}">{html.escape(text)}</span>'

    body = []
    for row in rows:
        parts = [span(t, "accepted") for t in row["accepted"]]
        if row["rejected"] is not None:
            parts.append(span(row["rejected"], "rejected", strike=True))
        parts.append(span(row["target"], "target"))
        body.append("<div>" + "".join(parts) + "</div>")
    return ("<!doctype html><meta charset='utf-8'><title>speculative decoding, step by step</title>"
            "<pre style='font-family:monospace;white-space:pre-wrap'>" + "\n".join(body) + "</pre>\n")
