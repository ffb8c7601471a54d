"""Speculation under load (sizing/batch_policy.py): the batch's measured costs decide whether to draft
and how high a draft token's chance must be; seeded sampled sequences are never steered."""

import pytest
import torch

from specdec import Sampler
from specdec.sizing.batch_policy import FEEDING_WORTH, JOIN_DECAY, BatchCosts
from specdec.sizing.pass_costs import WORTH, LoadCosts
from specdec.decoding.sequence import Decoding
from specdec.decoding.speculation import Speculation
from specdec.sizing.schedules import CostAware, TreeCost

from conftest import tiny_model
from test_passcost import LOADED, ROUNDS


def _simulate(costs: BatchCosts, batch: int, pass_seconds, drafted_tokens: float, steps: int = 120) -> list[bool]:
    """Steps at `batch` sequences: a drafting step scores 4 rows a sequence and commits
    `drafted_tokens` a sequence, a plain one 1 row and 1 token -> the decisions taken."""
    chosen = []
    for _ in range(steps):
        speculate = costs.speculate(batch)
        width = batch * (4 if speculate else 1)
        tokens = round(batch * (drafted_tokens if speculate else 1))
        costs.record(batch, speculate, tokens, 0.01 * batch if speculate else 0.0, 3 * batch if speculate else 0,
                     pass_seconds(width), width, rounds=3 if speculate else 0)
        chosen.append(speculate)
    return chosen


def test_drafting_stops_where_rows_are_dear_and_goes_on_where_they_are_cheap():
    dear = _simulate(BatchCosts(), 8, lambda width: 0.05 * width, drafted_tokens=2.0)
    cheap = _simulate(BatchCosts(), 8, lambda width: 0.2 + 0.001 * width, drafted_tokens=2.0)
    assert sum(dear[20:]) < 0.2 * len(dear[20:])  # plain steps, but for the probes
    assert sum(cheap[20:]) > 0.8 * len(cheap[20:])


def test_the_bar_for_a_draft_token_rises_with_the_batch():
    """Same pass-cost curve, more sequences: the batch makes more tokens per second, so one more
    row must carry a likelier token to pay (the threshold imposed on each sequence's policy)."""
    costs = BatchCosts()
    curve = lambda width: 0.15 + 0.01 * width  # noqa: E731
    _simulate(costs, 1, curve, drafted_tokens=2.5)
    _simulate(costs, 8, curve, drafted_tokens=2.5)
    alone, loaded = CostAware(), CostAware()
    costs.steer(1, [(alone, True)])
    costs.steer(8, [(loaded, True)])
    rate, per_row, slope, _ = costs.costs(8)
    assert abs(slope - 0.01) < 1e-6 and loaded.threshold == min(0.99, rate * (per_row + slope))
    assert loaded.threshold > alone.threshold
    costs.steer(8, [(loaded, False)])
    assert loaded.budget() == 0 and alone.budget() == alone.gamma


def test_only_sequences_whose_output_cannot_depend_on_draft_lengths_are_steered():
    target = tiny_model(0, exact_rows=True)
    drafter = tiny_model(1, layers=1)
    def steer(seed_rule="coupled", **kw):
        speculation = Speculation.of(drafter, schedule=CostAware(), seed_rule=seed_rule)
        return Decoding([1, 2, 3], target, speculation, **kw).steerable

    assert isinstance(steer(), CostAware)  # greedy
    assert isinstance(steer(sampler=Sampler(0.8)), CostAware)  # sampled, no seed
    assert isinstance(steer(sampler=Sampler(0.8), seed=3), CostAware)  # coupled: the seeded AR output anyway
    assert steer(sampler=Sampler(0.8), seed=3, seed_rule="stream") is None  # pinned only without timings
    assert Decoding([1, 2, 3], target, Speculation.of(drafter, gamma=3)).steerable is None  # a fixed γ, as asked
    assert Decoding([1, 2, 3], target, None).steerable is None


