"""Speculative acceptance as a pure, batched tensor function (Leviathan et al. 2023, Algorithm 1).

Kept apart from the decoding loop so that it can be tested alone, statistically, with millions
of trials per second.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..errors import SpecdecError
from .samplers import race, sample


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


@dataclass(frozen=True)
class Typical:
    """Medusa's typical acceptance (Cai et al. 2024, `evaluate_posterior`): a draft token x is
    accepted where the target gives it p(x) > min(epsilon, delta·exp(-H(p))), H the entropy of p.
    LOSSY under sampling (the output no longer follows p); greedy verification is unchanged."""

    epsilon: float = 0.09
    delta: float = 0.3

    def __post_init__(self):
        for name in ("epsilon", "delta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise SpecdecError(f"typical acceptance needs 0 < {name} <= 1, got {value!r}")

    def describe(self) -> str:
        return f"typical acceptance ε={self.epsilon:g}, δ={self.delta:g}"


def typical_threshold(probs: torch.Tensor, typical: Typical) -> torch.Tensor:
    """min(ε, δ·exp(-H(p))) for each distribution p in probs [..., V] -> [...]."""
    p = probs.float()
    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)
    return torch.clamp(typical.delta * torch.exp(-entropy), max=typical.epsilon)


def verify_typical(target_probs: torch.Tensor, draft_tokens: torch.Tensor, typical: Typical,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Typical acceptance of a draft (LOSSY under sampling; see `Typical`).

    Args:
        target_probs: [..., γ+1, V] the target's p at each draft position, plus one past the end.
        draft_tokens: [..., γ] (long) the drafted tokens (their q plays no part).
    Returns:
        num_accepted: [...] the longest prefix of tokens each above its position's threshold.
        next_token: [...] a sample from p at the first position not accepted (as Medusa: not
            from a residual, which is what makes the rule lossy but lets it accept a token the
            drafter over-proposes).
    """
    if target_probs.shape[:-2] != draft_tokens.shape[:-1] or target_probs.shape[-2] != draft_tokens.shape[-1] + 1:
        raise SpecdecError(f"target_probs {tuple(target_probs.shape)} must be [..., γ+1, V] for draft_tokens "
                           f"{tuple(draft_tokens.shape)} [..., γ]")
    p = target_probs.float()
    gamma = draft_tokens.shape[-1]
    p_x = p[..., :gamma, :].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # [..., γ]
    accepted = p_x > typical_threshold(p[..., :gamma, :], typical)
    num_accepted = accepted.long().cumprod(-1).sum(-1)  # [...]
    index = num_accepted[..., None, None].expand(*num_accepted.shape, 1, p.shape[-1])
    return num_accepted, sample(p.gather(-2, index).squeeze(-2), generator)


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


