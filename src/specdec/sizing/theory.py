"""Closed forms of Leviathan et al. (2023), §3: acceptance, expected tokens, walltime, arithmetic.

alpha: the expected acceptance rate E[β], β = Σ_x min(p(x), q(x)) per position (iid assumption).
gamma: draft tokens per step. c: cost of one drafter pass / one target pass (walltime).
c_hat: arithmetic operations of one drafter token / one target token.
"""

from __future__ import annotations

import math

import torch

from ..errors import SpecdecError


def _check(alpha: float, gamma: int | None = None, c: float | None = None) -> None:
    if not 0 <= alpha <= 1:
        raise SpecdecError(f"alpha must be in [0, 1], got {alpha}")
    if gamma is not None and (not isinstance(gamma, int) or gamma < 1):
        raise SpecdecError(f"gamma must be an integer >= 1, got {gamma!r}")
    if c is not None and c < 0:
        raise SpecdecError(f"cost coefficient must be >= 0, got {c}")


def acceptance_beta(target_probs: torch.Tensor, draft_probs: torch.Tensor, lenience: float = 1.0) -> torch.Tensor:
    """β = Σ_x min(p(x), q(x)) per position: [..., V], [..., V] -> [...].

    With lenience l in (0, 1] (Leviathan et al. A.5: accept when q(x) ≤ p(x)/l), β = Σ min(q, p/l).
    """
    if not 0 < lenience <= 1:
        raise SpecdecError(f"lenience must be in (0, 1], got {lenience}")
    return torch.minimum(target_probs.float() / lenience, draft_probs.float()).sum(-1)


def coupled_acceptance(target_probs: torch.Tensor, draft_probs: torch.Tensor, top: int = 64) -> torch.Tensor:
    """The chance that a seed's coupled draws agree (Gumbel-max coupling: the drafter proposes
    argmax q/E, the target takes argmax p/E, with the same Exp(1) races E): [..., V], [..., V] -> [...].

    Both pick x iff every y has E_y > E_x·max(p(y)/p(x), q(y)/q(x)), so
    P(agree) = Σ_x 1 / Σ_y max(p(y)/p(x), q(y)/q(x)), each term at most min(p(x), q(x)). Summed
    over the `top` ids of min(p, q): exact to within the rest's Σ min(p, q). At least
    (1 − TV)/(1 + TV) (Daliri et al. 2024), against the standard rule's β = 1 − TV.
    """
    p, q = target_probs.float(), draft_probs.float()
    lead = p.shape[:-1]
    p, q = p.reshape(-1, p.shape[-1]), q.reshape(-1, q.shape[-1])
    agree = torch.zeros(p.shape[0])
    for row in range(p.shape[0]):  # [top, V] at a time: the whole [n, top, V] would not fit
        least, ids = torch.minimum(p[row], q[row]).topk(min(top, p.shape[-1]))
        ids = ids[least > 0]
        p_x, q_x = p[row, ids, None], q[row, ids, None]  # [k, 1]
        spread = torch.maximum(p[row] * q_x, q[row] * p_x).sum(-1) / (p_x * q_x).squeeze(-1)  # [k]
        agree[row] = (1 / spread).sum()
    return agree.reshape(lead)


def lenient_alpha_range(alpha: float, lenience: float) -> tuple[float, float]:
    """Where α under lenience l, E[Σ min(q, p/l)] (`acceptance_beta`), lies given the exact α =
    E[Σ min(q, p)] alone: [α, min(1, α/l)], as min(q, p) ≤ min(q, p/l) ≤ min(q, p)/l and Σ q = 1.
    Which point depends on p and q (`specdec measure --lenience` measures it)."""
    _check(alpha)
    if not 0 < lenience <= 1:
        raise SpecdecError(f"lenience must be in (0, 1], got {lenience}")
    return alpha, min(1.0, alpha / lenience)


def alpha_from_distributions(target_probs: torch.Tensor, draft_probs: torch.Tensor, lenience: float = 1.0) -> float:
    """α = E[β] over all leading positions of [..., V] distributions."""
    return float(acceptance_beta(target_probs, draft_probs, lenience).mean())