def test_a_new_batch_size_starts_from_the_nearest_ones_record():
    """Sequences end and join all the time: a batch size seen for the first time takes the nearest
    one's measurements instead of paying drafting steps to warm up again."""
    costs = BatchCosts()
    _simulate(costs, 8, lambda width: 0.05 * width, drafted_tokens=2.0, steps=40)  # plain wins at 8
    assert costs.speculate(7) is False and costs.kinds[7].steps(True) == costs.kinds[8].steps(True)


def test_a_smaller_batch_drafts_where_the_measured_costs_predict_a_gain_though_a_larger_one_lost():
    """As the batch shrinks, drafting starts to pay: a pass over a few rows costs about what one
    row does. A size not tried yet does not inherit a larger one's verdict where the costs
    measured so far (target pass by width, drafter rounds, tokens per drafting step) predict that
    drafting wins there; the catch-up it would cost is weighed against what it would save."""
    curve = lambda width: 0.2 + 0.02 * width  # noqa: E731
    costs = BatchCosts()
    chosen = _simulate(costs, 8, curve, drafted_tokens=2.0, steps=40)
    assert sum(chosen[20:]) < 5  # at 8, 4 rows a sequence cost more than 2 tokens bring
    drafting, plain = costs.predict(8)
    assert drafting < plain and abs(plain - 8 / curve(8)) < 1e-6
    drafting, plain = costs.predict(1)
    assert abs(plain - 1 / curve(1)) < 1e-6 and abs(drafting - 2 / (curve(4) + 0.08)) < 1e-6  # 3 rounds of 8/300 s
    assert costs.speculate(7) is False  # predicted to lose there too: the nearest record stands
    # one more step like the others at 8, in which the drafters caught up on 1,000 tokens in 2 s
    costs.record(8, True, 16, 0.08 + 2.0, 24, curve(32), 32, caught_up=1000, catch_up_seconds=2.0, rounds=3)
    assert costs.speculate(2, lag=10_000, remaining=5) is False and costs.deferred == 1  # not worth its catch-up
    assert costs.speculate(1) is True and costs.kinds[1].steps(True) == 0  # its own record from here
    # its own steps decide from then on: here drafting does win at 1
    assert sum(_simulate(costs, 1, curve, drafted_tokens=2.0, steps=40)[20:]) > 15


