"""Token trees in the decoding loop: tree passes, cache compaction, greedy identity, sampled exactness."""

import pytest
import torch

from specdec import TransformersModel, Sampler, autoregressive_generate, speculative_generate
from specdec.drafters import Drafter, LookupTreeDrafter, MixedDrafter, SidesDrafter, SuffixTreeDrafter
from specdec.drafters.nodes import Node
from specdec.errors import SpecdecError
from specdec.sizing.schedules import TreeCost
from specdec.core.trees import Tree, input_parents

from conftest import TableModel, tiny_model
from test_sampling_exactness import ALPHA, chi_square_pvalue, exact_joint
from specdec.backends.cache import cache_length, compact_cache

TREE = Tree([3, 4, 5, 6, 7, 8, 9], [-1, 0, 1, 0, -1, 4, 4])  # three root-to-leaf paths off the main chain


def _wide() -> TreeCost:
    """A policy that grows wide trees whatever the costs (for tests: the loop must be exact anyway)."""
    return TreeCost(threshold=0.02, node_threshold=0.001, warmup=10**9)


def _tree_pass(model: TransformersModel, prompt: list[int], tree: Tree):
    cache = model.new_cache()
    pending = model.prefill(prompt, cache)
    logits = model.forward(pending + tree.tokens, cache, len(tree) + 1, parents=input_parents(len(pending), tree.parents))
    return logits, cache


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("kernels", ["auto", "stock"])
def test_a_tree_pass_equals_chain_passes_over_each_path(attention, kernels):
    model = tiny_model(3, vocab=32, kernels=kernels)
    model.hf.set_attn_implementation(attention)
    prompt = [2, 5, 7, 9, 11]
    logits, cache = _tree_pass(model, prompt, TREE)
    for node in range(len(TREE)):
        path = [TREE.tokens[i] for i in TREE.path_to(node)]
        chain = model.forward(prompt + path, None, num_logits=1)[-1]
        torch.testing.assert_close(logits[node + 1], chain, atol=2e-5, rtol=0)
    # compaction to a path off the main chain: the cache then equals a chain pass's cache
    path = TREE.path_to(6)  # nodes 4, 6: tokens 7, 9
    compact_cache(cache, len(prompt), path)
    chain_cache = model.new_cache()
    model.forward(prompt + [7, 9], chain_cache, 1)
    assert cache_length(cache) == len(prompt) + 2
    for ours, theirs in zip(cache.layers, chain_cache.layers):
        torch.testing.assert_close(ours.keys, theirs.keys, atol=2e-5, rtol=0)
        torch.testing.assert_close(ours.values, theirs.values, atol=2e-5, rtol=0)
    following = model.forward([13], cache, 1)[-1]
    torch.testing.assert_close(following, model.forward(prompt + [7, 9, 13], None, 1)[-1], atol=2e-5, rtol=0)


def test_a_boolean_mask_under_eager_attention_would_be_wrong():
    """Why eager gets an additive mask: the power check behind the test above."""
    from specdec.core import trees

    model = tiny_model(3, vocab=32)
    model.hf.set_attn_implementation("eager")
    real = trees.tree_attention
    try:
        trees_module_attention = lambda *a, **k: real(*a, **{**k, "additive": False})  # noqa: E731
        import specdec.backends.transformers as models
        models.tree_attention = trees_module_attention
        logits, _ = _tree_pass(model, [2, 5, 7], TREE)
    finally:
        models.tree_attention = real
    chain = model.forward([2, 5, 7, 7, 9], None, 1)[-1]
    assert (logits[TREE.path_to(6)[-1] + 1] - chain).abs().max() > 1e-3


def test_row_exact_tree_passes_equal_one_token_passes_bit_for_bit():
    from test_rows import qwen_like

    model = qwen_like(torch.bfloat16, exact_rows=True, vocab=512)
    prompt = [2, 5, 7, 9, 11, 13]
    logits, _ = _tree_pass(model, prompt, TREE)
    for node in range(len(TREE)):
        cache = model.new_cache()
        pending = model.prefill(prompt, cache)
        path = [TREE.tokens[i] for i in TREE.path_to(node)]
        row = model.forward(pending, cache, 1)
        for token in path:
            row = model.forward([token], cache, 1)
        assert torch.equal(row[-1], logits[node + 1]), node


