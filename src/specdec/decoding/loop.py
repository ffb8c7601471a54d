"""Decoding one sequence: autoregressive (the baseline) and speculative (Leviathan et al., Algorithm 1).

`Decoding` is one sequence's state, a step at a time: schedule -> draft -> (one target pass) ->
verify -> roll back. `run` makes the passes with `forward` (`autoregressive_generate`,
`speculative_generate`); the engine (engine/) makes them for many sequences with one
`forward_batch`. Both caches always hold every token of the sequence except those not yet fed;
after verification the rejected draft positions are cropped from both, so no accepted token is
ever recomputed.
"""

from __future__ import annotations

import time
from typing import Sequence


from ..backends import Backend
from ..drafters import Drafter
from ..errors import SpecdecError
from ..core.penalties import LogitRules
from ..models.roles import check_roles
from ..core.samplers import GREEDY, Sampler
from ..sizing.schedules import Schedule
from ..backends.text import pair_mode
from ..core.verify import Typical


from .results import GenerationResult, StepCallback
from .sequence import Decoding, Limits
from .speculation import Speculation


def autoregressive_generate(prompt_ids: Sequence[int], model: Backend, sampler: Sampler = GREEDY,
                            max_new_tokens: int = 128, eos_token_ids: Sequence[int] | None = None,
                            seed: int | None = None, on_step: StepCallback | None = None,
                            logprobs: int | None = None, seed_rule: str = "coupled",
                            rules: LogitRules | None = None, grammar=None) -> GenerationResult:
    """Generate one token per target pass, with a KV cache: the baseline to beat. logprobs,
    seed_rule, rules and grammar: as `speculative_generate`'s."""
    return run(Decoding(prompt_ids, model, Speculation.of(seed_rule=seed_rule), sampler,
                        Limits(max_new_tokens, eos_token_ids), seed=seed, on_step=on_step, logprobs=logprobs,
                        rules=rules, grammar=grammar))


def speculative_generate(prompt_ids: Sequence[int], target: Backend,
                         speculation: Speculation | Backend | Drafter | None = None,
                         gamma: int | None = None, sampler: Sampler = GREEDY, max_new_tokens: int = 128,
                         eos_token_ids: Sequence[int] | None = None, seed: int | None = None,
                         first_target: bool = True, on_step: StepCallback | None = None,
                         schedule: Schedule | None = None, lenience: float | None = None,
                         debug: bool = False, logprobs: int | None = None,
                         typical: Typical | None = None, seed_rule: str | None = None,
                         rules: LogitRules | None = None, grammar=None,
                         allow_larger_drafter: bool = False, drafter: Backend | Drafter | None = None
                         ) -> GenerationResult:
    """Speculative decoding: the drafter proposes tokens, the target scores them in one forward
    pass, and the verification keeps an exact prefix plus one target token.

    speculation: what drafts and how drafts are accepted, whole: a `Speculation` (`build(config,
        parts)`, or `Speculation.of(drafter, gamma=..., ...)`), which then takes none of the options
        gamma, schedule, lenience, typical and seed_rule. A bare drafter is accepted too, with those
        options beside it (the older spelling: `speculative_generate(ids, target, drafter, gamma=4)`),
        turned into `Speculation.of(drafter, ...)` here, once (also as the keyword `drafter=`):
    drafter: a smaller model (any `Backend`, same vocabulary), or any `Drafter` (drafters/: n-gram,
        prompt lookup), or a tree drafter (`make_tree_drafter`: sides, eagle2, sequoia, lookup,
        mixed), whose token tree the target verifies in one pass under a tree attention mask;
        its own cost policy (`drafter.policy`, a `TreeCost`) sizes the tree, up to its depth bound
        (`gamma`, where given, in place of the policy's own).
        A drafter with `reads_target_hidden` (Medusa heads, EAGLE) is handed, after the prefill
        and every target pass, the target's final hidden states [n, H] at the positions that pass
        committed, in order (`observe`): the drafter then holds one per sequence position but the
        last, the last one being where the target chose the newest token.
    gamma: a chain's fixed draft length where no schedule is given (default 5); a tree's depth bound.
    schedule: how many tokens a chain drafts per step (sizing/schedules.py); default: a fixed `gamma`.
    lenience: 1 (default) is exact; l in (0, 1) accepts more drafts and is LOSSY under sampling
        (no token gets more than p/l; see `verify_draft`); greedy output is unaffected.
    typical: Medusa's typical acceptance instead of rejection sampling (`verify.Typical`): LOSSY
        under sampling, greedy output unaffected; chains only.
    seed: pins the output. Under `seed_rule="coupled"` (default) every sampled token is a coupled
        draw (Gumbel-max, `verify_coupled`) from noise of (seed, position) alone, so the output is
        token for token the seeded `autoregressive_generate` output on the same machine, whatever
        the drafter, the draft lengths, the tree or the batch, and schedules keep learning from
        timings. Under `seed_rule="stream"`, or a lossy rule (lenience, typical), the standard rule
        draws from seeded streams: the output is pinned per method and schedule only, and
        schedules get no timings (their starting thresholds). Unseeded runs take the standard rule.
    debug: record in each `Step.info` the p(x), q(x) and uniform draw u of every draft token
        ("p", "q", "u"; under greedy and under a seed u is None and p, q are the one-hot values 0 or 1:
        a token passes iff it is the target's own).
    logprobs: None, or k >= 0: the result's `logprobs` holds, for every emitted token, the target's
        log-probability of it and its k most likely tokens there (core/logprobs.py: the model's own
        distribution at temperature 1, the same whatever was drafted).
    rules: penalties, logit bias and a minimum length (`penalties.LogitRules`), applied to the
        target's logits at every position before the sampler, as autoregressive decoding with the
        same rules applies them (chains only).
    grammar: what the output must match (`grammar.Grammar`, "json" for any JSON object, or a JSON
        Schema as a dict): every position's logits are masked with the grammar's state there
        (draft positions after the draft tokens before them), after `rules`; tokens the grammar
        forces are drafted for free (`GenerationStats.forced`). Chains only. The output is the
        constrained autoregressive output (greedy: token for token; seeded: the seeded one).

    The output follows the target's distribution under `sampler` exactly (token for token the
    target's greedy output when the sampler is greedy). `first_target=True` makes the first token
    come from the target's prompt pass alone, before any drafting. Drafts shrink near
    `max_new_tokens` and the context limit. Generation stops at any id in `eos_token_ids`
    (default: the target's), also when one arrives inside an accepted draft.

    The target comes before the drafter (romsto's code has them the other way round): a pair the
    loader marked the other way round (`specdec.load(..., role=)`), or a drafter model with more
    parameters than the target, is refused (`roles.check_roles`); `allow_larger_drafter=True`
    lets a larger drafter through where that is meant.
    """
    if drafter is not None:
        if speculation is not None:
            raise SpecdecError("give speculative_generate a speculation or a drafter, not both")
        speculation = drafter
    speculation = _speculation(speculation, gamma=gamma, schedule=schedule, lenience=lenience, typical=typical,
                               seed_rule=seed_rule)
    decoding = Decoding(prompt_ids, target, speculation, sampler, Limits(max_new_tokens, eos_token_ids), seed=seed,
                        first_target=first_target, on_step=on_step, debug=debug, logprobs=logprobs, rules=rules,
                        grammar=grammar)
    # after the pair's own checks (a vocabulary that differs)
    check_roles(target, decoding.drafter, allow_larger_drafter)
    return run(decoding)