def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens per step, (1 − α^(γ+1)) / (1 − α); γ + 1 when α = 1."""
    _check(alpha, gamma)
    if alpha == 1:
        return gamma + 1.0
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def walltime_improvement(alpha: float, gamma: int, c: float) -> float:
    """Expected speedup over AR, (1 − α^(γ+1)) / ((1 − α)(γc + 1)), if verification costs one pass."""
    _check(alpha, gamma, c)
    return expected_tokens(alpha, gamma) / (gamma * c + 1)


def step_speedup(tokens: float, drafter_passes: int, c: float, verification: float) -> float:
    """Expected speedup over AR of a step that makes `tokens` tokens with `drafter_passes` drafter
    passes (each c target passes) and one verification pass costing `verification` 1-token target
    passes: tokens / (drafter_passes·c + verification). With tokens = expected_tokens(α, γ),
    γ drafter passes and verification 1 this is `walltime_improvement`; for a tree, the passes
    are its depth and the verification its width's measured (or assumed) cost."""
    if tokens < 1 or drafter_passes < 0 or c < 0 or verification <= 0:
        raise SpecdecError(f"step_speedup needs tokens >= 1, drafter passes >= 0, c >= 0 and verification > 0, "
                           f"got {tokens!r}, {drafter_passes!r}, {c!r}, {verification!r}")
    return tokens / (drafter_passes * c + verification)


def flat_verification(nodes: int, at16: float = 1.2) -> float:
    """The verification cost (in 1-token target passes) of scoring `nodes` drafted tokens plus one
    on a machine where wide passes are nearly free: linear in the nodes, 16 of them costing
    `at16` (1.2: a GPU at batch 1, or a CPU with AMX once the output head no longer dominates)."""
    if nodes < 0 or at16 < 1:
        raise SpecdecError(f"flat_verification needs nodes >= 0 and at16 >= 1, got {nodes!r}, {at16!r}")
    return 1.0 + (at16 - 1.0) * nodes / 16


def optimal_gamma(alpha: float, c: float, max_gamma: int = 64) -> int:
    """The integer γ in [1, max_gamma] that maximises `walltime_improvement`."""
    _check(alpha, c=c)
    return max(range(1, max_gamma + 1), key=lambda g: walltime_improvement(alpha, g, c))


def arithmetic_increase(alpha: float, gamma: int, c_hat: float) -> float:
    """Expected factor of extra arithmetic, (γĉ + γ + 1)(1 − α) / (1 − α^(γ+1))."""
    _check(alpha, gamma, c_hat)
    return (gamma * c_hat + gamma + 1) / expected_tokens(alpha, gamma)


def expected_tree_tokens(parents: list[int], ranks: list[int], acceptance: list[float]) -> float:
    """Expected tokens per step of a draft tree under the positional acceptance model (Sequoia,
    Chen et al. 2024): 1 + Σ_nodes Π_{path to the node} acceptance[rank], the target's own token
    included.

    parents: [N] each node's parent (-1: the root), parents before children (core/trees.py).
    ranks:   [N] each node's rank among its siblings' tokens in the drafter's order (0: best).
    acceptance[r]: the chance that the rank-r child is the accepted one, given its parent was;
        ranks past the end of the list count as never accepted.
    A node lies on the accepted path with the product of its path's acceptances, and each such
    node is one accepted token: the sum is E[accepted], by linearity. A chain of rank-0 nodes
    with acceptance[0] = α gives Leviathan et al.'s (1 − α^(γ+1)) / (1 − α) (`expected_tokens`).
    """
    from ..core.trees import check_parents

    if len(ranks) != len(parents):
        raise SpecdecError(f"need one rank per node: {len(parents)} parents, {len(ranks)} ranks")
    check_parents(parents)
    for a in acceptance:
        _check(a)
    if any(not isinstance(r, int) or r < 0 for r in ranks):
        raise SpecdecError(f"ranks must be integers >= 0, got {list(ranks)!r}")
    reach: list[float] = []
    for parent, rank in zip(parents, ranks):
        own = acceptance[rank] if rank < len(acceptance) else 0.0
        reach.append(own * (1.0 if parent < 0 else reach[parent]))
    return 1.0 + sum(reach)


def typical_first_token_law(target_probs: torch.Tensor, draft_probs: torch.Tensor, epsilon: float = 0.09,
                            delta: float = 0.3) -> torch.Tensor:
    """The law of the first token emitted under typical acceptance (`verify.Typical`) when the
    drafter draws x ~ q: r(y) = q(y)·a(y) + (1 - Σ_x q(x)·a(x))·p(y), a(y) = 1 if p(y) passes
    the threshold. p, q: [..., V] -> r [..., V]. With exact verification r = p."""
    from ..core.verify import Typical, typical_threshold

    p, q = target_probs.float(), draft_probs.float()
    passes = (p > typical_threshold(p, Typical(epsilon, delta)).unsqueeze(-1)).float()
    kept = q * passes
    return kept + (1 - kept.sum(-1, keepdim=True)) * p


