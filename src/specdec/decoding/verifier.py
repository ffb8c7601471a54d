"""How a sequence verifies its draft against the target's logits: a token of the target's own,
a chain, a tree, each under the sequence's sampler and acceptance rule (the rules themselves are
core/verify.py's)."""

from __future__ import annotations


import torch

from ..drafters import Draft
from ..drafters.base import one_hot
from ..errors import SpecdecError
from ..core.samplers import Sampler, greedy_tokens, race, sample
from ..core.trees import Tree
from ..core.verify import (Typical, sibling_laws, verify_coupled, verify_draft, verify_greedy, verify_tree, verify_tree_coupled,
                     verify_tree_greedy, verify_typical)



def _target_token(logits: torch.Tensor, sampler: Sampler, generator: torch.Generator,
                  noise: torch.Tensor | None = None) -> torch.Tensor | int:
    """The target's own token from logits [V] (greedy without building a one-hot row; under a
    seed the coupled draw with that position's races `noise` [V])."""
    if sampler.is_greedy:
        return greedy_tokens(logits)
    return race(sampler.probs(logits), noise) if noise is not None else sample(sampler.probs(logits), generator)


def _verify_tree(logits: torch.Tensor, tree: Tree, sampler: Sampler, generator: torch.Generator,
                 details: dict | None = None, noise: torch.Tensor | None = None) -> tuple[list[int], int]:
    """(accepted path as node indices, next_token) for the target's logits [N+1, V] over `tree`;
    `noise` [N+1, V]: each row's shared races under a seed (`verify_tree_coupled`), else None."""
    if not tree.tokens:
        return [], int(_target_token(logits[-1], sampler, generator, None if noise is None else noise[-1]))
    tokens = torch.tensor(tree.tokens, device=logits.device)
    if sampler.is_greedy:
        last, next_token = verify_tree_greedy(greedy_tokens(logits), tokens, tree.parents)
    elif noise is not None:
        last, next_token = verify_tree_coupled(sampler.probs(logits), noise, tokens, tree.parents)
    else:
        if tree.probs is None and tree.scheme != "deterministic":
            raise SpecdecError(f"a sampled tree with {tree.scheme!r} siblings needs the drafter's probs")
        parent_probs = tree.probs if tree.probs is not None else logits.new_zeros(len(tree), logits.shape[-1])
        laws = sibling_laws(parent_probs.to(logits.device), tokens, tree.parents, tree.scheme)
        last, next_token = verify_tree(sampler.probs(logits), laws, tokens, tree.parents, generator, details)
    if details:
        details.update({k: None if v is None else v.tolist() for k, v in details.items()})
    return tree.path_to(int(last)), int(next_token)


def chain_beta(logits: torch.Tensor, draft: Draft, sampler: Sampler, positions: list[int],
               target_probs: torch.Tensor | None = None) -> torch.Tensor:
    """β = Σ_x min(p(x), q(x)) at the chain draft's `positions` -> [len(positions)].

    logits: [γ+1, V] the target's rows over the draft (row j scores draft token j). The loop asks
    for the positions the target judged given an accepted prefix: 0 .. the first rejection
    (included), all γ when every token passed, less the positions a grammar forced (q and p both
    one-hot there; they are not the drafter's). p is the sampler's law, q the draft's `probs`, one-hot
    at the drafted token where the drafter gave none (a deterministic drafter: β = p(token)). Under
    greedy both are one-hot at their argmaxes (`logits_to_probs` at temperature 0), so β is 1 where
    the target's argmax is the drafted token, else 0: the T = 0 α of Leviathan et al.'s Table 3.
    Σ min(p, q), the standard rule's acceptance chance, whatever rule verified (lenient, typical
    or a seed's coupled draws). target_probs [γ+1, V]: the sampler's law of `logits` where the
    verification computed it (else computed here for the judged rows)."""
    if not positions:
        return logits.new_zeros(0, dtype=torch.float32)
    rows = torch.tensor(positions, device=logits.device)
    tokens = torch.tensor(draft.tokens, device=logits.device)[rows]
    if sampler.is_greedy:
        return (greedy_tokens(logits[rows]) == tokens).float()
    p = sampler.probs(logits[rows]) if target_probs is None else target_probs[rows]
    if draft.probs is None:
        return p.gather(-1, tokens[:, None]).squeeze(-1)
    q = draft.probs.to(p.device)[rows]
    from ..sizing.theory import acceptance_beta

    return acceptance_beta(p[:, :q.shape[-1]], q[:, :p.shape[-1]])


def _verify(logits: torch.Tensor, draft: Draft, sampler: Sampler, generator: torch.Generator,
            lenience: float = 1.0, details: dict | None = None, typical: Typical | None = None,
            noise: torch.Tensor | None = None, probs: torch.Tensor | None = None) -> tuple[int, int]:
    """(num_accepted, next_token) for the target's logits [γ+1, V] over `draft`; with a `details`
    dict, also the lists "p", "q", "u" of each draft token (for the step view); `noise` [γ+1, V]:
    each row's shared races under a seed (`verify_coupled`), else None; `probs` [γ+1, V]: the
    sampler's law of `logits` where the caller has it (else computed here)."""
    if not draft.tokens:
        return 0, int(_target_token(logits[-1], sampler, generator, None if noise is None else noise[-1]))
    tokens = torch.tensor(draft.tokens, device=logits.device)
    if not sampler.is_greedy and probs is None:
        probs = sampler.probs(logits)
    if sampler.is_greedy or noise is not None:
        if sampler.is_greedy:
            num_accepted, next_token = verify_greedy(greedy_tokens(logits), tokens)
        else:
            num_accepted, next_token = verify_coupled(probs, noise, tokens)
        if details is not None:  # one-hot p and q as under greedy: a token passes iff it is the target's
            target_tokens = greedy_tokens(logits) if sampler.is_greedy else race(probs, noise)
            matches = (target_tokens[:-1] == tokens).float()
            details.update(p=matches, q=torch.ones_like(matches), u=None)
    elif typical is not None:
        num_accepted, next_token = verify_typical(probs, tokens, typical, generator)
    else:
        q = draft.probs if draft.probs is not None else one_hot(draft.tokens, logits.shape[-1], logits.device)
        num_accepted, next_token = verify_draft(probs, q, tokens, generator, lenience, details)
    if details:
        details.update({k: None if v is None else v.tolist() for k, v in details.items()})
    return int(num_accepted), int(next_token)
