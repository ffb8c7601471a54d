"""verify_tree, sibling_laws and verify_tree_greedy: exactness over 10^6 draft trees per scheme,
power checks (wrong laws and a biased duplicate skip are detected), chain equivalence with
verify_draft / verify_greedy, greedy walks on hand-built trees, and clear errors.

The synthetic target is a function of the prefix: p(.), p(. | a), p(. | a, b), p(. | a, b, c) are
tables, so the law of every emitted position depends on the path taken through the tree. The
drafter's q is another such function. Each trial drafts a tree exactly as its scheme says, one
batched `verify_tree` call decides all trials, and each trial emits its path's tokens then the
next token; the tokens past the emitted ones are completed from the target (what the decoding
loop's next steps would do). Lossless means the first 3 tokens then follow the enumerated law
p(a)·p(b|a)·p(c|a,b) exactly.

Tolerance: chi-square tests of the first token (6 cells), of the first two (36 cells) and of the
first three (216 cells, each expecting >= 15 counts) against that law, each at significance
1e-4/3 (Bonferroni over the three): a correct rule fails by chance about once in 10^4 runs; seeds
are fixed, so runs are repeatable. A power check must bring the smallest of the three p-values
below 1e-6 with the same 10^6 trials.
"""

import functools
import itertools

import pytest
import torch
from scipy.stats import chi2_contingency

from specdec import SpecdecError, sample, verify_draft
from specdec.core.trees import Tree, depths
from specdec.core.verify import sibling_laws, verify_greedy, verify_tree, verify_tree_greedy

from test_verify import _chi_square_pvalue, _dirichlet, _run_chain

TRIALS = 1_000_000
POWER_TRIALS = 300_000  # the power checks' p-values are ~1e-300 at 10^6 trials: fewer suffice
ALPHA = 1e-4
POWER = 1e-6
V = 6

# The draft tree: 3 siblings at the root, a chain below the first, 2 siblings at depth 3, with
# each node's first child first (core/trees.py's layout).
#          root
#     0 (a)    4 (b)   5 (c)
#     1
#   2   3
PARENTS = [-1, 0, 1, 1, -1, -1]
N = len(PARENTS)
DEPTHS = depths(PARENTS)
CHILDREN = {parent: [n for n, p in enumerate(PARENTS) if p == parent] for parent in [-1, *range(N)]}
# PATH_TABLE[last + 1] = the nodes of the path to `last` (N pads)
PATH_TABLE = torch.tensor([[N] * 3] + [(Tree([0] * N, PARENTS).path_to(n) + [N] * 3)[:3] for n in range(N)])
DEPTH_OF_LAST = torch.tensor([0] + DEPTHS)
# a mixed tree (one scheme per node): a top-1 sibling then sampled ones at the root, as a sampled
# model chain with deterministic lookup branches would give
MIXED = ("deterministic", "iid", "without-replacement", "without-replacement", "iid", "iid")


@functools.lru_cache(maxsize=1)
def _tables():
    """Target and drafter as functions of the prefix: p(. | prefix) and q(. | prefix) for prefixes
    of length d = 0..3, all in one table each: row OFFSETS[d] + (prefix as a base-V number)."""
    p_tables, q_tables = [], []
    g = torch.Generator().manual_seed(77)
    for d in range(4):
        rows = V ** d
        # mixed with a little uniform so that every 3-token tuple expects >= 15 counts in 10^6
        p = 0.85 * _dirichlet(rows, V, 40 + d) + 0.15 / V
        # q: p distorted by a random factor in [e^-1.2, e^1.2]: many rejections, yet deep paths
        q = p * torch.randn(rows, V, generator=g).clamp(-2, 2).mul(0.6).exp()
        p_tables.append(p)
        q_tables.append(q / q.sum(-1, keepdim=True))
    return torch.cat(p_tables), torch.cat(q_tables)


OFFSETS = [sum(V ** e for e in range(d)) for d in range(5)]  # 0, 1, 7, 43, 259


def _joint_laws():
    """The target's law of the first 1, 2 and 3 tokens, flat (index a, a·V + b, a·V² + b·V + c)."""
    p = _tables()[0]
    one = p[0]
    two = (one[:, None] * p[OFFSETS[1]:OFFSETS[2]]).flatten()
    three = (two[:, None] * p[OFFSETS[2]:OFFSETS[3]]).flatten()
    return one, two, three


