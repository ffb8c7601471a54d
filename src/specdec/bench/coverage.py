"""SpecInfer's coverage figure (Miao et al. 2024) on our models: over the target's own
continuations, the share of positions where the target's token is among a drafter model's
top-k tokens, k = 1..5, teacher-forced (the continuations of `bench.reproduce`: greedy, and
sampled with top-p)."""

from __future__ import annotations


import torch
from rich.console import Console
from rich.progress import Progress

from .leviathan import COLUMNS, Continuations, teacher_forced_logits

TOP_K = 5
NUCLEUS_TOP_P = 0.9  # the nucleus continuations' top-p (at T = 1)
# SpecInfer (Miao et al. 2024), read from their figure, approximate: a single small model's top-k
# covers about this share of the LLM's greedy tokens
PAPER_GREEDY = {1: 0.70, 5: 0.90}


def in_top_k(drafter_logits: torch.Tensor, tokens: torch.Tensor, k: int = TOP_K) -> torch.Tensor:
    """drafter_logits [n, V], tokens [n] -> [n, k] bool: whether tokens[i] is among row i's
    top-j tokens, j = 1..k (cumulative: a token in the top 2 is in the top 3)."""
    ranked = drafter_logits.topk(k, dim=-1).indices  # [n, k]
    return (ranked == tokens.view(-1, 1)).cumsum(-1).bool()


def coverage(drafter, continuations: Continuations, vocab: int, k: int = TOP_K,
             console: Console | None = None, label: str = "") -> dict:
    """{"top_k": [share of positions whose token is in the drafter's top-j, j = 1..k], "positions"}."""
    hits = torch.zeros(k)
    positions = 0
    with Progress(*COLUMNS, console=console or Console(stderr=True), transient=True) as progress:
        bar = progress.add_task(f"coverage {label}", total=len(continuations.tokens))
        for prompt, generated in zip(continuations.prompts, continuations.tokens):
            if generated:
                logits = teacher_forced_logits(drafter, prompt, generated, vocab)
                hits += in_top_k(logits, torch.tensor(generated, device=logits.device), k).sum(0).float().cpu()
                positions += len(generated)
            progress.advance(bar)
    return {"top_k": (hits / max(positions, 1)).tolist(), "positions": positions}


def coverage_markdown(result: dict) -> str:
    """Our coverage table (drafter × continuation × k) beside SpecInfer's."""
    k = len(next(iter(result["drafters"].values()))["greedy"]["top_k"]) if result["drafters"] else TOP_K
    head = " | ".join(f"top-{j}" for j in range(1, k + 1))
    lines = [f"Target {result['target']}: the share of its own tokens that lie in the drafter's top-k, teacher-forced; "
             f"greedy: its T = 0 continuations, nucleus: T = 1, top-p {result['top_p']} "
             f"({result['positions']} positions each at most).", "",
             f"| drafter | target's tokens | {head} |", "|---|---|" + "---|" * k]
    for name, row in result["drafters"].items():
        for kind in ("greedy", "nucleus"):
            if kind in row:
                cells = " | ".join(f"{v:.0%}" for v in row[kind]["top_k"])
                lines.append(f"| {name} | {kind} ({row[kind]['positions']}) | {cells} |")
    paper = " | ".join(f"≈{PAPER_GREEDY[j]:.0%}" if j in PAPER_GREEDY else "" for j in range(1, k + 1))
    lines.append(f"| SpecInfer, one SSM (read from their figure, approximate) | greedy | {paper} |")
    return "\n".join(lines) + "\n"
