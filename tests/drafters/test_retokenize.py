"""A drafter model with another tokenizer: it drafts text, re-encoded with the target's tokenizer,
and verified as a deterministic proposal (exact under any sampler)."""

from __future__ import annotations

import pytest
import torch

from specdec import Sampler, autoregressive_generate, load, speculative_generate
from specdec.models import catalogue as registry
from specdec.drafters import Draft, OtherTokenizerDrafter
from specdec.backends.text import pair_mode

from conftest import TableModel
from test_sampling_exactness import ALPHA, DEEP_PROMPT, _cyclic_target, chi_square_pvalue, exact_joint


class CharTokenizer:
    """One character a token, in the order of `alphabet`: two orders are two tokenizers."""

    bos_token_id = eos_token_id = unk_token_id = None

    def __init__(self, alphabet: str):
        self.alphabet = alphabet

    def __len__(self) -> int:
        return len(self.alphabet)

    def get_vocab(self) -> dict[str, int]:
        return {c: i for i, c in enumerate(self.alphabet)}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self.alphabet.index(c) for c in text]

    def decode(self, ids, **kwargs) -> str:
        return "".join(self.alphabet[int(i)] for i in ids)


def _pair() -> tuple[TableModel, TableModel]:
    """The cyclic target (tokens 'abc') and a drafter that knows the same cycle in another order ('cab')."""
    target = _cyclic_target()
    target.tokenizer = CharTokenizer("abc")
    drafter = TableModel(vocab=3, seed=1, name="other")
    order = [2, 0, 1]  # the drafter's id of each target id: a -> 1, b -> 2, c -> 0 under 'cab'
    for a in range(4):
        for b in range(4):
            ta = a if a == 3 else order[a]
            tb = b if b == 3 else order[b]
            drafter.table[a, b] = target.table[ta, tb][order]  # the target's law, in the drafter's ids
    drafter.table += 0.5 * torch.randn(drafter.table.shape, generator=torch.Generator().manual_seed(9))
    drafter.tokenizer = CharTokenizer("cab")
    return target, drafter


def test_another_tokenizer_is_drafted_for_through_text():
    target, drafter = _pair()
    assert pair_mode(target, drafter) == "retokenize"
    assert pair_mode(target, target) == "shared"
    other = OtherTokenizerDrafter(drafter)
    other.check_target(target)
    assert other.retokenize([0, 1, 2], "ab") == [0, 1]  # 'ab' in the target's ids
    other.start(DEEP_PROMPT)
    draft = other.propose(DEEP_PROMPT, 4, Sampler(0.0), torch.Generator(), lambda n, logits: True)
    assert len(draft.tokens) == 4 and draft.probs is None and other.passes == 4
    assert draft.tokens[0] == 2  # after "…a b": the cycle goes on with c


@pytest.mark.slow
def test_sampled_drafts_through_text_keep_the_joint_law_and_a_foreign_q_breaks_it():
    """The draft is verified as one-hot, which is exact whatever the drafter drew; reporting the
    drafter's own q instead (in its ids) is the plausible bug, and the test catches it."""
    target, drafter = _pair()
    sampler, length = Sampler(1.0), 5
    joint = exact_joint(target, DEEP_PROMPT, length, sampler)

    class ForeignQ(OtherTokenizerDrafter):
        def propose(self, context, max_tokens, sampler, generator, keep_going):
            draft = super().propose(context, max_tokens, sampler, generator, keep_going)
            rows = [sampler.probs(self.model.table[3, 3]) for _ in draft.tokens]  # a q in the drafter's ids
            return Draft(draft.tokens, torch.stack(rows) if rows else None)

    for made, exact in ((OtherTokenizerDrafter, True), (ForeignQ, False)):
        samples, accepted = [], 0
        for seed in range(2_500):
            out = speculative_generate(DEEP_PROMPT, target, made(drafter), gamma=4, sampler=sampler,
                                       max_new_tokens=length, seed=seed, seed_rule="stream", first_target=False)
            samples.append(tuple(out.tokens))
            accepted += out.stats.accepted
        assert accepted > 1_000
        assert (chi_square_pvalue(samples, joint) > ALPHA) == exact