def _draw(q, k, how, generator):
    """k siblings from the rows q [trials, V], as a drafter following `how` draws them."""
    if how == "iid":
        return torch.multinomial(q, k, replacement=True, generator=generator)
    if how == "without-replacement":
        return torch.multinomial(q, k, replacement=False, generator=generator)  # in drawing order
    if how == "deterministic":
        return q.topk(k, -1).indices  # the k likeliest, best first
    if how == "iid-redrawn-until-distinct":
        # i.i.d. draws, each duplicate redrawn until it differs from the earlier siblings
        drawn = torch.multinomial(q, k, replacement=True, generator=generator)
        for j in range(1, k):
            while True:
                again = (drawn[:, j:j + 1] == drawn[:, :j]).any(-1)
                if not again.any():
                    break
                drawn[again, j] = torch.multinomial(q[again], 1, generator=generator).squeeze(-1)
        return drawn
    raise ValueError(how)


def _draft_tokens(how: str | tuple, seed: int, trials: int):
    """`trials` draft trees drafted as `how` says (one scheme, or one per node) -> tokens [trials, N]
    and the row of each node's prefix in the tables [trials, N]."""
    hows = [how] * N if isinstance(how, str) else list(how)
    g = torch.Generator().manual_seed(seed)
    q_table = _tables()[1]
    tokens = torch.zeros(trials, N, dtype=torch.long)
    codes = torch.zeros(trials, N, dtype=torch.long)  # each node's path tokens as a base-V number
    for parent, children in CHILDREN.items():
        if not children:
            continue
        code = torch.zeros(trials, dtype=torch.long) if parent < 0 else codes[:, parent]
        depth = 0 if parent < 0 else DEPTHS[parent]
        q = q_table[OFFSETS[depth] + code]  # [trials, V]: q at the parent's prefix
        for kind in dict.fromkeys(hows[c] for c in children):
            nodes = [c for c in children if hows[c] == kind]
            tokens[:, nodes] = _draw(q, len(nodes), kind, g)
        codes[:, children] = code[:, None] * V + tokens[:, children]
    return tokens, codes + torch.tensor([OFFSETS[d] for d in DEPTHS])


@functools.lru_cache(maxsize=2)
def _draft(how: str | tuple, seed: int, trials: int = TRIALS):
    """Drafted trees and their rows: tokens [trials, N], target_probs [trials, N+1, V] (the root's
    p, then p at each node's prefix) and the drafter's q at each node's parent [trials, N, V]."""
    tokens, rows = _draft_tokens(how, seed, trials)
    p_table, q_table = _tables()
    rows = torch.cat([torch.zeros(trials, 1, dtype=torch.long), rows], 1)  # the root's, then each node's
    target = p_table.index_select(0, rows.flatten()).view(trials, N + 1, V)
    parent_rows = rows[:, [parent + 1 for parent in PARENTS]].flatten()
    return tokens, target, q_table.index_select(0, parent_rows).view(trials, N, V)


def _first_three(last, next_token, tokens, generator):
    """The first 3 tokens of each trial's output: the accepted path, the next token, then tokens
    sampled from the target's conditionals, as the decoding loop would go on."""
    p_table = _tables()[0]
    trials = tokens.shape[0]
    depth = DEPTH_OF_LAST[last + 1]
    padded = torch.cat([tokens, torch.zeros(trials, 1, dtype=torch.long)], 1)
    out = torch.where(torch.arange(3) < depth[:, None], padded.gather(1, PATH_TABLE[last + 1]), -1)
    short = depth < 3
    out[short, depth[short]] = next_token[short]
    code = torch.zeros(trials, dtype=torch.long)
    for i in range(3):
        missing = out[:, i] < 0
        if missing.any():
            out[missing, i] = sample(p_table[OFFSETS[i] + code[missing]], generator)
        code = code * V + out[:, i]
    return out


