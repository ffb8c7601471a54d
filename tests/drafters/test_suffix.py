"""Suffix drafting (drafters/suffix.py): the index's counts against a brute-force scan, the shared
cache's eviction, what the drafter proposes and how it calibrates. Greedy identity and the sampled
law run with every drafter in test_drafters.py and test_sampling_exactness.py."""

from __future__ import annotations

import random

import pytest
import torch

from specdec import GREEDY, Sampler, SpecdecError, autoregressive_generate, speculative_generate
from specdec.drafters import SuffixCache, SuffixDrafter, SuffixIndex, SuffixTreeDrafter, make_tree_drafter
from specdec.drafters.suffix import best_path, best_tree
from specdec.core.trees import Tree
from specdec.sizing.schedules import make_schedule

from conftest import tiny_model


def brute_counts(sequences: list[list[int]], context: list[int], length: int) -> dict[int, int]:
    """What followed each occurrence of context's last `length` tokens, by a scan of every sequence
    (the context's own end, which nothing follows yet, included: it adds nothing)."""
    key, counts = context[len(context) - length:], {}
    for seq in sequences:
        for i in range(len(seq) - length):
            if seq[i:i + length] == key:
                counts[seq[i + length]] = counts.get(seq[i + length], 0) + 1
    return counts


@pytest.mark.parametrize("seed", range(6))
def test_index_counts_what_followed_every_suffix_as_a_scan_does(seed):
    rng = random.Random(seed)
    sequences = [[rng.randrange(3) for _ in range(rng.randrange(1, 40))] for _ in range(3)]
    index = SuffixIndex(depth=6, window=1000)
    for seq in sequences[:-1]:
        index.add(seq)
    for start in range(0, len(sequences[-1]), 5):  # the last sequence fed piece by piece, still open
        index.extend(sequences[-1][start:start + 5])
    for context in [sequences[-1]] + [[rng.randrange(3) for _ in range(8)] for _ in range(10)]:
        for length in range(1, 7):
            if length <= len(context):
                assert index.counts(context, length) == brute_counts(sequences, context, length), (context, length)


def test_matches_stop_at_the_depth_and_at_sequence_bounds():
    index = SuffixIndex(depth=3)
    index.add([1, 2, 3, 4, 5])
    index.extend([9, 3, 4])
    assert index.occurrences([2, 3, 4]) == [(4, 3)]  # the open sequence's own 4 is followed by nothing yet
    assert index.occurrences([0, 1, 2, 3, 4]) == [(4, 3)]  # depth 3
    index.close()
    index.extend([4])
    assert index.occurrences([7, 4]) == [(4, 1)]  # the second 4 ended its sequence: nothing followed it


def test_the_oldest_sequences_are_dropped_beyond_max_tokens():
    index = SuffixIndex(depth=4, max_tokens=10)
    index.add([1, 2, 3])
    index.add([4, 5, 6])
    index.add([7, 8, 1, 2, 9])  # 4 + 4 + 6 held > 10: [1, 2, 3] goes
    assert index.held == 10 and index.counts([1, 2], 2) == {9: 1}
    index.add([0, 0, 0])  # and then [4, 5, 6]
    assert index.held == 10 and index.counts([4], 1) == {} and index.counts([1, 2], 2) == {9: 1}
    index.add([5])  # [7, 8, 1, 2, 9] goes: the dropped part now outweighs the rest and is compacted away
    assert index.tokens == [0, 0, 0, -1, 5, -1] and index.floor == 0
    assert index.counts([0], 1) == {0: 2} and index.counts([1, 2], 2) == {}


def test_best_path_follows_the_most_frequent_token_while_the_product_of_ratios_holds():
    index = SuffixIndex(depth=6)
    for tail in ([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 7], [1, 5, 6, 0]):
        index.add(tail)
    starts = [q for q, _ in index.occurrences([1])]
    tokens, ratios = best_path(index.tokens, starts, max_tokens=5, min_prob=0.1)
    assert tokens == [2, 3, 4] and ratios == pytest.approx([3 / 4, 1.0, 2 / 3])  # then the separator: done
    tokens, _ = best_path(index.tokens, starts, max_tokens=5, min_prob=0.6)  # 3/4 · 1 · 2/3 = 0.5 < 0.6
    assert tokens == [2, 3]
    assert best_path(index.tokens, starts, max_tokens=1, min_prob=0.1)[0] == [2]
def brute_tree(sequences: list[list[int]], key: list[int], max_depth: int,
               min_prob: float) -> dict[tuple[int, ...], tuple[float, float]]:
    """Every continuation string s of key whose product of count ratios is >= min_prob, by scans:
    s -> (its last token's ratio, the product)."""
    found = {}

    def visit(path: list[int], product: float) -> None:
        if len(path) >= max_depth:
            return
        counts = brute_counts(sequences, key + path, len(key) + len(path))
        total = sum(counts.values())
        for token, count in counts.items():
            if product * count / total >= min_prob:
                found[tuple(path + [token])] = (count / total, product * count / total)
                visit(path + [token], product * count / total)

    visit([], 1.0)
    return found


