"""core/trees.py: the Tree type, its bookkeeping helpers, and the attention mask and position ids of
a pass over a tree."""

import pytest
import torch

from specdec import SpecdecError
from specdec.core.trees import Tree, check_parents, depths, input_parents, main_chain_length, tree_attention

#        root
#   0           5
#   1     3     6   7
#   2     4
PARENTS = [-1, 0, 1, 0, 3, -1, 5, 5]
DEPTHS = [1, 2, 3, 2, 3, 1, 2, 2]


def test_chain():
    tree = Tree.chain([5, 6, 7])
    assert (tree.tokens, tree.parents, tree.scheme, tree.probs) == ([5, 6, 7], [-1, 0, 1], "deterministic", None)
    assert len(tree) == 3 and tree.is_chain() and tree.main_chain_length == 3 and tree.depths == [1, 2, 3]
    assert tree.values == [1.0, 1.0, 1.0]
    probs = torch.rand(3, 10).softmax(-1)
    sampled = Tree.chain([5, 6, 7], probs)
    assert sampled.scheme == "iid" and sampled.probs is probs and sampled.parents == [-1, 0, 1]
    empty = Tree.chain([])
    assert empty.parents == [] and empty.main_chain_length == 0 and empty.is_chain()


def test_depths_and_main_chain_length():
    tree = Tree(list(range(10, 18)), PARENTS)
    assert tree.depths == depths(PARENTS) == DEPTHS
    assert tree.main_chain_length == main_chain_length(PARENTS) == 3 and not tree.is_chain()
    cases = [([], 0), ([-1], 1), ([-1, -1], 1), ([-1, 0, 0], 2), ([-1, 0, 1, 2], 4), ([-1, 0, 1, -1], 3)]
    for parents, length in cases:
        assert main_chain_length(parents) == length, parents
    assert depths([-1, -1, 1, 2, 0]) == [1, 1, 2, 3, 2]


def test_path_to():
    tree = Tree(list(range(10, 18)), PARENTS)
    assert tree.path_to(-1) == []
    assert tree.path_to(2) == [0, 1, 2] and tree.path_to(4) == [0, 3, 4] and tree.path_to(7) == [5, 7]
    for node in range(len(tree)):
        path = tree.path_to(node)
        assert path[-1] == node and len(path) == DEPTHS[node]
        assert [PARENTS[n] for n in path] == [-1, *path[:-1]]  # from the root down, one level a step


def test_input_parents():
    """A pass feeds the pending tokens as a chain, then the tree hung from the last of them."""
    assert input_parents(1, [-1, 0, -1]) == [-1, 0, 1, 0]
    assert input_parents(3, [-1, 0, -1, 2]) == [-1, 0, 1, 2, 3, 2, 5]
    assert input_parents(0, PARENTS) == PARENTS
    assert depths(input_parents(2, PARENTS)) == [1, 2] + [d + 2 for d in DEPTHS]


def _expected_mask(parents, past):
    """[T, past + T]: the cache, then the token's path from the root (its ancestors and itself)."""
    tree = Tree([0] * len(parents), parents)
    mask = torch.zeros(len(parents), past + len(parents), dtype=torch.bool)
    mask[:, :past] = True
    for node in range(len(parents)):
        mask[node, [past + a for a in tree.path_to(node)]] = True
    return mask


@pytest.mark.parametrize("past", [0, 5])
def test_tree_attention_sees_the_cache_the_ancestors_and_itself(past):
    count = len(PARENTS)
    mask, positions = tree_attention(PARENTS, past, torch.float32)
    assert mask.shape == (1, 1, count, past + count) and mask.dtype == torch.bool
    assert torch.equal(mask[0, 0], _expected_mask(PARENTS, past))
    # by hand: node 4 (path 0, 3, 4) sees neither the other branch (1, 2) nor the root's other child (5..7)
    assert mask[0, 0, 4, past:].tolist() == [True, False, False, True, True, False, False, False]
    assert mask[0, 0, 7, past:].tolist() == [False, False, False, False, False, True, False, True]
    assert mask[0, 0, :, :past].all()
    assert positions.shape == (1, count) and positions.dtype == torch.long
    assert positions[0].tolist() == [past + d - 1 for d in DEPTHS]


def test_a_chain_gets_the_causal_mask():
    mask, positions = tree_attention([-1, 0, 1, 2], 3, torch.float32)
    assert torch.equal(mask[0, 0], torch.ones(4, 7, dtype=torch.bool).tril(3))
    assert positions.tolist() == [[3, 4, 5, 6]]


def test_tree_attention_over_pending_tokens_and_a_tree():
    """Two pending tokens (a chain after a cache of 3), then a tree of 3 nodes hung from the second."""
    mask, positions = tree_attention(input_parents(2, [-1, 0, -1]), 3, torch.float32)
    assert positions.tolist() == [[3, 4, 5, 6, 5]]
    assert mask[0, 0, :, 3:].int().tolist() == [[1, 0, 0, 0, 0],
                                                 [1, 1, 0, 0, 0],
                                                 [1, 1, 1, 0, 0],
                                                 [1, 1, 1, 1, 0],
                                                 [1, 1, 0, 0, 1]]


def test_tree_attention_for_the_last_tokens_only():
    """`new`: a pass that feeds only the region's last tokens (the earlier ones cached) gets
    their rows of the full mask and their positions."""
    full, full_positions = tree_attention(PARENTS, 4, torch.float32)
    part, part_positions = tree_attention(PARENTS, 4, torch.float32, new=3)
    assert part.shape == (1, 1, 3, 4 + len(PARENTS))
    assert torch.equal(part, full[:, :, -3:]) and torch.equal(part_positions, full_positions[:, -3:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_additive_mask_is_zero_or_the_finite_minimum(dtype):
    boolean, positions = tree_attention(PARENTS, 4, dtype)
    additive, additive_positions = tree_attention(PARENTS, 4, dtype, additive=True)
    assert additive.dtype == dtype and additive.shape == boolean.shape
    assert (additive[boolean] == 0).all() and (additive[~boolean] == torch.finfo(dtype).min).all()
    assert torch.isfinite(additive).all()  # -inf would give NaN on a fully masked row
    assert torch.equal(positions, additive_positions)


@pytest.mark.parametrize("parents", [[0], [-1, 1], [-1, 2, 0], [-2], [-1, 0, 3, 1]])
def test_a_parent_after_its_child_is_a_clear_error(parents):
    with pytest.raises(SpecdecError, match="parent"):
        check_parents(parents)
    with pytest.raises(SpecdecError, match="parent"):
        Tree(list(range(len(parents))), parents)
    with pytest.raises(SpecdecError, match="parent"):
        tree_attention(parents, 2, torch.float32)
    check_parents([-1, 0, 0, -1, 3])  # and a valid forest passes


def test_tree_errors_are_clear():
    with pytest.raises(SpecdecError, match="unknown sibling scheme"):
        Tree([1, 2], [-1, 0], scheme="top-k")
    with pytest.raises(SpecdecError, match="one parent per token"):
        Tree([1, 2, 3], [-1, 0])
    with pytest.raises(SpecdecError, match="one row per node"):
        Tree([1, 2], [-1, 0], torch.rand(3, 5), scheme="iid")