def _pvalues(out):
    """p-values of the first 1, 2 and 3 tokens; with too few trials for every 3-token cell to
    expect 15 counts (the power checks' 3·10^5), of the first 1 and 2 only."""
    one, two, three = _joint_laws()
    assert two.min() * out.shape[0] >= 15  # the chi-square approximation holds on every cell
    values = [_chi_square_pvalue(out[:, 0], one), _chi_square_pvalue(out[:, 0] * V + out[:, 1], two)]
    if three.min() * out.shape[0] >= 15:
        values.append(_chi_square_pvalue((out[:, 0] * V + out[:, 1]) * V + out[:, 2], three))
    return values


def _tree_verify(target, laws, tokens, generator):
    return verify_tree(target, laws, tokens, PARENTS, generator)


def _run(drafted: str | tuple, law: str | list, seed: int = 1, verify=_tree_verify, trials: int = TRIALS):
    """Draft 10^6 trees as `drafted` says, verify them with the laws of `law` -> (p-values of the
    first 1, 2, 3 output tokens, last_node [trials], next_token [trials])."""
    tokens, target, parent_q = _draft(drafted, seed, trials)
    laws = sibling_laws(parent_q, tokens, PARENTS, law)
    g = torch.Generator().manual_seed(seed + 1)
    last, next_token = verify(target, laws, tokens, g)
    return _pvalues(_first_three(last, next_token, tokens, g)), last, next_token


def _assert_every_ending_is_frequent(last):
    """So that an exactness test is not vacuous: each kind of ending occurs in a fair share of the
    trials: no node accepted (the residual at the root), a later root sibling accepted after the
    first was rejected, an inner node whose children were all rejected (residual below the root),
    a depth-3 leaf (bonus token after 3 accepted)."""
    shares = {ending: (last == ending).double().mean().item() for ending in range(-1, N)}
    assert shares[-1] > 0.01 and shares[4] + shares[5] > 0.02, shares
    assert shares[0] > 0.02 and shares[1] > 0.02, shares
    assert shares[2] + shares[3] > 0.04 and shares[3] > 0.005, shares


# The exactness tests come first, and the power checks reuse their drafts (cached, 2 at a time).
SCHEMES = {"deterministic": "deterministic", "mixed": MIXED, "without-replacement": "without-replacement",
           "iid": "iid"}


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.slow
def test_tree_output_law_equals_target(scheme):
    drafted = SCHEMES[scheme]
    pvalues, last, _ = _run(drafted, drafted if isinstance(drafted, str) else list(drafted))
    _assert_every_ending_is_frequent(last)
    assert len(pvalues) == 3 and min(pvalues) > ALPHA / 3, f"output law differs from the target: p-values {pvalues}"


@pytest.mark.parametrize("scheme", ["iid", "without-replacement"])
def test_one_tree_without_a_batch_dimension_gets_the_batched_decisions(scheme):
    """verify_tree on one sequence ([N+1, V], [N, V], [N]: what decoding passes) makes, for the
    same draws, the decision of the batched rule on a batch of one; over trees that end in
    every way, so the statistical tests of the batched rule carry over to it."""
    tokens, target, parent_q = _draft(scheme, 1, 400)
    laws = sibling_laws(parent_q, tokens, PARENTS, scheme)
    endings = set()
    for i in range(len(tokens)):
        single = verify_tree(target[i], laws[i], tokens[i], PARENTS, torch.Generator().manual_seed(i))
        batch_of_one = verify_tree(target[i:i + 1], laws[i:i + 1], tokens[i:i + 1], PARENTS,
                                   torch.Generator().manual_seed(i))
        assert single[0].shape == single[1].shape == ()
        assert (int(single[0]), int(single[1])) == (int(batch_of_one[0]), int(batch_of_one[1])), i
        endings.add(int(single[0]))
    assert endings == set(range(-1, N))


def test_iid_draws_do_repeat_siblings():
    """The iid exactness test covers duplicate siblings (kept in the tree, tried, rejected)."""
    tokens = _draft("iid", 1, 100_000)[0]
    root_duplicate = (tokens[:, 4] == tokens[:, 0]) | (tokens[:, 5] == tokens[:, 0]) | (tokens[:, 5] == tokens[:, 4])
    assert root_duplicate.double().mean() > 0.2 and (tokens[:, 2] == tokens[:, 3]).double().mean() > 0.1