def verify_ragged(target_tokens: Sequence[Sequence[int]],
                  draft_tokens: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """`verify_greedy` over a ragged batch of chains in one call, for a batched step where the
    target's own token at each row decides (greedy, or a seed's coupled draws: `verify_coupled`).

    Args:
        target_tokens: B sequences, the b-th [γ_b + 1]: the target's token at each of its rows.
        draft_tokens: B sequences, the b-th [γ_b] (γ_b >= 0): its draft.
    Returns:
        num_accepted, next_token: [B] each, as `verify_greedy`'s for each sequence alone.

    Drafts are padded with -1 and targets with -2, so no padding position ever matches.
    """
    if len(target_tokens) != len(draft_tokens):
        raise SpecdecError(f"{len(target_tokens)} sequences of target tokens for {len(draft_tokens)} drafts")
    for b, (target, draft) in enumerate(zip(target_tokens, draft_tokens)):
        if len(target) != len(draft) + 1:
            raise SpecdecError(f"sequence {b}: {len(target)} target tokens for a draft of {len(draft)}; "
                               "give one per draft token and one past it")
    if not draft_tokens:
        return [], []
    width = max(len(draft) for draft in draft_tokens)
    targets = torch.full((len(draft_tokens), width + 1), -2, dtype=torch.long)
    drafts = torch.full((len(draft_tokens), width), -1, dtype=torch.long)
    for b, (target, draft) in enumerate(zip(target_tokens, draft_tokens)):
        targets[b, :len(target)] = torch.as_tensor(list(target), dtype=torch.long)
        drafts[b, :len(draft)] = torch.as_tensor(list(draft), dtype=torch.long)
    num_accepted, next_token = verify_greedy(targets, drafts)
    return num_accepted.tolist(), next_token.tolist()


def verify_coupled(target_probs: torch.Tensor, noise: torch.Tensor,
                   draft_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafter-invariant verification under a seed (Gumbel-max coupling; Daliri, Musco and Suresh
    2024): the target's token at each position is its own coupled draw, and a draft token is
    accepted iff it equals it.

    Args:
        target_probs: [..., γ+1, V] the target's p at each draft position, plus one past the end.
        noise: [..., γ+1, V] the shared exponential races of those positions
            (`samplers.position_noise`: a function of the seed and the position alone).
        draft_tokens: [..., γ] (long), however they were drafted.
    Returns:
        num_accepted, next_token: as `verify_draft`'s.

    Each emitted token is argmax p / E at its position, an exact draw from p given the tokens
    before it, whatever the draft: the output is, token for token, the seeded autoregressive
    output. A draft proposed as argmax q / E with the same noise is accepted with probability at
    least (1 − TV(p, q)) / (1 + TV(p, q)), against the standard rule's 1 − TV(p, q).
    """
    if noise.shape != target_probs.shape:
        raise SpecdecError(f"noise must have the shape of target_probs {tuple(target_probs.shape)}, "
                           f"got {tuple(noise.shape)}")
    return verify_greedy(race(target_probs, noise), draft_tokens)


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


# ---------------------------------------------------------------------------------------------
# Token trees (core/trees.py). A node is tried only while the walk stands at its parent; siblings are
# tried in rank order; the bonus or residual token comes from the row where the walk ends.

def sibling_laws(parent_probs: torch.Tensor, draft_tokens: torch.Tensor, parents: list[int],
                 scheme: str | list[str]) -> torch.Tensor:
    """The law each node was drawn from, given its earlier siblings: what `verify_tree` needs.

    Args:
        parent_probs: [..., N, V] the drafter's q at each node's parent (equal rows for siblings).
        draft_tokens: [..., N] (long) the tree's tokens.
        parents: [N] each node's parent (-1: the root), parents before children.
        scheme: one for the tree or one per node:
            "iid": the node was drawn from q independently of its siblings (SpecInfer's
                multi-step speculative sampling, Miao et al. 2024): its law is q;
            "without-replacement": drawn from q with the tokens of its earlier
                "without-replacement" siblings removed (recursive rejection sampling, Jeon et
                al. 2024): its law is that renormalised q;
            "deterministic": chosen without a random draw (top-k, lookup): its law is one-hot.
    Returns:
        laws: [..., N, V] fp32.
    """
    count = draft_tokens.shape[-1]
    schemes = [scheme] * count if isinstance(scheme, str) else list(scheme)
    if len(schemes) != count or len(parents) != count:
        raise SpecdecError(f"need one parent and one scheme per node: {count} nodes, {len(parents)} parents, "
                           f"{len(schemes)} schemes")
    vocab = parent_probs.shape[-1]
    laws = parent_probs.float().clone()
    for n, kind in enumerate(schemes):
        if kind == "deterministic":
            laws[..., n, :] = torch.nn.functional.one_hot(draft_tokens[..., n], vocab).float()
        elif kind == "without-replacement":
            earlier = [m for m in range(n) if parents[m] == parents[n] and schemes[m] == kind]
            if earlier:
                row = laws[..., n, :].scatter(-1, draft_tokens[..., earlier], 0.0)
                total = row.sum(-1, keepdim=True)
                laws[..., n, :] = torch.where(total > 0, row / total.clamp_min(1e-30), row)
        elif kind != "iid":
            raise SpecdecError(f"unknown sibling scheme {kind!r}; use iid, without-replacement or deterministic")
    return laws


def verify_tree(target_probs: torch.Tensor, draft_laws: torch.Tensor, draft_tokens: torch.Tensor,
                parents: list[int], generator: torch.Generator | None = None,
                details: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-draft speculative sampling over a token tree: the general rule behind SpecInfer's
    i.i.d. siblings, recursive rejection sampling and deterministic siblings.

    Args:
        target_probs: [..., N+1, V] the target's p at the root (row 0) and at each node (row n+1).
        draft_laws: [..., N, V] the law each node was drawn from given its earlier siblings
            (`sibling_laws`).
        draft_tokens: [..., N] (long); parents: [N] (-1: the root), parents before children,
            siblings in the order they were drawn.
        details: if a dict is given it receives "p", "q", "u" [..., N] for each node (p and q at
            the time the node was tried; nodes never tried hold their unused draw).
    Returns:
        last_node: [...] (long) the end of the accepted path (-1: no node accepted).
        next_token: [...] (long) the target's token after it.

    The walk starts at the root with p = p_root. At the current node, each child x (in order)
    is accepted with probability min(1, p(x)/q_x(x)), q_x its law; on acceptance the walk moves
    to x and p becomes the target's row at x; on rejection p <- norm(max(0, p - q_x)). When no
    child is left, the next token is drawn from p: the bonus token at a leaf, the residual else.

    Lossless (the emitted tokens follow the target's p exactly) when, for every node, its law is
    the distribution it was drawn from conditionally on the earlier siblings and the path to it,
    and no draft depends on the verification's draws: i.i.d. siblings with law q (a duplicate
    is always rejected, but its residual update counts: it may be skipped only with that update
    still applied), siblings drawn without replacement with the renormalised law, and any
    deterministic tree (one-hot laws) built from the context alone. Whether a sampled node is in
    the tree at all must not depend on its own token (pruning sampled siblings by their own
    probability is biased); deciding from the parent and the earlier siblings is fine. A chain
    with law q is `verify_draft`'s rule.
    """
    count = _check_tree(draft_tokens, parents, target_probs.shape[:-1], target_probs.shape[-1])
    if tuple(draft_laws.shape) != (*draft_tokens.shape, target_probs.shape[-1]):
        raise SpecdecError(f"draft_laws must have shape [..., N, V] = {(*draft_tokens.shape, target_probs.shape[-1])}, "
                           f"got {tuple(draft_laws.shape)} (vocabularies of target and drafter must match)")
    if torch.isnan(target_probs).any() or torch.isnan(draft_laws).any():
        raise SpecdecError("NaN in target_probs or draft_laws")
    if (target_probs < 0).any() or (draft_laws < 0).any():
        raise SpecdecError("negative entries in target_probs or draft_laws")
    p_rows = target_probs.float()
    laws = draft_laws.float()
    p = p_rows[..., 0, :]
    p = p / p.sum(-1, keepdim=True)
    current = torch.full(draft_tokens.shape[:-1], -1, dtype=torch.long, device=p.device)
    u = torch.rand(draft_tokens.shape, generator=generator, device=p.device, dtype=torch.float32)
    if draft_tokens.dim() == 1:  # one sequence: only the nodes the walk reaches cost anything
        return _walk_tree(p, p_rows, laws, draft_tokens, parents, u, generator, details)
    seen_p, seen_q = [], []
    for n in range(count):
        active = current == parents[n]
        x = draft_tokens[..., n:n + 1]
        q = laws[..., n, :]
        p_x, q_x = p.gather(-1, x).squeeze(-1), q.gather(-1, x).squeeze(-1)
        seen_p.append(p_x)
        seen_q.append(q_x)
        accepted = active & (u[..., n] * q_x < p_x)
        rejected = active & ~accepted
        residual = (p - q).clamp_min(0)
        total = residual.sum(-1, keepdim=True)
        # an all-zero residual after a rejection can only come from rounding when p ≈ q: keep p
        residual = torch.where(total > 0, residual / total.clamp_min(1e-30), p)
        p_next = p_rows[..., n + 1, :]
        p_next = p_next / p_next.sum(-1, keepdim=True)
        p = torch.where(accepted[..., None], p_next, torch.where(rejected[..., None], residual, p))
        current = torch.where(accepted, torch.full_like(current, n), current)
    if details is not None and count:
        details.update(p=torch.stack(seen_p, -1), q=torch.stack(seen_q, -1), u=u)
    return current, sample(p, generator)


def _walk_tree(p: torch.Tensor, p_rows: torch.Tensor, laws: torch.Tensor, draft_tokens: torch.Tensor,
               parents: list[int], u: torch.Tensor, generator: torch.Generator | None,
               details: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify_tree` for one sequence (no leading dimensions): the same rule and the same draws,
    visiting only the children of the nodes on the walk."""
    current = -1
    tokens = draft_tokens.tolist()
    seen_p = torch.zeros(len(tokens))
    seen_q = torch.zeros(len(tokens))
    for n, x in enumerate(tokens):
        if parents[n] != current:
            continue
        q = laws[n]
        p_x, q_x = float(p[x]), float(q[x])
        seen_p[n], seen_q[n] = p_x, q_x
        if float(u[n]) * q_x < p_x:
            current = n
            p = p_rows[n + 1] / p_rows[n + 1].sum()
        else:
            residual = (p - q).clamp_min(0)
            total = residual.sum()
            if total > 0:  # else rounding when p ≈ q: keep p
                p = residual / total
    if details is not None and tokens:
        details.update(p=seen_p, q=seen_q, u=u)
    return torch.tensor(current, device=p.device), sample(p, generator)


def verify_tree_greedy(target_tokens: torch.Tensor, draft_tokens: torch.Tensor,
                       parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify_tree` for a greedy target: from the root, follow the child that carries the
    target's argmax while there is one.

    Args:
        target_tokens: [..., N+1] (long) the target's argmax at the root (0) and each node (n+1).
        draft_tokens: [..., N] (long); parents: [N].
    Returns:
        last_node: [...] (long) end of the accepted path (-1: none); next_token: [...] the
        target's argmax there. Token for token the target's greedy output.
    """
    count = _check_tree(draft_tokens, parents, target_tokens.shape, None)
    current = torch.full(draft_tokens.shape[:-1], -1, dtype=torch.long, device=draft_tokens.device)
    for n in range(count):
        wanted = target_tokens.gather(-1, (current + 1).unsqueeze(-1)).squeeze(-1)
        hit = (current == parents[n]) & (draft_tokens[..., n] == wanted)
        current = torch.where(hit, torch.full_like(current, n), current)
    return current, target_tokens.gather(-1, (current + 1).unsqueeze(-1)).squeeze(-1)


def verify_tree_coupled(target_probs: torch.Tensor, noise: torch.Tensor, draft_tokens: torch.Tensor,
                        parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify_coupled` over a token tree: from the root, follow the child that equals the
    target's coupled draw while there is one.

    Args:
        target_probs: [..., N+1, V] the target's p at the root (row 0) and at each node (n+1).
        noise: [..., N+1, V] the races of the position each row's token would take: the root's
            row those of the tree's first position, a node at depth d (`trees.depths`: the root's
            children have depth 1) those d positions later.
        draft_tokens: [..., N] (long); parents: [N].
    Returns:
        last_node, next_token: as `verify_tree`'s; token for token the seeded autoregressive
        output, whatever the tree's shape or how its siblings were drawn.
    """
    if noise.shape != target_probs.shape:
        raise SpecdecError(f"noise must have the shape of target_probs {tuple(target_probs.shape)}, "
                           f"got {tuple(noise.shape)}")
    return verify_tree_greedy(race(target_probs, noise), draft_tokens, parents)


def _check_tree(draft_tokens: torch.Tensor, parents: list[int], target_shape: torch.Size,
                vocab: int | None) -> int:
    """Raise SpecdecError unless a tree's inputs fit together; returns its node count N.
    target_shape: the target's [..., N+1] leading shape (probs without V, or tokens)."""
    from .trees import check_parents

    if draft_tokens.dtype not in (torch.long, torch.int32, torch.int64):
        raise SpecdecError(f"draft_tokens must be integer (long), got {draft_tokens.dtype}")
    count = draft_tokens.shape[-1]
    if len(parents) != count:
        raise SpecdecError(f"a tree of {count} nodes needs {count} parents, got {len(parents)}")
    check_parents(parents)
    if tuple(target_shape) != (*draft_tokens.shape[:-1], count + 1):
        raise SpecdecError(f"target_probs (or target_tokens) must have shape [..., N+1] = "
                           f"{(*draft_tokens.shape[:-1], count + 1)} before V "
                           f"for draft_tokens {tuple(draft_tokens.shape)}, got {tuple(target_shape)}")
    if vocab is not None and count and (draft_tokens.min() < 0 or draft_tokens.max() >= vocab):
        raise SpecdecError(f"draft_tokens must lie in [0, {vocab}), got values outside it")
    return count