@pytest.mark.parametrize("seed", range(8))
def test_best_tree_holds_the_most_probable_continuations_a_scan_finds(seed):
    """SuffixDecoding's tree mode: the nodes are the `max_nodes` continuations of highest product
    of count ratios (each node's ratio as counted by a scan), parents before children."""
    rng = random.Random(seed)
    sequences = [[rng.randrange(3) for _ in range(rng.randrange(10, 60))] for _ in range(3)]
    index = SuffixIndex(depth=8, window=1000)
    for seq in sequences:
        index.add(seq)
    for key in ([rng.randrange(3) for _ in range(rng.randrange(1, 4))] for _ in range(5)):
        starts = [q for q, matched in index.occurrences(key) if matched >= len(key)]
        expected = brute_tree(sequences, key, max_depth=4, min_prob=0.05)
        for max_nodes in (1, 3, 10, 100):
            nodes = best_tree(index.tokens, starts, max_nodes, max_depth=4, min_prob=0.05)
            paths = []
            for parent, token, ratio, product in nodes:
                assert parent < len(paths)  # parents first
                paths.append((paths[parent] if parent >= 0 else ()) + (token,))
                assert expected[paths[-1]] == pytest.approx((ratio, product)), (key, paths[-1])
            best = sorted((product for _, product in expected.values()), reverse=True)[:max_nodes]
            assert sorted((n[3] for n in nodes), reverse=True) == pytest.approx(best), (key, max_nodes)
            assert [n[3] for n in nodes] == sorted((n[3] for n in nodes), reverse=True)  # best first


def test_the_suffix_tree_is_valued_by_calibrated_ratios_and_learns_from_what_was_tried():
    drafter = SuffixTreeDrafter(depth=8, factor=2.5)  # at most 5 nodes after a 2-token match
    context = [1, 2, 3, 5, 1, 2, 4, 6, 1, 2, 3, 9, 1, 2]
    drafter.start(context)
    tree = drafter.propose(context, 8, GREEDY, torch.Generator())
    # after "1 2": 3 twice, 4 once; after "1 2 3": 9 and 5 (the latest first); after "1 2 4": 6
    assert tree.tokens == [3, 9, 5, 4, 6] and tree.parents == [-1, 0, 0, -1, 3]
    assert tree.values == pytest.approx([2 / 3, 1 / 3, 1 / 3, 1 / 3, 1 / 3])  # scale 1 before any count
    drafter.keep_path(len(context), [0])  # 3 kept, then neither 9 nor 5: 4, 9, 5 tried and rejected
    counts = drafter.calibration[1]  # 2-token matches
    assert (counts.tries, counts.hits, counts.expected) == (4, 1, pytest.approx(2 / 3 + 1 / 3 + 1 / 2 + 1 / 2))
    assert drafter.chance(1.0, 2) == pytest.approx((1 + 4) / (2 + 4))
    assert drafter.index.tokens == context  # only committed tokens were indexed


@pytest.mark.slow
def test_suffix_trees_share_a_cache_and_a_seed_pins_them_to_their_own_text():
    cache = SuffixCache(depth=8)
    cache.add([7, 8, 9, 10])
    alone = make_tree_drafter("suffix", suffix_cache=cache)
    alone.start([5, 7, 8])
    assert alone.propose([5, 7, 8], 8, GREEDY, torch.Generator()).tokens == [9, 10]
    alone.pin()
    assert alone.propose([5, 7, 8], 8, GREEDY, torch.Generator()).tokens == []
    target, drafter = tiny_model(0, vocab=32, layers=2), tiny_model(1, vocab=32, layers=1)
    mixed = make_tree_drafter("mixed-suffix", drafter, suffix_cache=cache)
    outputs = []
    for earlier in ([], [[7, 11, 2, 5, 8, 1] * 4, list(range(32)) * 2]):
        for output in earlier:
            cache.add(output)
        outputs.append(speculative_generate([3, 7, 9, 3, 7, 11], target, mixed, sampler=Sampler(1.0), seed=5,
                                            max_new_tokens=30, eos_token_ids=[]).tokens)
    assert outputs[0] == outputs[1]
    assert len(cache.index.starts) == 5  # 1 + 2 added + the two outputs: finished outputs join the cache
    mixed.start([2, 5, 8])
    assert mixed.lookup.shared  # unpinned, the cache counts


def test_the_drafter_copies_repeated_text_and_only_committed_tokens_are_counted():
    drafter = SuffixDrafter(depth=8)
    context = [5, 6, 7, 8, 9, 10, 1, 2, 5, 6, 7]
    drafter.start(context[:4])
    draft = drafter.propose(context, 10, GREEDY, torch.Generator(), lambda n, chance: True)
    assert draft.tokens == [8, 9, 10] and draft.probs is None  # factor 1: at most the match's 3 tokens
    drafter.rollback(len(context) + 1)  # the target kept 8, rejected 9
    assert drafter.index.tokens == context  # the draft was not indexed: only committed tokens are
    by_length = drafter.calibration[1]  # matches of 2-3 tokens
    assert by_length.tries == 2 and by_length.hits == 1  # 8 tried and kept, 9 tried and rejected