# --- power checks: each is a plausible slip, and the test above must catch it -----------------

@pytest.mark.parametrize("drafted,law", [
    ("iid", "without-replacement"),  # i.i.d. draws verified with the renormalised q
    ("without-replacement", "iid"),  # draws without replacement verified with SpecInfer's unchanged q
])
def test_a_law_that_does_not_match_the_drafting_is_detected(drafted, law):
    pvalues, _, _ = _run(drafted, law, trials=POWER_TRIALS)
    assert min(pvalues) < POWER, pvalues


def test_redrawing_duplicates_until_distinct_is_drawing_without_replacement():
    """"Dedupe" an i.i.d. drafter by redrawing each duplicate until it differs from the earlier
    siblings: the siblings are then drawn without replacement (same law, checked here on the
    3 root siblings), so verified with the i.i.d. law this is the biased case just above, and
    verified with the "without-replacement" law it is exact."""
    q = _tables()[1][0].expand(200_000, -1)
    g = torch.Generator().manual_seed(11)
    redrawn = _draw(q, 3, "iid-redrawn-until-distinct", g)
    cells = lambda x: (x[:, 0] * V + x[:, 1]) * V + x[:, 2]  # noqa: E731
    # the law of an ordered draw without replacement, enumerated: q(a)·q(b)/(1-q(a))·q(c)/(1-q(a)-q(b))
    law = torch.zeros(V ** 3, dtype=torch.float64)
    qd = q[0].double()
    for a, b, c in itertools.permutations(range(V), 3):
        law[(a * V + b) * V + c] = qd[a] * qd[b] / (1 - qd[a]) * qd[c] / (1 - qd[a] - qd[b])
    assert _chi_square_pvalue(cells(redrawn), law) > ALPHA / 2  # (and never a repeated token: law 0 there)
    # the multinomial draws that the "without-replacement" trees above use have the same law
    assert _chi_square_pvalue(cells(_draw(q, 3, "without-replacement", g)), law) > ALPHA / 2


# --- duplicate siblings under i.i.d. drafting --------------------------------------------------
# verify_tree keeps a duplicate sibling: it is tried and surely rejected (a token x rejected
# earlier has p(x) = 0 in the residual), and its rejection still updates the residual,
# p <- norm(max(0, p - q)). An implementation that skips the duplicate (saving its target row and
# its subtree's) is lossless only if it still applies that update; skipping the update too
# leaves the residual one subtraction short, which is biased (see the enumeration below).

def _walk_skipping_duplicates(update_residual: bool):
    """verify_tree's walk, written out, except that a sibling whose token equals an earlier
    sibling's is never tried (nor its subtree entered); with `update_residual` the residual update
    of its (sure) rejection is applied all the same. Same draws, in the same order, as verify_tree."""

    def walk(target, laws, tokens, generator):
        p = target[:, 0] / target[:, 0].sum(-1, keepdim=True)
        current = torch.full(tokens.shape[:1], -1, dtype=torch.long)
        u = torch.rand(tokens.shape, generator=generator)
        for n, parent in enumerate(PARENTS):
            earlier = [m for m in range(n) if PARENTS[m] == parent]
            duplicate = (tokens[:, earlier] == tokens[:, n:n + 1]).any(-1) if earlier else torch.zeros_like(current,
                                                                                                            dtype=bool)
            active = current == parent
            q, x = laws[:, n], tokens[:, n:n + 1]
            tried = active & ~duplicate
            accepted = tried & (u[:, n] * q.gather(-1, x).squeeze(-1) < p.gather(-1, x).squeeze(-1))
            subtract = (tried | (active & update_residual)) & ~accepted
            residual = (p - q).clamp_min(0)
            total = residual.sum(-1, keepdim=True)
            residual = torch.where(total > 0, residual / total.clamp_min(1e-30), p)
            p_next = target[:, n + 1] / target[:, n + 1].sum(-1, keepdim=True)
            p = torch.where(accepted[:, None], p_next, torch.where(subtract[:, None], residual, p))
            current = torch.where(accepted, n, current)
        return current, sample(p, generator)

    return walk