def test_trees_refuse_sliding_window_models_clearly():
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=8)
    model = TransformersModel(MistralForCausalLM(config), None, "tiny-mistral", kernels="stock")
    with pytest.raises(SpecdecError, match="sliding-window"):
        model.forward([1, 2, 3], model.new_cache(), 3, parents=[-1, 0, 0])


DRAFTERS = {
    "sides": lambda d: SidesDrafter(d, width=3, policy=_wide()),
    "sides-iid": lambda d: SidesDrafter(d, width=3, scheme="iid", policy=_wide()),
    "sides-deterministic": lambda d: SidesDrafter(d, width=3, scheme="deterministic", policy=_wide()),
    # sampled sides pruned by the cost rule: which join must not depend on their own tokens
    # (ranking them by their own q made this test fail at p ~ 1e-62)
    "sides-pruned": lambda d: SidesDrafter(d, width=5, policy=TreeCost(threshold=0.02, node_threshold=0.2,
                                                                       max_nodes=3, warmup=10**9)),
    "lookup": lambda d: LookupTreeDrafter(policy=_wide()),
    "suffix": lambda d: SuffixTreeDrafter(factor=4.0, policy=_wide()),
    "mixed": lambda d: MixedDrafter(d, width=2, policy=_wide()),
    "mixed-alternating": lambda d: _Alternating(d, width=2, policy=_wide()),
    "mixed-suffix": lambda d: _mixed_suffix(d, _wide()),
    "mixed-suffix-alternating": lambda d: _mixed_suffix(d, _wide(), _Alternating),
    # chains that stop early, so that lookup carries them on (`MixedDrafter._extend`)
    "mixed-short-chains": lambda d: MixedDrafter(d, width=2, policy=TreeCost(threshold=0.7, node_threshold=0.001,
                                                                             warmup=10**9)),
}


def _mixed_suffix(drafter, policy: TreeCost, made=MixedDrafter) -> MixedDrafter:
    return made(drafter, width=2, policy=policy, lookup=SuffixTreeDrafter(factor=4.0, policy=policy))


class _Turns:
    """Stands for MixedDrafter's measured choice: lookup alone and model with lookup in turn."""

    def __init__(self):
        self.with_model = True

    def reset(self) -> None:
        pass

    def record(self, *args) -> None:
        pass

    def choose(self) -> bool:
        self.with_model = not self.with_model
        return self.with_model


class _Alternating(MixedDrafter):
    """Steps of lookup alone and of model and lookup in turn, decided by the step count alone
    (never by a draw): under seeded sampling the measured choice is never made, so this is what
    puts lookup-alone steps into the sampled exactness test."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        turns = _Turns()
        self.kinds = {n: turns for n in self.kinds}


@pytest.mark.parametrize("kind", ["sides", "lookup", "suffix", "mixed", "mixed-short-chains", "mixed-suffix"])
def test_greedy_tree_decoding_equals_greedy_ar_on_tiny_models(kind):
    target, drafter = tiny_model(1, vocab=32), tiny_model(2, vocab=32, layers=1, logit_scale=0.3)
    off_main_chain = branched = 0
    for prompt in ([2, 5, 7, 9, 11, 5, 7], [3, 3, 4, 8, 3, 3, 4]):
        expected = autoregressive_generate(prompt, target, max_new_tokens=40).tokens
        result = speculative_generate(prompt, target, DRAFTERS[kind](drafter), max_new_tokens=40, seed=0)
        assert result.tokens == expected
        off_main_chain += sum(1 for s in result.steps if s.path and s.path != list(range(len(s.path))))
        branched += sum(1 for s in result.steps if s.tree_parents and len(set(s.tree_parents)) < len(s.tree_parents))
    assert branched > 0
    if kind not in ("lookup", "suffix"):  # their branches are rarely right on a random model; mixed covers them
        assert off_main_chain > 0  # acceptances off the main chain happened: the gather path ran


# the lookup trie is deterministic: its sampled exactness is that of the mixed tree's lookup nodes
@pytest.mark.parametrize("kind", ["sides", "sides-iid", "sides-deterministic", "sides-pruned", "mixed",
                                  "mixed-alternating", "mixed-short-chains", "mixed-suffix",
                                  "mixed-suffix-alternating"])
@pytest.mark.slow
def test_sampled_tree_generation_matches_the_target_joint_distribution(kind):
    """The joint law of the first 3 tokens against the enumerated target law (chi-square, 1e-4).
    It caught a mixed tree that ranked lookup nodes before the model's sampled sides (p ~ 1e-27)."""
    target, drafter = TableModel(vocab=5, seed=0), TableModel(vocab=5, seed=1)
    sampler, prompt, length, runs = Sampler(1.0), [2, 3, 2], 3, 3_000
    joint = exact_joint(target, prompt, length, sampler)
    samples, off_main_chain, lookup_alone = [], 0, 0
    for seed in range(runs):
        out = speculative_generate(prompt, target, DRAFTERS[kind](drafter), gamma=3, sampler=sampler,
                                   max_new_tokens=length, seed=seed, seed_rule="stream", first_target=False)
        samples.append(tuple(out.tokens))
        off_main_chain += sum(1 for s in out.steps if s.path and s.path != list(range(len(s.path))))
        lookup_alone += sum(1 for s, passes in zip(out.steps, out.stats.drafter_passes_per_step)
                            if s.draft_tokens and not passes)
    assert chi_square_pvalue(samples, joint) > ALPHA
    if kind.endswith("-alternating"):
        assert lookup_alone > runs // 2  # the steps this case is for did happen
    if kind != "lookup":
        assert off_main_chain > runs // 20


