"""What a generation returns: its tokens, each step (`Step`), and the counts and times of the
whole run (`GenerationStats`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable


from ..core.logprobs import TokenLogprob



@dataclass
class Step:
    """One target pass: what was drafted, how much was kept, and the token the target added.

    For a token tree, `draft_tokens` are all its nodes, `tree_parents` their parents and `path`
    the accepted nodes (num_accepted = len(path)).
    """

    draft_tokens: list[int]
    num_accepted: int
    next_token: int
    emitted: list[int]  # tokens appended to the output (accepted drafts + next_token, cut at EOS/limit)
    info: dict = field(default_factory=dict)  # the schedule's per-step values (e.g. EGAG's h_norm, gamma)
    tree_parents: list[int] | None = None
    path: list[int] | None = None
    forced: tuple[int, ...] = ()  # positions in draft_tokens where a grammar allowed that token alone (free drafts)

    @property
    def accepted_tokens(self) -> list[int]:
        if self.path is not None:
            return [self.draft_tokens[i] for i in self.path]
        return self.draft_tokens[:self.num_accepted]

    @property
    def rejected_token(self) -> int | None:
        """The first draft token the target turned down (for a tree: the accepted path's end's
        top-ranked child), or None when every draft it judged was accepted."""
        if self.path is None:
            return self.draft_tokens[self.num_accepted] if self.num_accepted < len(self.draft_tokens) else None
        end = self.path[-1] if self.path else -1
        return next((self.draft_tokens[i] for i, parent in enumerate(self.tree_parents) if parent == end), None)

    @property
    def next_kind(self) -> str:
        """'target' (no draft), 'bonus' (all drafts accepted; for a tree: the accepted path ends at
        a leaf) or 'resampled' (after a rejection)."""
        if not self.draft_tokens:
            return "target"
        if self.tree_parents is not None:
            end = self.path[-1] if self.path else -1
            return "resampled" if end in self.tree_parents else "bonus"
        return "bonus" if self.num_accepted == len(self.draft_tokens) else "resampled"


@dataclass
class GenerationStats:
    new_tokens: int = 0
    target_passes: int = 0
    drafter_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_per_step: list[int] = field(default_factory=list)  # for trees: the accepted path's length
    nodes_per_step: list[int] = field(default_factory=list)  # tree nodes scored per step (trees only)
    widths_per_step: list[int] = field(default_factory=list)  # tokens in each step's target pass (speculative)
    drafter_passes_per_step: list[int] = field(default_factory=list)  # the drafter's passes in each step
    # by draft position (a tree's depth) i + 1: the drafts that reached it, and those accepted there
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    wall_seconds: float = 0.0
    first_token_seconds: float | None = None  # until the first new token was known (prompt pass included)
    target_seconds: float = 0.0  # inside the target's passes (its prompt pass included)
    drafter_seconds: float = 0.0  # drafting, and keeping the drafter's state in step (rollback, hidden states)
    lenience: float = 1.0  # < 1: lossy acceptance (Leviathan et al. A.5)
    typical: str | None = None  # typical acceptance's settings where it was used (lossy; `verify.Typical`)
    greedy: bool | None = None  # whether the sampler was greedy (None: not recorded)
    cached_prompt_tokens: int = 0  # prompt entries taken as an earlier sequence left them (a prompt cache)
    forced: int = 0  # tokens a grammar forced and a pass accepted (not counted in drafted or accepted)
    # Leviathan et al.'s α = E[β], β = Σ_x min(p(x), q(x)): summed over the chain positions the
    # target scored given an accepted prefix (`chain_beta`), and their number
    beta_sum: float = 0.0
    beta_positions: int = 0
    fixed_gamma: int | None = None  # a chain's draft length where a fixed schedule set it (None: varied, or a tree)

    def add_seconds(self, counter: str, seconds: float) -> None:
        """Add `seconds` to the timer `counter` (target_seconds, drafter_seconds, ...)."""
        self.__dict__[counter] += seconds

    @property
    def lossy(self) -> bool:
        """Lenience < 1 and typical acceptance change the output only under sampling: greedy
        verification is by the target's argmax either way, so a greedy run stays exact (unknown
        counts as sampled)."""
        return (self.lenience < 1 or self.typical is not None) and not self.greedy

    @property
    def lossy_reason(self) -> str:
        """What made the output lossy ('' where it is not)."""
        if not self.lossy:
            return ""
        return self.typical if self.typical is not None else f"lenience {self.lenience:g}"

    def count_positions(self, depth: int, accepted: int) -> None:
        """One draft `depth` tokens deep (a chain's length, a tree's depth), `accepted` of them kept."""
        grow = depth - len(self.drafted_at)
        if grow > 0:
            self.drafted_at += [0] * grow
            self.accepted_at += [0] * grow
        for i in range(depth):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < accepted

    @property
    def acceptance_by_position(self) -> list[float]:
        """[i]: of the drafts that reached position i + 1 (a chain's token, a tree's depth), the
        share whose accepted prefix reached it: the same statistic for every drafter (vLLM's per-position
        acceptance)."""
        return [a / d for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted draft tokens / drafted tokens (None when nothing was drafted). For trees,
        accepted path nodes / tree nodes: it shrinks by construction as trees widen (only one
        path can be accepted), so compare trees by tokens per target pass instead."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def alpha(self) -> float | None:
        """Leviathan et al.'s α, the quantity `theory` takes: the mean of β = Σ min(p, q) over the
        positions the target scored where the loop had both laws (`beta_positions`), else implied by
        the tokens per drafting step at a fixed γ (`theory.alpha_from_tokens`), else None (a tree,
        a varied γ, nothing drafted). Not the acceptance rate, accepted / drafted: that one also
        counts the drafts after a rejection, which nobody judged, so it is lower at any γ > 1."""
        if self.beta_positions:
            return self.beta_sum / self.beta_positions
        if self.fixed_gamma is not None and self.accepted_per_step:
            from ..sizing.theory import alpha_from_tokens

            steps = len(self.accepted_per_step)
            return alpha_from_tokens((sum(self.accepted_per_step) + steps) / steps, self.fixed_gamma)
        return None

    @property
    def alpha_source(self) -> str | None:
        """How `alpha` was found: "beta" (Σ min(p, q)), "tokens per step" (implied), or None."""
        if self.beta_positions:
            return "beta"
        return "tokens per step" if self.alpha is not None else None

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def tokens_per_target_pass(self) -> float:
        return self.new_tokens / self.target_passes if self.target_passes else 0.0

    # the names before the glossary (docs/glossary.md): "forward" is now "pass" everywhere
    target_forwards = property(lambda self: self.target_passes, doc="Old name of `target_passes`.")
    drafter_forwards = property(lambda self: self.drafter_passes, doc="Old name of `drafter_passes`.")
    tokens_per_target_forward = property(lambda self: self.tokens_per_target_pass,
                                         doc="Old name of `tokens_per_target_pass`.")

    @property
    def loop_seconds(self) -> float:
        """The decoding loop's own time: the wall clock outside the target's and the drafter's
        work (verification, sampling, rolling back the target's cache, the schedule, Python)."""
        return max(0.0, self.wall_seconds - self.target_seconds - self.drafter_seconds)

    @property
    def loop_ms_per_step(self) -> float | None:
        """`loop_seconds` per target pass (one decoding step), in ms."""
        return 1e3 * self.loop_seconds / self.target_passes if self.target_passes else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(lossy=self.lossy, acceptance_rate=self.acceptance_rate, alpha=self.alpha,
                 alpha_source=self.alpha_source, tokens_per_second=self.tokens_per_second,
                 acceptance_by_position=self.acceptance_by_position,
                 tokens_per_target_pass=self.tokens_per_target_pass, loop_seconds=self.loop_seconds,
                 loop_ms_per_step=self.loop_ms_per_step)
        return d


@dataclass
class GenerationResult:
    tokens: list[int]  # the generated tokens only (the prompt excluded)
    steps: list[Step]
    stats: GenerationStats
    stop_reason: str  # "eos", "max_new_tokens" or "context"
    logprobs: list[TokenLogprob] | None = None  # one per token, where asked for (`Decoding(logprobs=)`)


StepCallback = Callable[[Step], None]