def test_the_draft_length_rule_sees_each_tokens_calibrated_chance():
    drafter = SuffixDrafter(depth=8)
    context = [5, 6, 7, 8, 9, 10, 11, 1, 5, 6, 7, 8]
    drafter.start(context)
    seen = []
    draft = drafter.propose(context, 10, GREEDY, torch.Generator(), lambda n, chance: seen.append(chance) or n < 2)
    assert draft.tokens == [9, 10] and seen == [1.0, 1.0, 1.0]  # asked before the first token too; unscaled ratios
    for _ in range(30):  # drafts after 4-token matches keep failing at their first token
        drafter.calibration[2].record(1.0, False)
    assert drafter.chance(1.0, 4) == pytest.approx(4 / 34) and drafter.chance(1.0, 3) == 1.0
    schedule = make_schedule("cost", gamma_max=10)
    schedule.reset()
    assert schedule.keep_going(0, 0.6) and not schedule.keep_going(0, 0.4)  # against its starting θ of 0.5
    draft = drafter.propose(context, 10, GREEDY, torch.Generator(), schedule.keep_going)
    assert draft.tokens == []  # the first token alone would not pay for its row
    drafter.calibration[2].reset()
    assert drafter.propose(context, 10, GREEDY, torch.Generator(), schedule.keep_going).tokens == [9, 10, 11, 1]


def test_finished_outputs_feed_the_shared_cache_which_keeps_a_bounded_number_of_tokens():
    cache = SuffixCache(max_tokens=12, depth=6)
    first = SuffixDrafter(cache, depth=6)
    first.start([1, 2])
    first.finish([1, 2, 30, 31, 32, 33, 34])
    assert cache.index.tokens == [30, 31, 32, 33, 34, -1]  # the output alone, not the prompt
    second = SuffixDrafter(cache, depth=6)
    second.start([9, 30, 31])
    draft = second.propose([9, 30, 31], 10, GREEDY, torch.Generator(), lambda n, chance: True)
    assert draft.tokens == [32, 33]  # from the earlier output; this request's own text has no match
    cache.add(list(range(40, 48)))  # 6 + 9 tokens held > 12: the oldest output goes
    assert cache.index.held == 9 and cache.index.counts([30], 1) == {}


def test_greedy_identical_with_ar_and_a_cache_shared_across_generations():
    target = tiny_model(0, vocab=32, layers=2, name="tiny-target")
    cache = SuffixCache(depth=16)
    prompts = [[3, 7, 9, 3, 7, 11], [3, 7, 9, 3, 7, 11], [5, 5, 6, 5, 5]]
    drafted = 0
    for prompt in prompts:
        ar = autoregressive_generate(prompt, target, max_new_tokens=40, eos_token_ids=[])
        sd = speculative_generate(prompt, target, SuffixDrafter(cache, depth=16), max_new_tokens=40,
                                  eos_token_ids=[], schedule=make_schedule("cost", gamma_max=8))
        assert sd.tokens == ar.tokens
        drafted += sd.stats.drafted
    assert drafted > 0 and len(cache.index.starts) == 3


def test_a_seeded_sampled_generation_does_not_draft_from_other_generations():
    """Under a seed, draft lengths decide which random draws a sampled generation uses, so its
    output must not hang on what earlier generations left in the cache."""
    target = tiny_model(0, vocab=32, layers=2, name="tiny-target")
    prompt, sampler = [3, 7, 9, 3, 7, 11], Sampler(1.0)
    outputs = []
    for earlier in ([], [[7, 11, 2, 5, 8, 1] * 4, list(range(32)) * 2]):
        cache = SuffixCache(depth=16)
        for output in earlier:
            cache.add(output)
        outputs.append(speculative_generate(prompt, target, SuffixDrafter(cache, depth=16), sampler=sampler, seed=5,
                                            max_new_tokens=30, eos_token_ids=[]).tokens)
    assert outputs[0] == outputs[1]
    assert len(cache.index.starts) == 3  # its own output joined the cache all the same
    unseeded = SuffixDrafter(cache, depth=16)
    unseeded.start(prompt)
    assert unseeded.shared and unseeded.candidates([2, 5, 8], 5)[0] == [1, 7, 11]  # unpinned: the cache counts


@pytest.mark.parametrize("bad", [dict(min_prob=0), dict(min_prob=1.5), dict(factor=0), dict(min_match=0),
                                 dict(depth=0), dict(depth="4")])
def test_bad_settings_are_refused_clearly(bad):
    with pytest.raises(SpecdecError, match="suffix"):
        SuffixDrafter(**bad)