def test_the_intersection_maps_the_drafters_tokens_and_q_onto_the_targets_ids():
    target, drafter = _pair()
    other = OtherTokenizerDrafter(drafter, mode="intersection")
    other.check_target(target)
    mine, theirs = other.shared_tokens()
    assert dict(zip(mine.tolist(), theirs.tolist())) == {0: 2, 1: 0, 2: 1}  # c, a, b in 'cab' -> 'abc'
    other.start(DEEP_PROMPT)
    draft = other.propose(DEEP_PROMPT, 3, Sampler(1.0), torch.Generator().manual_seed(0), lambda n, logits: True)
    assert len(draft.tokens) == 3 and draft.probs.shape == (3, 3)
    assert torch.allclose(draft.probs.sum(-1), torch.ones(3))
    with pytest.raises(Exception, match="unknown mode"):
        OtherTokenizerDrafter(drafter, mode="both")


@pytest.mark.slow
def test_sampled_drafts_over_the_intersection_keep_the_joint_law_and_an_unmapped_q_breaks_it():
    """Each drafted token is drawn from the drafter's q over the shared tokens and verified with
    that q in the target's ids; the same q left in the drafter's ids is the plausible bug."""
    target, drafter = _pair()
    sampler, length = Sampler(1.0), 5
    joint = exact_joint(target, DEEP_PROMPT, length, sampler)

    class Unmapped(OtherTokenizerDrafter):
        def _propose_shared(self, *args):
            draft = super()._propose_shared(*args)
            mine, theirs = self.shared_tokens()
            rows = draft.probs.clone()
            rows[:, mine] = draft.probs[:, theirs]  # each q value back at the drafter's id of its token
            return Draft(draft.tokens, rows)

    for made, exact in ((OtherTokenizerDrafter, True), (Unmapped, False)):
        samples, accepted = [], 0
        for seed in range(2_500):
            out = speculative_generate(DEEP_PROMPT, target, made(drafter, mode="intersection"), gamma=4,
                                       sampler=sampler, max_new_tokens=length, seed=seed,
                                       seed_rule="stream", first_target=False)
            samples.append(tuple(out.tokens))
            accepted += out.stats.accepted
        assert accepted > 1_000
        assert (chi_square_pvalue(samples, joint) > ALPHA) == exact


@pytest.fixture(scope="module")
def gemma3():
    if not registry.is_installed("gemma3-270m"):
        pytest.skip("gemma3-270m is not installed (run `specdec install gemma3-270m`)")
    return load("gemma3-270m", dtype="fp32", device="cpu")


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("mode", ["auto", "intersection"])
def test_greedy_with_a_drafter_of_another_tokenizer_equals_ar(smollm2, gemma3, reverse, mode):
    """SmolLM2-135M drafting for Gemma 3 270M and the reverse: two tokenizers, the drafter model
    passed as it is (under greedy the loop drafts through text) or drafting over the shared tokens,
    greedy output token for token AR's."""
    target, drafter = (smollm2, gemma3) if reverse else (gemma3, smollm2)
    ids = target.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
    expected = autoregressive_generate(ids, target, max_new_tokens=24).tokens
    result = speculative_generate(ids, target, drafter if mode == "auto" else OtherTokenizerDrafter(drafter, mode),
                                  gamma=4, max_new_tokens=24, allow_larger_drafter=reverse)
    assert result.tokens == expected
    assert result.stats.accepted > 0  # the re-encoded drafts were right at times


def test_bench_runs_ours_and_transformers_with_a_drafter_of_another_tokenizer(smollm2, gemma3):
    from specdec.bench.runners import Settings
    from specdec.bench.run import run_benchmark
    from specdec.errors import SpecdecError

    methods = ["ar", "sd-other-tokenizer", "hf-assisted-other-tokenizer"]
    result = run_benchmark(["humaneval:1:0"], None, methods, "smollm2-135m", None,
                           Settings(max_new_tokens=8, other_drafter="gemma3-270m"), dtype="fp32")
    summary = result["summary"]
    # (the cost schedule may draft nothing on a one-prompt, 8-token run: the drafting itself is
    # tested by the greedy identity test above)
    assert summary["sd-other-tokenizer"]["identical_to_ar"] == 1
    assert summary["hf-assisted-other-tokenizer"]["prompts"] == 1
    with pytest.raises(SpecdecError, match="shares"):
        run_benchmark(["humaneval:1:0"], None, ["sd-other-tokenizer"], "smollm2-135m", None,
                      Settings(max_new_tokens=4, other_drafter="smollm2-135m"), dtype="fp32")
