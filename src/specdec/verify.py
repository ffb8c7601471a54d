"""Speculative acceptance as a pure, batched tensor function (Leviathan et al. 2023, Algorithm 1).

Kept apart from the decoding loop so that it can be tested alone, statistically, with millions
of trials per second.
"""

from __future__ import annotations

import torch

from .errors import SpecdecError
from .samplers import sample


def verify_draft(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
                 generator: torch.Generator | None = None, lenience: float = 1.0,
                 details: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decide how much of a draft to keep, and the one token the target adds.

    Args:
        target_probs: [..., γ+1, V] the target's p at each draft position, plus one past the end.
        draft_probs:  [..., γ, V]   the drafter's q that each draft token was sampled from.
        draft_tokens: [..., γ] (long) the drafted tokens.
        generator: source of the uniform draws (for reproducible runs).
        lenience: l in (0, 1]. 1 is exact. l < 1 (Leviathan et al. A.5) accepts with probability
            min(1, p(x)/(l·q(x))) and keeps the same residual: LOSSY, the output then follows
            no longer p, but no token is emitted with probability above p(x)/l.
        details: if a dict is given, it receives the tensors behind the decision, each [..., γ]:
            "p" = p(x), "q" = q(x) of each draft token, and "u" = its uniform draw.

    Returns:
        num_accepted: [...] (long, 0..γ) length of the accepted prefix. Draft token i is accepted
            with probability min(1, p(x)/q(x)), in order, until the first rejection.
        next_token: [...] (long) at a rejection, a sample from norm(max(0, p − q)) at that
            position; when all γ are accepted, a bonus sample from p at position γ.

    The output distribution equals the target's exactly, for any q (also q(x) = 0, p = q,
    disjoint supports, one-hot p and q). Inputs of any float dtype are computed in fp32. A token
    to which the target gives probability 0 is never accepted or emitted.
    """
    _check_shapes(target_probs, draft_probs, draft_tokens)
    if not 0 < lenience <= 1:
        raise SpecdecError(f"lenience must be in (0, 1] (1 = exact), got {lenience!r}")
    p = target_probs.float()
    q = draft_probs.float()
    gamma = draft_tokens.shape[-1]

    tokens = draft_tokens.unsqueeze(-1)
    p_x = p[..., :gamma, :].gather(-1, tokens).squeeze(-1)  # [..., γ]
    q_x = q.gather(-1, tokens).squeeze(-1)  # [..., γ]
    u = torch.rand(p_x.shape, generator=generator, device=p.device, dtype=torch.float32)
    # u < p/(l·q) written without the division: q_x = 0 accepts iff p_x > 0; p_x = 0 never accepts
    accepted = u * q_x * lenience < p_x
    if details is not None:
        details.update(p=p_x, q=q_x, u=u)
    num_accepted = accepted.long().cumprod(-1).sum(-1)  # [...]

    # Residual at the stopping position; a zero row of q past the end turns it into p (the bonus).
    q_padded = torch.cat([q, torch.zeros_like(q[..., :1, :])], dim=-2)  # [..., γ+1, V]
    index = num_accepted[..., None, None].expand(*num_accepted.shape, 1, p.shape[-1])
    p_stop = p.gather(-2, index).squeeze(-2)  # [..., V]
    q_stop = q_padded.gather(-2, index).squeeze(-2)
    residual = (p_stop - q_stop).clamp_min(0)
    # A rejection with an all-zero residual can only come from rounding when p ≈ q; p is then right.
    empty = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(empty, p_stop, residual)
    next_token = sample(residual, generator)
    return num_accepted, next_token


def verify_greedy(target_tokens: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify_draft` for a greedy target: keep the draft while it matches the target's argmax.

    Args:
        target_tokens: [..., γ+1] (long) the target's argmax at each draft position and one past it.
        draft_tokens:  [..., γ] (long).
    Returns:
        num_accepted: [...] (long) length of the matching prefix.
        next_token: [...] (long) the target's token at the first mismatch, or the bonus token.

    With one-hot p this is what `verify_draft` returns for any q (a draft token is accepted
    with probability p(x) ∈ {0, 1}; the residual is p itself), with no [γ+1, V] tensors.
    """
    if target_tokens.shape[-1] != draft_tokens.shape[-1] + 1 or target_tokens.shape[:-1] != draft_tokens.shape[:-1]:
        raise SpecdecError(f"target_tokens must have shape [..., γ+1] for draft_tokens {tuple(draft_tokens.shape)}, "
                           f"got {tuple(target_tokens.shape)}")
    gamma = draft_tokens.shape[-1]
    matches = (target_tokens[..., :gamma] == draft_tokens).long()
    num_accepted = matches.cumprod(-1).sum(-1)
    next_token = target_tokens.gather(-1, num_accepted.unsqueeze(-1)).squeeze(-1)
    return num_accepted, next_token


def _check_shapes(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor) -> None:
    if draft_tokens.dim() < 1 or draft_tokens.shape[-1] < 1:
        raise SpecdecError(f"draft_tokens must have shape [..., γ] with γ >= 1, got {tuple(draft_tokens.shape)}")
    if draft_tokens.dtype not in (torch.long, torch.int32, torch.int64):
        raise SpecdecError(f"draft_tokens must be integer (long), got {draft_tokens.dtype}")
    *lead, gamma = draft_tokens.shape
    if tuple(draft_probs.shape[:-1]) != (*lead, gamma):
        raise SpecdecError(
            f"draft_probs must have shape [..., γ, V] = {(*lead, gamma, 'V')}, got {tuple(draft_probs.shape)}"
        )
    vocab = draft_probs.shape[-1]
    if tuple(target_probs.shape) != (*lead, gamma + 1, vocab):
        raise SpecdecError(
            f"target_probs must have shape [..., γ+1, V] = {(*lead, gamma + 1, vocab)}, "
            f"got {tuple(target_probs.shape)} (vocabularies of target and drafter must match)"
        )
    if torch.isnan(target_probs).any() or torch.isnan(draft_probs).any():
        raise SpecdecError("NaN in target_probs or draft_probs")
    if draft_tokens.min() < 0 or draft_tokens.max() >= vocab:
        raise SpecdecError(f"draft_tokens must lie in [0, {vocab}), got values outside it")
