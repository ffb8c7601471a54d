"""Leviathan et al. 2023, Table 3 on our models: α = E[Σ_x min(p(x), q(x))] of every drafter we
have against one target, at T = 0 and T = 1.

Two stages. (i) The target writes its own continuations of Spec-Bench prompts once per sampler
(the batched engine, plain decoding, seeded under sampling), kept as token ids (JSON). (ii) Each
continuation is scored teacher-forced: one cache-free target pass gives p at every generated
position, and each drafter gives q at the same positions. A model drafter's q is its softmax
through the same sampler (at T = 0 both are one-hot at their argmax, as in verification, so β is
1 where the argmaxes agree); a model-free drafter's q is one-hot at the token it proposes there
(or its own q where it draws, n-gram under sampling), and it is scored only where it proposes;
the unigram and bigram tables' q is their normalised counts (argmax at T = 0).

Drafters are a registry (`DRAFTERS`): adding one is one entry.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..errors import SpecdecError
from ..core.samplers import Sampler
from ..sizing.theory import acceptance_beta

COLUMNS = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
BATCH = 16  # sequences in flight while the target writes its continuations
MAX_LOGITS = 256  # positions scored per cache-free pass: longer continuations are scored in chunks

# Leviathan et al. 2023, Table 3: (target, drafter, α at T = 0, α at T = 1)
PAPER_TABLE3 = [
    ("GPT-like (97M)", "unigram", 0.03, 0.03), ("GPT-like (97M)", "bigram", 0.05, 0.05),
    ("GPT-like (97M)", "GPT-like (6M)", 0.88, 0.89),
    ("T5-XXL (EnDe)", "unigram", 0.08, 0.07), ("T5-XXL (EnDe)", "bigram", 0.20, 0.14),
    ("T5-XXL (EnDe)", "T5-small", 0.75, 0.62), ("T5-XXL (EnDe)", "T5-base", 0.80, 0.68),
    ("T5-XXL (EnDe)", "T5-large", 0.82, 0.71),
    ("T5-XXL (CNNDM)", "unigram", 0.13, 0.08), ("T5-XXL (CNNDM)", "bigram", 0.23, 0.18),
    ("T5-XXL (CNNDM)", "T5-small", 0.65, 0.53), ("T5-XXL (CNNDM)", "T5-base", 0.73, 0.55),
    ("T5-XXL (CNNDM)", "T5-large", 0.75, 0.56),
    ("LaMDA (137B)", "LaMDA (100M)", 0.61, 0.57), ("LaMDA (137B)", "LaMDA (2B)", 0.71, 0.71),
    ("LaMDA (137B)", "LaMDA (8B)", 0.75, 0.75),
]


# --- stage (i): the target's own continuations ---------------------------------------------------

@dataclass
class Continuations:
    """The target's continuations of some prompts under one sampler (what stage (ii) scores)."""

    target: str
    sampler: str  # Sampler.describe()
    seed: int
    max_new_tokens: int
    prompts: list[list[int]]  # token ids, chat template applied
    tasks: list[str]
    tokens: list[list[int]]  # each prompt's continuation

    @property
    def total(self) -> int:
        return sum(len(t) for t in self.tokens)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(vars(self)) + "\n")

    @classmethod
    def load(cls, path: Path) -> "Continuations":
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError) as exc:
            raise SpecdecError(f"{path}: not a continuations file written by `specdec reproduce` ({exc})") from None


def spec_bench_prompts(count: int | None = None) -> list[tuple[str, str]]:
    """(task, text) of Spec-Bench prompts, taken round-robin across its tasks (so a short run still
    covers every task), `count` of them (None: all)."""
    from .datasets import load_prompts

    by_task: dict[str, list[str]] = {}
    for p in load_prompts("spec-bench"):
        by_task.setdefault(p.task, []).append(p.text)
    order = []
    for i in range(max(len(v) for v in by_task.values())):
        order += [(task, texts[i]) for task, texts in by_task.items() if i < len(texts)]
    return order[:count] if count is not None else order


