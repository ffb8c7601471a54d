"""How a sequence verifies its draft against the target's logits: the verifier it chooses once
(`choose_verifier`: greedy | coupled | standard | lenient | typical, over a chain or a tree), and
the batch's one call over the sequences whose target tokens decide their steps (`decide_batch`).
The acceptance rules themselves are core/verify.py's; a sequence reaches them through here alone."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..drafters import Draft
from ..drafters.base import one_hot
from ..errors import SpecdecError
from ..core.samplers import Sampler, SeededNoise, greedy_rows, greedy_tokens, race, sample
from ..core.trees import Tree, depths
from ..core.verify import (Typical, sibling_laws, verify_coupled, verify_draft, verify_greedy, verify_ragged,
                           verify_tree, verify_tree_coupled, verify_tree_greedy, verify_typical)

RULES = ("greedy", "coupled", "standard", "lenient", "typical")


@dataclass(frozen=True)
class Verdict:
    """What one verification decided.

    num_accepted: how many draft tokens stand (a chain's prefix, a tree's path).
    next_token: the target's own token after them (at a rejection, or the bonus).
    path: a tree's accepted nodes, root side first (None for a chain).
    probs: [γ+1, V] the sampler's law of a chain's rows, where the verification computed it.
    """

    num_accepted: int
    next_token: int
    path: list[int] | None = None
    probs: torch.Tensor | None = field(default=None, compare=False)

    @property
    def accepted(self) -> Sequence[int]:
        """The draft positions that stand, in order: a chain's 0 .. num_accepted-1, a tree's path."""
        return range(self.num_accepted) if self.path is None else self.path

    def rejected(self, draft: Draft) -> bool:
        """Whether the target rejected one of a chain's draft tokens (its row's p is what an online
        distiller learns from; a tree has no single rejected position)."""
        return self.path is None and self.num_accepted < len(draft.tokens)


class Verifier:
    """One sequence's verification under its sampler and acceptance rule, for one draft shape.

    rule: one of RULES; trees: whether it verifies token trees (else chains).
    batchable: whether the target's own token at each row decides the step (greedy and coupled
        chains), so that a batched step verifies it with the others in one call (`decide_batch`).
    noise: the sequence's shared races under a seed (`SeededNoise`), for the coupled rule alone.
    """

    rule = ""
    trees = False
    batchable = False

    def __init__(self, sampler: Sampler, noise: SeededNoise | None = None, lenience: float = 1.0,
                 typical: Typical | None = None):
        self.sampler, self.noise, self.lenience, self.typical = sampler, noise, lenience, typical

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def target_token(self, logits: torch.Tensor, generator: torch.Generator, start: int) -> int:
        """The target's own token from logits [V] at sequence position `start` (a step with no draft,
        or an empty one): its argmax, a fresh draw, or under a seed the coupled draw."""
        return int(sample(self.sampler.probs(logits), generator))

    def verify(self, logits: torch.Tensor, draft: Draft, generator: torch.Generator, start: int,
               details: dict | None = None) -> Verdict:
        """The verdict on `draft` from the target's logits [n+1, V] over it (row j scores draft token
        j, the last row the token after the whole draft); `start`: the sequence's length (the draft's
        first position); `details`, where given, receives what the step view shows."""
        raise NotImplementedError

    def beta(self, logits: torch.Tensor, draft: Draft, verdict: Verdict, forced: Sequence[int]) -> tuple[float, int]:
        """(Σ β, positions) at the draft positions this pass judged, for the α estimate (`chain_beta`);
        a tree adds nothing."""
        return 0.0, 0

    def _races(self, start: int, offsets: Sequence[int], vocab: int) -> torch.Tensor:
        """The shared races [n, V] of the positions `offsets` past `start` (the rows of this pass's
        logits that choose tokens there)."""
        return self.noise.rows([start + offset for offset in offsets], vocab)


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


# --- chains ------------------------------------------------------------------------------------

class ChainVerifier(Verifier):
    """A chain's verification: the empty draft is the target's token alone, else the rule's `_decide`."""

    def verify(self, logits, draft, generator, start, details=None):
        if not draft.tokens:
            return Verdict(0, self.target_token(logits[-1], generator, start))
        tokens = torch.tensor(draft.tokens, device=logits.device)
        verdict = self._decide(logits, draft, tokens, generator, start, details)
        if details:
            details.update({k: None if v is None else v.tolist() for k, v in details.items()})
        return verdict

    def _decide(self, logits: torch.Tensor, draft: Draft, tokens: torch.Tensor, generator: torch.Generator,
                start: int, details: dict | None) -> Verdict:
        raise NotImplementedError

    def beta(self, logits, draft, verdict, forced):
        # the rows the target judged given an accepted prefix: 0 .. the first rejection (included),
        # all γ when every token passed, less those the grammar forced (not the drafter's)
        rows = len(draft.tokens) + 1
        judged = [j for j in range(min(verdict.num_accepted + 1, len(draft.tokens))) if j not in forced]
        shared = verdict.probs if verdict.probs is not None and verdict.probs.shape[0] == rows else None
        return float(chain_beta(logits[-rows:], draft, self.sampler, judged, shared).sum()), len(judged)

    def target_tokens(self, logits: torch.Tensor, start: int) -> list[int]:
        """The target's own token at each row of logits [n, V] (the rows past position `start`),
        where those decide the step (`batchable`)."""
        raise SpecdecError(f"the {self.rule} rule draws against the draft: its rows do not decide alone")


