"""Pass-cost profiles (sizing/pass_costs.py): the bound on what a draft can gain, its cache, and a cost
schedule that drafts nothing where drafting cannot pay."""

import json

import pytest

from specdec import autoregressive_generate, speculative_generate
from specdec.sizing import pass_costs as passcost
from specdec.sizing.pass_costs import LoadCosts, PassCosts, load_costs, pass_costs
from specdec.sizing.schedules import CostAware

from conftest import TableModel, cpu_only, steady_batch_timings, tiny_model

# seconds by width measured on the 2-core AVX512-BF16 EPYC (docs/kernels.md)
GGUF = {1: 0.0326, 2: 0.0567, 3: 0.0746, 4: 0.109, 6: 0.158, 8: 0.218}
BF16 = {1: 0.174, 2: 0.171}
# batched passes on the same CPU (passcost.batch_pass_seconds, 2026-11-27): the bf16 1.5B target
# over (sequences, rows each), and its int8 0.5B drafter's one-row rounds by sequences
LOADED = {(1, 1): 0.1648, (1, 2): 0.1652, (1, 4): 0.1915, (2, 1): 0.1632, (2, 2): 0.1805, (2, 4): 0.2137,
          (4, 1): 0.1939, (4, 2): 0.2210, (4, 4): 0.2790, (8, 1): 0.2199, (8, 2): 0.2878, (8, 4): 0.4185,
          (16, 1): 0.2905, (16, 2): 0.4717}
ROUNDS = {1: 0.0375, 2: 0.0423, 4: 0.0543, 8: 0.1107, 16: 0.1291}


def test_the_best_case_bound_and_the_margin():
    # llama.cpp target with its 0.5B GGUF drafter: a 2-token draft, 3·32.6 / (74.6 + 2·18.7) = 0.87, is the best
    gguf = PassCosts(GGUF, 0.0187)
    assert gguf.best_speedup() == pytest.approx(3 * 0.0326 / (0.0746 + 2 * 0.0187))
    assert gguf.never_pays()
    # the same target with a free drafter (prompt lookup): 3·32.6 / 74.6 = 1.31, worth drafting
    assert PassCosts(GGUF, 0.0).best_speedup() == pytest.approx(3 * 0.0326 / 0.0746)
    assert not PassCosts(GGUF, 0.0).never_pays()
    # bf16 on the same CPU: a 2-token pass costs less than a 1-token one
    assert PassCosts(BF16, 0.0368).best_speedup() > 1.5 and not PassCosts(BF16, 0.0368).never_pays()
    # a jump at 2 tokens, flat after it: the bound takes the best width, not the first
    assert not PassCosts({1: 1.0, 2: 1.9, 8: 2.0}, 0.1).never_pays()
    # exactly k passes for k tokens: no draft pays, whatever the drafter
    assert PassCosts({k: float(k) for k in (1, 2, 4, 8)}, 0.0).never_pays()
    assert PassCosts(GGUF, 0.0187).to_dict()["never_pays"] is True


def _measuring(said: list):
    """A `say` that keeps the lines announcing a measurement (not each measured size's)."""
    return lambda message: said.append(message) if message.startswith("measuring") else None


def test_profiles_are_measured_once_and_cached_per_pair(tmp_path, monkeypatch):
    monkeypatch.setattr(passcost.registry, "home", lambda: tmp_path)
    target, drafter = tiny_model(0, vocab=32), tiny_model(1, vocab=32, layers=1, name="tiny-drafter")
    said = []
    first = pass_costs(target, drafter, say=_measuring(said))
    assert len(said) == 1 and set(first.target) >= {1, 2} and first.drafter > 0
    again = pass_costs(target, drafter, say=_measuring(said))
    assert len(said) == 1 and again == first  # read back, not measured
    free = pass_costs(target, None, say=_measuring(said))  # another pair: measured on its own
    assert len(said) == 2 and free.drafter == 0
    data = json.loads((tmp_path / "pass-costs.json").read_text())
    assert len(data) == 2
    # a damaged entry or file is measured again, never trusted
    key = next(k for k in data if k.endswith("model-free"))
    data[key]["seconds"]["target"] = {"1": -1.0}
    (tmp_path / "pass-costs.json").write_text(json.dumps(data))
    pass_costs(target, None, say=_measuring(said))
    assert len(said) == 3
    (tmp_path / "pass-costs.json").write_text("{not json")
    pass_costs(target, drafter, say=_measuring(said))
    assert len(said) == 4