def generate_continuations(target, prompts: Sequence[Sequence[int]], sampler: Sampler, max_new_tokens: int,
                           seed: int = 0, tasks: Sequence[str] | None = None, batch: int = BATCH,
                           console: Console | None = None, until: int | None = None) -> Continuations:
    """The target's continuations of `prompts` (plain decoding, `batch` sequences in flight; seeded
    per prompt, `seed + i`, under sampling). until: stop after the batch that brings the total to
    this many tokens (the prompts after it are left out; how many a prompt gives is known only
    once it has ended)."""
    from ..engine import generate_many

    tokens: list[list[int]] = []
    with Progress(*COLUMNS, console=console or Console(stderr=True), transient=True) as progress:
        bar = progress.add_task(f"target continuations ({sampler.describe()})", total=until or len(prompts))
        for start in range(0, len(prompts), batch):
            chunk = [list(p) for p in prompts[start:start + batch]]
            seeds = None if sampler.is_greedy else [seed + start + i for i in range(len(chunk))]
            results = generate_many(chunk, target, None, max_batch=batch, seeds=seeds, sampler=sampler,
                                    max_new_tokens=max_new_tokens)
            tokens += [list(r.tokens) for r in results]
            made = sum(len(t) for t in tokens)
            progress.update(bar, completed=min(made, until) if until else len(tokens))
            if until is not None and made >= until:
                break
    used = len(tokens)
    return Continuations(target.name, sampler.describe(), seed, max_new_tokens, [list(p) for p in prompts[:used]],
                         list(tasks or ["-"] * len(prompts))[:used], tokens)


# --- stage (ii): teacher-forced scoring ----------------------------------------------------------

def teacher_forced_logits(model, prompt: Sequence[int], generated: Sequence[int], vocab: int) -> torch.Tensor:
    """logits [n, vocab] of `model` at each of the n generated positions (the distribution each
    token was drawn from), from cache-free passes over prompt + continuation, in chunks of
    MAX_LOGITS positions."""
    ids = list(prompt) + list(generated)
    n, rows = len(generated), []
    for start in range(0, n, MAX_LOGITS):
        end = min(n, start + MAX_LOGITS)
        rows.append(model.forward(ids[:len(prompt) + end - 1], None, end - start)[:, :vocab].float())
    return torch.cat(rows) if rows else torch.zeros(0, vocab)


class ModelScorer:
    """A drafter model's q: its teacher-forced softmax through the sampler."""

    def __init__(self, model):
        self.model = model

    def betas(self, prompt, generated, p: torch.Tensor, sampler: Sampler) -> torch.Tensor:
        q = sampler.probs(teacher_forced_logits(self.model, prompt, generated, p.shape[-1]).to(p.device))
        return acceptance_beta(p, q)


class ProposalScorer:
    """A model-free drafter's q at each position: its one-token proposal after the true context
    (one-hot, or its own q where it draws); NaN where it proposes nothing."""

    def __init__(self, make: Callable[[], object], target, seed: int = 0):
        self.make, self.target, self.seed = make, target, seed

    def betas(self, prompt, generated, p: torch.Tensor, sampler: Sampler) -> torch.Tensor:
        from ..drafters.base import accept_draft

        drafter = self.make()
        drafter.check_target(self.target)
        drafter.start(list(prompt))
        generator = torch.Generator(device=p.device).manual_seed(self.seed)
        context, out = list(prompt), torch.full((len(generated),), float("nan"))
        for t, token in enumerate(generated):
            draft = drafter.propose(context, 1, sampler, generator, lambda *_: True)
            if draft.tokens:
                if draft.probs is not None:
                    out[t] = acceptance_beta(p[t], draft.probs[0].to(p.device))
                else:
                    out[t] = p[t, draft.tokens[0]]
            accept_draft(drafter, len(context), [])
            context.append(token)
        return out


class CountsScorer:
    """The unigram or bigram table's q (`drafters.bigram.BigramTable`): the normalised counts,
    the argmax at T = 0."""

    def __init__(self, table, order: int):
        self.table, self.order = table, order

    def betas(self, prompt, generated, p: torch.Tensor, sampler: Sampler) -> torch.Tensor:
        n = len(generated)
        if self.order == 1:
            q = self.table.unigram_probs().to(p.device).expand(n, -1)
        else:
            previous = (list(prompt) + list(generated))[len(prompt) - 1:len(prompt) - 1 + n]
            q = self.table.bigram_probs(previous).to(p.device)
        if sampler.is_greedy:
            return (p.argmax(-1) == q.argmax(-1)).float()
        return acceptance_beta(p, q)


@dataclass
class Context:
    """What the registry's entries build from: the target, a loader of catalogue models, the
    unigram/bigram corpus table and a seed."""

    target: object
    load_model: Callable[[str], object]
    table: Callable[[], object]
    seed: int = 0


@dataclass(frozen=True)
class Entry:
    summary: str
    make: Callable[[Context], object]  # -> a scorer (`betas(prompt, generated, p, sampler)`)
    proposes_everywhere: bool = True  # False: model-free, scored where it proposes


def registry_drafter(name: str, target) -> Callable[[], object]:
    """The drafter factory of method `name` on `target` alone, through the method registry."""
    from ..decoding.speculation import Parts, build, resolve

    return build(resolve(name), Parts(target)).make_drafter


