"""The method registry: a `SpecConfig` in, a drafter and a draft-length schedule out.

This is the one place that turns a method's name into drafter objects (a test reads the
sources and fails on a second). `METHODS` are the building blocks; `PRESETS` name configs
that differ from a method's defaults (the bench's `sd-heuristic`, `tree-sides`, `*-flat`, ...).
`specdec methods` lists both; every entry point takes the same names (`resolve`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from ..backends import features
from ..errors import SpecdecError
from .config import (GAMMA_SCHEDULES, METHODS, SEED_RULES, Method, SpecConfig, check_runs_trees,  # noqa: F401
                     from_flags, method_chains, special_drafter)


def _presets() -> dict[str, tuple[SpecConfig, str]]:
    from ..drafters import TREES

    chain = SpecConfig("chain")
    presets = {
        "default": (chain, "the default: the drafter model's chain sized by measured costs (= chain)"),
        "sd": (chain.replace(schedule="fixed"), "the drafter model's chain at a fixed γ (--gamma)"),
        "sd-cost": (chain, "the drafter model's chain sized by measured costs (= chain)"),
        "sd-heuristic": (chain.replace(schedule="heuristic"), "chain, γ +2 after a fully accepted draft, −1 otherwise"),
        "sd-confidence": (chain.replace(schedule="confidence"), "chain, stop below the drafter's top probability τ"),
        "sd-egag": (chain.replace(schedule="egag"), "chain, entropy-guided adaptive γ (EGAG)"),
        "sd-stream": (chain.replace(schedule="fixed", seed_rule="stream"),
                      "sd with a seed drawn as the standard rule's streams, not coupled: what coupling costs"),
        "sd-typical": (chain.replace(acceptance="typical"),
                       "chain with Medusa's typical acceptance (ε 0.09, δ 0.3): LOSSY under sampling"),
        "sd-cost-flat": (chain.replace(assumed=True), "sd-cost sized for assumed nearly-free wide passes"),
        "ngram-fixed": (SpecConfig("ngram", schedule="fixed"), "ngram at a fixed γ"),
        "lookup-fixed": (SpecConfig("lookup", schedule="fixed"), "lookup at a fixed γ"),
        "bigram-fixed": (SpecConfig("bigram", schedule="fixed"), "bigram at a fixed γ (--gamma)"),
        "lookahead-flat": (SpecConfig("lookahead", assumed=True),
                           "lookahead shaped for assumed nearly-free wide passes"),
        "medusa-uncalibrated": (SpecConfig("medusa", calibrated=False),
                                "medusa with node values from the heads' raw q (an ablation)"),
        "eagle-uncalibrated": (SpecConfig("eagle", calibrated=False),
                               "eagle with node values from the layer's raw q (an ablation)"),
        "cascade-horizontal-lookup": (SpecConfig("cascade-horizontal", cascade="lookup"),
                                      "cascade-horizontal with prompt lookup for the later tokens"),
    }
    for shape, summary in TREES.items():
        if shape != "lookahead":
            presets[f"tree-{shape}"] = (SpecConfig("tree", tree=shape), f"token tree: {summary}")
    for shape in ("sides", "eagle2", "sequoia", "mixed"):
        presets[f"tree-{shape}-flat"] = (SpecConfig("tree", tree=shape, assumed=True),
                                         f"tree-{shape} sized for assumed nearly-free wide passes")
    return presets


PRESETS = _presets()
LENIENT = "sd-lenient:"  # sd-lenient:L, a preset with a parameter: the chain accepting with lenience L


def lenient_preset(name: str) -> SpecConfig | None:
    """The config of `sd-lenient:L`: sd (the drafter model's chain at a fixed γ) accepting with
    lenience L in (0, 1) (Leviathan et al. A.5, LOSSY under sampling); None for another name,
    SpecdecError for a bad L."""
    if not name.startswith(LENIENT):
        return None
    try:
        lenience = float(name.removeprefix(LENIENT))
    except ValueError:
        lenience = float("nan")
    if not 0 < lenience < 1:  # nan too
        raise SpecdecError(f"{name}: sd-lenient:L takes a lenience L in (0, 1), e.g. sd-lenient:0.5")
    return SpecConfig("chain", schedule="fixed", acceptance="lenient", lenience=lenience)


def names() -> list[str]:
    """Every name `resolve` takes: the methods, then the presets."""
    return list(METHODS) + [name for name in PRESETS if name not in METHODS]


def describe_names() -> str:
    return ", ".join(names())


def preset(name: str) -> SpecConfig:
    """The config a method or preset name stands for, with the defaults of everything else (not
    validated: a checkpoint or datastore it needs is not set). SpecdecError for an unknown name."""
    if name in METHODS:
        return SpecConfig(name)
    if name in PRESETS:
        return PRESETS[name][0]
    lenient = lenient_preset(name)
    if lenient is not None:
        return lenient
    raise SpecdecError(f"unknown method {name!r}; choose from {describe_names()}, sd-lenient:L (`specdec methods` "
                       "says what each does)")


def gamma_means_fixed(name: str, config: SpecConfig) -> bool:
    """Whether a γ given without a schedule turns `config` (preset `name`'s) to a fixed γ: a plain
    method's chain ("default", "chain", "lookup", ...) whose schedule does not read γ. A preset
    that names its own sizing (sd-cost, sd-confidence, the trees, ...) keeps it, γ bounding its
    drafts as `gamma_max` does (`SpecConfig.effective_gamma_max`)."""
    plain = name == "default" or name in METHODS
    return plain and method_chains(config.method) and config.schedule not in GAMMA_SCHEDULES


def resolve(name: str, **options) -> SpecConfig:
    """`preset(name)` with `options` (SpecConfig fields) on top, validated. SpecdecError for an
    unknown name or an option out of range."""
    return preset(name).replace(**options).validate()


def summary(name: str) -> str:
    if name.startswith(LENIENT):
        return (f"sd with lenient acceptance l = {lenient_preset(name).lenience:g} (Leviathan et al. A.5): LOSSY "
                "under sampling, greedy unchanged")
    return METHODS[name].summary if name in METHODS else PRESETS[name][1]


@dataclass
class Parts:
    """What a build draws on besides its config; the caller loads and owns them.

    drafter_model: the drafter model, for configs that need one (`SpecConfig.needs_drafter_model`).
    costs: `costs(model)` gives the measured pass costs (`pass_costs.PassCosts`) of the target with
        that drafter model (None: a model-free drafter) for the cost schedule; None: the schedule
        times passes as it goes (a seed under the stream rule, which nothing measured may size).
    assumed: the `schedules.AssumedCosts` a config with `assumed=True` is sized for.
    suffix_cache: earlier outputs that suffix drafting draws on too (shared by a run's or a
        server's requests); None: each generation drafts from its own text.
    datastore: the retrieval method's `datastore.Datastore` (else opened from the config's folder).
    lookahead_rows: rows a target pass takes at little more than one row's cost
        (`pass_costs.flat_rows`), which shape lookahead where the config gives no shape.
    """

    target: object
    drafter_model: object = None
    costs: Callable | None = None
    assumed: object = None
    suffix_cache: object = None
    datastore: object = None
    lookahead_rows: int | None = None


@dataclass(frozen=True)
class _Given:
    """A factory handing out the one object it holds (a drafter model, a drafter or a schedule a
    caller made); two compare equal when they hold the same object."""

    made: object

    def __call__(self):
        return self.made


@dataclass(frozen=True)
class Speculation:
    """A built speculation, what a request and its sequence carry whole: `make_drafter()` gives one
    sequence's drafter (a drafter model itself for chains, which the engine batches across
    sequences), `make_schedule()` a chain's draft-length schedule, and the acceptance options.
    `make_schedule` is None for tree methods (the tree drafter's own `TreeCost` sizes its trees) and
    both are None for plain decoding. Made by `build(config, parts)`, or `Speculation.of(drafter,
    ...)` from a drafter object; its options are checked where it is made, once.

    gamma: a chain's fixed draft length where no schedule is given (None: 5); a tree's depth bound
        (None: its policy's).
    lenience: 1 is exact; l in (0, 1) lenient acceptance (LOSSY under sampling; chains only).
    typical: Medusa's typical acceptance (`verify.Typical`), or None; chains only.
    seed_rule: what a seed pins ("coupled" or "stream"; `speculative_generate`).
    config: the `SpecConfig` it was built from (None: made by `of`).
    """

    config: SpecConfig | None
    make_drafter: Callable[[], object] | None
    make_schedule: Callable[[], object] | None
    gamma: int | None = None
    lenience: float = 1.0
    typical: object = None
    seed_rule: str = "coupled"

    def __post_init__(self):
        _check_acceptance(self.gamma, self.lenience, self.typical, self.seed_rule)

    @classmethod
    def of(cls, drafter=None, *, gamma: int | None = None, schedule=None, lenience: float = 1.0,
           typical=None, seed_rule: str = "coupled") -> "Speculation":
        """The speculation of a drafter a caller holds: a drafter model (any `Backend`), a `Drafter`
        (one sequence's state: `speculative_generate` alone takes one) or a factory of drafters
        (a drafter class, a lambda: what the engine's requests take); None: plain decoding.
        schedule: a chain's `Schedule`, or a factory of them (None: a fixed `gamma`). The options
        as the fields'; SpecdecError for one out of range."""
        if drafter is None:
            if schedule is not None:
                raise SpecdecError("a schedule sizes drafts; plain decoding (no drafter) drafts nothing")
            return cls(None, None, None, None, lenience, typical, seed_rule)
        from ..drafters.base import is_factory
        from ..sizing.schedules import Schedule

        make_drafter = drafter if is_factory(drafter) else _Given(drafter)
        make_schedule = _Given(schedule) if isinstance(schedule, Schedule) else schedule
        return cls(None, make_drafter, make_schedule, gamma, lenience, typical, seed_rule)

    @property
    def speculative(self) -> bool:
        return self.make_drafter is not None

    @property
    def one_schedule(self):
        """The schedule object `of` was given, where it was one (it holds one sequence's state, so
        only one sequence may be sized by it), else None (a factory, a fixed γ, a tree's policy)."""
        return self.make_schedule.made if isinstance(self.make_schedule, _Given) else None

    @property
    def one_drafter(self):
        """The drafter object `of` was given, where it was one (it holds one sequence's state, so only
        one sequence may draft with it), else None (a factory, a drafter model, plain decoding)."""
        from ..drafters.base import is_drafter

        made = self.make_drafter.made if isinstance(self.make_drafter, _Given) else None
        return made if is_drafter(made) else None

    def made_once(self, drafter=None, schedule=None) -> "Speculation":
        """This speculation handing out `drafter` and `schedule`, which its caller made from it
        (`make_drafter()`, `schedule()`) to show them as one generation runs (the CLI's step view,
        a self-skip search's choice): for that one generation."""
        return dataclasses.replace(self, make_drafter=None if drafter is None else _Given(drafter),
                                   make_schedule=None if schedule is None else _Given(schedule))

    def schedule(self):
        """A new chain schedule, or None (a tree method's drafter sizes its own drafts; `ar`)."""
        return None if self.make_schedule is None else self.make_schedule()

    def describe_sizing(self) -> str:
        """How the drafts are sized, in words (the schedule's, or the tree policy's)."""
        if self.make_schedule is not None:
            return self.make_schedule().describe()
        return "" if self.make_drafter is None else self.make_drafter().policy.describe()

    def check_drafter(self, drafter, target, trees: bool) -> None:
        """What the options ask of the drafter one sequence made (`trees`: it drafts token trees) and
        its target; SpecdecError where they do not fit (the checks that need the drafter made)."""
        if not trees:
            return
        check_runs_trees(target)  # (lenient and typical acceptance on trees: the verifier's choice refuses them)
        if self.make_schedule is not None:
            raise SpecdecError(f"the tree drafter {drafter.name} sizes its drafts by its own policy "
                               "(its `policy`, a TreeCost); give the tree's depth bound as gamma instead of a schedule")


def _check_acceptance(gamma, lenience, typical, seed_rule) -> None:
    """The acceptance options' own ranges, checked once where a speculation is made."""
    from ..core.verify import Typical

    if gamma is not None and (isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1):
        raise SpecdecError(f"gamma must be an integer >= 1 (a chain's draft length, a tree's depth bound), "
                           f"got {gamma!r}")
    if isinstance(lenience, bool) or not (isinstance(lenience, (int, float)) and 0 < lenience <= 1):
        raise SpecdecError(f"lenience must be in (0, 1] (1 = exact), got {lenience!r}")
    if typical is not None and not isinstance(typical, Typical):
        raise SpecdecError(f"typical must be a verify.Typical, got {typical!r}")
    if typical is not None and lenience != 1:
        raise SpecdecError("choose lenience or typical acceptance, not both")
    if seed_rule not in SEED_RULES:
        raise SpecdecError(f"seed_rule must be one of {', '.join(SEED_RULES)}, got {seed_rule!r}")


def build(config: SpecConfig, parts: Parts) -> Speculation:
    """The drafter and schedule factories of `config` on `parts` (the only place drafters are
    assembled from a method's name), with its acceptance options."""
    options = dict(lenience=config.effective_lenience(), typical=config.typical(), seed_rule=config.seed_rule)
    if config.method == "ar":
        return Speculation(config, None, None, **options)
    config.validate(parts.target)
    if config.needs_drafter_model() and parts.drafter_model is None:
        raise SpecdecError(f"the {config.method} method drafts with a drafter model, and none is loaded")
    make_drafter = _DRAFTERS[config.method](config, parts)
    from ..sizing.schedules import make_schedule

    if METHODS[config.method].trees:  # a tree drafter's own TreeCost sizes its drafts, up to gamma_max deep
        return Speculation(config, make_drafter, None, **options)
    costs = None  # measured once here, shared by every schedule made
    if config.schedule == "cost" and parts.costs is not None and config.method not in ("self-skip", "early-exit"):
        costs = parts.costs(parts.drafter_model if METHODS[config.method].drafter_model else None)
    assumed = _assumed(config, parts)
    return Speculation(config, make_drafter, lambda: make_schedule(
        config.schedule, config.effective_gamma(), config.gamma_min, config.effective_gamma_max(), config.egag_beta,
        config.confidence,
        costs, assumed), **options)


def _assumed(config: SpecConfig, parts: Parts):
    if not config.assumed:
        return None
    if parts.assumed is None:
        raise SpecdecError("a config sized for assumed costs needs them (schedules.AssumedCosts; the bench sets "
                           "them from the pair's measured drafter cost)")
    return parts.assumed


def _chain(config, parts):
    model = parts.drafter_model
    return lambda: model


def _parallel(config, parts):
    from ..drafters.parallel import ParallelDrafter

    model = parts.drafter_model
    if not features(model).parallel_k:
        raise SpecdecError(f"the parallel method drafts with a parallel drafter, and {model.name} is none: "
                           "--drafter parallel:DIR (`specdec train-parallel-drafter`)")
    return lambda: ParallelDrafter(model)


def _cascade(config, parts):
    from ..drafters import CascadeDrafter

    return lambda: CascadeDrafter(parts.drafter_model, config.cascade)


def _ngram(config, parts):
    from ..drafters import NgramDrafter

    return lambda: NgramDrafter(config.ngram_n)


def _bigram(config, parts):
    from ..drafters.bigram import BigramDrafter, corpus_table

    target = parts.target  # counted once here, shared by every drafter made
    table = corpus_table(target.tokenizer, target.vocab_size) if target is not None else None
    return lambda: BigramDrafter(table=table)


def _lookup(config, parts):
    from ..drafters import LookupDrafter

    return LookupDrafter


def _forced(config, parts):
    from ..drafters.forced import ForcedOnlyDrafter

    return ForcedOnlyDrafter


def _suffix(config, parts):
    from ..drafters import SuffixDrafter

    return lambda: SuffixDrafter(parts.suffix_cache)


_OPENED: dict[str, object] = {}  # datastores and checkpoints by folder, read once a process


def _opened(kind: str, folder: str):
    if (kind, folder) not in _OPENED:
        if kind == "datastore":
            from ..drafters.datastore import Datastore as opener
        elif kind == "medusa":
            from ..adapters.medusa_heads import load_heads as opener
        else:
            from ..adapters.eagle_layer import load_eagle as opener
        _OPENED[kind, folder] = opener(folder)
    return _OPENED[kind, folder]


def _retrieval(config, parts):
    from ..drafters import SuffixDrafter

    datastore = parts.datastore
    if datastore is None:
        if config.datastore is None:
            raise SpecdecError("the retrieval method needs a datastore (`specdec datastore build`)")
        datastore = _opened("datastore", config.datastore)
    return lambda: SuffixDrafter(parts.suffix_cache, datastore=datastore)


def _tree(config, parts):
    from ..drafters import make_tree_drafter

    assumed = _assumed(config, parts)
    return lambda: make_tree_drafter(config.tree, parts.drafter_model, config.tree_nodes, config.tree_scheme,
                                     assumed=assumed, suffix_cache=parts.suffix_cache,
                                     max_depth=config.effective_gamma_max())


def _lookahead(config, parts):
    from ..drafters import lookahead_shape, make_tree_drafter

    assumed = _assumed(config, parts)
    shape = config.lookahead_shape
    if shape is None and parts.lookahead_rows is not None and assumed is None:
        shape = lookahead_shape(min(parts.lookahead_rows, config.tree_nodes))
    return lambda: make_tree_drafter("lookahead", None, config.tree_nodes, assumed=assumed, lookahead_shape=shape,
                                     max_depth=config.effective_gamma_max())


def _self_drafting(config, parts):
    from ..drafters.eagle import EagleDrafter
    from ..drafters.medusa import MedusaDrafter
    from ..sizing.schedules import TreeCost

    checkpoint = _opened(config.method, config.checkpoint)
    made = MedusaDrafter if config.method == "medusa" else EagleDrafter
    return lambda: made(checkpoint, policy=TreeCost(max_depth=config.effective_gamma_max(), max_nodes=config.tree_nodes,
                                                    calibrate=config.calibrated))


def _self_skip(config, parts):
    from ..drafters.layerskip import self_skip_drafter

    skip = list(config.skip_layers) if config.skip_layers else None
    first: list = []

    def make():  # the layer search runs once, at the first drafter; later ones skip what it chose
        if not first:
            first.append(self_skip_drafter(parts.target, skip))
            return first[0]
        return self_skip_drafter(parts.target, first[0].model.skip)

    return make


def _early_exit(config, parts):
    from ..drafters.early_exit import early_exit_drafter

    return _searched_once(lambda exit_layer: early_exit_drafter(parts.target, exit_layer), config.exit_layer)


def _searched_once(make_drafter, exit_layer):
    """Drafters of the target's first layers: the exit search runs once, at the first drafter;
    later ones exit where it chose."""
    first: list = []

    def make():
        if not first:
            first.append(make_drafter(exit_layer))
            return first[0]
        return make_drafter(first[0].model.exit_layer)

    return make


def _multi_draft(config, parts):
    # the drafter model and the target's own first layers: two drafters of one vocabulary that
    # err differently (a second model, or a model-free chain, mostly agrees with one of them)
    from ..drafters import ModelDrafter
    from ..drafters.early_exit import early_exit_drafter
    from ..drafters.multi import MultiDrafter
    from ..sizing.schedules import TreeCost

    early = _searched_once(lambda exit_layer: early_exit_drafter(parts.target, exit_layer), config.exit_layer)
    gamma_max = config.effective_gamma_max()
    return lambda: MultiDrafter([ModelDrafter(parts.drafter_model), early()],
                                gamma=min(config.effective_gamma(), gamma_max),
                                policy=TreeCost(max_depth=gamma_max, max_nodes=config.tree_nodes))


def _cascade_horizontal(config, parts):
    from ..drafters.horizontal import HorizontalCascadeDrafter

    return lambda: HorizontalCascadeDrafter(parts.drafter_model, config.cascade, config.cascade_split)


_DRAFTERS = {"chain": _chain, "parallel": _parallel, "cascade": _cascade, "ngram": _ngram, "bigram": _bigram,
             "lookup": _lookup, "forced": _forced, "suffix": _suffix,
             "retrieval": _retrieval, "tree": _tree, "lookahead": _lookahead, "medusa": _self_drafting,
             "eagle": _self_drafting, "self-skip": _self_skip, "early-exit": _early_exit,
             "multi-draft": _multi_draft, "cascade-horizontal": _cascade_horizontal}


def open_files(config: SpecConfig) -> None:
    """Open the datastore or checkpoint `config` names now (read once a process), so that a bad
    folder fails before minutes of model loading."""
    if config.method == "retrieval" and config.datastore is not None:
        _opened("datastore", config.datastore)
    if config.method in ("medusa", "eagle"):
        _opened(config.method, config.checkpoint)


def from_options(method: str = "default", drafter: str | None = None, tree: str = "off", cascade: str = "off",
                 schedule: str | None = None, lenience: float = 1.0, typical: bool = False, **fields) -> SpecConfig:
    """The config a command line names: `method` (a method or preset, `speculation.resolve`) with
    today's `--drafter`, `--tree` and `--cascade` flags on top. Where the method is a drafter
    model's chain (`default`, `sd`, `sd-*`), those flags choose what drafts instead, keeping the
    preset's schedule and rules: `--method sd --drafter lookup` is prompt lookup at a fixed γ.
    Elsewhere `--drafter` names the drafter model, `--tree` a `tree` method's shape and
    `--cascade` a cascade's stage. `schedule` None keeps the preset's; lenience < 1 and
    `typical` set the acceptance rule; `fields`: further SpecConfig fields. Validated."""
    if method == "ar":
        if typical or lenience != 1:
            raise SpecdecError("--typical and --lenience change how drafts are accepted; --method ar drafts nothing")
        return SpecConfig("ar")
    base = preset(method)  # validated below, with the flags that may complete it (a checkpoint, a datastore)
    changes: dict = {}
    if base.method == "chain" and drafter is not None:
        changes.update(from_flags(drafter, tree, cascade))
    else:
        if tree != "off" and base.method != "tree":
            raise SpecdecError(f"--tree shapes the tree method; --method {method} is not one (use --method tree "
                               f"--tree {tree}, or --method default)")
        if cascade != "off" and base.method != "cascade":
            raise SpecdecError(f"--cascade sets the cascade method's stage; --method {method} is not one")
        if tree != "off":
            if tree == "lookahead":
                raise SpecdecError("the lookahead tree is its own method: --method lookahead")
            changes["tree"] = tree
        if cascade != "off":
            changes["cascade"] = cascade
        special = special_drafter(drafter) if drafter is not None else None
        if special is not None and special["method"] == base.method:  # e.g. --method medusa --drafter medusa:DIR
            changes.update({k: v for k, v in special.items() if k != "method"})
        elif drafter is not None and base.replace(**changes).needs_drafter_model():
            if special is not None:
                raise SpecdecError(f"--method {method} drafts with a drafter model; --drafter {drafter} is not one")
            changes["drafter"] = drafter
    if schedule is not None:
        changes["schedule"] = schedule
    elif fields.get("gamma") is not None and gamma_means_fixed(method, base.replace(**changes)):
        changes["schedule"] = "fixed"  # --gamma N alone: a fixed γ = N, as in the papers and their code
    if typical and lenience != 1:
        raise SpecdecError("--typical and --lenience are two acceptance rules; choose one")
    if typical:
        changes["acceptance"] = "typical"
    elif lenience != 1:
        changes.update(acceptance="lenient", lenience=lenience)
    return base.replace(**changes, **fields).validate()
