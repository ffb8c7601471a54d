"""Penalties, logit bias and min_tokens (core/penalties.py): the batched rule against a row-by-row
reference, and speculative decoding under them exact: greedy token for token the AR output with
the same rules (alone and batched), sampled following the rules' law."""

from __future__ import annotations

import pytest
import torch

from specdec import Sampler, SpecdecError, autoregressive_generate, generate_many, speculative_generate
from specdec.core.penalties import LogitRules

from conftest import TableModel, tiny_model
from test_sampling_exactness import ALPHA, chi_square_pvalue


def _reference(logits, prompt, output, continuation, ends, rules: LogitRules) -> torch.Tensor:
    """The rules applied one row at a time, as plain loops over the vocabulary."""
    out = logits.clone().float()
    for j in range(len(out)):
        history = list(output) + list(continuation[:j])
        for token in range(out.shape[1]):
            count = history.count(token)
            if rules.repetition != 1 and (count or token in prompt):
                value = out[j, token]
                out[j, token] = value / rules.repetition if value > 0 else value * rules.repetition
            out[j, token] -= rules.frequency * count + rules.presence * (count > 0)
        for token, value in rules.bias:
            out[j, token] += value
        if len(history) < rules.min_tokens:
            out[j, list(ends)] = float("-inf")
    return out


@pytest.mark.parametrize("rules", [LogitRules(presence=0.7), LogitRules(frequency=-0.4), LogitRules(repetition=1.3),
                                   LogitRules(bias=((2, 5.0), (7, -100.0))), LogitRules(min_tokens=4),
                                   LogitRules(0.5, 0.3, 1.2, ((1, 1.5),), 3)], ids=str)
def test_the_batched_rules_equal_a_row_by_row_reference(rules):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 9, generator=generator) * 3
    prompt, output, continuation, ends = [1, 1, 4], [2, 5, 2], [5, 8, 2], {0, 8}
    expected = _reference(logits, prompt, output, continuation, ends, rules)
    torch.testing.assert_close(rules.apply(logits, prompt, output, continuation, ends), expected)
    mask = rules.prompt_tokens(prompt, 9, logits.device)  # what a sequence makes once
    torch.testing.assert_close(rules.apply(logits, mask, output, continuation, ends), expected)
    assert rules.active and not LogitRules().active


def test_bad_rules_are_refused_by_name():
    for kwargs, match in ((dict(presence=3), "presence"), (dict(frequency=float("nan")), "frequency"),
                          (dict(repetition=0), "repetition"), (dict(min_tokens=-1), "min_tokens"),
                          (dict(bias=((3, 101),)), "logit bias values"), (dict(bias=((-1, 1),)), "token ids")):
        with pytest.raises(SpecdecError, match=match):
            LogitRules(**kwargs)
    with pytest.raises(SpecdecError, match="vocabulary of 9"):
        LogitRules(bias=((9, 1.0),)).apply(torch.zeros(1, 9), [], [], [], set())
    with pytest.raises(SpecdecError, match="chain drafts only"):
        from specdec.drafters import make_tree_drafter
        target = tiny_model(0)
        speculative_generate([0, 3], target, make_tree_drafter("mixed", tiny_model(1)), max_new_tokens=4,
                             rules=LogitRules(presence=1.0))


RULES = [LogitRules(presence=1.5, frequency=0.5), LogitRules(repetition=1.8), LogitRules(bias=((3, 4.0), (5, -100.0))),
         LogitRules(min_tokens=12)]
ENDS = [[1, 6], [1, 6], [1, 6], [0]]  # min_tokens holds back an end token the plain output meets early


