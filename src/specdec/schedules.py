"""Draft-length schedules: how many tokens to draft at the next step.

A schedule gives a budget before each step (`budget`), may cut the draft short as it grows
(`keep_going`, fed the drafter's untempered logits for each drafted token), and learns from
the verification (`update`). None of them touches exactness: they only choose γ.
"""

from __future__ import annotations

import math

import torch

from .errors import SpecdecError

SCHEDULES = ("fixed", "heuristic", "confidence", "egag")


def _check_gamma(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpecdecError(f"{name} must be an integer >= 1, got {value!r}")


class Schedule:
    """Fixed γ; the base of the others."""

    name = "fixed"

    def __init__(self, gamma: int = 5):
        _check_gamma("gamma", gamma)
        self.gamma = gamma

    def reset(self) -> None:
        """Called at the start of each generation."""

    def budget(self) -> int:
        """Most tokens to draft at this step."""
        return self.gamma

    def keep_going(self, drafted: int, logits: torch.Tensor | None) -> bool:
        """After `drafted` tokens, whose last came from `logits` [V] (None: no distribution)."""
        return True

    def update(self, drafted: int, accepted: int) -> None:
        """What the target kept of the step's draft."""

    def step_info(self) -> dict:
        """Per-step values worth recording (e.g. EGAG's normalised entropy)."""
        return {}

    def describe(self) -> str:
        return f"fixed γ={self.gamma}"


class Fixed(Schedule):
    pass


class Heuristic(Schedule):
    """transformers' and llama.cpp's rule: γ += 2 after a fully accepted draft, else γ -= 1."""

    name = "heuristic"

    def __init__(self, gamma: int = 5, gamma_min: int = 1, gamma_max: int = 32):
        super().__init__(gamma)
        _check_range(gamma_min, gamma_max)
        self.initial, self.gamma_min, self.gamma_max = gamma, gamma_min, gamma_max

    def reset(self) -> None:
        self.gamma = self.initial

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        step = 2 if accepted == drafted else -1
        self.gamma = min(self.gamma_max, max(self.gamma_min, self.gamma + step))

    def describe(self) -> str:
        return f"heuristic γ₀={self.initial} in [{self.gamma_min}, {self.gamma_max}]"


class Confidence(Schedule):
    """Draft until the drafter's top probability falls below τ (that token still goes in), or γ_max."""

    name = "confidence"

    def __init__(self, threshold: float = 0.4, gamma_max: int = 20):
        _check_gamma("gamma_max", gamma_max)
        if not 0 <= threshold < 1:
            raise SpecdecError(f"confidence threshold must be in [0, 1), got {threshold!r}")
        super().__init__(gamma_max)
        self.threshold = threshold

    def keep_going(self, drafted: int, logits: torch.Tensor | None) -> bool:
        return logits is None or float(logits.float().softmax(-1).max()) >= self.threshold

    def describe(self) -> str:
        return f"confidence τ={self.threshold:g}, γ_max={self.gamma}"


def normalized_entropy(logits: torch.Tensor) -> float:
    """H(softmax(logits)) / log V, in [0, 1]: logits [V]."""
    logp = logits.float().log_softmax(-1)
    entropy = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum()
    return float(entropy) / math.log(logits.shape[-1])


class EGAG(Schedule):
    """Entropy-guided adaptive γ: from the drafter's first distribution of the step,
    γ = clamp(round((1 − H_norm)·γ_max), γ_min, γ_max), with H_norm smoothed across steps by an
    EMA of weight β on the past (β = 0: no smoothing)."""

    name = "egag"

    def __init__(self, gamma_min: int = 1, gamma_max: int = 10, beta: float = 0.0):
        _check_range(gamma_min, gamma_max)
        if not 0 <= beta < 1:
            raise SpecdecError(f"EGAG's EMA weight beta must be in [0, 1), got {beta!r}")
        super().__init__(gamma_max)
        self.gamma_min, self.gamma_max, self.beta = gamma_min, gamma_max, beta
        self.reset()

    def reset(self) -> None:
        self.ema: float | None = None
        self.h_norm: float | None = None
        self.step_gamma = self.gamma_max

    def keep_going(self, drafted: int, logits: torch.Tensor | None) -> bool:
        if drafted == 1:
            h = 0.0 if logits is None else normalized_entropy(logits)
            self.ema = h if self.ema is None or self.beta == 0 else self.beta * self.ema + (1 - self.beta) * h
            self.h_norm = self.ema
            self.step_gamma = min(self.gamma_max, max(self.gamma_min, round((1 - self.ema) * self.gamma_max)))
        return drafted < self.step_gamma

    def step_info(self) -> dict:
        return {"h_norm": self.h_norm, "gamma": self.step_gamma}

    def describe(self) -> str:
        return f"egag γ in [{self.gamma_min}, {self.gamma_max}], β={self.beta:g}"


def _check_range(gamma_min, gamma_max) -> None:
    _check_gamma("gamma_min", gamma_min)
    _check_gamma("gamma_max", gamma_max)
    if gamma_min > gamma_max:
        raise SpecdecError(f"gamma_min ({gamma_min}) must not exceed gamma_max ({gamma_max})")


def make_schedule(name: str = "fixed", gamma: int = 5, gamma_min: int = 1, gamma_max: int = 10,
                  beta: float = 0.0, confidence: float = 0.4) -> Schedule:
    """A schedule by name: fixed (gamma), heuristic (starts at gamma, in [gamma_min, gamma_max]),
    confidence (threshold `confidence`, up to gamma_max), egag (gamma_min, gamma_max, beta)."""
    if name == "fixed":
        return Fixed(gamma)
    if name == "heuristic":
        return Heuristic(gamma, gamma_min, gamma_max)
    if name == "confidence":
        return Confidence(confidence, gamma_max)
    if name == "egag":
        return EGAG(gamma_min, gamma_max, beta)
    raise SpecdecError(f"unknown schedule '{name}'; choose from {', '.join(SCHEDULES)}")