@pytest.mark.parametrize("drafter_seed, c", [(1, 0.5), (0, 0.05)])
def test_the_mixed_tree_leaves_the_model_out_where_lookup_alone_makes_more_per_second(drafter_seed, c):
    """The target's greedy output soon repeats itself, so lookup alone drafts it at no drafter
    pass: with an unrelated drafter (seed 1), or with the target itself as a cheap drafter (seed 0),
    lookup-alone steps make more per (assumed) second and the model is left out of most steps."""
    from specdec.sizing.schedules import AssumedCosts

    target, drafter = TableModel(12, 0), TableModel(12, drafter_seed)
    prompt = [1, 2, 3, 1, 2, 3, 4]
    expected = autoregressive_generate(prompt, target, max_new_tokens=100, eos_token_ids=[]).tokens
    mixed = MixedDrafter(drafter, policy=TreeCost(assumed=AssumedCosts(c, 0.01), warmup=2))
    out = speculative_generate(prompt, target, mixed, gamma=8, max_new_tokens=100, eos_token_ids=[], first_target=False)
    assert out.tokens == expected
    steps = list(zip(out.steps, out.stats.drafter_passes_per_step))
    alone = [s.num_accepted for s, passes in steps if s.draft_tokens and not passes]
    with_model = [s.num_accepted for s, passes in steps if passes]
    assert len(alone) >= 4 and sum(alone) > 2 * sum(with_model)  # most accepted tokens came at no drafter pass
    measured = {kind: sum(k.steps(kind) for k in mixed.kinds.values()) for kind in (True, False)}
    assert measured[True] >= 2 and measured[False] >= 3  # both kinds measured: with model, alone


def _off_main_chain(result) -> int:
    return sum(1 for s in result.steps if s.path and s.path != list(range(len(s.path))))


class _Demoted(Drafter):
    """A greedy tree drafter whose root's two best children swap places, so that the drafter's
    favourite, often right, lies off the main chain: acceptances off the main chain are forced
    (the gather paths of both caches run). Greedy only: reordering sampled siblings would change
    their laws. Its class declares the inner drafter's capabilities (`_demoted`)."""

    def __init__(self, inner):
        self.inner = inner
        self.name, self.model = f"{inner.name}-demoted", getattr(inner, "model", None)
        self._old: list[int] = []

    def __getattr__(self, name):  # timing, policy, cache, lag, caught_up
        return getattr(self.inner, name)

    @property
    def passes(self) -> int:
        return self.inner.passes

    def check_target(self, target) -> None:
        self.inner.check_target(target)

    def start(self, prompt) -> None:
        self.inner.start(prompt)

    def finish(self, sequence) -> None:
        self.inner.finish(sequence)

    def most_nodes(self) -> int:
        return self.inner.most_nodes()

    def propose(self, context, max_depth, sampler, generator, keep_going=None) -> Tree:
        return self._demote(self.inner.propose(context, max_depth, sampler, generator))

    def proposal(self, context, max_depth, sampler, generator, keep_going=None):
        return self._demote((yield from self.inner.proposal(context, max_depth, sampler, generator)))

    def _demote(self, tree: Tree) -> Tree:
        roots = tree.children(-1)
        old = list(range(len(tree)))
        if len(roots) >= 2:
            first, second = roots[0], roots[1]
            end = roots[2] if len(roots) > 2 else len(tree)
            old = old[second:end] + old[first:second] + old[end:]
        new_of = {o: n for n, o in enumerate(old)}
        self._old = old
        return Tree([tree.tokens[o] for o in old], [-1 if tree.parents[o] < 0 else new_of[tree.parents[o]] for o in old],
                    None, [tree.values[o] for o in old], "deterministic")

    def keep_path(self, start, path) -> None:
        self.inner.keep_path(start, [self._old[n] for n in path])