def test_skipping_duplicates_but_keeping_their_residual_update_is_lossless():
    """Skip a duplicate sibling's test (and its subtree) but still apply p <- norm(max(0, p - q))
    for it: exact, and trial for trial what verify_tree does with the duplicate kept."""
    pvalues, last, next_token = _run("iid", "iid", verify=_walk_skipping_duplicates(update_residual=True),
                                     trials=POWER_TRIALS)
    assert min(pvalues) > ALPHA / 3, pvalues
    tokens, target, parent_q = _draft("iid", 1, 100_000)
    kept = verify_tree(target, parent_q, tokens, PARENTS, torch.Generator().manual_seed(2))
    skipped = _walk_skipping_duplicates(True)(target, parent_q, tokens, torch.Generator().manual_seed(2))
    assert torch.equal(kept[0], skipped[0]) and torch.equal(kept[1], skipped[1])


def test_skipping_duplicates_without_their_residual_update_is_biased():
    """Power check: skipping a duplicate sibling altogether (never tried, residual not updated)
    is detected."""
    pvalues, _, _ = _run("iid", "iid", verify=_walk_skipping_duplicates(update_residual=False), trials=POWER_TRIALS)
    assert min(pvalues) < POWER, pvalues


def test_a_zero_law_for_duplicates_is_the_biased_skip():
    """The same slip expressed through verify_tree: a duplicate given an all-zero law is never
    accepted (p(x) = 0 there) and leaves p unchanged: trial for trial the biased walk. (This is
    also what the "without-replacement" law does to a duplicate of an i.i.d. draft.)"""
    tokens, target, parent_q = _draft("iid", 1, 100_000)
    laws = parent_q.clone()
    for n, parent in enumerate(PARENTS):
        earlier = [m for m in range(n) if PARENTS[m] == parent]
        if earlier:
            laws[(tokens[:, earlier] == tokens[:, n:n + 1]).any(-1), n] = 0.0
    zero_law = verify_tree(target, laws, tokens, PARENTS, torch.Generator().manual_seed(2))
    skipped = _walk_skipping_duplicates(False)(target, parent_q, tokens, torch.Generator().manual_seed(2))
    assert torch.equal(zero_law[0], skipped[0]) and torch.equal(zero_law[1], skipped[1])
    kept = verify_tree(target, parent_q, tokens, PARENTS, torch.Generator().manual_seed(2))
    assert not torch.equal(zero_law[1], kept[1])  # (the walk with its flag off does differ)


def _exact_two_sibling_law(p, q, skip_duplicate, update_residual):
    """Exact output law (float64, enumerated) of two i.i.d. siblings x1, x2 ~ q below the root,
    both leaves, verified with law q, the second skipped when it equals the first."""

    def residual(r):
        m = (r - q).clamp_min(0)
        return m / m.sum()

    out = torch.zeros_like(p)
    for x1, x2 in itertools.product(range(len(p)), repeat=2):
        weight = q[x1] * q[x2]
        accept1 = min(1.0, float(p[x1] / q[x1]))
        out[x1] += weight * accept1
        r1 = residual(p)
        if skip_duplicate and x2 == x1:
            out += weight * (1 - accept1) * (residual(r1) if update_residual else r1)
            continue
        accept2 = min(1.0, float(r1[x2] / q[x2]))
        out[x2] += weight * (1 - accept1) * accept2
        out += weight * (1 - accept1) * (1 - accept2) * residual(r1)
    return out


def test_duplicate_skip_by_enumeration():
    """The reasoning, on numbers. p = (.1, .45, .45), q = (.6, .3, .1): after x1 = 0 is rejected
    the residual is r1 = (0, .3, .7) and r1(0) = 0, so a duplicate x2 = 0 is surely rejected; but
    its rejection moves the residual to r2 = norm(max(0, r1 - q)) = (0, 0, 1). Skipping it keeps
    r1 instead, on an event of probability sum_x max(0, q - p)(x)·q(x) = .3, so the output law
    moves by .3·(r1 - r2) = (0, .09, -.09)."""
    p = torch.tensor([0.1, 0.45, 0.45], dtype=torch.float64)
    q = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    for skip, update in [(False, False), (True, True)]:
        assert torch.allclose(_exact_two_sibling_law(p, q, skip, update), p, atol=1e-12)
    biased = _exact_two_sibling_law(p, q, skip_duplicate=True, update_residual=False)
    assert torch.allclose(biased, torch.tensor([0.1, 0.54, 0.36], dtype=torch.float64), atol=1e-12)


