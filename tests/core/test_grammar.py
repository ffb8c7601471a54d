"""Constrained output (core/grammar.py) exact under speculation: greedy output token for token the
constrained AR output for every chain method, alone and in engine batches; a seed pins the
constrained AR output whatever drafted; sampling follows p_g (chi-square, with a power check);
forced tokens drafted for free and counted apart. Tiny random models with a byte-level BPE
tokenizer built here (the grammar reads the tokenizer).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from specdec import Sampler
from specdec.backends.transformers import TransformersModel
from specdec.engine import Engine, Request
from specdec.errors import SpecdecError
from specdec.decoding.loop import autoregressive_generate, speculative_generate
from specdec.core.grammar import Grammar
from specdec.decoding.speculation import Parts, build, resolve

from test_server_openai import SPECIALS, byte_level_tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "kind": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"}},
          "required": ["name", "kind", "ok"], "additionalProperties": False}
GRAMMARS = {"schema": Grammar.json_schema(SCHEMA), "json": Grammar.json(), "regex": Grammar.regex(r"(ab|ba)+c"),
            "short": Grammar.regex(r"(ab|ba)c")}  # ends within a draft: the end is forced, nothing drafted after
PROMPT_TEXT = "an answer: "
METHODS = ["forced", "lookup", "suffix", "ngram", "chain", "cascade", "sd", "sd-heuristic"]


def _model(tokenizer, seed: int, layers: int, name: str, kernels: str = "auto") -> TransformersModel:
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = tokenizer.convert_tokens_to_ids(SPECIALS)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=ids[0], eos_token_id=ids[1], pad_token_id=ids[1])
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # sharp enough that p and q differ
    return TransformersModel(model, tokenizer, name, kernels=kernels, exact_rows=True)


@pytest.fixture(scope="module")
def pair():
    tokenizer = byte_level_tokenizer([('"', ':'), ('{', '"'), ('"', ','), ('c', 'a')])
    return _model(tokenizer, 0, 2, "tiny-grammar"), _model(tokenizer, 1, 1, "tiny-grammar-drafter")


@pytest.fixture(scope="module")
def prompt(pair):
    return pair[0].encode(PROMPT_TEXT)


def _drafter(method: str, pair):
    target, drafter = pair
    built = build(resolve(method), Parts(target, drafter if resolve(method).needs_drafter_model() else None))
    return built.make_drafter(), built.schedule()


def _valid(target, grammar: Grammar, tokens: list[int]) -> bool:
    """Whether every token of an output keeps to the grammar (its end token included)."""
    return grammar.constraint(target, target.eos_token_ids).valid(tokens) == len(tokens)


CASES = [(m, g) for m in METHODS for g in GRAMMARS if g == "schema" or m in ("forced", "chain", "lookup", "sd")]


@pytest.mark.parametrize("method, grammar", CASES, ids=[f"{m}-{g}" for m, g in CASES])
def test_greedy_constrained_output_is_constrained_ar_token_for_token(pair, prompt, method, grammar):
    target = pair[0]
    g = GRAMMARS[grammar]
    ar = autoregressive_generate(prompt, target, max_new_tokens=40, grammar=g)
    assert _valid(target, g, ar.tokens)
    plain = autoregressive_generate(prompt, target, max_new_tokens=40)
    assert plain.tokens != ar.tokens  # the grammar changes the output: the test has power
    drafter, schedule = _drafter(method, pair)
    out = speculative_generate(prompt, target, drafter, schedule=schedule, max_new_tokens=40, grammar=g)
    assert out.tokens == ar.tokens
    if grammar == "short":
        assert ar.stop_reason == "eos" and len(ar.tokens) <= 4
    if grammar == "schema":  # keys and punctuation are forced: drafted for free, counted apart
        assert out.stats.forced > 0 and out.stats.target_passes < ar.stats.target_passes
        assert out.stats.accepted <= out.stats.drafted


def test_a_target_drafting_for_itself_keeps_to_the_grammar_too(pair, prompt):
    """Self-drafting (layer skip): the target with layers left out drafts under the grammar as a
    drafter model does; the output is the constrained AR output."""
    target = _model(pair[0].tokenizer, 0, 4, "tiny-grammar-4", kernels="stock")  # layers to skip
    built = build(resolve("self-skip").replace(skip_layers=(1,)), Parts(target))
    for g in (GRAMMARS["schema"], GRAMMARS["short"]):
        ar = autoregressive_generate(prompt, target, max_new_tokens=30, grammar=g)
        out = speculative_generate(prompt, target, built.make_drafter(), schedule=built.schedule(),
                                   max_new_tokens=30, grammar=g)
        assert out.tokens == ar.tokens and out.stats.drafted + out.stats.forced > 0


@pytest.mark.parametrize("batch", [2, 5])
def test_constrained_sequences_in_engine_batches_equal_their_ar_alone(pair, batch):
    target = pair[0]
    prompts = [target.encode(f"{i} says: ") for i in range(batch)]
    grammars = [GRAMMARS[name] for name in ("schema", "json", "regex", "schema", "json")][:batch]
    expected = [autoregressive_generate(p, target, max_new_tokens=30, grammar=g).tokens
                for p, g in zip(prompts, grammars)]
    for method in ("forced", "chain", "lookup"):
        engine = Engine(target, max_batch=batch)
        drafter = build(resolve(method), Parts(target, pair[1] if method == "chain" else None))
        ids = [engine.add(Request(p, drafter.make_drafter, max_new_tokens=30, schedule=drafter.make_schedule,
                                  grammar=g)) for p, g in zip(prompts, grammars)]
        results = engine.run()
        assert [results[i].tokens for i in ids] == expected, method


@pytest.mark.parametrize("method", ["chain", "lookup", "forced"])
def test_a_seed_pins_the_constrained_ar_output_whatever_drafts(pair, prompt, method):
    target = pair[0]
    sampler = Sampler(temperature=1.0)
    for seed in (1, 2, 3):
        ar = autoregressive_generate(prompt, target, sampler=sampler, seed=seed, max_new_tokens=30,
                                     grammar=GRAMMARS["schema"])
        drafter, schedule = _drafter(method, pair)
        out = speculative_generate(prompt, target, drafter, schedule=schedule, sampler=sampler, seed=seed,
                                   max_new_tokens=30, grammar=GRAMMARS["schema"])
        assert out.tokens == ar.tokens and _valid(target, GRAMMARS["schema"], ar.tokens)


def _constrained_law(model, prompt: list[int], grammar: Grammar, depth: int) -> dict[tuple[int, ...], float]:
    """The exact law of the first `depth` tokens under p_g (the model's p masked by the grammar)."""
    law = {(): 1.0}
    for _ in range(depth):
        nxt = {}
        for prefix, mass in law.items():
            constraint = grammar.constraint(model, model.eos_token_ids)
            constraint.commit(list(prefix))
            logits = model.forward(prompt + list(prefix), model.new_cache(), 1)[-1:]
            probs = torch.softmax(constraint.mask_logits(logits, []), -1)[0]
            for token in torch.nonzero(probs > 1e-9).flatten().tolist():
                nxt[prefix + (token,)] = mass * float(probs[token])
        law = nxt
    return law


@pytest.mark.slow
def test_unseeded_constrained_sampling_follows_p_g(pair, prompt):
    """2,000 unseeded samples of the first two tokens under a grammar with several choices at
    each, drafted by the drafter model: chi-square against p_g at 0.1% (it passes), and against
    the drafter's own constrained law (it fails: the test has power)."""
    from scipy.stats import chisquare

    target, drafter_model = pair
    grammar = Grammar.regex(r"[a-d][a-d]x")
    law = _constrained_law(target, prompt, grammar, 2)
    wrong = _constrained_law(drafter_model, prompt, grammar, 2)
    counts = Counter()
    drafter, schedule = _drafter("sd", pair)
    for _ in range(2000):
        out = speculative_generate(prompt, target, drafter, schedule=schedule, sampler=Sampler(temperature=1.0),
                                   max_new_tokens=2, grammar=grammar)
        counts[tuple(out.tokens)] += 1
    keys = sorted(set(law) | set(counts))
    observed = [counts[k] for k in keys]
    assert set(counts) <= set(law)  # nothing outside the grammar
    expected = [law.get(k, 0.0) for k in keys]
    expected = [e * 2000 / sum(expected) for e in expected]
    assert chisquare(observed, expected).pvalue > 1e-3
    off = [2000 * wrong.get(k, 1e-9) for k in keys]
    off = [e * 2000 / sum(off) for e in off]
    assert chisquare(observed, off).pvalue < 1e-3


def test_trees_ignore_eos_and_bad_grammars_are_refused_in_words(pair, prompt):
    target = pair[0]
    tree = build(resolve("tree-lookup"), Parts(target)).make_drafter()
    with pytest.raises(SpecdecError, match="chain drafts only"):
        speculative_generate(prompt, target, tree, grammar="json")
    with pytest.raises(SpecdecError, match="end token"):
        autoregressive_generate(prompt, target, eos_token_ids=[], grammar="json")
    with pytest.raises(SpecdecError, match="not valid"):
        autoregressive_generate(prompt, target, grammar={"type": "object", "properties": {"a": {"type": "strin"}}})
    with pytest.raises(SpecdecError, match="grammar must be"):
        autoregressive_generate(prompt, target, grammar=42)


def test_a_reused_drafter_forgets_the_last_grammar_and_a_foreign_end_never_comes(pair, prompt):
    """A drafter model object used again without a grammar drafts freely (it kept the last run's
    finished matcher, which forced an end token into every draft); a sequence that ends on another
    token than the model's own end never emits that one, though the grammar would allow it."""
    from specdec.drafters import ModelDrafter

    target, drafter_model = pair
    drafter = ModelDrafter(drafter_model)
    speculative_generate(prompt, target, drafter, gamma=4, max_new_tokens=20, grammar=GRAMMARS["short"])
    free = speculative_generate(prompt, target, drafter, gamma=4, max_new_tokens=20)
    assert free.tokens == autoregressive_generate(prompt, target, max_new_tokens=20).tokens
    assert free.stats.drafted >= 4 and free.stats.forced == 0
    other_end = target.encode("!")[0]
    out = autoregressive_generate(prompt, target, max_new_tokens=10, eos_token_ids=[other_end],
                                  grammar=Grammar.regex(r"(ab|ba)c!?"))
    assert not set(out.tokens) & set(target.eos_token_ids)
    with pytest.raises(SpecdecError, match="do not combine"):
        from specdec.core.penalties import LogitRules

        autoregressive_generate(prompt, target, max_new_tokens=10, grammar="json", rules=LogitRules(min_tokens=3))
