"""The target's log-probabilities of the tokens a generation emitted (OpenAI's `logprobs`).

Every emitted token was chosen from one row of a target pass: an accepted draft token from the row
that scored its position, the target's own token from the row after the accepted ones. That row is
the target's distribution there whatever was drafted, and a row-exact pass computes it bit for bit
as a decode step does, so a token's log-probability does not depend on the method, the draft, or
what shared the pass. Values are the model's own (log-softmax of its logits at temperature 1, before
any sampling setting), as vLLM reports by default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenLogprob:
    """One emitted token: its log-probability and the `top` most likely tokens at its position
    (id, log-probability), most likely first."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor]:
    """Log-probabilities of `tokens` under `logits`, and each row's `top` best.

    logits: [T, V] (any float dtype; computed in fp32); tokens: [T] long; top: 0..V.
    Returns (chosen [T] fp32, top_ids [T, top] long, top_values [T, top] fp32), top_values sorted
    in decreasing order (ties: lower id first, as torch.topk on CPU gives them).
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(-1, tokens.view(-1, 1).to(logp.device)).squeeze(-1)
    values, ids = logp.topk(top, dim=-1) if top else (logp[:, :0], torch.zeros(len(logp), 0, dtype=torch.long))
    return chosen, ids, values


def emitted_rows(num_accepted: int, path: list[int] | None) -> list[int]:
    """Which row of a verification pass's logits scored each token its step emitted: a chain's
    accepted drafts and its next token come from rows 0..num_accepted; a tree's from the root (row
    0) and then the row of each accepted node (node n is row n + 1)."""
    if path is not None:
        return [0] + [node + 1 for node in path]
    return list(range(num_accepted + 1))


def collect(logits: torch.Tensor, rows: list[int], tokens: list[int], top: int) -> list[TokenLogprob]:
    """`TokenLogprob`s of `tokens` (a step's emitted tokens, possibly cut short at EOS or the limit),
    token i read from row `rows[i]` of logits [N, V]."""
    if not tokens:
        return []
    picked = logits[torch.as_tensor(rows[:len(tokens)], device=logits.device)]
    chosen, ids, values = token_logprobs(picked, torch.as_tensor(tokens), top)
    return [TokenLogprob(t, float(c), list(zip(i.tolist(), v.tolist())))
            for t, c, i, v in zip(tokens, chosen.tolist(), ids, values)]