# --- chains: verify_tree on a chain is verify_draft ---------------------------------------------

CHAIN_GAMMA, CHAIN_VOCAB = 4, 8
CHAIN_PARENTS = list(range(-1, CHAIN_GAMMA - 1))


def _chain_as_tree(p, q, tokens, generator=None):
    """verify_draft's signature, computed by verify_tree on the chain tree with i.i.d. laws."""
    laws = sibling_laws(q, tokens, CHAIN_PARENTS, "iid")
    last, next_token = verify_tree(p, laws, tokens, CHAIN_PARENTS, generator)
    return last + 1, next_token


def test_a_chain_tree_has_verify_drafts_output_law():
    p = _dirichlet(CHAIN_GAMMA + 1, CHAIN_VOCAB, 21)
    q = _dirichlet(CHAIN_GAMMA, CHAIN_VOCAB, 22)
    trials = 300_000
    emitted_chain, n_chain = _run_chain(p, q, trials, 3)
    emitted_tree, n_tree = _run_chain(p, q, trials, 4, verify=_chain_as_tree)
    # the law of (number accepted, next token), compared between independent runs of the two
    cells = CHAIN_VOCAB * (CHAIN_GAMMA + 1)
    table = torch.stack([torch.bincount(n * CHAIN_VOCAB + e[torch.arange(trials), n], minlength=cells)
                         for e, n in ((emitted_chain, n_chain), (emitted_tree, n_tree))])
    table = table[:, table.sum(0) > 0].numpy()
    assert chi2_contingency(table).pvalue > ALPHA / 2
    assert len(set(n_tree.tolist())) == CHAIN_GAMMA + 1  # every accepted length occurs
    # and each emitted position follows its p
    for i in range(CHAIN_GAMMA + 1):
        reached = emitted_tree[:, i] >= 0
        assert _chi_square_pvalue(emitted_tree[reached, i], p[i]) > ALPHA / 2 / (CHAIN_GAMMA + 1)


def test_a_chain_tree_makes_verify_drafts_decisions():
    """Same inputs, same generator: the same decisions trial for trial (the two draw their
    uniforms in the same order)."""
    p = _dirichlet(CHAIN_GAMMA + 1, CHAIN_VOCAB, 23)
    q = _dirichlet(CHAIN_GAMMA, CHAIN_VOCAB, 24)
    trials = 100_000
    draft = sample(q.expand(trials, -1, -1), torch.Generator().manual_seed(0))
    expected = verify_draft(p.expand(trials, -1, -1), q.expand(trials, -1, -1), draft, torch.Generator().manual_seed(1))
    got = _chain_as_tree(p.expand(trials, -1, -1), q.expand(trials, -1, -1), draft, torch.Generator().manual_seed(1))
    same = (expected[0] == got[0]) & (expected[1] == got[1])
    assert same.double().mean() > 0.9999  # (the tree normalises p: a tie at float precision may differ)


def test_verify_tree_greedy_on_a_chain_is_verify_greedy():
    g = torch.Generator().manual_seed(0)
    gamma = 5
    target_tokens = torch.randint(0, V, (3, 400, gamma + 1), generator=g)
    draft_tokens = torch.where(torch.rand(3, 400, gamma, generator=g) < 0.75, target_tokens[..., :gamma],
                               torch.randint(0, V, (3, 400, gamma), generator=g))
    n, next_token = verify_greedy(target_tokens, draft_tokens)
    last, next_tree = verify_tree_greedy(target_tokens, draft_tokens, list(range(-1, gamma - 1)))
    assert torch.equal(last + 1, n) and torch.equal(next_tree, next_token)
    assert set(n.flatten().tolist()) == set(range(gamma + 1))


# --- greedy trees ---------------------------------------------------------------------------------

#        root
#   0 (t1)          5 (t6)
#   1 (t2)   3 (t4)   6 (t7)
#   2 (t3)   4 (t5)
GREEDY_PARENTS = [-1, 0, 1, 0, 3, -1, 5]
GREEDY_TOKENS = [1, 2, 3, 4, 5, 6, 7]


