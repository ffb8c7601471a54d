"""The drafter base class, the capabilities a drafter declares, and how the loop drives its passes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Generator, Sequence

import torch

from ..backends import declares_features
from ..errors import SpecdecError
from ..core.samplers import Sampler
from ..core.trees import Draft  # the proposal type, chain or tree (a `trees.Tree` is one)

# Called after each drafted token with how many are drafted so far and the drafter's own
# (untempered) logits [V] for the last one, or a float (a model-free drafter's estimate of the
# chance that the token is accepted, its parent accepted), or None (no estimate at all);
# False stops the draft there. A drafter that knows its first token's chance before drafting
# it may ask first with 0 drafted: False drafts nothing. Draft-length schedules (sizing/schedules.py)
# provide it.
KeepGoing = Callable[[int, "torch.Tensor | float | None"], bool]


@dataclass(frozen=True)
class Capabilities:
    """What a drafter does beyond the `Drafter` base class, declared by its class (a class attribute
    `capabilities`) so that the loop and the engine read it instead of probing for members.

    trees: `propose` returns token trees (a `Draft` with parents: `trees.Tree`), kept by
        `keep_path`, sized by a `policy` of its own, instead of chains.
    batched_passes: `proposal(...)`, `propose` as a generator that leaves its drafter-model passes
        to the caller, so the engine batches them across sequences.
    model: holds a drafter model (`model`, with this sequence's `cache`).
    catches_up: keeps that model in step with the context: `lag(context)`, the tokens it has yet
        to feed, and `caught_up`, the tokens and seconds it fed to catch up.
    reads_target_hidden: `observe(hidden)` after the prefill and every target pass (self-drafting heads).
    reads_target_tokens: `observe_targets(tokens)`, the target's argmax at every scored node (lookahead).
    pins: `pin()` stops it drawing on other generations (which would change a seeded output).
    finishes: `finish(sequence)` when its sequence ends (e.g. to share the output with later ones).
    one_pass: its drafter model proposes `k` tokens a pass (a parallel drafter): a token inside a
        pass costs a row of it, not a pass of its own (the cost schedule prices it so).
    grammar: drafts under a grammar's state (`constraint`, a `grammar.Constraint` the loop sets):
        its q masked as the target's p is, and the tokens the grammar forces taken without a pass.
    """

    trees: bool = False
    batched_passes: bool = False
    model: bool = False
    catches_up: bool = False
    reads_target_hidden: bool = False
    reads_target_tokens: bool = False
    pins: bool = False
    finishes: bool = False
    one_pass: bool = False
    grammar: bool = False


def capabilities_of(drafter) -> Capabilities:
    """The capabilities `drafter`'s class declares (`Drafter.capabilities`); SpecdecError for an
    object that does not subclass `Drafter`."""
    require_drafter(drafter)
    declared = type(drafter).capabilities
    if declared.batched_passes and _defined_below(type(drafter), "propose", "proposal"):
        # a subclass that overrides the whole proposal must be called through it
        return dataclasses.replace(declared, batched_passes=False)
    return declared


def _defined_below(cls: type, name: str, other: str) -> bool:
    """Whether `cls` (or a class between it and the one defining `other`) defines `name` below
    where `other` is defined: an override the other member does not go through."""
    owner = lambda member: next((i for i, c in enumerate(cls.__mro__) if member in vars(c)), len(cls.__mro__))  # noqa: E731
    return owner(name) < owner(other)


def require_drafter(drafter) -> None:
    """SpecdecError unless `drafter` is a `Drafter` (the loop reads its class's declarations, never
    probes its members)."""
    if not isinstance(drafter, Drafter):
        raise SpecdecError(f"{type(drafter).__name__} is no drafter: a drafter subclasses specdec.drafters.Drafter "
                           "and declares what it does beyond it in `capabilities` (specdec.drafters.Capabilities)")


def require_drafter_or_model(value) -> None:
    """SpecdecError unless `value` is a `Drafter` or a model backend (whose class declares `features()`)."""
    if not isinstance(value, Drafter) and not declares_features(value):
        raise SpecdecError(f"{type(value).__name__} is neither a drafter nor a model: a drafter subclasses "
                           "specdec.drafters.Drafter, a model backend declares features() (specdec.backends.Features)")


def is_drafter(value) -> bool:
    """Whether `value` is a drafter object (a `Drafter`), not a model or a factory."""
    return isinstance(value, Drafter)


def is_factory(value) -> bool:
    """Whether `value` makes drafters (a `Drafter` class, a lambda), not a drafter or a model backend."""
    if isinstance(value, type):
        return issubclass(value, Drafter)
    return callable(value) and not isinstance(value, Drafter) and not declares_features(value)


class Drafter:
    """The base of every drafter: the contract the decoding loop drives.

    - `start(prompt)`: a new generation; `prompt` is its context.
    - `propose(context, max_tokens, sampler, generator, keep_going) -> Draft`, the one proposal
      entry: a chain (parents None), or, where the class declares `capabilities.trees`, a tree
      (`trees.Tree`, a Draft with parents) no deeper than `max_tokens`, sized by the drafter's
      own `policy` (the loop passes keep_going None). `proposal(...)`, with the same arguments,
      leaves the drafter model's passes to the caller (`capabilities.batched_passes`).
    - `accept(start, path)`: what verification kept of the last draft (`accept_draft`).
    - `finish(sequence)`: the generation ended (called where the class declares `finishes`).

    Members beyond these are declared in a class attribute `capabilities` (`Capabilities`), never
    probed. What every drafter reports the same way (tokens drafted and accepted, by position;
    drafter passes and seconds) the loop counts in `GenerationStats`. Every drafter subclasses
    this class: the loop refuses any other object (`require_drafter`).
    """

    name: str = "drafter"
    capabilities: Capabilities = Capabilities()  # a chain drafter without a model: nothing beyond the base
    passes: int = 0  # drafter passes since `start` (0 for model-free drafters)

    def check_target(self, target) -> None:
        """Raise SpecdecError if this drafter cannot serve `target` (e.g. another vocabulary)."""

    def start(self, prompt: Sequence[int]) -> None:
        """Forget the previous generation; `prompt` is the new context."""
        raise NotImplementedError

    def propose(self, context: Sequence[int], max_tokens: int, sampler: Sampler, generator: torch.Generator,
                keep_going: KeepGoing) -> Draft:
        """Up to `max_tokens` (>= 1) tokens to follow `context` (every token emitted so far, prompt
        included): a chain, or a tree of that depth where the class declares `trees`. An empty
        draft is allowed: the target then emits one token on its own."""
        raise NotImplementedError

    def accept(self, start: int, path: Sequence[int]) -> None:
        """Verification kept the nodes `path` of the last draft, proposed after `context[:start]`
        (a chain's kept nodes are 0, 1, ..., k-1): a chain drafter rolls back to the context's
        first start + k tokens (`rollback`), a tree drafter keeps the path (`keep_path`)."""
        if type(self).capabilities.trees:
            self.keep_path(start, list(path))
        else:
            self.rollback(start + len(path))

    def rollback(self, length: int) -> None:
        """A chain drafter's state after `accept`: only `context[:length]` of the last proposal's
        context + draft was kept. Nothing to do for a drafter that keeps no state of its drafts."""

    def finish(self, sequence: Sequence[int]) -> None:
        """The generation ended with `sequence` (prompt and output): declared by `finishes`, for a
        drafter that learns across generations."""

    def most_nodes(self) -> int:
        """A tree drafter's most nodes in one tree (its policy's `max_nodes`: what a KV charge
        keeps room for); 0 for a chain drafter, whose schedule bounds its drafts."""
        return self.policy.max_nodes if capabilities_of(self).trees else 0


def accept_draft(drafter, start: int, path: Sequence[int]) -> None:
    """Tell `drafter` what verification kept of its last draft (`Drafter.accept`)."""
    require_drafter(drafter)
    drafter.accept(start, path)


def most_nodes(drafter) -> int:
    """`Drafter.most_nodes`."""
    require_drafter(drafter)
    return drafter.most_nodes()


# A proposal that leaves its model passes to the caller: it yields each pass it needs (a
# backends.Segment on the drafter model) and is sent that pass's logits; it returns its Draft.
# The engine runs many sequences' proposals in lock step, one batched drafter pass per round.
Proposal = Generator["Segment", torch.Tensor, "Draft"]


def drive(proposal: Generator, forward: Callable) -> object:
    """Run a generator of passes (`Proposal`, `Decoding.drafting`) to its end, each pass made by
    `forward(input_ids, cache, num_logits, parents=, tree_start=)` -> what it returns."""
    try:
        segment = next(proposal)
        while True:
            segment = proposal.send(forward(segment.input_ids, segment.cache, segment.num_logits,
                                            parents=segment.parents, tree_start=segment.tree_start))
    except StopIteration as stop:
        return stop.value


def one_hot(tokens: Sequence[int], vocab_size: int, device: torch.device | None = None) -> torch.Tensor:
    """tokens [n] -> [n, V] fp32: the q of a deterministic proposal."""
    return torch.nn.functional.one_hot(torch.tensor(list(tokens), device=device), vocab_size).float()
