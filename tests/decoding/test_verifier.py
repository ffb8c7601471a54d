"""The verifier a sequence chooses once (decoding/verifier.py): which rule and shape each sampler,
seed and acceptance option gets, what is refused, that the batch's one call decides as each
sequence's own verifier would, and that every sequence of an engine step is verified there (the
batchable ones in one call). The rules' statistics are tested in test_verify.py,
test_tree_verify.py, test_coupled.py and test_sampling_exactness.py."""

from __future__ import annotations

import ast
import copy
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from specdec import Engine, Request, Sampler, SpecdecError, speculative_generate
from specdec.core.samplers import GREEDY, SeededNoise
from specdec.core.trees import Draft, Tree
from specdec.core.verify import Typical, verify_ragged
from specdec.decoding import sequence as sequence_module
from specdec.decoding import verifier as verifier_module
from specdec.decoding.verifier import (VERIFIERS, CoupledChain, CoupledTree, GreedyChain, GreedyTree, LenientChain,
                                       StandardChain, StandardTree, TypicalChain, Verdict, choose_verifier,
                                       decide_batch)
from specdec.drafters import make_tree_drafter

from conftest import tiny_model
from test_rows import _ids, qwen_like

SRC = Path(__file__).resolve().parents[2] / "src" / "specdec"
SAMPLED = Sampler(temperature=1.0)
NOISE = SeededNoise(7)

# sampler, a seed's shared noise, lenience, typical, trees -> the verifier
CHOICES = [
    (GREEDY, None, 1.0, None, False, GreedyChain),
    (GREEDY, None, 0.5, None, False, GreedyChain),  # greedy compares tokens whatever the rule
    (GREEDY, None, 1.0, Typical(), False, GreedyChain),
    (SAMPLED, NOISE, 1.0, None, False, CoupledChain),
    (SAMPLED, None, 1.0, None, False, StandardChain),
    (SAMPLED, None, 0.5, None, False, LenientChain),
    (SAMPLED, None, 1.0, Typical(), False, TypicalChain),
    (GREEDY, None, 1.0, None, True, GreedyTree),
    (SAMPLED, NOISE, 1.0, None, True, CoupledTree),
    (SAMPLED, None, 1.0, None, True, StandardTree),
]


@pytest.mark.parametrize("sampler,noise,lenience,typical,trees,expected", CHOICES,
                         ids=[f"{c[-1].__name__}-{i}" for i, c in enumerate(CHOICES)])
def test_each_sampler_rule_and_shape_gets_its_verifier(sampler, noise, lenience, typical, trees, expected):
    verifier = choose_verifier(sampler, noise, lenience, typical, trees)
    assert type(verifier) is expected and VERIFIERS[verifier.rule, trees] is expected
    assert verifier.trees == trees
    # the target's own tokens decide greedy and coupled chains alone: they join the batch's one call
    assert verifier.batchable == (not trees and verifier.rule in ("greedy", "coupled"))
    assert verifier.noise is (noise if verifier.rule == "coupled" else None)  # only the coupled rule reads races


def test_the_table_holds_the_exact_rules_for_trees_and_all_five_for_chains():
    assert sorted(rule for rule, trees in VERIFIERS if not trees) == sorted(verifier_module.RULES)
    assert sorted(rule for rule, trees in VERIFIERS if trees) == ["coupled", "greedy", "standard"]


REFUSED = [
    (0.5, None, True, "lenience < 1 applies to chain drafts only; tree verification is exact"),
    (1.0, Typical(), True, "typical acceptance applies to chain drafts only; tree verification is exact"),
    (0.5, Typical(), False, "choose lenience or typical acceptance, not both"),
    (1.0, "typical", False, "typical must be a verify.Typical"),
    (0.0, None, False, "lenience must be in (0, 1]"),
    (1.5, None, False, "lenience must be in (0, 1]"),
]


@pytest.mark.parametrize("lenience,typical,trees,message", REFUSED)
def test_refused_combinations_raise_a_clear_error(lenience, typical, trees, message):
    with pytest.raises(SpecdecError, match=re.escape(message)):
        choose_verifier(SAMPLED, None, lenience, typical, trees)


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(0, vocab=16), tiny_model(1, vocab=16, layers=1)


@pytest.mark.parametrize("lenience,typical,message", [(0.5, None, "lenience < 1 applies to chain drafts only"),
                                                      (1.0, Typical(), "typical acceptance applies to chain")])
def test_a_tree_drafter_is_refused_a_lossy_rule_with_the_same_error_as_the_choice(tiny, lenience, typical, message):
    target, drafter_model = tiny
    with pytest.raises(SpecdecError, match=message) as through_the_loop:
        speculative_generate([1, 2, 3], target, make_tree_drafter("sides", drafter_model), sampler=SAMPLED,
                             lenience=lenience, typical=typical, max_new_tokens=4)
    with pytest.raises(SpecdecError) as chosen:
        choose_verifier(SAMPLED, None, lenience, typical, trees=True)
    assert str(through_the_loop.value) == str(chosen.value)