def _own_layers(method: str) -> Callable[[Context], object]:
    """The target drafting for itself (self-skip, early-exit), scored teacher-forced."""
    return lambda ctx: ModelScorer(registry_drafter(method, ctx.target)().model)


def _free(name: str) -> Callable[[Context], object]:
    def make(ctx: Context):
        return ProposalScorer(registry_drafter(name, ctx.target), ctx.target, ctx.seed)
    return make


DRAFTERS: dict[str, Entry] = {
    "self-skip": Entry("the target with layers skipped (chosen at start), scored teacher-forced", _own_layers("self-skip")),
    "early-exit": Entry("the target's first layers and its own head (exit chosen at start), scored teacher-forced",
                        _own_layers("early-exit")),
    "lookup": Entry("prompt lookup (one-hot q where it proposes)", _free("lookup"), proposes_everywhere=False),
    "ngram": Entry("NASD n-gram, n = 4, online (its count q where it proposes)", _free("ngram"),
                   proposes_everywhere=False),
    "suffix": Entry("suffix drafting over the prompt and output (one-hot q where it proposes)", _free("suffix"),
                    proposes_everywhere=False),
    "unigram": Entry("unigram counts of the corpus", lambda ctx: CountsScorer(ctx.table(), 1)),
    "bigram": Entry("bigram counts of the corpus (`--drafter bigram`)", lambda ctx: CountsScorer(ctx.table(), 2)),
}


def catalogue_drafters(target_name: str) -> list[str]:
    """The catalogue's models other than the target (each scored where its vocabulary is the target's)."""
    from ..models import catalogue as registry

    return [name for name in registry.MODELS if name != target_name]


def score(continuations: Continuations, target, scorers: dict[str, object], sampler: Sampler,
          console: Console | None = None) -> dict[str, dict]:
    """{drafter: {"alpha", "positions", "proposed", "share_proposed"}} over every continuation:
    α is the mean β over the positions where the drafter proposed."""
    sums = {name: [0.0, 0] for name in scorers}
    positions = 0
    with Progress(*COLUMNS, console=console or Console(stderr=True), transient=True) as progress:
        bar = progress.add_task(f"teacher-forced scoring ({sampler.describe()})", total=len(continuations.tokens))
        for prompt, generated in zip(continuations.prompts, continuations.tokens):
            if generated:
                logits = teacher_forced_logits(target, prompt, generated, target.vocab_size)
                p = sampler.probs(logits)
                positions += len(generated)
                for name, scorer in scorers.items():
                    beta = scorer.betas(prompt, generated, p, sampler)
                    kept = beta[~beta.isnan()]
                    sums[name][0] += float(kept.sum())
                    sums[name][1] += int(kept.numel())
            progress.advance(bar)
    return {name: {"alpha": s / n if n else None, "proposed": n, "positions": positions,
                   "share_proposed": n / positions if positions else 0.0} for name, (s, n) in sums.items()}


# --- the table ------------------------------------------------------------------------------------

def alpha_markdown(result: dict) -> str:
    """Our Table 3 (drafter × α at T = 0 and T = 1, positions, share proposed) beside the paper's."""
    positions = result["positions"]
    lines = [f"Target {result['target']}, {positions.get('0', 0)} (T = 0) and {positions.get('1', 0)} (T = 1) "
             f"target tokens of its own continuations of {result['prompts']} Spec-Bench prompts; "
             f"unigram and bigram counted over {result['corpus']}.", "",
             "| drafter | α (T = 0) | α (T = 1) | positions scored (T = 0 / T = 1) | share proposed (T = 0 / T = 1) |",
             "|---|---|---|---|---|"]
    for name, row in result["drafters"].items():
        t0, t1 = row.get("0"), row.get("1")

        def cell(r, key, fmt):
            return "–" if r is None or r.get(key) is None else format(r[key], fmt)
        lines.append(f"| {name} | {cell(t0, 'alpha', '.2f')} | {cell(t1, 'alpha', '.2f')} | "
                     f"{cell(t0, 'proposed', 'd')} / {cell(t1, 'proposed', 'd')} | "
                     f"{cell(t0, 'share_proposed', '.0%')} / {cell(t1, 'share_proposed', '.0%')} |")
    for name, why in result.get("left_out", {}).items():
        lines.append(f"| {name} | left out: {why} | | | |")
    lines += ["", "Leviathan et al. 2023, Table 3:", "", "| target | drafter | α (T = 0) | α (T = 1) |",
              "|---|---|---|---|"]
    lines += [f"| {t} | {d} | {a0:.2f} | {a1:.2f} |" for t, d, a0, a1 in PAPER_TABLE3]
    return "\n".join(lines) + "\n"

