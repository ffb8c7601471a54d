"""`SpecConfig`: what speculation a generation runs, as one typed value, checked in one place.

The CLI (`generate`, `chat`, `serve`, `profile`, `bench`), the server's `speculative` block and
the Python API all describe speculation with it; `speculation.build` turns it into a drafter and a
draft-length schedule. It holds names and numbers only: the models, datastores and checkpoints
it names are loaded by whoever runs it (a request to the server may not name any).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import SpecdecError

ACCEPTANCE = ("exact", "lenient", "typical")
SEED_RULES = ("coupled", "stream")
# --drafter values that name no model
MODEL_FREE_DRAFTERS = ("ngram", "bigram", "lookup", "suffix", "retrieval", "forced")
DEFAULT_GAMMA = 5  # the fixed schedule's γ, the heuristic's start and EGAG's ceiling where gamma is not given
DEFAULT_GAMMA_MAX = 20  # the longest draft of the cost, heuristic and confidence schedules, a tree's depth
GAMMA_SCHEDULES = ("fixed", "heuristic", "egag")  # --gamma N alone keeps these (EGAG: γ is its ceiling); else fixed


@dataclass(frozen=True)
class Method:
    """A registered method and what it asks of the run.

    drafter_model: it drafts with a drafter model (the `tree` method: unless its shape needs none).
    chains: it proposes chains (False: token trees, which the target scores under a tree mask).
    self_drafting: the target drafts for itself (heads or skipped layers): one sequence at a time.
    """

    summary: str
    drafter_model: bool = False
    chains: bool = True
    self_drafting: bool = False

    @property
    def trees(self) -> bool:
        return not self.chains


METHODS: dict[str, Method] = {
    "ar": Method("plain autoregressive decoding: one target pass per token, nothing drafted"),
    "chain": Method("the drafter model's chain, its length from the schedule (default: measured costs)",
                    drafter_model=True),
    "parallel": Method("a parallel drafter (PARD): the drafter model proposes its chain in one pass "
                       "(--drafter parallel:DIR, from `specdec train-parallel-drafter`)", drafter_model=True),
    "cascade": Method("the drafter model's chain with a model-free stage (suffix or lookup) guessing its tokens",
                      drafter_model=True),
    "ngram": Method("NASD: an n-gram table built online from the prompt and output"),
    "bigram": Method("a bigram table counted from a corpus (Python's standard library) alone: a drafter "
                     "that costs nothing (Leviathan et al. §3.6)"),
    "lookup": Method("prompt lookup: a copy of what followed the current suffix earlier"),
    "forced": Method("no drafter: only the tokens a grammar forces, drafted for free (plain decoding without one)"),
    "suffix": Method("suffix drafting (SuffixDecoding) over the prompt, the output and earlier outputs"),
    "retrieval": Method("suffix drafting over a datastore (REST; `specdec datastore build`) and the text"),
    "tree": Method("a token tree (shape: sides, eagle2, sequoia, lookup, mixed, suffix, mixed-suffix), sized by "
                   "measured cost", drafter_model=True, chains=False),
    "lookahead": Method("lookahead decoding: Jacobi window and n-gram pool, no drafter model", chains=False),
    "medusa": Method("the target drafts for itself with Medusa heads (a checkpoint): a token tree",
                     chains=False, self_drafting=True),
    "eagle": Method("the target drafts for itself with an EAGLE layer (a checkpoint): EAGLE-2 trees",
                    chains=False, self_drafting=True),
    "self-skip": Method("the target drafts for itself with layers skipped (chosen at start)", self_drafting=True),
    "early-exit": Method("the target drafts for itself with its first layers and its own head (exit chosen at start)",
                         self_drafting=True),
    "multi-draft": Method("SpecInfer's several drafters: the drafter model's and the target's early-exit chains "
                          "merged into one token tree", drafter_model=True, chains=False, self_drafting=True),
    "cascade-horizontal": Method("the drafter model for a chain's first tokens (2), a model-free "
                                 "stage (suffix or lookup) for the rest", drafter_model=True),
}


@dataclass(frozen=True)
class SpecConfig:
    """One speculation, by name and options.

    method: a registered method (`speculation.METHODS`: ar, chain, parallel, cascade, ngram, lookup, suffix,
        retrieval, tree, lookahead, medusa, eagle, self-skip, early-exit, multi-draft,
        cascade-horizontal).
    drafter: the drafter model's name, for methods that draft with one (None: the run's default).
    tree, tree_nodes, tree_scheme: the `tree` method's shape (`drafters.TREES`), its node budget
        (also lookahead's, medusa's and eagle's) and how sampled trees draw siblings.
    schedule, gamma, gamma_min, gamma_max, egag_beta, confidence: a chain's draft length
        (`schedules.make_schedule`); gamma_max also bounds a tree's depth (its TreeCost's `max_depth`).
        gamma (None: 5) is the fixed schedule's γ and the heuristic's start; under the other
        schedules and for trees, a given gamma bounds every draft as gamma_max does (the lower
        of the two rules). gamma_max None is 20, but EGAG's is γ, as in the EGAG code
        (`effective_gamma`, `effective_gamma_max`). The command line's `--gamma N` alone picks
        the fixed schedule (`from_options`).
    acceptance: exact (rejection sampling), lenient (`lenience` < 1) or typical (`typical_epsilon`,
        `typical_delta`): the last two are LOSSY under sampling and take chains only.
    seed_rule: what a seed pins (`speculative_generate`): coupled (the seeded AR output whatever
        drafts) or stream (the standard rule's streams, per method).
    cascade: the cascade method's model-free stage (suffix or lookup); also cascade-horizontal's.
    ngram_n: the ngram drafter's longest n-gram. lookahead_shape: lookahead's (W, N, G), or
        None to size it from measured costs.
    checkpoint: the medusa or eagle method's folder (`specdec train-heads`); calibrated: their
        node values from measured acceptance (False: the raw q, an ablation).
    skip_layers: self-skip's layers (None: chosen at start). datastore: retrieval's folder.
    exit_layer: early-exit's (and multi-draft's second drafter's) exit layer (None: chosen at start).
    cascade_split: cascade-horizontal's chain positions drafted by the drafter model.
    assumed: sized for assumed nearly-free wide passes (`schedules.AssumedCosts`, the bench's
        `-flat` presets) instead of this machine's measured costs.
    """

    method: str = "chain"
    drafter: str | None = None
    tree: str = "mixed"
    tree_nodes: int = 64
    tree_scheme: str = "without-replacement"
    schedule: str = "cost"
    gamma: int | None = None
    gamma_min: int = 1
    gamma_max: int | None = None
    egag_beta: float = 0.0
    confidence: float = 0.4
    acceptance: str = "exact"
    lenience: float = 1.0
    typical_epsilon: float = 0.09
    typical_delta: float = 0.3
    seed_rule: str = "coupled"
    cascade: str = "suffix"
    ngram_n: int = 4
    lookahead_shape: tuple[int, int, int] | None = None
    checkpoint: str | None = None
    calibrated: bool = True
    skip_layers: tuple[int, ...] | None = None
    datastore: str | None = None
    assumed: bool = False
    exit_layer: int | None = None
    cascade_split: int = 2

    def replace(self, **changes) -> "SpecConfig":
        """This config with `changes` (field names), not validated."""
        return dataclasses.replace(self, **changes)

    @property
    def speculative(self) -> bool:
        return self.method != "ar"

    def typical(self):
        """The `verify.Typical` of typical acceptance, else None."""
        from ..core.verify import Typical

        return Typical(self.typical_epsilon, self.typical_delta) if self.acceptance == "typical" else None

    def effective_lenience(self) -> float:
        return self.lenience if self.acceptance == "lenient" else 1.0

    def effective_gamma(self) -> int:
        """γ of the fixed schedule, the heuristic's start (gamma, or 5 where not given)."""
        return DEFAULT_GAMMA if self.gamma is None else self.gamma

    def effective_gamma_max(self) -> int:
        """The longest draft (a tree's depth). The heuristic's: gamma_max (20 where not given),
        its gamma being where it starts. Elsewhere the lower of gamma_max and gamma where given;
        where neither is, 20, but EGAG's is γ = 5 (the EGAG code's `gamma_max=None` -> γ)."""
        if self.schedule == "heuristic" and method_chains(self.method):
            return DEFAULT_GAMMA_MAX if self.gamma_max is None else self.gamma_max
        given = [bound for bound in (self.gamma, self.gamma_max) if bound is not None]
        if given:
            return min(given)
        return DEFAULT_GAMMA if self.schedule == "egag" and method_chains(self.method) else DEFAULT_GAMMA_MAX

    def validate(self, target=None) -> "SpecConfig":
        """Raise SpecdecError naming the first option out of range or that the method does not
        take; with `target` (a loaded model), also what its backend cannot run (trees and
        self-drafting on llama.cpp's weights). Returns self."""
        method = METHODS.get(self.method)
        if method is None:
            raise SpecdecError(f"unknown method {self.method!r}; choose from {', '.join(METHODS)} (presets: "
                               "`specdec methods`)")
        _choice("schedule", self.schedule, _schedules())
        for name in ("gamma", "gamma_min", "gamma_max", "tree_nodes", "ngram_n"):
            value = getattr(self, name)
            if value is None and name in ("gamma", "gamma_max"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpecdecError(f"{name} must be an integer >= 1, got {value!r}")
        gamma, gamma_max = self.effective_gamma(), self.effective_gamma_max()
        if self.gamma_min > gamma_max:
            raise SpecdecError(f"gamma_min ({self.gamma_min}) is above gamma_max ({gamma_max})")
        if self.schedule == "heuristic" and not self.gamma_min <= gamma <= gamma_max:
            raise SpecdecError(f"the heuristic schedule starts at gamma ({gamma}), which must lie in "
                               f"[gamma_min, gamma_max] = [{self.gamma_min}, {gamma_max}]")
        _choice("acceptance", self.acceptance, ACCEPTANCE)
        _choice("seed_rule", self.seed_rule, SEED_RULES)
        if not 0 < self.lenience <= 1:
            raise SpecdecError(f"lenience must be in (0, 1], got {self.lenience}")
        if self.acceptance == "lenient" and self.lenience == 1:
            raise SpecdecError("lenient acceptance needs a lenience below 1")
        if self.acceptance != "exact" and not method.chains:
            raise SpecdecError(f"{self.acceptance} acceptance applies to chain drafts only; {self.method} "
                               "is verified exactly")
        self.typical()  # checks epsilon and delta
        if self.method == "tree":
            from ..drafters import check_tree_options

            check_tree_options(self.tree, self.tree_nodes, self.tree_scheme)
            if self.tree == "lookahead":
                raise SpecdecError("the lookahead tree is its own method: lookahead")
        if self.method in ("cascade", "cascade-horizontal"):
            from ..drafters.cascade import STAGES

            _choice("cascade stage", self.cascade, STAGES)
        for name in ("exit_layer", "cascade_split"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise SpecdecError(f"{name} must be an integer >= 1, got {value!r}")
        if self.lookahead_shape is not None:
            if self.method != "lookahead":
                raise SpecdecError("a lookahead shape applies to the lookahead method")
            from ..drafters.lookahead import check_shape

            if len(self.lookahead_shape) != 3:
                raise SpecdecError(f"a lookahead shape is (W, N, G), got {self.lookahead_shape!r}")
            check_shape(tuple(self.lookahead_shape))
        if self.method in ("medusa", "eagle") and not self.checkpoint:
            raise SpecdecError(f"the {self.method} method needs its checkpoint folder (from `specdec train-heads "
                               f"--kind {self.method}`)")
        if target is not None:
            from ..models.loading import GGUF_WEIGHTS

            if method.trees:
                check_runs_trees(target)
            if target.weights in GGUF_WEIGHTS and method.self_drafting:
                raise SpecdecError(f"{self.method} cannot run on gguf weights (llama.cpp's backend takes chain "
                                   "drafts only); use transformers' weights (--dtype auto)")
        return self

    def needs_drafter_model(self) -> bool:
        """Whether building this speculation takes a drafter model (`drafter`, or the run's)."""
        from ..drafters import MODEL_FREE_TREES

        method = METHODS[self.method]
        if self.method == "tree":
            return self.tree not in MODEL_FREE_TREES
        return method.drafter_model

    def to_dict(self) -> dict:
        """The options that differ from the defaults, as JSON values (e.g. a bench report's)."""
        default = SpecConfig()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(default, f.name) or f.name == "method"}


def runs_trees(target) -> bool:
    """Whether `target`'s backend scores token trees (takes a tree attention mask): llama.cpp's
    (gguf weights), captured CUDA graphs and encoder-decoders take chains only."""
    from ..backends import features

    return features(target).tree_masks


def weights_run_trees(dtype: str) -> bool:
    """`runs_trees` before loading: whether weights of `dtype` load on a backend that scores token
    trees (gguf weights load on llama.cpp's, which does not)."""
    from ..models.loading import GGUF_WEIGHTS

    return dtype not in GGUF_WEIGHTS


def check_runs_trees(target) -> None:
    """SpecdecError where `target`'s backend cannot score token trees (`runs_trees`)."""
    if not runs_trees(target):
        raise SpecdecError(f"token trees are not supported on the {target.kernels} backend "
                           f"({target.name}); use a chain method, or --dtype auto (transformers' weights) for trees")


def method_chains(method: str) -> bool:
    """Whether a registered method drafts chains (unknown names: True, refused elsewhere)."""
    return method not in METHODS or METHODS[method].chains


def _schedules():
    from ..sizing.schedules import SCHEDULES

    return SCHEDULES


def _choice(what: str, value, choices) -> None:
    if value not in choices:
        raise SpecdecError(f"unknown {what} {value!r}; choose from {', '.join(choices)}")


def from_flags(drafter: str, tree: str = "off", cascade: str = "off") -> dict:
    """The method and options today's `--drafter`, `--tree` and `--cascade` flags name (the
    `--method sd` spelling of `generate`, `profile`, `chat` and `serve`): a model drafter's chain,
    a model-free drafter, a self-drafting target, a tree or a cascade. Returns SpecConfig fields."""
    if drafter == "retrieval":
        raise SpecdecError("the retrieval drafter needs a datastore: --drafter retrieval:DIR (build one with "
                           "`specdec datastore build`)")
    special = special_drafter(drafter)
    if tree != "off" and special is not None and special["method"] not in MODEL_FREE_DRAFTERS:
        raise SpecdecError(f"--tree applies to drafter models; {drafter} drafts its own way (medusa, eagle: a tree)")
    if tree != "off" and special is not None and tree not in ("lookup", "suffix", "lookahead"):
        raise SpecdecError(f"--tree {tree} drafts with a drafter model; {drafter} is none")
    if tree != "off" and special is not None:  # a tree that needs no model: the tree drafts
        special = None
    if special is not None and cascade != "off":
        raise SpecdecError("--cascade drafts for a drafter model's chain; use it with --drafter MODEL and no --tree")
    if special is not None:
        return special
    if tree != "off" and cascade != "off":
        raise SpecdecError("--cascade drafts for a drafter model's chain; use it with --drafter MODEL and no --tree")
    if tree == "lookahead":
        return {"method": "lookahead"}
    if tree in ("lookup", "suffix"):
        return {"method": "tree", "tree": tree}
    if tree != "off":
        return {"method": "tree", "tree": tree, "drafter": drafter}
    if cascade != "off":
        return {"method": "cascade", "cascade": cascade, "drafter": drafter}
    return {"method": "chain", "drafter": drafter}


def special_drafter(drafter: str) -> dict | None:
    """SpecConfig fields of a --drafter that names no drafter model, or one that drafts its own way
    (a parallel drafter), else None."""
    if drafter in MODEL_FREE_DRAFTERS:
        return {"method": drafter}
    if drafter.startswith("retrieval:"):
        return {"method": "retrieval", "datastore": drafter.removeprefix("retrieval:")}
    if drafter.startswith("parallel:"):  # a drafter model that drafts its own way
        return {"method": "parallel", "drafter": drafter}
    for kind in ("medusa", "eagle"):
        if drafter.startswith(kind + ":"):
            return {"method": kind, "checkpoint": drafter.removeprefix(kind + ":")}
    if drafter == "self-skip":
        return {"method": "self-skip"}
    if drafter == "early-exit":
        return {"method": "early-exit"}
    if drafter.startswith("early-exit:"):
        layer = drafter.removeprefix("early-exit:").strip()
        if not layer.isdigit():
            raise SpecdecError(f"early-exit:LAYER takes one layer number (the exit), got {drafter!r}")
        return {"method": "early-exit", "exit_layer": int(layer)}
    if drafter.startswith("self-skip:"):
        try:
            layers = tuple(int(part) for part in drafter.removeprefix("self-skip:").split(",") if part.strip())
        except ValueError:
            raise SpecdecError(f"self-skip:LAYERS takes comma-separated layer numbers, got {drafter!r}") from None
        return {"method": "self-skip", "skip_layers": layers}
    return None

