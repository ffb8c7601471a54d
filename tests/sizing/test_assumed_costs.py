"""Drafts sized for another machine's costs (schedules.AssumedCosts) and the speedup projected
there from a run's own steps (AssumedCosts.projected_speedup, the bench's projection)."""

import pytest

from specdec import SpecdecError, autoregressive_generate, speculative_generate
from specdec.bench.runners import Record
from specdec.bench.report import render_markdown
from specdec.bench.run import summarize
from specdec.drafters import make_tree_drafter
from specdec.sizing.schedules import AssumedCosts, CostAware, TreeCost
from specdec.sizing.theory import flat_verification

from conftest import TableModel


def test_assumed_costs_replace_the_wall_clock():
    flat = AssumedCosts.flat(0.2, at16=1.2)
    assert flat.slope == pytest.approx(0.2 / 16)
    # its verification cost is theory.flat_verification's: 16 drafted tokens plus the pending one cost 1.2
    assert flat.seconds(3, 17) == (pytest.approx(0.6), pytest.approx(flat_verification(16, 1.2)))
    assumed, timed = TreeCost(warmup=1, assumed=flat), TreeCost(warmup=1)
    for width, seconds in ((3, 0.9), (7, 2.5), (5, 1.1), (2, 0.7)):  # a steep, noisy machine
        for policy in (assumed, timed):
            policy.timing(0.3 * (width - 1), width - 1, seconds, width, 3)
    rate, drafter, slope, one = assumed.measured
    assert (drafter, slope, one) == (pytest.approx(0.2), pytest.approx(0.2 / 16), pytest.approx(1.0))
    assert assumed.node_threshold == pytest.approx(rate * 0.2 / 16)
    assert assumed.threshold == pytest.approx(min(0.99, rate * (0.2 + 0.2 / 16)))
    assert timed.node_threshold > 10 * assumed.node_threshold  # the wall clock here prices a node far dearer
    assert "assumed costs" in assumed.describe() and "assumed" not in timed.describe()
    assert "assumed costs" in CostAware(assumed=flat).describe()
    with pytest.raises(SpecdecError, match="at16"):
        AssumedCosts.flat(0.2, at16=0.9)
    with pytest.raises(SpecdecError, match="finite"):
        AssumedCosts(-0.1, 0.01)


@pytest.mark.parametrize("kind", ["eagle2", "sides", "mixed", "sequoia"])
def test_trees_sized_for_nearly_free_passes_grow_and_stay_exact(kind):
    target, drafter = TableModel(12, 0, sharpness=1.0), TableModel(12, 1, sharpness=1.0)
    drafter.table = target.table + 0.5 * drafter.table  # a drafter that agrees with the target often
    prompt = [1, 2, 3, 1, 2, 3, 4]
    ar = autoregressive_generate(prompt, target, max_new_tokens=48, eos_token_ids=[])
    nodes, passes = {}, {}
    for name, costs in (("flat", AssumedCosts.flat(0.05)), ("steep", AssumedCosts(0.05, 1.0))):
        tree = make_tree_drafter(kind, drafter, max_nodes=32, assumed=costs)
        out = speculative_generate(prompt, target, tree, gamma=8, max_new_tokens=48, eos_token_ids=[])
        assert out.tokens == ar.tokens  # greedy: token for token AR's, however the tree is sized
        # a step per target pass, but the first token's (first_target)
        assert len(out.stats.widths_per_step) == len(out.stats.drafter_passes_per_step) == out.stats.target_passes - 1
        nodes[name] = sum(out.stats.nodes_per_step) / len(out.stats.nodes_per_step)
        passes[name] = out.stats.target_passes
    # where a node costs 1/80 of a pass, trees grow (where it costs a whole pass, drafting stops)
    assert nodes["flat"] > 3 and nodes["steep"] < 0.5
    assert passes["flat"] < 0.8 * passes["steep"]