def _catching_up(costs: BatchCosts, batch: int, pass_seconds, drafted_tokens: float, per_token: float,
                 steps: int = 200, prompt: int = 300) -> tuple[list[bool], float]:
    """As `_simulate`, but each sequence's drafter falls a token behind at every plain step and
    catches up (at `per_token` seconds a token) when it next drafts, and every 10 steps a sequence
    ends and a new one joins whose drafter has not seen its `prompt` tokens yet -> (decisions,
    catch-up seconds paid after the first drafting step)."""
    behind, chosen, paid = [prompt] * batch, [], []
    for step in range(steps):
        if step % 10 == 9:
            behind[step // 10 % batch] = prompt
        speculate = costs.speculate(batch, lag=sum(behind), remaining=1000)
        width = batch * (4 if speculate else 1)
        tokens = round(batch * (drafted_tokens if speculate else 1))
        caught_up = sum(behind) if speculate else 0
        catch_up = caught_up * per_token
        if speculate:
            paid.append(catch_up)
        costs.record(batch, speculate, tokens, (0.01 * batch + catch_up) if speculate else 0.0,
                     3 * batch if speculate else 0, pass_seconds(width), width, caught_up, catch_up)
        behind = [1] * batch if speculate else [b + 1 for b in behind]
        chosen.append(speculate)
    return chosen, sum(paid[1:])


def test_a_losing_probe_waits_until_its_drafters_catch_up_is_cheap_against_the_plain_time():
    """Plain steps win at 8, and new sequences keep joining. A probe of drafting makes every
    drafter catch up on the prompt or the plain tokens it has not seen: where that costs under a
    tenth of the plain time since the last drafting step, probes come as they would anyway; where
    it costs more (long new prompts), they wait, and what is paid stays under that tenth."""
    dear = lambda width: 0.05 * width  # noqa: E731
    for prompt, cheap_enough in [(50, True), (300, False)]:
        free, free_paid = _catching_up(BatchCosts(probe_share=float("inf")), 8, dear, 2.0, 0.002, prompt=prompt)
        costs = BatchCosts()
        gated, paid = _catching_up(costs, 8, dear, 2.0, 0.002, prompt=prompt)
        assert sum(free[1:]) > 0
        if cheap_enough:
            assert gated == free and costs.deferred == 0
        else:
            assert sum(gated[1:]) < sum(free[1:]) and costs.deferred > 0
            assert paid <= 0.1 * sum(dear(8) for drafted in gated if not drafted) and paid < free_paid
    # where drafting wins, catching up never stops it: the drafters' lag stays one token
    cheap, _ = _catching_up(BatchCosts(), 8, lambda width: 0.2 + 0.001 * width, 2.0, 0.002, prompt=300)
    assert sum(cheap[20:]) > 0.8 * len(cheap[20:])


def test_catching_up_is_charged_to_the_switch_not_to_the_drafting_rate():
    costs = BatchCosts()
    costs.record(4, True, 12, 1.0, 12, 0.5, 16, caught_up=400, catch_up_seconds=0.9)
    assert costs.kinds[4].rate(True) == 12 / 0.6
    assert costs.catch_up_seconds(100) == 100 * 0.9 / 400
    costs.record(4, False, 4, 0.0, 0, 0.2, 4)
    assert costs.plain_seconds == 0.2
    # drafting is the faster kind (20 tok/s against 20 tok/s plain... made faster): resuming pays
    # only when the tokens left can repay the catch-up
    costs.record(4, False, 4, 0.0, 0, 0.3, 4)
    assert costs.kinds[4].rate(True) > costs.kinds[4].rate(False)
    assert costs.speculate(4, lag=10, remaining=1000) is True
    assert costs.speculate(4, lag=10_000, remaining=10) is False and costs.deferred == 1


def _steady(joins: int, steps: int = 40) -> list[bool]:
    """Four in flight: drafting steps make 8 tokens in 0.4 s (20 tok/s), plain ones 4 in 0.236 s
    (17 tok/s); drafters catch up at 4 ms a token, and `joins` sequences joined drafting with a
    160-token context and 64 tokens to make -> the decisions of `steps` steps."""
    costs = BatchCosts()
    costs.record(4, True, 8, 0.1 + 1.6, 12, 0.3, 16, caught_up=400, catch_up_seconds=1.6, rounds=3)
    for _ in range(joins):
        costs.joined(160, 64)
    assert costs.prompt_charge() == (0.0 if joins == 0 else pytest.approx(0.004 * 160 / 64))
    chosen = []
    for _ in range(steps):
        draft = costs.speculate(4)
        if draft:
            costs.record(4, True, 8, 0.1, 12, 0.3, 16, rounds=3)
        else:
            costs.record(4, False, 4, 0.0, 0, 0.236, 4)
        chosen.append(draft)
    return chosen


def test_the_prompts_catch_up_is_charged_to_drafting_in_the_choice_of_kind():
    """Drafting steps beat plain ones by 1.18× on their own time, but every request that drafts
    first pays its drafter's catch-up on its prompt: 0.64 s over its 64 tokens, 10 ms a token,
    which leaves drafting at 16.7 tok/s against plain's 17. The batch then takes plain steps, but
    for the probes; with no prompt to charge (power check) the same steps keep drafting."""
    charged, free = _steady(joins=4), _steady(joins=0)
    assert sum(charged[10:]) < 0.2 * len(charged[10:])
    assert sum(free[10:]) > 0.8 * len(free[10:])


def test_the_engine_counts_each_new_drafters_first_catch_up_as_a_join():
    from specdec import Engine, Request

    target, drafter = tiny_model(0, exact_rows=True), tiny_model(1, layers=1, exact_rows=True)
    engine = Engine(target, max_batch=2)
    for prompt in ([1, 2, 3, 4, 5, 6], [4, 5, 6, 7, 8, 9]):
        engine.add(Request(prompt, drafter, max_new_tokens=8, eos_token_ids=[], schedule=CostAware))
    engine.step()  # first tokens, from the target alone
    assert engine.costs.prompt_charge() == 0.0
    engine.step()  # the first drafting step: both drafters feed their 7-token contexts
    joins = [7 * JOIN_DECAY + 7] * 2  # (context, tokens left) of each, the older decayed
    assert engine.costs._joins == pytest.approx(joins) and engine.costs.prompt_charge() > 0
    engine.step()
    assert engine.costs._joins == pytest.approx(joins)  # a drafter that has caught up once never joins again


def test_a_sequence_whose_catch_up_would_not_repay_itself_sits_out_while_the_batch_drafts():
    """Where drafting has been faster, a new sequence drafts only once its drafter's catch-up (its
    prompt) costs less than its drafting saves the batch over its own remaining tokens; a probe of
    drafting that has been losing is the batch's decision alone."""
    costs = BatchCosts()
    costs.record(4, True, 12, 1.0, 12, 0.5, 16, caught_up=400, catch_up_seconds=0.9)  # 20 tok/s drafting
    costs.record(4, False, 4, 0.0, 0, 0.4, 4)  # 10 tok/s plain
    # drafting, a sequence makes 3 tokens a drafting step of 0.6 s for 4 sequences, sitting out 1:
    # each of its tokens drafted saves the batch 2/3 of a quarter of such a step, 0.1 s
    assert costs.repays_catch_up(4, lag=0, remaining=1)
    assert costs.repays_catch_up(4, lag=100, remaining=10)  # 0.225 s of catch-up, 1 s saved
    assert costs.repays_catch_up(4, lag=500, remaining=15)  # 1.125 s against 1.5 s
    assert not costs.repays_catch_up(4, lag=500, remaining=10)  # 1.125 s against 1 s
    costs.record(4, False, 4, 0.0, 0, 0.01, 4)
    costs.record(4, False, 4, 0.0, 0, 0.01, 4)  # plain steps now the faster: a probe decides for all
    assert costs.kinds[4].rate(False) > costs.kinds[4].rate(True)
    assert costs.repays_catch_up(4, lag=500, remaining=10)


def test_a_long_prompt_joins_the_drafting_where_sitting_out_would_cost_the_batch_more():
    """Two in flight, drafting at 14 tok/s (3 tokens a sequence a step) against 10 tok/s plain; a
    709-token prompt joins with 64 tokens to make. Its drafter's catch-up, 2.8 s, is less than
    the 9.2 s of the batch's time its sitting out through drafting steps would waste; the batch's
    rates alone (64 tokens at 14 against 10 tok/s: 1.8 s) would keep it plain for all 64 tokens,
    as they did at 2 in flight in one bench run (22 s for that request against 14.5 s alone)."""
    costs = BatchCosts()
    for _ in range(10):
        costs.record(2, True, 6, 0.13, 6, 0.3, 8, rounds=3)  # 6 tokens in 0.43 s
        costs.record(2, False, 2, 0.0, 0, 0.2, 2)
    costs.record(2, True, 6, 0.13 + 3.9, 6, 0.3, 8, caught_up=1000, catch_up_seconds=3.9, rounds=3)
    assert costs.catch_up_seconds(709) > 2.7
    assert costs.repays_catch_up(2, lag=709, remaining=64)
    assert not costs.repays_catch_up(2, lag=709, remaining=8)  # near its end: not worth its catch-up


def test_a_step_of_first_tokens_only_decides_nothing():
    """The first token of each sequence comes from the target alone: such a step cannot draft,
    so it must not be timed as a drafting step (it would make drafting look as cheap as plain)."""
    from specdec import Engine, Request

    target, drafter = tiny_model(0, exact_rows=True), tiny_model(1, layers=1, exact_rows=True)
    engine = Engine(target, max_batch=2)
    for prompt in ([1, 2, 3], [4, 5]):
        engine.add(Request(prompt, drafter, max_new_tokens=8, eos_token_ids=[], schedule=CostAware))
    engine.step()
    assert engine.costs.kinds == {}
    engine.step()
    assert list(engine.costs.kinds) == [2] and engine.costs.kinds[2].steps(True) == 1


def test_batch_sizes_where_the_profile_says_no_draft_can_pay_decode_plainly_from_the_first_step():
    """Learning that drafting loses costs drafting steps; with the machine's batched pass costs
    (the int8 drafter: no draft pays at 16 sequences) there is no warm-up and no probe there,
    while a size where drafting may pay still learns from its steps, and keeps drafting where
    they show it faster whatever the acceptance then says."""
    dear = lambda width: 0.05 * width  # noqa: E731
    costs = BatchCosts(prior=LoadCosts(LOADED, ROUNDS))
    assert not any(_simulate(costs, 16, dear, drafted_tokens=2.0, steps=40)) and costs.ruled_out == 40
    assert sum(_simulate(BatchCosts(), 16, dear, drafted_tokens=2.0, steps=40)) >= 3  # power: unruled, it pays to learn
    cheap = lambda width: 0.2 + 0.001 * width  # noqa: E731
    chosen = _simulate(costs, 2, cheap, drafted_tokens=3.0, steps=40)
    assert chosen[:3] == [True] * 3 and sum(chosen[20:]) > 15
    costs.acceptance = lambda: 0.0  # as if the drafts now failed: no size can pay in the profile
    assert costs.speculate(2) is True and costs.speculate(4) is False


def test_the_longest_draft_in_a_batch_makes_the_most_tokens_a_second_for_it():
    """Drafter passes run in lock step, so in a batch a draft is capped where one more token a
    sequence would cost the batch more than it is worth: longer at a higher acceptance, none
    alone (a sequence alone pays only its own rounds)."""
    costs = BatchCosts(prior=LoadCosts(LOADED, ROUNDS))
    assert costs.longest_draft(1, 20) is None and BatchCosts().longest_draft(4, 20) is None  # nothing measured
    caps = {}
    for alpha in (0.6, 0.8, 0.95):
        costs.acceptance = lambda alpha=alpha: alpha
        caps[alpha] = costs.longest_draft(4, 20)
        # no other length makes more tokens a second at this acceptance, by the profile
        rate = {k: (1 - alpha ** (k + 1)) / (1 - alpha) /
                (costs.prior.pass_seconds(4, k + 1) + k * costs.prior.drafter_seconds(4)) for k in range(1, 21)}
        assert rate[caps[alpha]] == max(rate.values())
    assert caps[0.6] < caps[0.8] < caps[0.95] < 20
    assert costs.longest_draft(4, 2) <= 2
    # without a profile, from the steps' own fits once their widths have varied
    fitted = BatchCosts()
    _simulate(fitted, 4, lambda width: 0.2 + 0.02 * width, drafted_tokens=2.0, steps=12)
    fitted.acceptance = lambda: 0.8
    rows = {k: (1 - 0.8 ** (k + 1)) / 0.2 / (0.2 + 0.02 * 4 * (k + 1) + k * 0.01 * 4 / 3) for k in range(1, 21)}
    assert fitted.longest_draft(4, 20) == max(rows, key=rows.get)
    # the cap reaches the sequences' cost-aware policies, and only in steps that draft
    policy = CostAware(gamma_max=20)
    costs.steer(4, [(policy, True)])
    assert policy.most == caps[0.95] and policy.budget() <= caps[0.95]
    costs.steer(4, [(policy, False)])
    assert policy.most is None and policy.budget() == 0
    costs.steer(1, [(policy, True)])
    assert policy.most is None and policy.budget() == 20


def test_a_step_caps_each_policy_within_its_own_longest_draft_and_trees_by_depth():
    """The batch's draft rates are computed once a step; each sequence's cap is the best length
    within its own gamma (as `longest_draft` gives it alone), and a tree's depth is capped too."""
    costs = BatchCosts(prior=LoadCosts(LOADED, ROUNDS))
    costs.acceptance = lambda: 0.95
    long, short, tree, plain = CostAware(gamma_max=20), CostAware(gamma_max=2), TreeCost(max_depth=20), CostAware()
    costs.steer(4, [(long, True), (short, True), (tree, True), (plain, False)])
    assert long.most == costs.longest_draft(4, 20) and short.most == costs.longest_draft(4, 2) <= 2
    assert short.most < long.most < 20  # power: the two caps differ, and the long one binds
    assert tree.most == long.most and tree.budget() == long.most
    assert plain.most is None and plain.budget() == 0
    costs.steer(1, [(tree, True)])
    assert tree.budget() == 20  # alone: no cap


def test_the_catch_up_ahead_counts_in_the_profiles_best_case():
    """The profile's best case at 4 sequences (1.30× at acceptance 0.8) allows a warm-up; but
    where the drafters would first read 400 prompt tokens (at 7.5 ms a token) to make 256 tokens,
    that catch-up spread over them leaves under 1.1×: plain steps, unmeasured. With little to
    catch up (power check), the warm-up runs."""
    profile = LoadCosts(LOADED, ROUNDS, catch_up=0.0075)
    assert profile.may_pay(4, 0.8) and not profile.may_pay(4, 0.8, charge=400 * 0.0075 / 256)
    costs = BatchCosts(prior=profile)
    assert costs.speculate(4, lag=400, remaining=256) is False and costs.ruled_out == 1
    assert costs.speculate(4, lag=40, remaining=256) is True and costs.ruled_out == 1


def test_a_step_that_feeds_prompts_starts_drafting_only_on_a_wider_margin():
    """Steps whose pass feeds prompts are never timed, so nothing corrects drafting started there:
    the profile's best case must reach FEEDING_WORTH. At 4 sequences (1.29x at acceptance 0.8)
    a decode step warms up and a feeding step stays plain; at 2 (1.41x) both draft; where drafting
    has been the faster kind at 4, a feeding step drafts too."""
    profile = LoadCosts(LOADED, ROUNDS)
    assert WORTH <= profile.best_speedup(4, 0.8) < FEEDING_WORTH <= profile.best_speedup(2, 0.8)
    costs = BatchCosts(prior=profile)
    assert costs.speculate(4, feeding=True) is False and costs.ruled_out == 1
    assert costs.speculate(2, feeding=True) is True
    assert BatchCosts(prior=profile).speculate(4) is True
    won = BatchCosts(prior=profile)
    _simulate(won, 4, lambda width: 0.2 + 0.001 * width, drafted_tokens=2.5, steps=6)
    assert won._won(4) and won.speculate(4, feeding=True) is True


def test_a_low_acceptance_rules_out_a_batch_size_the_profile_allowed_at_the_prior():
    """Prompt lookup (no drafter rounds) could pay at 8 sequences at acceptance 0.8, not at what
    its drafting steps show (1.2 tokens a sequence for 3 drafted)."""
    costs = BatchCosts(prior=LoadCosts(LOADED))
    assert costs.acceptance() == 0.8 and costs.prior.may_pay(8, costs.acceptance())
    _simulate(costs, 5, lambda width: 0.2 + 0.001 * width, drafted_tokens=1.2, steps=3)
    measured = 1 - 1 / 1.2  # the bound from tokens a step beats 0.2 / 3 accepted
    drafted = 15 * (0.9 ** 2 + 0.9 + 1)  # three steps of 5 sequences drafting 3 each, decayed
    assert abs(costs.acceptance() - (measured * drafted + 0.8 * 16) / (drafted + 16)) < 1e-9
    before = costs.ruled_out
    assert costs.speculate(8) is False and costs.ruled_out == before + 1


def test_before_its_own_catch_up_is_timed_a_warm_up_weighs_the_profiles_against_what_it_could_save():
    """At the tail of a run under load, a few sequences with long contexts and a few tokens left:
    drafting there has never been timed, so without a profile they would all catch their drafters
    up (seconds) to draft a handful of tokens. The profile's catch-up price and best case say to
    wait; with many tokens left the same catch-up pays and the warm-up drafts."""
    profile = LoadCosts(LOADED, ROUNDS, catch_up=0.0025)
    costs = BatchCosts(prior=profile)
    assert costs.catch_up_seconds(1644) == 1644 * 0.0025
    # waits: put off for its catch-up, or ruled out by the profile with that catch-up spread over 50 tokens
    assert costs.speculate(5, lag=1644, remaining=50) is False and costs.deferred + costs.ruled_out == 1
    assert costs.repays_catch_up(5, lag=330, remaining=10) is False
    assert costs.speculate(5, lag=1644, remaining=5 * 1000) is True
    assert costs.repays_catch_up(5, lag=330, remaining=1000) is True
    assert BatchCosts().speculate(5, lag=1644, remaining=50) is True  # power: no profile, no price


def test_a_probe_near_the_end_waits_where_no_draft_could_repay_its_catch_up():
    """A probe of drafting that has been losing may spend a tenth of the plain time on catching
    its drafters up; but with few tokens left even the profile's best case cannot repay that, so
    at a run's tail (a 16-in-flight run down to 6 sequences once paid 0.9 s of catch-up for 9
    tokens) it waits. Without a profile nothing bounds the saving, and the probe comes."""
    dear = lambda width: 0.05 * width  # noqa: E731
    probes = {}
    for prior in (None, LoadCosts(LOADED, ROUNDS)):
        costs = BatchCosts(prior=prior)
        for _ in range(3):  # drafting measured, and slower than plain steps
            costs.record(1, True, 2, 0.11, 3, dear(4), 4, caught_up=50, catch_up_seconds=0.1, rounds=3)
        drafted = 0
        for _ in range(60):
            draft = costs.speculate(1, lag=50, remaining=1)
            drafted += draft
            costs.record(1, draft, 2 if draft else 1, 0.11 if draft else 0.0, 3 if draft else 0,
                         dear(4 if draft else 1), 4 if draft else 1, caught_up=50 if draft else 0,
                         catch_up_seconds=0.1 if draft else 0.0, rounds=3 if draft else 0)
        probes[prior is None] = drafted
    assert probes[True] > 0 and probes[False] == 0


def test_a_warm_up_at_a_shrunken_batch_waits_where_the_tokens_left_cannot_repay_its_catch_up():
    """Seeded T = 0.8 at 8 in flight: once the batch was down to 6 sequences with ~180 tokens left
    among them, three warm-up drafting steps made the drafters catch up on ~470 tokens (1.85 s)
    and saved nothing. A plain step makes 6 tokens a pass, so the best case saves ~0.6 s there."""
    costs = BatchCosts(prior=LoadCosts(LOADED, ROUNDS, catch_up=0.0039))
    _simulate(costs, 8, lambda width: 0.23 + 0.02 * (width - 8), drafted_tokens=2.0, steps=100)  # ruled out: 23 s plain
    assert costs.prior.may_pay(6, costs.acceptance())  # the profile alone would let 6 try
    waited = costs.deferred + costs.ruled_out
    assert costs.speculate(6, lag=470, remaining=180) is False and costs.deferred + costs.ruled_out == waited + 1
    # long outputs left: the catch-up pays (spread over them, it leaves the profile's best case, 1.105×
    # at 6 sequences, above the 10% margin)
    assert costs.speculate(6, lag=470, remaining=100_000) is True