def _demoted(inner) -> _Demoted:
    """`inner` demoted, under a class that declares `inner`'s capabilities."""
    from specdec.drafters.base import capabilities_of

    return type("_Demoted", (_Demoted,), {"capabilities": capabilities_of(inner)})(inner)


def _wide_real(nodes: int = 12) -> TreeCost:
    return TreeCost(threshold=0.05, node_threshold=0.001, max_nodes=nodes, warmup=10**9)


@pytest.fixture(scope="module")
def smollm2_expected(smollm2):
    from test_generate import SMOLLM2_PROMPTS

    return {p: autoregressive_generate(smollm2.encode(p), smollm2, max_new_tokens=20).tokens for p in SMOLLM2_PROMPTS}


@pytest.mark.parametrize("kind", ["sides", "eagle2", "sequoia", "mixed"])
def test_greedy_tree_decoding_equals_greedy_ar_on_real_smollm2(smollm2, smollm2_drafters, smollm2_expected, kind):
    """Real weights and its truncated-layer drafters (first 6 layers: mostly rejected; first 24:
    mostly accepted); the root's best children swapped, so acceptances leave the main chain."""
    from specdec.drafters import Eagle2Drafter, SequoiaDrafter

    make = {"sides": lambda d: SidesDrafter(d, width=3, policy=_wide_real()),
            "eagle2": lambda d: Eagle2Drafter(d, width=3, policy=_wide_real()),
            "sequoia": lambda d: SequoiaDrafter(d, policy=_wide_real()),
            "mixed": lambda d: MixedDrafter(d, width=3, policy=_wide_real())}[kind]
    off_main_chain = 0
    for (prompt, expected), drafter in zip(smollm2_expected.items(), smollm2_drafters):
        result = speculative_generate(smollm2.encode(prompt), smollm2, _demoted(make(drafter)), gamma=4,
                                      max_new_tokens=20)
        assert result.tokens == expected, f"{kind}, {drafter.name}, prompt={prompt!r}"
        off_main_chain += _off_main_chain(result)
    assert off_main_chain > 0


def test_greedy_tree_decoding_equals_greedy_ar_on_the_default_pair(default_pair, default_pair_greedy):
    target, drafter = default_pair
    ids, expected = default_pair_greedy
    expected = expected[:24]  # greedy AR's first 24 tokens are its 24-token output
    result = speculative_generate(ids, target, _demoted(MixedDrafter(drafter, width=3, policy=_wide_real(8))),
                                  gamma=6, max_new_tokens=24)
    assert result.tokens == expected
    assert result.stats.target_passes < len(expected) / 2  # the pair really speculates
    assert _off_main_chain(result) > 0


def _matched(ngram: int) -> Node:
    node = Node(0, 1.0, "deterministic")
    node.ngram = ngram
    return node


def test_lookup_nodes_are_valued_by_lookups_own_acceptance():
    """In a mixed tree the lookup branches' value comes from how often verification accepted
    lookup's own nodes: a model chain accepted at every step must not lend lookup its rate (it did,
    through the policy's first-token rate, and lookup branches crowded trees on code)."""
    lookup = LookupTreeDrafter()
    assert lookup.acceptance() == 0.5  # the prior
    # model chain 0-1-2 (lookup agreed on node 1), a lookup branch 3-4 at the root
    lookup.remember(Tree([5, 6, 7, 8, 9], [-1, 0, 1, -1, 3]), {i: _matched(n) for i, n in {1: 2, 3: 1, 4: 1}.items()})
    lookup.learn([0, 1])  # the chain's first two accepted: tried 0, 3 (root), 1 (after 0), 2 (after 1)
    assert (lookup.tries, lookup.hits) == (2, 1)  # node 1 accepted, node 3 rejected, node 4 never tried
    lookup.learn([0])  # nothing remembered since: nothing counted twice
    assert (lookup.tries, lookup.hits) == (2, 1) and lookup.acceptance() == pytest.approx(2 / 4)
    # by match length: node 1 came from a 2-token match (accepted), node 3 from a 1-token one (rejected)
    assert lookup.by_ngram == {2: [1, 1], 1: [1, 0]}
    assert lookup.acceptance(2) == pytest.approx((1 + 2 * 0.5) / 3) and lookup.acceptance(1) == pytest.approx(1 / 3)
    assert lookup.acceptance(3) == pytest.approx(0.5)  # never tried: the overall rate