@pytest.mark.parametrize("argmax,last,next_token", [
    ({-1: 6, 5: 7, 6: 0}, 6, 0),  # the root's second child, then its leaf: bonus argmax
    ({-1: 1, 0: 4, 3: 5, 4: 8}, 4, 8),  # off the main chain: the second child of node 0, then its leaf
    ({-1: 1, 0: 2, 1: 3, 2: 9}, 2, 9),  # the whole main chain, bonus at its leaf
    ({-1: 1, 0: 2, 1: 9}, 1, 9),  # node 1's only child does not match: stop there
    ({-1: 1, 0: 7}, 0, 7),  # 7 is a token of the tree, but not a child of node 0
    ({-1: 0}, -1, 0),  # no child of the root matches
])
def test_greedy_tree_walks(argmax, last, next_token):
    g = torch.Generator().manual_seed(len(argmax))
    target = torch.randint(0, 10, (len(GREEDY_TOKENS) + 1,), generator=g)  # rows off the walk: noise
    for node, token in argmax.items():
        target[node + 1] = token
    got = verify_tree_greedy(target, torch.tensor(GREEDY_TOKENS), GREEDY_PARENTS)
    assert (int(got[0]), int(got[1])) == (last, next_token)


def test_greedy_tree_is_batched_over_leading_dimensions():
    """Each element of a [2, 3] batch (its own tokens and targets) gets its own walk."""
    cases = [({-1: 6, 5: 7, 6: 0}, 6, 0), ({-1: 1, 0: 4, 3: 5, 4: 8}, 4, 8), ({-1: 0}, -1, 0),
             ({-1: 1, 0: 2, 1: 9}, 1, 9), ({-1: 3}, 0, 5), ({-1: 1, 0: 7}, 0, 7)]
    targets, tokens = torch.zeros(6, len(GREEDY_TOKENS) + 1, dtype=torch.long), []
    for i, (argmax, _, _) in enumerate(cases):
        for node, token in argmax.items():
            targets[i, node + 1] = token
        tokens.append(GREEDY_TOKENS if i != 4 else [3, 2, 3, 4, 5, 6, 7])  # case 4: node 0 drafted 3
    targets[4, 1] = 5
    last, next_token = verify_tree_greedy(targets.view(2, 3, -1), torch.tensor(tokens).view(2, 3, -1), GREEDY_PARENTS)
    assert last.shape == next_token.shape == (2, 3)
    assert last.flatten().tolist() == [c[1] for c in cases]
    assert next_token.flatten().tolist() == [c[2] for c in cases]


def test_greedy_tree_is_verify_tree_with_one_hot_p():
    """With a one-hot target, verify_tree accepts exactly the child carrying the argmax and then
    emits it, whatever the laws: verify_tree_greedy's walk, on random trees and batches."""
    g = torch.Generator().manual_seed(2)
    parents = [-1, 0, 0, 1, -1, 4, 5, 5, -1]
    target_tokens = torch.randint(0, 4, (2000, len(parents) + 1), generator=g)
    draft_tokens = torch.randint(0, 4, (2000, len(parents)), generator=g)
    laws = torch.rand(2000, len(parents), 4, generator=g).softmax(-1)
    p = torch.nn.functional.one_hot(target_tokens, 4).float()
    expected = verify_tree_greedy(target_tokens, draft_tokens, parents)
    got = verify_tree(p, laws, draft_tokens, parents, g)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert set(expected[0].tolist()) == set(range(-1, len(parents)))  # every node ends a walk


# --- errors ---------------------------------------------------------------------------------------

def _small():
    return torch.rand(3, 4).softmax(-1), torch.rand(2, 4).softmax(-1), torch.tensor([1, 2]), [-1, 0]


@pytest.mark.parametrize("change,message", [
    (lambda p, q, x, par: (p[:2], q, x, par), "target_probs"),
    (lambda p, q, x, par: (p, q[:1], x, par), "draft_laws"),
    (lambda p, q, x, par: (p, q, x, [-1]), "parents"),
])
def test_verify_tree_shape_errors_are_clear(change, message):
    with pytest.raises(SpecdecError, match=message):
        verify_tree(*change(*_small()))