def _speculation(speculation, **options) -> Speculation:
    """`speculation` itself (its options are its own: none may be given beside it), or a bare drafter
    (or None) with the loose options, as `Speculation.of(...)`."""
    given = {name: value for name, value in options.items() if value is not None}
    if isinstance(speculation, Speculation):
        if given:
            raise SpecdecError(f"a Speculation carries its own {', '.join(given)}; give them to Speculation.of "
                               "(or build's config), not beside it")
        return speculation
    return Speculation.of(speculation, **given)


def speculative_generate_encoder_decoder(source_ids: Sequence[int], target, drafter=None,
                                         decoder_prompt: Sequence[int] | None = None,
                                         allow_larger_drafter: bool = False, **options) -> GenerationResult:
    """Encoder-decoder targets (T5, BART; `backends.seq2seq.Seq2SeqModel`): each model encodes
    `source_ids` [S] once, then the decoders run `speculative_generate`'s loop, their own caches
    cropped on rejection (chains only). Without a drafter, autoregressive decoding of the target.

    drafter: a smaller `Seq2SeqModel` of the same vocabulary and decoder start (it encodes the
        source itself), a model-free chain drafter (prompt lookup, n-gram: they see the decoder's
        tokens), or None; or a `Speculation` of one (then without the loose options below).
    decoder_prompt: the decoder's first tokens (default: its start token alone); the result holds
        what follows them.
    allow_larger_drafter: as `speculative_generate`'s (a larger drafter is refused without it).
    options: as `speculative_generate`'s (sampler, max_new_tokens, seed, schedule, ...).
    """
    from ..backends.seq2seq import Seq2SeqModel

    if not isinstance(target, Seq2SeqModel):
        raise SpecdecError(f"the target must be an encoder-decoder model (Seq2SeqModel), got {type(target).__name__}; "
                           "decoder-only models take speculative_generate")
    acceptance = {name: options.pop(name) for name in ("gamma", "schedule", "lenience", "typical", "seed_rule")
                  if name in options}
    speculation = _speculation(drafter, **acceptance)
    drafter = speculation.make_drafter() if speculation.speculative else None
    if isinstance(drafter, Seq2SeqModel):
        if pair_mode(target, drafter) != "shared":
            raise SpecdecError(f"tokenizers differ: target {target.name} and drafter {drafter.name}; an "
                               "encoder-decoder drafter must share the target's vocabulary")
        if drafter.decoder_start_token_id != target.decoder_start_token_id:
            raise SpecdecError(f"the drafter's decoder starts with id {drafter.decoder_start_token_id}, the target's "
                               f"with {target.decoder_start_token_id}: they must share one vocabulary")
        check_roles(target, drafter, allow_larger_drafter)
        drafter = drafter.bind(source_ids)
    if drafter is not None:  # this generation's drafter, bound to its source
        speculation = speculation.made_once(drafter, speculation.schedule())
    prompt = [target.decoder_start_token_id] if decoder_prompt is None else list(decoder_prompt)
    limits = Limits(options.pop("max_new_tokens", 128), options.pop("eos_token_ids", None))
    sampler = options.pop("sampler", GREEDY)
    return run(Decoding(prompt, target.bind(source_ids), speculation, sampler, limits, **options))


def run(decoding: "Decoding") -> GenerationResult:
    """One sequence to its end, one target pass per step: what the engine does for many at once."""
    decoding.prefill()
    target = decoding.target
    while not decoding.done:
        segment = decoding.draft()
        began = time.perf_counter()
        logits = target.forward(segment.input_ids, segment.cache, segment.num_logits, parents=segment.parents)
        decoding.apply(logits, time.perf_counter() - began)
    return decoding.result()