def _matches(details: dict | None, target_tokens: torch.Tensor, tokens: torch.Tensor) -> None:
    """The step view's p and q under a rule where a token passes iff it is the target's: one-hot
    both, as under greedy."""
    if details is not None:
        matches = (target_tokens[:-1] == tokens).float()
        details.update(p=matches, q=torch.ones_like(matches), u=None)


class GreedyChain(ChainVerifier):
    """Keep the draft while it matches the target's argmax (`verify_greedy`)."""

    rule, batchable = "greedy", True

    def target_token(self, logits, generator, start):
        return int(greedy_tokens(logits))

    def target_tokens(self, logits, start):
        return greedy_tokens(logits).tolist()

    def _decide(self, logits, draft, tokens, generator, start, details):
        target_tokens = greedy_tokens(logits)
        num_accepted, next_token = verify_greedy(target_tokens, tokens)
        _matches(details, target_tokens, tokens)
        return Verdict(int(num_accepted), int(next_token))


class CoupledChain(ChainVerifier):
    """Under a seed: the target's token at each position is its coupled draw from noise of
    (seed, position) alone, and a draft token passes iff it equals it (`verify_coupled`)."""

    rule, batchable = "coupled", True

    def target_token(self, logits, generator, start):
        return int(race(self.sampler.probs(logits), self._races(start, [0], logits.shape[-1])[0]))

    def target_tokens(self, logits, start):
        return race(self.sampler.probs(logits), self._races(start, range(len(logits)), logits.shape[-1])).tolist()

    def _decide(self, logits, draft, tokens, generator, start, details):
        probs = self.sampler.probs(logits)
        noise = self._races(start, range(len(logits)), logits.shape[-1])
        num_accepted, next_token = verify_coupled(probs, noise, tokens)
        if details is not None:
            _matches(details, race(probs, noise), tokens)
        return Verdict(int(num_accepted), int(next_token), probs=probs)


class StandardChain(ChainVerifier):
    """Rejection sampling against the draft's q (`verify_draft`, Leviathan et al.): exact."""

    rule = "standard"

    def _decide(self, logits, draft, tokens, generator, start, details):
        probs = self.sampler.probs(logits)
        q = draft.probs if draft.probs is not None else one_hot(draft.tokens, logits.shape[-1], logits.device)
        num_accepted, next_token = verify_draft(probs, q, tokens, generator, self.lenience, details)
        return Verdict(int(num_accepted), int(next_token), probs=probs)


class LenientChain(StandardChain):
    """`verify_draft` with lenience l < 1 (accept with min(1, p/(l·q))): LOSSY under sampling."""

    rule = "lenient"


class TypicalChain(ChainVerifier):
    """Medusa's typical acceptance (`verify_typical`): LOSSY under sampling."""

    rule = "typical"

    def _decide(self, logits, draft, tokens, generator, start, details):
        probs = self.sampler.probs(logits)
        num_accepted, next_token = verify_typical(probs, tokens, self.typical, generator)
        return Verdict(int(num_accepted), int(next_token), probs=probs)


# --- trees -------------------------------------------------------------------------------------

