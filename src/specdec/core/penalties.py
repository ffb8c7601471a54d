"""Penalties, logit bias and a minimum length: per-position changes to the target's logits before
sampling (the OpenAI and vLLM request fields `presence_penalty`, `frequency_penalty`,
`repetition_penalty`, `logit_bias` and `min_tokens`).

Each changes a position's logits by what the sequence holds before that position. A verification
pass scores γ+1 positions at once, position j after the draft's first j tokens, so row j is
changed as if those j tokens had been generated: exactly what autoregressive decoding would apply
there had it generated them. The rules thus shape the target's p position by position, and the
verification stays exact for it (greedy: token for token the greedy AR output under the same
rules). Chains only: a tree's rows have other pasts than their neighbours' (not built).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Collection, Sequence

import torch

from ..errors import SpecdecError

BIAS_LIMIT = 100.0  # OpenAI's range for logit_bias values


@dataclass(frozen=True)
class LogitRules:
    """What to change in every position's logits (all off by default).

    presence: subtracted from the logit of every token the output holds (OpenAI: -2..2).
    frequency: times how often the output holds a token, subtracted from its logit (-2..2).
    repetition: tokens of the prompt or the output get logit / r where positive, logit · r where
        not (vLLM's and transformers' rule; 1 = off, > 0).
    bias: (token id, value) pairs added to those logits (OpenAI's logit_bias, -100..100).
    min_tokens: the end tokens are ruled out until the output holds this many tokens.
    allowed: the only token ids that may come (vLLM's allowed_token_ids); empty: every token.
    "Output" at a position is every token generated before it (draft tokens before it included).
    """

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    allowed: tuple[int, ...] = ()

    def __post_init__(self):
        for name, low, high in (("presence", -2, 2), ("frequency", -2, 2)):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and low <= value <= high):
                raise SpecdecError(f"{name} penalty must be a number in [{low}, {high}], got {value!r}")
        if not (isinstance(self.repetition, (int, float)) and 0 < self.repetition <= 10 and
                math.isfinite(self.repetition)):
            raise SpecdecError(f"repetition penalty must be a number in (0, 10], got {self.repetition!r}")
        if not (isinstance(self.min_tokens, int) and not isinstance(self.min_tokens, bool) and self.min_tokens >= 0):
            raise SpecdecError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if not all(isinstance(token, int) and token >= 0 for token in self.allowed):
            raise SpecdecError(f"allowed token ids must be token ids >= 0, got {self.allowed!r}")
        for token, value in self.bias:
            if not (isinstance(token, int) and token >= 0):
                raise SpecdecError(f"logit bias keys must be token ids >= 0, got {token!r}")
            if not (isinstance(value, (int, float)) and -BIAS_LIMIT <= value <= BIAS_LIMIT):
                raise SpecdecError(f"logit bias values must be numbers in [-100, 100], got {value!r} for token {token}")

    @property
    def active(self) -> bool:
        """Whether these rules change anything."""
        return bool(self.presence or self.frequency or self.repetition != 1 or self.bias or self.min_tokens or
                    self.allowed)

    def prompt_tokens(self, prompt: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor | None:
        """[V] bool, the prompt's tokens, which the repetition penalty reaches (None where it is
        off): what `apply` takes for `prompt`, made once per sequence rather than per step."""
        if self.repetition == 1 or not prompt:
            return None
        ids = torch.tensor(sorted({t for t in prompt if t < vocab}), dtype=torch.long, device=device)
        return torch.zeros(vocab, dtype=torch.bool, device=device).index_fill_(0, ids, True)

    def apply(self, logits: torch.Tensor, prompt: Sequence[int] | torch.Tensor | None, output: Sequence[int],
              continuation: Sequence[int], ends: Collection[int]) -> torch.Tensor:
        """logits [R, V] of R consecutive positions, row j after prompt + output + continuation[:j]
        (R - 1 <= len(continuation)) -> the changed logits [R, V] fp32 (a new tensor). prompt: its
        ids, or `prompt_tokens`'s mask of them. ends: the end tokens min_tokens holds back."""
        rows, vocab = logits.shape
        if len(continuation) < rows - 1:
            raise SpecdecError(f"{rows} rows need {rows - 1} continuation tokens, got {len(continuation)}")
        if any(token >= vocab for token, _ in self.bias) or any(token >= vocab for token in self.allowed):
            raise SpecdecError(f"a logit bias or allowed token id is past this model's vocabulary of {vocab}")
        device = logits.device
        counts = output_counts(output, continuation[:rows - 1], rows, vocab, device)
        seen = counts > 0
        if prompt is not None and not torch.is_tensor(prompt):
            prompt = self.prompt_tokens(prompt, vocab, device)
        if prompt is not None and self.repetition != 1:
            seen = seen | prompt
        banned = torch.arange(rows, device=device) + len(output) < self.min_tokens  # [R]
        return penalize(logits.float(), counts, seen, self.presence, self.frequency, self.repetition,
                        self._bias(vocab, device), banned, sorted(t for t in ends if t < vocab))

    def _bias(self, vocab: int, device: torch.device) -> torch.Tensor | None:
        if not self.bias and not self.allowed:
            return None
        bias = torch.zeros(vocab, device=device)
        if self.bias:
            bias[torch.tensor([t for t, _ in self.bias], device=device)] = torch.tensor(
                [float(v) for _, v in self.bias], device=device)
        if self.allowed:  # -inf: a static mask, the same at every position, so verification stays exact
            mask = torch.full((vocab,), float("-inf"), device=device)
            mask[torch.tensor(list(self.allowed), device=device)] = 0.0
            bias = bias + mask
        return bias


def output_counts(output: Sequence[int], continuation: Sequence[int], rows: int, vocab: int,
                  device: torch.device) -> torch.Tensor:
    """counts [R, V] fp32: row j, how often each token occurs in output + continuation[:j]."""
    base = torch.bincount(torch.tensor(list(output), dtype=torch.long, device=device), minlength=vocab)[:vocab]
    counts = base.float().unsqueeze(0).repeat(rows, 1)
    if rows > 1:
        tokens = torch.tensor(list(continuation), dtype=torch.long, device=device)  # [R - 1]
        before = torch.ones(rows, rows - 1, device=device).tril(-1)  # row j counts continuation[:j]
        counts.scatter_add_(1, tokens.unsqueeze(0).expand(rows, -1), before)
    return counts


def penalize(logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor, presence: float, frequency: float,
             repetition: float, bias: torch.Tensor | None, banned: torch.Tensor, ends: Sequence[int]) -> torch.Tensor:
    """The rules as one batched function of its tensors: logits [R, V] fp32, counts [R, V] (each
    row's output counts), seen [R, V] or [V] (tokens the repetition penalty reaches), bias [V] or
    None, banned [R] (rows whose end tokens are ruled out) -> [R, V]."""
    out = logits
    if repetition != 1:
        out = torch.where(seen, torch.where(out > 0, out / repetition, out * repetition), out)
    if frequency or presence:
        out = out - frequency * counts - presence * (counts > 0).float()
    if bias is not None:
        out = out + bias
    if ends and bool(banned.any()):
        out = out.clone() if out is logits else out
        index = torch.tensor(list(ends), device=out.device)
        out[banned.nonzero().squeeze(-1).unsqueeze(-1), index] = float("-inf")
    return out