def test_a_sequence_without_a_drafter_takes_the_samplers_rule_whatever_its_acceptance_options():
    assert type(choose_verifier(SAMPLED, None, 0.5, Typical(), drafts=False)) is StandardChain
    assert type(choose_verifier(GREEDY, None, 0.5, Typical(), drafts=False)) is GreedyChain
    assert type(choose_verifier(SAMPLED, NOISE, 1.0, None, drafts=False)) is CoupledChain


def test_a_sequence_chooses_its_verifier_once_and_verifies_every_step_through_it(tiny, monkeypatch):
    """One choice at the sequence's start; then every drafted step goes through that verifier's
    `verify` and every draft-less step through its `target_token`, the rule's outcome unchanged."""
    target, drafter = tiny
    chosen, verified = [], []
    real_choose = sequence_module.choose_verifier

    def choose(*args, **kwargs):
        chosen.append(real_choose(*args, **kwargs))
        return chosen[-1]

    real_verify, real_token = StandardChain.verify, StandardChain.target_token
    monkeypatch.setattr(sequence_module, "choose_verifier", choose)
    monkeypatch.setattr(StandardChain, "verify", lambda self, *a, **k: verified.append((self, "verify")) or
                        real_verify(self, *a, **k))
    monkeypatch.setattr(StandardChain, "target_token", lambda self, *a, **k: verified.append((self, "token")) or
                        real_token(self, *a, **k))
    out = speculative_generate([1, 2, 3], target, drafter, gamma=3, sampler=SAMPLED, max_new_tokens=12,
                               eos_token_ids=[], seed=3, seed_rule="stream")
    assert len(chosen) == 1 and type(chosen[0]) is StandardChain
    assert {id(v) for v, _ in verified} == {id(chosen[0])}
    kinds = [kind for _, kind in verified]
    # the first token comes from the prompt's pass alone; every later step verifies a draft
    assert kinds[0] == "token" and kinds.count("verify") == len(out.steps) - 1 > 0
    assert any(step.draft_tokens for step in out.steps)