def lenient_first_token_law(target_probs: torch.Tensor, draft_probs: torch.Tensor,
                            lenience: float = 1.0) -> torch.Tensor:
    """The law of the first token a step emits under lenient acceptance (`verify_draft`'s
    `lenience` l; Leviathan et al. A.5) when the drafter draws x ~ q: x is kept with probability
    min(1, p(x)/(l·q(x))), else the target's token comes from the residual norm(max(0, p − q)), so
    r(y) = min(q(y), p(y)/l) + (1 − β_l)·norm(max(0, p − q))(y), with β_l = Σ min(q, p/l)
    (`acceptance_beta`). p, q: [..., V] -> r [..., V]. With l = 1, r = p (the exact rule); for
    l < 1 the distance TV(p, r) (`total_variation`) is what the lenience costs at one position."""
    if not 0 < lenience <= 1:
        raise SpecdecError(f"lenience must be in (0, 1], got {lenience}")
    p, q = target_probs.float(), draft_probs.float()
    kept = torch.minimum(q, p / lenience)
    residual = (p - q).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    # an empty residual only where p = q, where nothing is rejected; verify_draft then samples p
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p)
    return kept + (1 - kept.sum(-1, keepdim=True)).clamp_min(0) * residual


def total_variation(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """½ Σ |a - b| over the last dimension: [..., V] -> [...]."""
    return 0.5 * (a.float() - b.float()).abs().sum(-1)


def alpha_from_tokens(tokens_per_step: float, gamma: int) -> float:
    """The α that Leviathan et al.'s E[tokens] = (1 − α^(γ+1)) / (1 − α) maps to `tokens_per_step`
    at a fixed draft length γ (the inverse of `expected_tokens`, by bisection: it rises from 1 at
    α = 0 to γ + 1 at α = 1). Tokens per step outside [1, γ + 1] are clamped to α = 0 or 1."""
    _check(0.0, gamma)
    if tokens_per_step <= 1:
        return 0.0
    if tokens_per_step >= gamma + 1:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(60):  # 2^-60: far below any measured tokens per step's own error
        middle = (low + high) / 2
        if expected_tokens(middle, gamma) < tokens_per_step:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def rule_of_thumb_speedup(alpha: float, gamma: int, c: float) -> float:
    """The speedup tutorials quote, (1 + γα) / (1 + γc): it counts γα accepted tokens per step, as
    if a rejection did not end the step's acceptance. Theorem 3.8 (`walltime_improvement`) counts
    α + α² + … + α^γ instead: never more, and far less at large γ. Kept to show the difference."""
    _check(alpha, gamma, c)
    return (1 + gamma * alpha) / (1 + gamma * c)


def rule_of_thumb_gamma(c: float) -> float:
    """The draft length tutorials pair with `rule_of_thumb_speedup`, γ* ≈ √(1/c − 1) (0 < c ≤ 1)."""
    if not 0 < c <= 1:
        raise SpecdecError(f"the rule of thumb's γ* needs c in (0, 1], got {c}")
    return (1 / c - 1) ** 0.5


def oracle_walltime_improvement(alpha: float, c: float) -> float:
    """Expected speedup over AR with an oracle draft length (Leviathan et al. §3.5's bound): each
    step drafts exactly the K tokens that will be accepted (K + 1 tokens for K drafter passes and one
    target pass, so no draft is wasted). Under iid acceptance K is geometric, P(K = k) = α^k (1 − α),
    and the long-run rate E[K + 1] / E[Kc + 1] is 1 / (1 − α + αc): unbounded (inf) at α = 1 and
    c = 0, where every draft passes and drafting is free."""
    _check(alpha, c=c)
    denominator = 1 - alpha + alpha * c
    return math.inf if denominator <= 0 else 1 / denominator


def trace_speedup(accepted: list[bool], c: float, gamma: int | None = None) -> tuple[float, float]:
    """(tokens per step, speedup over AR) of drafting along one acceptance trace, a fixed γ or an
    oracle (gamma None). accepted[t]: whether the drafter's token at position t of the target's
    continuation would pass given the text before it (greedy: the argmaxes agree; sampled: a draw
    with probability β_t). A step starting at t accepts the run k of passes from t (cut at γ) and
    adds the target's token after it: k + 1 tokens, next step at t + k + 1. It costs γc + 1 target
    passes at fixed γ and kc + 1 with the oracle, which drafts exactly k. The trace's last step may
    run past its end (cut there); an empty trace gives (0, 0)."""
    if c < 0 or (gamma is not None and (not isinstance(gamma, int) or gamma < 1)):
        raise SpecdecError(f"trace_speedup needs c >= 0 and gamma None or an integer >= 1, got {c!r}, {gamma!r}")
    t = steps = tokens = 0
    cost = 0.0
    while t < len(accepted):
        k = 0
        while t + k < len(accepted) and accepted[t + k] and (gamma is None or k < gamma):
            k += 1
        made = min(k + 1, len(accepted) - t)
        steps, tokens = steps + 1, tokens + made
        cost += (k if gamma is None else gamma) * c + 1
        t += k + 1
    return (tokens / steps, tokens / cost) if steps else (0.0, 0.0)