@pytest.mark.parametrize("rules,eos", list(zip(RULES, ENDS)), ids=[str(r) for r in RULES])
def test_greedy_speculative_equals_ar_under_the_same_rules(rules, eos):
    # logits flat enough that the rules change the output
    target, drafter = tiny_model(0, vocab=16, logit_scale=0.05), tiny_model(0, vocab=16, logit_scale=0.05, name="same")
    other = tiny_model(3, vocab=16, logit_scale=0.05, name="other")
    prompt = [0, 4, 4, 9, 4]
    ar = autoregressive_generate(prompt, target, max_new_tokens=24, eos_token_ids=eos, rules=rules).tokens
    plain = autoregressive_generate(prompt, target, max_new_tokens=24, eos_token_ids=eos).tokens
    assert ar != plain  # the rules change this output (the test has power)
    for model in (drafter, other):
        for gamma in (1, 4):
            assert speculative_generate(prompt, target, model, gamma=gamma, max_new_tokens=24, eos_token_ids=eos,
                                        rules=rules).tokens == ar
    if rules.min_tokens:
        assert len(ar) >= rules.min_tokens and not set(ar[:rules.min_tokens - 1]) & set(eos)


def test_batched_requests_keep_their_own_rules():
    target = tiny_model(0, vocab=16, exact_rows=True, logit_scale=0.05)
    drafter = tiny_model(3, vocab=16, logit_scale=0.05, name="other")
    prompts = [[0, 4, 4, 9], [0, 7, 2], [0, 5]]
    expected = [autoregressive_generate(p, target, max_new_tokens=16, eos_token_ids=[], rules=r).tokens
                for p, r in zip(prompts, RULES)]
    from specdec.engine import Engine, Request

    engine = Engine(target, max_batch=3)
    ids = [engine.add(Request(p, drafter, max_new_tokens=16, eos_token_ids=[], rules=r))
           for p, r in zip(prompts, RULES)]
    results = engine.run()
    assert [results[i].tokens for i in ids] == expected
    assert generate_many(prompts[:1], target, None, max_new_tokens=16, eos_token_ids=[],
                         rules=RULES[0])[0].tokens == expected[0]


def _joint_under(target: TableModel, prompt, length, sampler, rules, ends) -> dict:
    """{first `length` tokens: probability} under AR sampling with the rules."""
    joint = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for prefix, mass in joint.items():
            logits = target.forward(list(prompt) + list(prefix), None, 1)
            probs = sampler.probs(rules.apply(logits, prompt, list(prefix), [], ends))[0]
            for token, p in enumerate(probs.tolist()):
                if p > 0:
                    nxt[prefix + (token,)] = mass * p
        joint = nxt
    return joint


@pytest.mark.slow
@pytest.mark.parametrize("sampler,rules", [(Sampler(1.0), LogitRules(presence=1.2, bias=((2, 1.0),))),
                                           (Sampler(0.8, min_p=0.1), LogitRules(repetition=1.7, min_tokens=2))],
                         ids=["presence+bias", "repetition+min_tokens+min_p"])
def test_sampled_speculative_decoding_follows_the_rules_law(sampler, rules):
    target, drafter = TableModel(vocab=5, seed=0), TableModel(vocab=5, seed=1)
    prompt, length, runs, ends = [2, 3], 3, 6_000, [4]
    joint = _joint_under(target, prompt, length, sampler, rules, set(ends))
    plain = _joint_under(target, prompt, length, sampler, LogitRules(), set(ends))
    generator = torch.Generator().manual_seed(99)
    samples = []
    for _ in range(runs):
        seed = int(torch.randint(0, 2 ** 62, (1,), generator=generator))
        out = speculative_generate(prompt, target, drafter, gamma=2, sampler=sampler, max_new_tokens=length,
                                   eos_token_ids=ends, seed=seed, seed_rule="stream", rules=rules)
        samples.append(tuple(out.tokens) + (None,) * (length - len(out.tokens)))
    joint = _ended(joint, ends, length)
    assert chi_square_pvalue(samples, joint) > ALPHA
    plain = _ended(plain, ends, length)  # the test tells the laws apart (a sample outside its support: apart)
    assert not set(samples) <= set(plain) or chi_square_pvalue(samples, plain) < ALPHA


def _ended(joint: dict, ends, length: int) -> dict:
    """The joint law as generation sees it: a sequence stops at its first end token."""
    out: dict = {}
    for prefix, p in joint.items():
        cut = next((i + 1 for i, t in enumerate(prefix) if t in ends), length)
        key = prefix[:cut] + (None,) * (length - cut)
        out[key] = out.get(key, 0.0) + p
    return out