@cpu_only  # the kernels' build keys the costs of CPU models alone
def test_another_build_of_our_kernels_measures_its_profiles_anew(tmp_path, monkeypatch):
    """Costs measured with one build of the kernels (sources, flags, compiler, CPU) are not read
    back for another: a faster kernel would be scheduled with its predecessor's costs."""
    from specdec.backends import native

    monkeypatch.setattr(passcost.registry, "home", lambda: tmp_path)
    target = tiny_model(0, vocab=32)
    said = []
    monkeypatch.setattr(native, "build_stamp", lambda: "one")
    pass_costs(target, None, say=_measuring(said))
    pass_costs(target, None, say=_measuring(said))
    assert len(said) == 1
    monkeypatch.setattr(native, "build_stamp", lambda: "another")
    pass_costs(target, None, say=_measuring(said))
    assert len(said) == 2


def test_a_cost_schedule_told_that_drafting_cannot_pay_drafts_nothing():
    target, drafter = TableModel(6, 0), TableModel(6, 1)

    class Counting(TableModel):
        passes = 0

        def forward(self, *args, **kwargs):
            Counting.passes += 1
            return super().forward(*args, **kwargs)

    counted = Counting(6, 1)
    ar = autoregressive_generate([1, 2], target, max_new_tokens=20, eos_token_ids=[])
    never = CostAware(20, pass_costs=PassCosts(GGUF, 0.0187))
    assert "drafts nothing" in never.describe()
    sd = speculative_generate([1, 2], target, counted, schedule=never, max_new_tokens=20, eos_token_ids=[])
    assert sd.tokens == ar.tokens
    assert sd.stats.drafted == 0 and Counting.passes == 0  # not even the drafter's prompt pass
    worth = CostAware(20, pass_costs=PassCosts(BF16, 0.0368))
    sd = speculative_generate([1, 2], target, drafter, schedule=worth, max_new_tokens=20, eos_token_ids=[])
    assert sd.tokens == ar.tokens and sd.stats.drafted > 0


def test_a_model_free_drafters_threshold_starts_at_the_profiles_price_of_a_row():
    """Suffix drafting drafts now and then, so its widths may never vary enough to measure the
    slope: the cost rule starts from the profile's (t(2) - t(1)) / t(1), not the 0.5 guess; a
    model drafter's start is unchanged (its widths vary from the first steps)."""
    free = CostAware(20, pass_costs=PassCosts(GGUF, 0.0))
    assert free.threshold == pytest.approx((0.0567 - 0.0326) / 0.0326)
    assert not free.keep_going(0, 0.7) and free.keep_going(0, 0.8)
    assert CostAware(20, pass_costs=PassCosts(GGUF, 0.0187)).threshold == 0.5
    assert CostAware(20).threshold == 0.5