def test_projected_speedup_prices_each_step_on_the_assumed_machine():
    costs = AssumedCosts.flat(0.25, at16=1.2)
    # AR's steps: one token per one-token pass
    assert AssumedCosts.flat(0.3).projected_speedup(3, [1, 1, 1], [0, 0, 0]) == pytest.approx(1.0)
    # two chain steps of 4 drafted tokens, 8 tokens; the first step's first pass is the drafter's prompt
    units = 0.25 * 8 + 2 * flat_verification(4, 1.2)
    assert costs.projected_speedup(8, [5, 5], [5, 4]) == pytest.approx(8 / units)
    # two such generations joined (the bench's --samples): two drafter prompt passes left out
    assert costs.projected_speedup(16, [5, 5, 5, 5], [5, 4, 5, 4], generations=2) == pytest.approx(16 / (2 * units))
    # model-free drafting (lookup): no drafter pass at all
    assert costs.projected_speedup(6, [6], [0]) == pytest.approx(6 / flat_verification(5, 1.2))
    # the first token from the target's own pass, before any step
    assert costs.projected_speedup(7, [6], [0], one_token_passes=1) == pytest.approx(7 / (1 + flat_verification(5)))
    with pytest.raises(SpecdecError, match="one width"):
        costs.projected_speedup(4, [2, 2], [1])


def test_the_bench_reports_tokens_per_pass_and_the_projection():
    flat = AssumedCosts.flat(0.25)
    records = [
        Record("h/0@t0", "ar", [1] * 4, 4, 2.0, 4),
        Record("h/0@t0", "sd-cost", [1] * 8, 8, 2.0, 2, drafted=8, accepted=6, widths_per_step=[5, 5],
               drafter_passes_per_step=[5, 4]),  # (first_target=False: every pass a step)
        Record("h/0@t0", "tree-mixed-flat", [1] * 8, 8, 4.0, 1, drafted=20, accepted=7, nodes_per_step=[20],
               widths_per_step=[21], drafter_passes_per_step=[7]),
        Record("h/0@t0", "hf-lookup", [1] * 8, 8, 1.0, None),
    ]
    for r in records:
        r.dataset = r.task = "humaneval"
    methods = [r.method for r in records]
    s = summarize(records, methods, flat)
    assert s["ar"]["projected_speedup"] == 1.0
    assert s["sd-cost"]["projected_speedup"] == pytest.approx(8 / (0.25 * 8 + 2 * flat_verification(4)))
    assert s["tree-mixed-flat"]["projected_speedup"] == pytest.approx(8 / (0.25 * 6 + flat_verification(20)))
    assert "projected_speedup" not in s["hf-lookup"]  # a peer's steps are not known
    assert "projected_speedup" not in summarize(records, methods)["sd-cost"]  # nothing assumed: no projection
    result = {"info": {"datasets": ["humaneval"], "prompts": 1, "temperatures": [0.0], "seed": 0,
                       "settings": {"max_new_tokens": 8, "gamma": 5, "gamma_min": 1, "gamma_max": 20,
                                    "confidence": 0.4, "egag_beta": 0.0, "ngram_n": 4},
                       "target": "t", "drafter": "d", "target_dtype": "bfloat16", "target_kernels": "k",
                       "drafter_dtype": "int8", "drafter_kernels": "k", "machine": "m",
                       "assumed_costs": flat.to_dict()},
              "summary": s, "groups": [], "records": [dict(vars(r), tokens_per_second=r.tokens_per_second)
                                                      for r in records]}
    text = render_markdown(result)
    assert "costs 1.20 one-token passes and a drafter pass 0.250 of one" in text
    # tokens per pass 8 vs sd-cost's 4: 2x; measured here 2 tok/s vs ar's 2 tok/s
    assert "| tree-mixed-flat | 8.00 | 2.00× | 20.0 | 1.00× |" in text


def test_a_kind_left_for_a_while_is_judged_by_its_next_probe():
    """Both kinds' sums decay at every step: after a long plain stretch one good drafting probe
    outweighs a bad old record (decayed per step of its own kind only, it would not: rate 0.93)."""
    from specdec.sizing.schedules import FasterOf

    kinds = FasterOf(warmup=1, probe=8, decay=0.9, waits={True: 8, False: 8})
    for _ in range(3):
        kinds.record(True, 1, 2.0)  # drafting at 0.5 tokens a second
    for _ in range(30):
        kinds.record(False, 1, 1.0)  # plain at 1
    assert kinds.rate(True) == pytest.approx(0.5) and kinds.rate(False) == pytest.approx(1.0)
    kinds.record(True, 3, 1.0)  # one probe at 3
    assert kinds.rate(True) > 2 > kinds.rate(False)
    assert kinds.steps(True) == 4 and kinds.steps(False) == 30