def test_lookup_branches_are_valued_by_the_acceptance_of_their_match_length():
    """A 2-token match's continuation and a 1-token match's hang side by side; each node's value
    is its match length's acceptance to the power of its depth (times its share), and the tree
    reports the longest match."""
    lookup = LookupTreeDrafter(max_ngram=2, min_ngram=1)
    lookup.by_ngram = {2: [10, 9], 1: [10, 1]}
    lookup.tries, lookup.hits = 20, 10
    root = Node(-1, 1.0, "deterministic")
    # ... 7 8 | 4 5 ... 8 | 6 ... 7 8: the suffix [7, 8] recurs before 4 5; [8] alone also before 6
    assert lookup.grow(root, [7, 8, 4, 5, 1, 8, 6, 2, 7, 8], 2) == 2
    first, second = root.children
    assert (first.token, first.ngram, second.token, second.ngram) == (4, 2, 6, 1)
    assert first.value == pytest.approx(0.5 * lookup.acceptance(2)) and second.value == pytest.approx(0.5 * lookup.acceptance(1))
    assert first.children[0].value == pytest.approx(0.5 * lookup.acceptance(2) ** 2)


def test_lookup_carries_the_model_chain_on_past_its_end():
    """Where the model's chain stops (here after one token: a threshold no q reaches) lookup
    continues from the chain's end: the context's last tokens never occurred before (lookup from
    the root finds nothing), but the chain's token did, and what followed it hangs below the chain."""
    drafter = TableModel(12, 0)
    first = int(drafter.table[9, 10].argmax())  # the drafter's token after ... 9 10
    context = [first, 3, 4, 5, 6] + [t for t in (0, 1, 2, 7, 8, 11) if t != first] + [9, 10]
    for extend in (True, False):
        mixed = MixedDrafter(drafter, policy=TreeCost(threshold=0.999, node_threshold=0.01, warmup=10**9,
                                                      calibrate=False), chain_lookup=extend)
        mixed.start(context)
        tree = mixed.propose(context, 8, Sampler(0.0), torch.Generator())
        chain_end = tree.tokens.index(first)
        below = [tree.tokens[i] for i in range(len(tree)) if i > chain_end and chain_end in tree.path_to(i)]
        if not extend:
            assert below == []
            continue
        assert len(below) >= 4 and below == context[1:1 + len(below)]  # what followed the chain's token
        assert set(mixed.lookup._proposed.values()) == {1}  # lookup's nodes, counted by their match length


def test_a_sampled_chain_token_is_valued_by_the_drafters_top_probability():
    """Under sampling a chain token in q's tail must not end the chain: it is accepted with
    min(1, p/q), which its own small q does not predict; the chain is valued by q's top
    probability. Here q = (0.55, 0.15, 0.15, 0.15) everywhere and the chain goes on while its
    value is >= 0.4: two tokens (0.55, then 0.3) whatever was sampled. Valued by each token's
    own q, a tail token (drawn 45% of the time) would end it at one."""
    model = TableModel(vocab=4, seed=0)
    model.table = torch.log(torch.tensor([0.55, 0.15, 0.15, 0.15])).expand(5, 5, 4).clone()
    sampler = Sampler(temperature=1.0)
    depths, tails = {}, 0
    for value in ("top", "token"):
        drafter = SidesDrafter(model, width=1, policy=TreeCost(threshold=0.4, warmup=10**9), sampled_value=value)
        generator = torch.Generator().manual_seed(0)
        depths[value] = []
        for _ in range(40):
            drafter.start([1, 2, 3])
            tree = drafter.propose([1, 2, 3], 6, sampler, generator)
            depths[value].append(len(tree))
            tails += tree.tokens[0] != 0
    assert tails > 10  # the case happened
    assert set(depths["top"]) == {2}
    assert 1 in depths["token"]  # the other rule would fail the assertion above
    with pytest.raises(SpecdecError, match="sampled_value must be 'top' or 'token'"):
        SidesDrafter(model, sampled_value="q")