def test_the_batched_profile_rules_out_the_batch_sizes_where_no_draft_can_pay():
    """Under load a pass over more rows is no longer free: with the int8 drafter, at 8 and 16
    sequences no draft pays even at acceptance 0.8, at 1-4 one does; without a drafter's rounds
    the bar is lower, and at a low acceptance it is not met either."""
    profile = LoadCosts(LOADED, ROUNDS)
    assert [profile.may_pay(b, 0.8) for b in (1, 2, 4, 8, 16)] == [True, True, True, False, False]
    four = (1 - 0.8 ** 4) / 0.2 * 0.2199 / (0.4185 + 3 * 0.1107)
    assert profile.best_speedup(8, 0.8) == pytest.approx(max(1.8 * 0.2199 / (0.2878 + 0.1107), four))
    free = LoadCosts(LOADED)
    assert free.drafter_seconds(8) == 0 and free.may_pay(8, 0.8) and not free.may_pay(8, 0.2)
    # between the batch sizes measured, a line; past the largest, the line through the last two
    assert profile.target_seconds(3, 1) == pytest.approx((0.1632 + 0.1939) / 2)
    assert profile.target_seconds(32, 1) == pytest.approx(0.2905 + 2 * (0.2905 - 0.2199))
    assert profile.target_seconds(16, 4) == pytest.approx(0.4185 + 2 * (0.4185 - 0.2790))  # 16 x 4 not measured
    assert profile.drafter_seconds(12) == pytest.approx((0.1107 + 0.1291) / 2)
    # over the rows a sequence as well: 3 rows between 2 and 4, 6 past the most measured
    assert profile.pass_seconds(4, 3) == pytest.approx((0.2210 + 0.2790) / 2)
    assert profile.pass_seconds(4, 6) == pytest.approx(0.2790 + 2 * (0.2790 - 0.2210) / 2)


def test_the_batched_profile_is_measured_once_per_model_and_cached(tmp_path, monkeypatch):
    monkeypatch.setattr(passcost.registry, "home", lambda: tmp_path)
    monkeypatch.setattr(passcost, "batch_pass_seconds", steady_batch_timings())
    target, drafter = tiny_model(0, vocab=32, exact_rows=True), tiny_model(1, vocab=32, layers=1, name="tiny-drafter",
                                                                           exact_rows=True)
    said = []
    first = load_costs(target, drafter, say=_measuring(said))
    assert len(said) == 3  # the target's passes, the drafter's rounds, its catch-up pass
    assert first.catch_up > 0
    assert set(first.target) == {(b, r) for b in passcost.LOAD_BATCHES for r in passcost.LOAD_ROWS}
    assert set(first.drafter) == set(passcost.LOAD_BATCHES) and all(t > 0 for t in first.drafter.values())
    assert load_costs(target, drafter, say=_measuring(said)) == first and len(said) == 3  # read back
    free = load_costs(target, None, say=_measuring(said))
    assert len(said) == 3 and free.target == first.target and free.drafter == {} and free.catch_up == 0
    assert load_costs(TableModel(8, 0), None) is None  # one sequence a pass: no profile


def test_a_model_that_holds_few_sequences_is_profiled_at_the_batches_it_holds(tmp_path, monkeypatch):
    """llama.cpp's model holds a fixed number of sequences (the server's max batch): the profile
    measures the batch sizes it can hold, and extrapolates past them."""
    import dataclasses

    monkeypatch.setattr(passcost.registry, "home", lambda: tmp_path)
    target = tiny_model(0, vocab=32, exact_rows=True)
    held = dataclasses.replace(target.features(), sequences=2)
    monkeypatch.setattr(target, "features", lambda: held)
    profile = load_costs(target, None)
    assert {b for b, _ in profile.target} == {1, 2} and profile.target_seconds(16, 1) > 0


def test_a_batched_profile_yields_between_sizes_and_goes_on_where_it_stopped(tmp_path, monkeypatch):
    """A server measures its batched profile between requests: asked to stop, it stops between two
    sizes (`Interrupted`, nothing cached), and the next call measures only the sizes left."""
    monkeypatch.setattr(passcost.registry, "home", lambda: tmp_path)
    target = tiny_model(0, vocab=32, exact_rows=True)
    timed = []
    monkeypatch.setattr(passcost, "batch_pass_seconds", steady_batch_timings(timed))
    with pytest.raises(passcost.Interrupted):
        load_costs(target, None, should_stop=lambda: len(timed) >= 4)
    assert len(timed) == 4 and not (tmp_path / "pass-costs.json").exists()
    profile = load_costs(target, None, should_stop=lambda: False)
    sizes = {(b, r) for b in passcost.LOAD_BATCHES for r in passcost.LOAD_ROWS}
    assert len(timed) == len(sizes) and set(timed) == sizes  # each size timed once in all
    assert set(profile.target) == sizes