def _rows(gamma: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randn(gamma + 1, vocab, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("verifier", [choose_verifier(GREEDY), choose_verifier(SAMPLED, SeededNoise(5))],
                         ids=["greedy", "coupled"])
def test_the_batch_call_decides_as_each_batchable_verifier_alone(verifier):
    """`decide_batch` decides greedy and coupled chains from their rows' own tokens in one
    `verify_ragged` call: for every draft (matching the target or not, any length, any start) that
    must equal what the sequence's verifier decides alone."""
    generator = torch.Generator().manual_seed(0)
    agreed = 0
    for seed in range(60):
        gamma, start = seed % 5, 10 + seed
        logits = _rows(gamma, 12, seed)
        own = verifier.target_tokens(logits, start)
        draft = [own[j] if (seed >> j) % 3 else (own[j] + 1) % 12 for j in range(gamma)]  # some mismatches
        (num,), (nxt,) = verify_ragged([own], [draft])
        alone = verifier.verify(logits, Draft(draft), generator, start)
        assert (num, nxt) == (alone.num_accepted, alone.next_token)
        assert alone.path is None and list(alone.accepted) == list(range(num))
        agreed += 0 < num < gamma
    assert agreed  # some drafts were cut inside, not only at their ends


def test_a_tree_verdict_keeps_its_path_and_a_chain_verdict_its_prefix():
    # the root's children 5 and 6, then 7 under 6 and 8 under 7: the target's argmax walks 6, 7, then says 9
    tree = Tree([5, 6, 7, 8], [-1, -1, 1, 2])
    logits = torch.full((5, 12), -5.0)
    for row, token in enumerate([6, 3, 7, 9, 2]):  # row 0: the root; row i + 1: node i
        logits[row, token] = 5.0
    verdict = choose_verifier(GREEDY, trees=True).verify(logits, tree, torch.Generator(), 10)
    assert verdict == Verdict(2, 9, path=[1, 2]) and verdict.accepted == [1, 2]
    assert not verdict.rejected(tree)  # a tree has no one rejected position
    empty = choose_verifier(GREEDY, trees=True).verify(logits[-1:], Tree([], []), torch.Generator(), 10)
    assert empty == Verdict(0, 2, path=[])
    chain = Verdict(1, 4)
    assert list(chain.accepted) == [0] and chain.rejected(Draft([3, 3])) and not chain.rejected(Draft([3]))


def test_the_batch_call_takes_only_batchable_sequences_whose_rows_fit_their_drafts(monkeypatch):
    calls = []
    monkeypatch.setattr(verifier_module, "verify_ragged", lambda t, d: calls.append(len(d)) or verify_ragged(t, d))
    logits = [_rows(2, 12, s) for s in range(5)]
    bad = logits[4].clone()
    bad[0, 0] = float("nan")

    def sequence(verifier, draft, batchable=True):
        return SimpleNamespace(verifier=verifier, sampler=verifier.sampler, sequence=[1, 2, 3], draft_tokens=draft,
                               verifies_by_tokens=batchable and verifier.batchable)

    decodings = [sequence(choose_verifier(GREEDY), [1, 2]),
                 sequence(choose_verifier(SAMPLED, SeededNoise(1)), [1, 2]),
                 sequence(choose_verifier(SAMPLED), [1, 2]),  # unseeded: verified by its own commit
                 sequence(choose_verifier(GREEDY), [1]),  # rows that do not fit its draft: its commit says so
                 sequence(choose_verifier(SAMPLED, SeededNoise(2)), [1, 2])]
    decided = decide_batch(decodings, logits[:4] + [bad])
    assert calls == [2]
    assert set(decided) == {0, 1, 4} and isinstance(decided[4], SpecdecError)
    for i in (0, 1):
        alone = decodings[i].verifier.verify(logits[i], Draft([1, 2]), torch.Generator(), 3)
        assert decided[i] == (alone.num_accepted, alone.next_token)


def test_only_the_verifier_imports_the_acceptance_rules():
    """The rules (core/verify.py's verify_* and sibling_laws) are reached through decoding/verifier.py
    alone; the package's public API re-exports them for users."""
    allowed = {SRC / "decoding" / "verifier.py", SRC / "__init__.py", SRC / "core" / "verify.py"}
    importers = set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1] == "verify":
                if any(a.name.startswith("verify_") or a.name == "sibling_laws" for a in node.names):
                    importers.add(path)
            elif isinstance(node, ast.Import) and any(a.name.endswith("core.verify") for a in node.names):
                importers.add(path)
    assert importers <= allowed, sorted(str(p.relative_to(SRC)) for p in importers - allowed)
    assert SRC / "decoding" / "verifier.py" in importers


@pytest.fixture(scope="module")
def pair():
    target = qwen_like(torch.bfloat16, exact_rows=True, layers=1)
    return target, copy.deepcopy(target), qwen_like(torch.bfloat16, exact_rows=True, layers=1, seed=1)


def test_every_sequence_of_an_engine_step_is_verified_by_its_verifier_the_batchable_in_one_call(pair, monkeypatch):
    """A mixed batch: each commit is decided either by the batch's one `verify_ragged` call (greedy
    and seeded chains and plain sequences, all of them each step) or by the sequence's own verifier
    (trees, unseeded sampling), never both, never neither."""
    target, same, other = pair
    ragged, through_verifier, commits = [], [], []
    monkeypatch.setattr(verifier_module, "verify_ragged", lambda t, d: ragged.append(len(d)) or verify_ragged(t, d))
    originals = {(cls, name): getattr(cls, name) for cls in VERIFIERS.values() for name in ("verify", "target_token")}
    for (cls, name), real in originals.items():
        def counted(self, *args, _real=real, **kwargs):
            through_verifier.append(id(self))
            return _real(self, *args, **kwargs)
        monkeypatch.setattr(cls, name, counted)
    real_commit = sequence_module.Decoding.apply

    def commit(self, logits, pass_seconds, decided=None, timed=True):
        before = len(through_verifier)
        emitted = real_commit(self, logits, pass_seconds, decided, timed)
        commits.append((self.verifier, decided is not None, len(through_verifier) > before))
        return emitted

    monkeypatch.setattr(sequence_module.Decoding, "apply", commit)
    sampler = Sampler(temperature=1.0, top_k=50)
    prompts = [(_ids(6, 4096, i) * 3)[: 5 + 4 * i] for i in range(6)]
    requests = [Request(prompts[0], other, max_new_tokens=8, eos_token_ids=[], gamma=3),
                Request(prompts[1], same, sampler, max_new_tokens=8, eos_token_ids=[], gamma=3, seed=5),
                Request(prompts[2], None, sampler, max_new_tokens=8, eos_token_ids=[], seed=6),
                Request(prompts[3], other, sampler, max_new_tokens=8, eos_token_ids=[], gamma=3),  # unseeded
                Request(prompts[4], lambda: make_tree_drafter("sides", other), max_new_tokens=8, eos_token_ids=[]),
                Request(prompts[5], None, sampler, max_new_tokens=8, eos_token_ids=[])]  # unseeded, plain
    engine = Engine(target, max_batch=6)
    for request in requests:
        engine.add(request)
    while engine.busy:
        before, calls = len(commits), len(ragged)
        engine.step()
        batched = sum(batched for _, batched, _ in commits[before:])
        assert ragged[calls:] == ([batched] if len(commits) > before else [])  # one call, every batchable one
    rules = {(v.rule, v.trees) for v, _, _ in commits}
    assert rules == {("greedy", False), ("coupled", False), ("standard", False), ("greedy", True)}
    for verifier, batched, own in commits:
        assert batched != own  # one way or the other, never both
        assert batched == verifier.batchable