@pytest.mark.parametrize("which", ["target", "laws"])
def test_verify_tree_nan_is_a_clear_error(which):
    p, q, x, parents = _small()
    (p if which == "target" else q)[1, 2] = float("nan")
    with pytest.raises(SpecdecError, match="NaN"):
        verify_tree(p, q, x, parents)


def test_verify_tree_greedy_shape_error_is_clear():
    with pytest.raises(SpecdecError, match="target_tokens"):
        verify_tree_greedy(torch.tensor([1, 2]), torch.tensor([1, 2]), [-1, 0])
    with pytest.raises(SpecdecError, match="parents"):
        verify_tree_greedy(torch.tensor([1, 2, 3]), torch.tensor([1, 2]), [-1])


def test_sibling_laws_errors_are_clear():
    _, q, x, parents = _small()
    with pytest.raises(SpecdecError, match="unknown sibling scheme"):
        sibling_laws(q, x, parents, "top-k")
    with pytest.raises(SpecdecError, match="unknown sibling scheme"):
        sibling_laws(q, x, parents, ["iid", "sorted"])
    with pytest.raises(SpecdecError, match="scheme"):
        sibling_laws(q, x, parents, ["iid"])  # one scheme per node
    with pytest.raises(SpecdecError, match="parent"):
        sibling_laws(q, x, [-1], "iid")


def test_sibling_laws_values():
    """iid: q; without-replacement: q with the earlier such siblings' tokens removed, renormalised
    (siblings only: not a parent's token, not a deterministic sibling's); deterministic: one-hot."""
    q = torch.tensor([0.4, 0.3, 0.2, 0.1]).expand(5, 4)
    tokens = torch.tensor([0, 1, 2, 2, 3])
    parents = [-1, -1, 1, -1, -1]
    laws = sibling_laws(q, tokens, parents, ["without-replacement", "without-replacement", "without-replacement",
                                             "deterministic", "without-replacement"])
    expected = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0, 0.5, 2 / 6, 1 / 6], [0.4, 0.3, 0.2, 0.1], [0, 0, 1, 0],
                             [0, 0, 2 / 3, 1 / 3]])
    assert torch.allclose(laws, expected)
    assert torch.equal(sibling_laws(q, tokens, parents, "iid"), q)


# Inputs that once gave a RuntimeError deep inside torch, or silently a wrong answer.
@pytest.mark.parametrize("parents", [[1, -1], [-1, 5], [-3, 0], [-1, 1]])
def test_verify_tree_rejects_parents_out_of_order(parents):
    p, q, x, _ = _small()
    with pytest.raises(SpecdecError, match="parent"):
        verify_tree(p, q, x, parents)  # unchecked, node 0 of [1, -1] was silently never tried


def test_verify_tree_greedy_rejects_parents_out_of_order():
    with pytest.raises(SpecdecError, match="parent"):
        verify_tree_greedy(torch.tensor([1, 2, 3]), torch.tensor([1, 2]), [1, -1])


@pytest.mark.parametrize("case", ["vocab", "token-range", "negative-token", "float-tokens", "batch", "batch-of-one"])
def test_verify_tree_rejects_inconsistent_inputs(case):
    p, q, x, parents = _small()
    if case == "vocab":
        q = torch.rand(2, 5).softmax(-1)
    elif case == "token-range":
        x = torch.tensor([1, 7])
    elif case == "negative-token":
        x = torch.tensor([1, -1])
    elif case == "float-tokens":
        x = x.float()
    elif case == "batch":
        p, q, x = p.expand(3, 3, 4), q.expand(2, 2, 4), x.expand(2, 2)
    else:
        p, q, x = p.expand(3, 3, 4), q.expand(3, 2, 4), x.expand(1, 2)  # unchecked: last_node [1], next_token [3]
    with pytest.raises(SpecdecError):
        verify_tree(p, q, x, parents)


def test_verify_tree_greedy_rejects_mismatched_batches():
    with pytest.raises(SpecdecError):  # unchecked: answered for 2 of 3 targets
        verify_tree_greedy(torch.tensor([[1, 2, 3]] * 3), torch.tensor([[1, 2]] * 2), [-1, 0])