def _timings(first: dict, then: dict):
    """A stand-in for `batch_pass_seconds`: each size's first timing from `first` (where given),
    later ones from `then`; the sizes timed, in order, in `.timed`."""
    def time_it(model, b, r, **kw):
        seen = (b, r) in time_it.timed
        time_it.timed.append((b, r))
        return then[(b, r)] if seen or (b, r) not in first else first[(b, r)]
    time_it.timed = []
    return time_it


def test_a_batched_profile_where_more_work_timed_faster_is_timed_again(tmp_path, monkeypatch):
    """Another process held the cores while 16 sequences x 1 row were timed (as when a server took
    its costs beside another server's start): 16 x 2 then timed faster than 16 x 1, and drafting
    looked free at 16 in flight. Those sizes are timed again and the faster timing kept."""
    monkeypatch.setattr(passcost.registry, "home", lambda: tmp_path)
    true = {**LOADED, (16, 4): 0.70}
    time_it = _timings({(16, 1): 0.66}, true)
    monkeypatch.setattr(passcost, "batch_pass_seconds", time_it)
    said = []
    profile = load_costs(tiny_model(0, vocab=32, exact_rows=True), None, say=said.append)
    assert time_it.timed.count((16, 1)) == 2 and time_it.timed.count((1, 1)) == 1  # only the pair that disagreed
    assert time_it.timed.count((16, 2)) == 2 and any("timed again" in line for line in said)
    assert profile.target[(16, 1)] == true[(16, 1)]
    assert profile.target_seconds(16, 2) > profile.target_seconds(16, 1)
    assert not LoadCosts(profile.target).may_pay(16, 0.5)  # what the contended timing had said it would


def test_disagreement_left_after_retiming_is_not_cached_nor_read_as_free_rows_and_a_doubtful_cache_is_retimed(
        tmp_path, monkeypatch):
    """Where timing again does not settle it (the cores stay busy), the profile is used for this
    run only, drafting ruled out at the batch sizes that disagreed; and a profile cached before
    this rule, where one disagrees, is timed anew."""
    monkeypatch.setattr(passcost.registry, "home", lambda: tmp_path)
    busy = {**LOADED, (16, 4): 0.70, (16, 1): 0.66}
    time_it = _timings({}, busy)
    monkeypatch.setattr(passcost, "batch_pass_seconds", time_it)
    target = tiny_model(0, vocab=32, exact_rows=True)
    said = []
    profile = load_costs(target, None, say=said.append)
    assert time_it.timed.count((16, 1)) == 1 + passcost.RETIMES and any("not cached" in line for line in said)
    assert not passcost.cache_path().exists()
    assert not LoadCosts(profile.target).may_pay(16, 0.85)  # the busy timing alone would say it pays
    assert not LoadCosts({k: busy[k] for k in profile.target}).best_speedup(16, 0.85) < passcost.WORTH
    assert profile.target[(8, 2)] == LOADED[(8, 2)]  # the sizes that agreed are as timed
    monkeypatch.setattr(passcost, "batch_pass_seconds", _timings({}, LOADED | {(16, 4): 0.70}))
    settled = load_costs(target, None)
    assert settled.target[(16, 1)] == LOADED[(16, 1)] and passcost.cache_path().exists()
    cache = json.loads(passcost.cache_path().read_text())
    key = next(k for k in cache if "batched rows" in k)
    cache[key]["seconds"]["16,1"] = 0.66  # as cached before this rule: 16 x 2 faster than 16 x 1
    passcost.cache_path().write_text(json.dumps(cache))
    again = _timings({}, LOADED | {(16, 4): 0.70})
    monkeypatch.setattr(passcost, "batch_pass_seconds", again)
    assert load_costs(target, None).target[(16, 1)] == LOADED[(16, 1)] and again.timed
