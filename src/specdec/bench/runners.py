"""The methods a benchmark compares: ours through the one speculative loop, and transformers' peers.

Every method runs on the very same model objects (same weights, kernels, dtype) and prompt ids.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field, fields

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from ..backends.transformers import TransformersModel
from ..decoding.beam import beam_search_generate, speculative_beam_search
from ..adapters.eagle_layer import load_eagle
from ..errors import SpecdecError
from ..decoding.loop import autoregressive_generate, speculative_generate
from ..decoding.sequence import seed_pins_drafts
from ..core.grammar import Grammar
from ..adapters.medusa_heads import load_heads
from ..decoding.speculation import Parts, build, lenient_preset, names, preset, summary
from ..sizing.pass_costs import LoadCosts, PassCosts
from ..core.samplers import Sampler
from ..sizing.schedules import AssumedCosts
from ..decoding.config import DEFAULT_GAMMA, SpecConfig
from ..core.verify import Typical
from .vllm_peer import VLLM_METHODS, check_dtype, check_threads

BENCH_ONLY = {  # ours, as their presets' configs with a drafter model of their own, and beam search
    "sd-distilled": "sd-cost with the drafter distilled towards the target (--distilled DIR from `specdec distill-drafter`)",
    "sd-parallel": "the parallel method (PARD): the drafter adapted to propose its chain in one pass (--parallel DIR "
                   "from `specdec train-parallel-drafter`)",
    "sd-online": "sd-cost with the drafter learning from its rejections (OSD), its adapter updated between prompts",
    "sd-other-tokenizer": "sd-cost with a drafter of another tokenizer (--other-drafter), drafting through text",
    "beam": "ours: beam search (--num-beams), greedy prompts only; row-exact on the CPU",
    "beam-sd": "ours: speculative beam search, a drafter-model tree per beam; its output is beam's",
}
OWN_MODEL_PRESET = "sd-cost"  # the config of sd-distilled, sd-online and sd-other-tokenizer
OWN_PRESETS = {"sd-parallel": "parallel"}  # bench-only methods with a preset of their own
PEER_METHODS = {
    "hf": "transformers generate, plain",
    "hf-assisted": "transformers generate with assistant_model, its defaults (γ up to 20, confidence 0.4)",
    "hf-assisted-fixed": "transformers generate with assistant_model, γ pinned to ours, no confidence cut",
    "hf-lookup": "transformers generate with prompt_lookup_num_tokens=γ",
    "hf-assisted-other-tokenizer": "transformers' universal assisted generation with the --other-drafter model",
    "llama-cpp": "llama.cpp (llama-cpp-python) plain decoding on the target's GGUF",
    "llama-cpp-spec": "llama.cpp (llama-cpp-python) speculative decoding, drafter GGUF, greedy drafts ≤ 16, p_min 0.75",
    "llama-cpp-lookup": "llama.cpp (llama-cpp-python) speculative decoding with its prompt lookup (2-grams, 10 tokens)",
    **VLLM_METHODS,
}
# every name of the method registry (`specdec methods`: the same as generate, chat and serve take), then the rest
BENCH_METHODS = {**{name: "ours: " + summary(name) for name in names()}, **BENCH_ONLY, **PEER_METHODS}
BASELINES = ("ar", "hf", "hf-assisted", "sd-cost", "llama-cpp", "beam")  # every method's per-prompt speedup is taken against each of these
NEEDS_DRAFTER = {name for name in names() if name != "ar" and preset(name).needs_drafter_model()} | {
    "sd-distilled", "sd-parallel", "sd-online", "beam-sd", "hf-assisted", "hf-assisted-fixed", "llama-cpp-spec"}
PEERS = ("hf", "llama-cpp", "vllm")  # method prefixes of other libraries' implementations
BEAM_METHODS = ("beam", "beam-sd")
# methods whose sampled output leaves the target's law (so a seed does not pin it to ar's)
LOSSY = tuple(name for name in names() if preset(name).acceptance != "exact")
# exact methods whose seed is the standard rule's streams (a seeded output of their own)
STREAM = tuple(name for name in names() if preset(name).seed_rule == "stream")
REFERENCE = {"beam-sd": "beam"}  # the output a method must reproduce on greedy prompts (default: ar's)
FLAT = "-flat"  # suffix of a method sized for assumed costs (Settings.assumed) instead of measured ones


def is_lossy(method: str) -> bool:
    """Whether one of our methods accepts by a lossy rule (its sampled output leaves the target's law)."""
    return method in LOSSY or lenient_preset(method) is not None


def is_peer(method: str) -> bool:
    return method.startswith(PEERS)


def is_flat(method: str) -> bool:
    return method in names() and preset(method).assumed


@dataclass
class PeerModels:
    """What the peers run on where it is not our models: transformers models when ours are on the
    llama.cpp backend, and llama.cpp's own `Llama` objects (bench/llama_peers.py)."""

    hf_target: TransformersModel | None = None
    hf_drafter: TransformersModel | None = None
    llama: object | None = None


# The SpecConfig fields a bench run sets for all of our methods (lookahead_shape: the lookahead
# methods' only), over each preset's values; the rest are the presets' own
RUN_OPTIONS = ("gamma", "gamma_min", "gamma_max", "egag_beta", "confidence", "ngram_n", "tree_nodes", "tree_scheme",
               "lookahead_shape")
SPEC_DEFAULTS = {f.name: f.default for f in fields(SpecConfig) if f.name in RUN_OPTIONS}


@dataclass
class Settings:
    """What every method shares in one run. spec: SpecConfig options (`RUN_OPTIONS`) by name,
    SpecConfig's defaults for those not given (`option`)."""

    max_new_tokens: int = 128
    spec: dict = field(default_factory=dict)
    heads: str | None = None  # Medusa heads' folder (the medusa method)
    eagle: str | None = None  # an EAGLE drafter's folder (the eagle method)
    datastore: str | None = None  # a retrieval datastore's folder (the retrieval method)
    distilled: str | None = None  # a distilled drafter adapter's folder (the sd-distilled method)
    parallel: str | None = None  # a parallel drafter's folder (the sd-parallel method)
    other_drafter: str = "smollm2-135m"  # the drafter with another tokenizer (sd-other-tokenizer, hf-…-other-tokenizer)
    skip_layers: list[int] | None = None  # the self-skip method's layers (None: chosen by its search)
    exit_layer: int | None = None  # early-exit's and multi-draft's exit layer (None: chosen by its search)
    pass_costs: PassCosts | None = None  # sd-cost's profile of the pair (None: not measured)
    free_costs: PassCosts | None = None  # the target's profile with a model-free drafter (suffix)
    load_costs: LoadCosts | None = None  # batched passes with the drafter model (bench --concurrency)
    free_load_costs: LoadCosts | None = None  # batched passes with a model-free drafter (bench --concurrency)
    vllm: object | None = None  # vLLM's workers (bench/vllm_peer.py: VllmPeers) where vllm methods run
    vllm_threads: str = "tuned"  # their thread setup (bench/vllm_peer.py)
    vllm_eager: bool = False  # their workers without torch.compile (loads in a third of the time; tests)
    vllm_dtype: str = "bfloat16"  # their weights' dtype (float32 in tests: bf16 rows drift apart between batch shapes)
    flat_at16: float = 1.2  # the assumed machine: 16 drafted tokens cost this many one-token passes
    assumed: AssumedCosts | None = None  # the -flat methods' costs: that curve and this pair's c
    num_beams: int = 4  # beam and beam-sd

    def __post_init__(self):
        unknown = set(self.spec) - set(RUN_OPTIONS)
        if unknown:
            raise SpecdecError(f"bench settings: {', '.join(sorted(unknown))} not among {', '.join(RUN_OPTIONS)}")
        check_threads(self.vllm_threads)
        check_dtype(self.vllm_dtype)

    def option(self, name: str):
        """The run's value of SpecConfig field `name` (one of `RUN_OPTIONS`)."""
        return self.spec.get(name, SPEC_DEFAULTS[name])


@dataclass
class Record:
    prompt_id: str  # "<dataset>/<index>@t<temperature>": a method's records pair up by it
    method: str
    tokens: list[int]
    new_tokens: int
    wall_seconds: float
    target_passes: int | None  # None where the method does not report it (transformers' peers)
    drafted: int = 0
    accepted: int = 0
    accepted_per_step: list[int] = field(default_factory=list)
    dataset: str = ""
    task: str = ""
    temperature: float = 0.0
    first_token_seconds: float | None = None  # prompt pass and first token: the time to first token (merged: the mean)
    nodes_per_step: list[int] = field(default_factory=list)  # tree methods: nodes scored per step
    target_seconds: float | None = None  # ours: inside target passes (None for peers, which do not say)
    drafter_seconds: float | None = None  # ours: drafting and keeping the drafter in step
    widths_per_step: list[int] = field(default_factory=list)  # ours, speculative: tokens per target pass
    drafter_passes_per_step: list[int] = field(default_factory=list)
    samples: int = 1  # generations folded into this record (`merge_samples`): their sums, their lists joined
    typical_tv: float | None = None  # sd-typical under sampling: `typical_divergence` of its output (merged: the mean)
    drafted_at: list[int] = field(default_factory=list)  # ours: drafts that reached position i + 1 (GenerationStats)
    accepted_at: list[int] = field(default_factory=list)  # ... and whose accepted prefix reached it
    # a prompt with a schema (json-tasks): tokens the grammar forced (GenerationStats.forced), the
    # masks computed and the seconds inside them (grammar.Constraint), and the output's check
    forced: int = 0
    mask_calls: int = 0
    mask_seconds: float = 0.0
    valid: bool | None = None  # None: no schema to check against
    problem: str | None = None  # why the output is not valid (truncated, not JSON, the schema's complaint)
    # ours, chains: Σ min(p, q) over the positions the target judged, their number, and a fixed γ
    # (GenerationStats.beta_sum, beta_positions, fixed_gamma): α apart from the acceptance rate
    beta_sum: float = 0.0
    beta_positions: int = 0
    fixed_gamma: int | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float | None:
        """Tokens after each generation's first over the time after it: the decoding rate, prompt
        passes left out."""
        if self.first_token_seconds is None or self.new_tokens <= self.samples:
            return None
        decoding = self.wall_seconds - self.samples * self.first_token_seconds
        return (self.new_tokens - self.samples) / decoding if decoding > 0 else None


def merge_samples(records: list[Record]) -> Record:
    """Several sampled generations of one method on one prompt as one record: tokens, times and
    counts summed (the time to first token averaged), per-step lists and the tokens joined. Its
    tokens per second is then total tokens over total time. Under sampling each generation writes a text of its own length, so
    one generation's rate says as much about that length (how far the prompt pass is spread)
    and that draw as about the method; the sums weigh each token alike."""
    if not records or len({(r.prompt_id, r.method) for r in records}) != 1:
        raise SpecdecError("merge_samples takes the records of one method on one prompt")

    def total(values):
        return None if any(v is None for v in values) else sum(values)

    first_tokens = total([r.first_token_seconds * r.samples if r.first_token_seconds is not None else None
                          for r in records])
    samples = sum(r.samples for r in records)

    first = records[0]
    return Record(first.prompt_id, first.method, [t for r in records for t in r.tokens],
                  sum(r.new_tokens for r in records), sum(r.wall_seconds for r in records),
                  total([r.target_passes for r in records]), sum(r.drafted for r in records),
                  sum(r.accepted for r in records), [n for r in records for n in r.accepted_per_step],
                  first.dataset, first.task, first.temperature,
                  None if first_tokens is None else first_tokens / samples, [n for r in records for n in r.nodes_per_step],
                  total([r.target_seconds for r in records]), total([r.drafter_seconds for r in records]),
                  [n for r in records for n in r.widths_per_step], [n for r in records for n in r.drafter_passes_per_step],
                  samples, typical_tv=_mean_of([r.typical_tv for r in records]),
                  drafted_at=position_sums([r.drafted_at for r in records]),
                  accepted_at=position_sums([r.accepted_at for r in records]),
                  forced=sum(r.forced for r in records), mask_calls=sum(r.mask_calls for r in records),
                  mask_seconds=sum(r.mask_seconds for r in records),
                  valid=None if first.valid is None else all(r.valid for r in records),
                  problem=next((r.problem for r in records if r.problem), None),
                  beta_sum=sum(r.beta_sum for r in records), beta_positions=sum(r.beta_positions for r in records),
                  fixed_gamma=first.fixed_gamma if len({r.fixed_gamma for r in records}) == 1 else None)


def position_sums(lists: list[list[int]]) -> list[int]:
    """Per-position counts of several runs added position by position (the longest's length)."""
    width = max((len(values) for values in lists), default=0)
    return [sum(values[i] for values in lists if i < len(values)) for i in range(width)]


def _mean_of(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def typical_divergence(target, drafter, prompt_ids: list[int], output: list[int], sampler: Sampler,
                       typical: Typical) -> float | None:
    """How far typical acceptance strays from the target's law on this text: over the output's
    positions, the mean total variation between the law it gives a step's first token
    (`theory.typical_first_token_law`, with the drafter's q there) and the target's p, both under
    `sampler`. None under greedy, where it does not stray. Two cache-free passes, untimed."""
    from ..sizing.theory import total_variation, typical_first_token_law

    if sampler.is_greedy or not output:
        return None
    ids = list(prompt_ids) + list(output[:-1])  # the positions that chose each output token
    with torch.inference_mode():
        p = sampler.probs(target.forward(ids, None, len(output)))
        draft_logits = drafter.forward(ids, None, len(output))[:, :p.shape[-1]]
        missing = p.shape[-1] - draft_logits.shape[-1]  # a narrower drafter head: q = 0 on the ids it lacks
        if missing > 0:
            draft_logits = torch.cat([draft_logits, draft_logits.new_full((len(output), missing), float("-inf"))], -1)
        q = sampler.probs(draft_logits)
    law = typical_first_token_law(p, q, typical.epsilon, typical.delta)
    return float(total_variation(law, p).mean())


def check_methods(methods: list[str]) -> None:
    """SpecdecError for a method the bench does not know; a preset with a parameter (sd-lenient:L)
    is checked and taken in with the rest."""
    for m in methods:
        if m not in BENCH_METHODS and lenient_preset(m) is not None:
            BENCH_METHODS[m] = "ours: " + summary(m)
            NEEDS_DRAFTER.add(m)
    unknown = [m for m in methods if m not in BENCH_METHODS]
    if unknown or not methods:
        raise SpecdecError(f"unknown method(s) {', '.join(unknown) or '(none given)'}; choose from "
                           f"{', '.join(BENCH_METHODS)}")


def bench_config(method: str, settings: Settings) -> SpecConfig:
    """The `SpecConfig` one of our methods runs in a bench: its preset (the registry's; sd-distilled,
    sd-online and sd-other-tokenizer: sd-cost's; sd-parallel: parallel's) with the run's options."""
    name = OWN_MODEL_PRESET if method in BENCH_ONLY and method not in BEAM_METHODS else method
    name = OWN_PRESETS.get(method, name)
    if name in BEAM_METHODS:
        return SpecConfig("ar")
    config = preset(name)
    options = {name: settings.option(name) for name in RUN_OPTIONS
               if name != "lookahead_shape" or config.method == "lookahead"}
    if config.method in CHECKPOINT_OPTIONS:
        self_drafting(settings, config.method)  # its one-line error where the folder is missing
        options["checkpoint"] = getattr(settings, CHECKPOINT_OPTIONS[config.method][0])
    if config.method == "self-skip" and settings.skip_layers:
        options["skip_layers"] = tuple(settings.skip_layers)
    if config.method in ("early-exit", "multi-draft") and settings.exit_layer:
        options["exit_layer"] = settings.exit_layer
    return config.replace(**options).validate()


def check_grammar_methods(methods: list[str]) -> None:
    """SpecdecError naming the methods that cannot constrain their output to a grammar (peers,
    beam search, token trees): refused before any model loads where a prompt has a schema."""
    refused = [m for m in methods if is_peer(m) or m in BEAM_METHODS or bench_method(m).trees]
    if refused:
        raise SpecdecError(f"{', '.join(refused)} cannot constrain output to a schema (json-tasks): run ours with "
                           "chains (e.g. ar, sd-cost, forced, lookup)")


def bench_method(method: str):
    """The registry's `spec.Method` one of our methods runs (peers: plain decoding's, as they take no drafts of ours)."""
    from ..decoding.config import METHODS as REGISTRY

    if is_peer(method) or method in BEAM_METHODS:
        return REGISTRY["ar"]
    name = OWN_PRESETS.get(method, OWN_MODEL_PRESET if method in BENCH_ONLY else method)
    return REGISTRY[preset(name).method]


class CountedGrammar(Grammar):
    """A grammar that keeps the matchers (`grammar.Constraint`) it makes, so that a run can read
    their mask counters after the generation."""

    def __init__(self, kind: str, source=None):
        super().__init__(kind, source)
        object.__setattr__(self, "made", [])  # frozen dataclass: a list of its own, not a field

    def constraint(self, model, ends):
        made = super().constraint(model, ends)
        self.made.append(made)
        return made


def run_method(method: str, ids: list[int], target: TransformersModel, drafter: TransformersModel | None,
               settings: Settings, sampler: Sampler, seed: int | None = None,
               peers: PeerModels | None = None, schema: dict | None = None) -> Record:
    """One generation of `method` on prompt `ids` (peers on `peers`' models where given). schema: a
    JSON Schema the output is constrained by (our chain methods only; `check_grammar_methods`): the
    record then counts the forced tokens and the masks' calls and seconds."""
    peers = peers or PeerModels()
    if schema is not None:
        check_grammar_methods([method])
    if method == "hf-assisted-other-tokenizer":
        return hf_generate(method, peers.hf_target or target, ids, settings, sampler, seed,
                           other_drafter(settings, target)[1][sampler.is_greedy])
    if method.startswith("hf"):
        return hf_generate(method, peers.hf_target or target, ids, settings, sampler, seed,
                           peers.hf_drafter or drafter)
    if method.startswith("llama-cpp"):
        if peers.llama is None:
            raise SpecdecError(f"{method} needs llama.cpp's models (bench/llama_peers.py)")
        tokens, wall, first = peers.llama.generate(method, ids, settings.max_new_tokens, sampler,
                                                   target.eos_token_ids, seed)
        return Record("", method, tokens, len(tokens), wall, len(tokens) if method == "llama-cpp" else None,
                      first_token_seconds=first)
    if method in VLLM_METHODS:
        if settings.vllm is None:
            raise SpecdecError(f"{method} needs vLLM's workers (bench/vllm_peer.py)")
        answer = settings.vllm.run(method, [ids], 1, settings.max_new_tokens, sampler, [seed], target.eos_token_ids)
        out = answer["records"][0]
        return Record("", method, out["tokens"], len(out["tokens"]), answer["wall_seconds"],
                      answer["iterations"] or None, answer["drafted"], answer["accepted"],
                      first_token_seconds=out["first_token_seconds"])
    # every exact method seeded (its output is the seeded AR output); typical acceptance's seed would
    # turn off the measured-cost policies (sequence.seed_pins_drafts): time what users run
    config = bench_config(method, settings)
    typical = config.typical()
    grammar = None if schema is None else CountedGrammar("json_schema", schema)
    common = dict(sampler=sampler, max_new_tokens=settings.max_new_tokens,
                  seed=None if seed_pins_drafts(seed, sampler, config.effective_lenience(), typical) else seed,
                  grammar=grammar)
    if method == "ar":
        result = autoregressive_generate(ids, target, seed_rule=config.seed_rule, **common)
    elif method in BEAM_METHODS:
        if not sampler.is_greedy:
            raise SpecdecError(f"{method} is deterministic: run it on greedy prompts (temperature 0)")
        options = dict(num_beams=settings.num_beams, max_new_tokens=settings.max_new_tokens)
        result = beam_search_generate(ids, target, **options) if method == "beam" else \
            speculative_beam_search(ids, target, drafter, **options)
    else:
        drafter = OWN_DRAFTERS.get(method, drafter)
        costs = settings.pass_costs
        if method == "sd-other-tokenizer":  # a model with another tokenizer: the loop drafts through text
            drafter, _, costs = other_drafter(settings, target)
        parts = Parts(target, drafter, costs=lambda model: costs if model is not None else settings.free_costs,
                      assumed=settings.assumed,
                      datastore=open_datastore(settings) if config.method == "retrieval" else None)
        speculation = build(config, parts)
        with learning(method, drafter):
            # --other-drafter names its role (and the only pair of two tokenizers here has the larger
            # model drafting one way round), so no size check there
            result = speculative_generate(ids, target, speculation,
                                          allow_larger_drafter=method == "sd-other-tokenizer", **common)
    s = result.stats
    divergence = typical_divergence(target, drafter, ids, result.tokens, sampler, typical) \
        if method == "sd-typical" else None
    return Record("", method, result.tokens, s.new_tokens, s.wall_seconds, s.target_passes, s.drafted,
                  s.accepted, s.accepted_per_step, first_token_seconds=s.first_token_seconds,
                  nodes_per_step=s.nodes_per_step, target_seconds=s.target_seconds, drafter_seconds=s.drafter_seconds,
                  widths_per_step=s.widths_per_step, drafter_passes_per_step=s.drafter_passes_per_step,
                  typical_tv=divergence, drafted_at=list(s.drafted_at), accepted_at=list(s.accepted_at),
                  forced=s.forced, mask_calls=sum(c.mask_calls for c in grammar.made) if grammar else 0,
                  mask_seconds=sum(c.mask_seconds for c in grammar.made) if grammar else 0.0,
                  beta_sum=s.beta_sum, beta_positions=s.beta_positions, fixed_gamma=s.fixed_gamma)


_DATASTORES: dict[str, object] = {}  # by folder: opened once a run
_ADAPTERS: dict = {}  # distilled adapters by folder, parallel drafters by ("parallel", folder): read once a run
OWN_DRAFTERS: dict[str, object] = {}  # method -> the drafter model it drafts with where not the run's (a run fills it)


def distilled_adapter(settings: Settings):
    """The sd-distilled method's adapter (`Settings.distilled`), read once a run."""
    from ..adapters.lora import load_adapter

    if not settings.distilled:
        raise SpecdecError("the sd-distilled method needs an adapter: --distilled DIR (`specdec distill-drafter`)")
    if settings.distilled not in _ADAPTERS:
        _ADAPTERS[settings.distilled] = load_adapter(settings.distilled)
    return _ADAPTERS[settings.distilled]


def parallel_adapter(settings: Settings):
    """The sd-parallel method's checkpoint (`Settings.parallel`), read once a run."""
    from ..adapters.pard import load_adapter

    if not settings.parallel:
        raise SpecdecError("the sd-parallel method needs a parallel drafter: --parallel DIR "
                           "(`specdec train-parallel-drafter`)")
    if ("parallel", settings.parallel) not in _ADAPTERS:
        _ADAPTERS["parallel", settings.parallel] = load_adapter(settings.parallel)
    return _ADAPTERS["parallel", settings.parallel]


def load_own_drafters(methods: list[str], settings: Settings, load_drafter) -> None:
    """The drafter models of sd-distilled (the run's drafter with the adapter merged in),
    sd-parallel (the parallel drafter of `--parallel DIR`) and sd-online (a copy of the run's
    drafter learning between prompts), each its own model object:
    merging an adapter into int8 weights takes seconds, too long to switch per prompt.
    `load_drafter(name)` loads as the run's drafter was loaded."""
    from ..adapters.lora import OnlineDistiller

    OWN_DRAFTERS.clear()
    if "sd-distilled" in methods:
        distilled_adapter(settings)
        OWN_DRAFTERS["sd-distilled"] = load_drafter(f"distilled:{settings.distilled}")
    if "sd-parallel" in methods:
        parallel_adapter(settings)
        OWN_DRAFTERS["sd-parallel"] = load_drafter(f"parallel:{settings.parallel}")
    if "sd-online" in methods:
        OWN_DRAFTERS["sd-online"] = OnlineDistiller(load_drafter(None)).model


def online_summary() -> dict | None:
    """What the run's sd-online learner did: its updates, the positions it holds, its time."""
    model = OWN_DRAFTERS.get("sd-online")
    if model is None:
        return None
    online = model.online
    return {"updates": online.updates, "buffered": online.buffered, "update_seconds": round(online.seconds, 2),
            "last_loss": online.last_loss}


@contextlib.contextmanager
def learning(method: str, drafter):
    """sd-online: its drafter's update after the generation (between requests, outside its timing)."""
    yield
    if method == "sd-online":
        drafter.online.update()


_OTHER_DRAFTERS: dict[tuple, tuple] = {}  # (name, device): (ours, transformers', pass costs), loaded once a run


def other_drafter(settings: Settings, target) -> tuple[TransformersModel, dict, PassCosts]:
    """The drafter with another tokenizer (`Settings.other_drafter`): the model our loop drafts
    with; transformers' copies of the same weights by sampling mode (its universal assisted
    generation under sampling rewires the assistant's embeddings in place, after which a greedy
    call on that model fails with a shape error); and the pair's pass costs. Loaded at the first
    call (the bench's warm-up)."""
    from ..models.loading import load
    from ..sizing.pass_costs import pass_costs
    from ..backends.text import pair_mode

    key = (settings.other_drafter, str(target.device))
    if key not in _OTHER_DRAFTERS:
        # bf16 over every id, for all three: a plain model (not our int8 drafter with its frequent-token head)
        ours, greedy, sampled = (load(settings.other_drafter, dtype="bf16", device=str(target.device),
                                      role="drafter", vocab=0) for _ in range(3))
        if pair_mode(target, ours) != "retokenize":
            raise SpecdecError(f"--other-drafter {settings.other_drafter} shares {target.name}'s tokenizer; the "
                               "other-tokenizer methods need a drafter with another one")
        _OTHER_DRAFTERS[key] = (ours, {True: greedy, False: sampled}, pass_costs(target, ours))
    return _OTHER_DRAFTERS[key]


def open_datastore(settings: Settings):
    """The retrieval method's datastore (`Settings.datastore`), opened once."""
    from ..drafters.datastore import Datastore

    if not settings.datastore:
        raise SpecdecError("the retrieval method needs a datastore: --datastore DIR (`specdec datastore build`)")
    if settings.datastore not in _DATASTORES:
        _DATASTORES[settings.datastore] = Datastore(settings.datastore)
    return _DATASTORES[settings.datastore]


_CHECKPOINTS: dict[tuple[str, str], object] = {}  # by (kind, folder)
CHECKPOINT_OPTIONS = {"medusa": ("heads", "--heads"), "eagle": ("eagle", "--eagle")}


def checkpoint_kind(method: str) -> str | None:
    """The checkpoint kind a self-drafting method reads ("medusa", "eagle"), else None."""
    kind = method.removesuffix("-uncalibrated")
    return kind if kind in CHECKPOINT_OPTIONS else None


def self_drafting(settings: Settings, kind: str):
    """The checkpoint a self-drafting method reads (Medusa heads or an EAGLE layer), read once per
    folder; SpecdecError when its option is missing or the folder is not a checkpoint of that kind."""
    field_name, option = CHECKPOINT_OPTIONS[kind]
    folder = getattr(settings, field_name)
    if not folder:
        raise SpecdecError(f"the {kind} method needs its checkpoint: {option} DIR "
                           f"(from `specdec train-heads --kind {kind}`)")
    if (kind, folder) not in _CHECKPOINTS:
        _CHECKPOINTS[kind, folder] = (load_heads if kind == "medusa" else load_eagle)(folder)
    return _CHECKPOINTS[kind, folder]


def hf_generate(method: str, model: TransformersModel, ids: list[int], settings: Settings, sampler: Sampler,
                seed: int | None, drafter: TransformersModel | None = None) -> Record:
    """transformers' own `generate` on the very same model objects, with the same sampler."""
    peers = {"hf": {}, "hf-assisted": {"assistant_model": drafter.hf if drafter else None},
             "hf-assisted-other-tokenizer": {"assistant_model": drafter.hf if drafter else None,
                                             "tokenizer": model.tokenizer,
                                             "assistant_tokenizer": drafter.tokenizer if drafter else None},
             "hf-assisted-fixed": {"assistant_model": drafter.hf if drafter else None},
             "hf-lookup": {"prompt_lookup_num_tokens": settings.option("gamma") or DEFAULT_GAMMA}}
    if drafter is not None:
        # transformers reads these from the *assistant's* generation config and may carry state
        # across calls (a "heuristic" schedule keeps its grown γ): set them afresh on every call
        config = drafter.hf.generation_config
        if method in ("hf-assisted", "hf-assisted-other-tokenizer"):  # transformers' defaults
            config.num_assistant_tokens, config.num_assistant_tokens_schedule = 20, "constant"
            config.assistant_confidence_threshold = 0.4
        else:
            config.num_assistant_tokens, config.num_assistant_tokens_schedule = \
                settings.option("gamma") or DEFAULT_GAMMA, "constant"
            config.assistant_confidence_threshold = 0.0
    if sampler.is_greedy:
        sampling = dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:
        if seed is not None:
            torch.manual_seed(seed)
        sampling = dict(do_sample=True, temperature=sampler.temperature, top_k=sampler.top_k,
                        top_p=sampler.top_p)
    eos = model.eos_token_ids
    inputs = torch.tensor([ids], device=model.device)
    clock = _FirstTokens()
    start = clock.start = time.perf_counter()
    with torch.inference_mode(), _without_assistant_config_warning():
        out = model.hf.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=settings.max_new_tokens,
                                num_beams=1, repetition_penalty=1.0, eos_token_id=eos,
                                pad_token_id=eos[0] if eos else None, stopping_criteria=StoppingCriteriaList([clock]),
                                **sampling, **peers[method])
    wall = time.perf_counter() - start
    tokens = out[0, len(ids):].tolist()
    return Record("", method, tokens, len(tokens), wall, len(tokens) if method == "hf" else None,
                  first_token_seconds=clock.seconds)


class _AssistantConfigWarning(logging.Filter):
    """Drops transformers' deprecation warning about passing `generation_config` with generation
    arguments. Our call passes arguments only; transformers' assisted generation makes that call
    itself, for the assistant (candidate_generator.py, `_prepare_generation_args` with
    `min_new_tokens`/`max_new_tokens`), on every bench run: nothing a caller can change."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Passing `generation_config` together with" not in record.getMessage()


@contextlib.contextmanager
def _without_assistant_config_warning():
    logger, warning = logging.getLogger("transformers.generation.utils"), _AssistantConfigWarning()
    logger.addFilter(warning)
    try:
        yield
    finally:
        logger.removeFilter(warning)


class _FirstTokens(StoppingCriteria):
    """A criterion that never stops: it notes when transformers' main loop first appended new tokens
    (the time to first token). The assistant of assisted generation never calls it."""

    def __init__(self):
        self.start, self.seconds = 0.0, None

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        if self.seconds is None:
            self.seconds = time.perf_counter() - self.start
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