class TreeVerifier(Verifier):
    """A token tree's verification: the walk from the root keeps a path (`Verdict.path`)."""

    trees = True

    def verify(self, logits, draft, generator, start, details=None):
        if not draft.tokens:
            return Verdict(0, self.target_token(logits[-1], generator, start), path=[])
        tokens = torch.tensor(draft.tokens, device=logits.device)
        last, next_token = self._walk(logits, draft, tokens, generator, start, details)
        if details:
            details.update({k: None if v is None else v.tolist() for k, v in details.items()})
        path = draft.path_to(int(last))
        return Verdict(len(path), int(next_token), path=path)

    def _walk(self, logits: torch.Tensor, tree: Tree, tokens: torch.Tensor, generator: torch.Generator,
              start: int, details: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last accepted node, -1 for none; the target's token after it)."""
        raise NotImplementedError


class GreedyTree(TreeVerifier):
    """Walk the tree along the target's argmax (`verify_tree_greedy`)."""

    rule = "greedy"
    target_token = GreedyChain.target_token

    def _walk(self, logits, tree, tokens, generator, start, details):
        return verify_tree_greedy(greedy_tokens(logits), tokens, tree.parents)


class CoupledTree(TreeVerifier):
    """Under a seed: a node's children pass iff one equals the coupled draw at its depth
    (`verify_tree_coupled`)."""

    rule = "coupled"
    target_token = CoupledChain.target_token

    def _walk(self, logits, tree, tokens, generator, start, details):
        noise = self._races(start, [0] + depths(tree.parents), logits.shape[-1])
        return verify_tree_coupled(self.sampler.probs(logits), noise, tokens, tree.parents)


class StandardTree(TreeVerifier):
    """Rejection sampling over the tree, each node against its sibling law (`verify_tree`): exact."""

    rule = "standard"

    def _walk(self, logits, tree, tokens, generator, start, details):
        if tree.probs is None and tree.scheme != "deterministic":
            raise SpecdecError(f"a sampled tree with {tree.scheme!r} siblings needs the drafter's probs")
        parent_probs = tree.probs if tree.probs is not None else logits.new_zeros(len(tree), logits.shape[-1])
        laws = sibling_laws(parent_probs.to(logits.device), tokens, tree.parents, tree.scheme)
        return verify_tree(self.sampler.probs(logits), laws, tokens, tree.parents, generator, details)


VERIFIERS: dict[tuple[str, bool], type[Verifier]] = {
    ("greedy", False): GreedyChain, ("coupled", False): CoupledChain, ("standard", False): StandardChain,
    ("lenient", False): LenientChain, ("typical", False): TypicalChain,
    ("greedy", True): GreedyTree, ("coupled", True): CoupledTree, ("standard", True): StandardTree,
}


def check_rule(lenience: float = 1.0, typical: Typical | None = None, trees: bool = False) -> None:
    """SpecdecError where no verifier takes these options (`choose_verifier`'s refusals, for a
    request checked before its sequence exists)."""
    if trees and lenience != 1:
        raise SpecdecError("lenience < 1 applies to chain drafts only; tree verification is exact")
    if trees and typical is not None:
        raise SpecdecError("typical acceptance applies to chain drafts only; tree verification is exact")
    if typical is not None and lenience != 1:
        raise SpecdecError("choose lenience or typical acceptance, not both")
    if typical is not None and not isinstance(typical, Typical):
        raise SpecdecError(f"typical must be a verify.Typical, got {typical!r}")
    if not (isinstance(lenience, (int, float)) and 0 < lenience <= 1):
        raise SpecdecError(f"lenience must be in (0, 1] (1 = exact), got {lenience!r}")


def choose_verifier(sampler: Sampler, noise: SeededNoise | None = None, lenience: float = 1.0,
                    typical: Typical | None = None, trees: bool = False, drafts: bool = True) -> Verifier:
    """The one verifier of a sequence. Greedy sampling compares tokens whatever the rule; a seed's
    shared `noise` (None: unseeded, or a seed that pins the drafts) makes it coupled; else
    lenience < 1 is lenient, `typical` typical, and the standard rule the rest. Trees take the
    exact rules alone (greedy, coupled, standard). drafts: False for a sequence without a drafter,
    which never verifies a draft (its lenience and typical play no part)."""
    if drafts:
        check_rule(lenience, typical, trees)
    else:
        lenience, typical = 1.0, None
    if sampler.is_greedy:
        rule = "greedy"
    elif noise is not None:
        rule = "coupled"
    elif typical is not None:
        rule = "typical"
    else:
        rule = "lenient" if lenience != 1 else "standard"
    return VERIFIERS[rule, bool(trees)](sampler, noise if rule == "coupled" else None, lenience, typical)


def decide_batch(decodings: Sequence, logits: Sequence[torch.Tensor | None]
                 ) -> dict[int, tuple[int, int] | Exception]:
    """The step's verification for every sequence whose target tokens decide it (greedy or seeded
    chains, `Decoding.verifies_by_tokens`), in one `verify_ragged` call over the batch -> by index
    in the batch, (num_accepted, next_token), or the sequence's own error (non-finite logits).
    decodings: the step's `Decoding`s; logits: each one's rows [n_i, V] from the step's pass (None
    where its pass failed).
    The others (trees, unseeded sampling, logit rules, step details) are verified by their own
    `apply`, as is a sequence whose pass returned other than a row per draft token and one more
    (its `apply` then raises its own error)."""
    chosen = [i for i, (d, rows) in enumerate(zip(decodings, logits))
              if rows is not None and d.verifies_by_tokens and len(rows) == len(d.draft_tokens) + 1]
    greedy = [i for i in chosen if decodings[i].sampler.is_greedy]
    # the greedy rows' argmaxes in one copy to the host (a GPU would wait once per sequence)
    tokens: dict[int, list[int] | Exception] = dict(zip(greedy, greedy_rows([logits[i] for i in greedy])))
    for i in chosen:
        if i not in tokens:
            try:
                tokens[i] = decodings[i].verifier.target_tokens(logits[i], len(decodings[i].sequence))
            except Exception as error:
                tokens[i] = error
    decided: dict[int, tuple[int, int] | Exception] = {i: t for i, t in tokens.items() if isinstance(t, Exception)}
    ready = [i for i in chosen if i not in decided]
    decided.update(zip(ready, zip(*verify_ragged([tokens[i] for i in ready],
                                                 [decodings[i].draft_tokens for i in ready]))))
    return decided
