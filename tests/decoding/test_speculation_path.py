"""One speculation from the request to the verifier: the `Speculation` a caller builds (or
`Speculation.of`) travels whole through `speculative_generate`, the engine's `Request` and the
server to the sequence that drafts with it; the server turns a request's `speculative` block into
one `SpecConfig` (a `replace()` on its default) and builds it once a request."""

import pytest

from specdec import Engine, Request, Sampler, SpecdecError, speculative_generate
from specdec.core.penalties import LogitRules
from specdec.core.verify import Typical
from specdec.decoding import loop, sequence
from specdec.decoding.config import SpecConfig, check_runs_trees, runs_trees
from specdec.decoding.sequence import Decoding, Limits
from specdec.decoding.speculation import Parts, Speculation, build, preset
from specdec.drafters import LookupDrafter, make_tree_drafter
from specdec.engine import engine as engine_module
from specdec.server import service as service_module
from specdec.server.schema import BadRequest, parse_job
from specdec.server.service import Service
from specdec.sizing.schedules import Fixed

from conftest import tiny_model

PROMPT = [3, 7, 9, 3, 7, 9, 3, 7]


@pytest.fixture(scope="module")
def pair():
    return (tiny_model(0, vocab=32, exact_rows=True, name="tiny-target"),
            tiny_model(1, vocab=32, layers=1, exact_rows=True, name="tiny-drafter", role="drafter"))


class _Recorded(Decoding):
    """A Decoding that records every construction and the speculation it was given."""

    made: list = []

    def __init__(self, prompt_ids, target, speculation=None, *args, **options):
        _Recorded.made.append(speculation)
        super().__init__(prompt_ids, target, speculation, *args, **options)


@pytest.fixture
def recorded(monkeypatch):
    _Recorded.made = []
    monkeypatch.setattr(loop, "Decoding", _Recorded)
    monkeypatch.setattr(engine_module, "Decoding", _Recorded)
    return _Recorded.made


def test_speculative_generate_hands_the_speculation_to_the_sequence_unchanged(pair, recorded):
    target, drafter = pair
    speculation = build(SpecConfig("chain", schedule="fixed", gamma=3, seed_rule="stream"), Parts(target, drafter))
    result = speculative_generate(PROMPT, target, speculation, max_new_tokens=8, eos_token_ids=[])
    assert recorded == [speculation] and recorded[0] is speculation
    # the bare-drafter spelling is the same speculation, made at the one entry, and the same output
    again = speculative_generate(PROMPT, target, drafter, gamma=3, seed_rule="stream", max_new_tokens=8,
                                 eos_token_ids=[])
    assert recorded[1] == Speculation.of(drafter, gamma=3, seed_rule="stream") and again.tokens == result.tokens
    with pytest.raises(SpecdecError, match="carries its own gamma"):
        speculative_generate(PROMPT, target, speculation, gamma=4)


def test_the_sequence_takes_its_acceptance_options_from_the_speculation(pair):
    target, drafter = pair
    typical = Typical(0.1, 0.2)
    speculation = Speculation.of(drafter, gamma=2, typical=typical, seed_rule="stream")
    decoding = Decoding(PROMPT, target, speculation, Sampler(0.8), Limits(4, []), seed=1)
    assert decoding.speculation is speculation
    assert (decoding.typical, decoding.lenience, decoding.seed_rule) == (typical, 1.0, "stream")
    assert isinstance(decoding.schedule, Fixed) and decoding.schedule.gamma == 2
    built = build(SpecConfig("chain", schedule="fixed", acceptance="lenient", lenience=0.5), Parts(target, drafter))
    assert (built.lenience, built.typical, built.seed_rule) == (0.5, None, "coupled")
    assert Decoding(PROMPT, target, built).lenience == 0.5


@pytest.mark.parametrize("options", [dict(lenience=0.5), dict(seed_rule="stream"), dict(typical=Typical())])
def test_a_seeded_output_is_the_same_whether_the_options_come_loose_or_in_the_speculation(pair, options):
    target, drafter = pair
    sampler = Sampler(0.9)
    for seed in range(4):
        loose = speculative_generate(PROMPT, target, drafter, sampler=sampler, max_new_tokens=10, eos_token_ids=[],
                                     seed=seed, gamma=3, **options)
        whole = speculative_generate(PROMPT, target, Speculation.of(drafter, gamma=3, **options), sampler=sampler,
                                     max_new_tokens=10, eos_token_ids=[], seed=seed)
        assert whole.tokens == loose.tokens


@pytest.mark.parametrize("options,message", [
    (dict(gamma=0), "gamma"), (dict(gamma=True), "gamma"), (dict(lenience=0), "lenience must be in"),
    (dict(lenience=1.5), "lenience must be in"), (dict(typical=0.1), "typical must be a verify.Typical"),
    (dict(typical=Typical(), lenience=0.5), "not both"), (dict(seed_rule="loose"), "seed_rule must be one of"),
])
def test_speculation_of_checks_its_options_once_in_one_line(pair, options, message):
    with pytest.raises(SpecdecError, match=message) as caught:
        Speculation.of(pair[1], **options)
    assert "\n" not in str(caught.value)


def test_a_request_in_the_older_keywords_equals_its_new_form(pair):
    target, drafter = pair
    older = Request(PROMPT, LookupDrafter, max_new_tokens=5, eos_token_ids=[], gamma=3, seed_rule="stream", seed=2)
    newer = Request(PROMPT, Speculation.of(LookupDrafter, gamma=3, seed_rule="stream"), limits=Limits(5, []), seed=2)
    assert older == newer and older.speculation == newer.speculation and older.limits == Limits(5, [])
    make = lambda: Fixed(4)  # noqa: E731
    assert Request(PROMPT, drafter, Sampler(0.5), schedule=make) == \
        Request(PROMPT, Speculation.of(drafter, schedule=make), Sampler(0.5))
    assert Request(PROMPT) == Request(PROMPT, Speculation.of(), limits=Limits())
    assert Request(PROMPT, drafter) != Request(PROMPT, drafter, gamma=2)
    with pytest.raises(SpecdecError, match="carries its own gamma"):
        Request(PROMPT, Speculation.of(drafter), gamma=3)
    with pytest.raises(SpecdecError, match="not both"):
        Request(PROMPT, limits=Limits(4), max_new_tokens=5)


def test_the_engine_makes_each_sequence_once_on_admission_with_the_requests_speculation(pair, recorded):
    target, drafter = pair
    speculation = build(SpecConfig("chain", schedule="fixed", gamma=2), Parts(target, drafter))
    engine = Engine(target, max_batch=2, kv_memory=10**9)
    ids = [engine.add(Request(PROMPT[:4 + i], speculation, limits=Limits(6, []))) for i in range(3)]
    assert recorded == []  # added: checked, no sequence made
    results = engine.run()
    assert sorted(results) == ids and len(recorded) == 3
    assert all(made is speculation for made in recorded)
    alone = [speculative_generate(PROMPT[:4 + i], target, speculation, max_new_tokens=6, eos_token_ids=[])
             for i in range(3)]
    assert [results[i].tokens for i in ids] == [r.tokens for r in alone]


def test_what_add_can_check_without_a_sequence_it_still_refuses_in_one_line(pair, recorded):
    target, drafter = pair
    engine = Engine(target, kv_memory=10**9)
    for request, message in [(Request([]), "empty prompt"), (Request([99]), "outside the vocabulary"),
                             (Request([1, 2], LookupDrafter()), "holds one sequence's state"),
                             (Request([1], max_new_tokens=0), "max_new_tokens must be"),
                             (Request([1], lambda: make_tree_drafter("lookup", max_nodes=sequence.DRAFT_ROOM + 1)),
                              "tree nodes")]:
        with pytest.raises(SpecdecError, match=message):
            engine.add(request)
    # what its sequence would refuse is refused when it is added, with or without bounds to check
    trees = lambda: make_tree_drafter("lookup")  # noqa: E731
    for engine in (Engine(target, max_batch=1), Engine(target, kv_memory=10**9)):
        for request, message in [
                (Request([1, 2], Speculation.of(trees, lenience=0.5)), "lenience < 1 applies to chain drafts only"),
                (Request([1, 2], trees, rules=LogitRules(presence=1.0)), "apply to chain drafts only"),
                (Request([1, 2], trees, grammar="json"), "a grammar constrains chain drafts only"),
                (Request([1], logprobs=-1), "logprobs must be"),
                (Request([1], rules="no"), "rules must be"),
                (Request([1, 2], drafter, schedule=Fixed(3)), "a schedule object holds one sequence's state")]:
            with pytest.raises(SpecdecError, match=message):
                engine.add(request)
        assert not engine.waiting
    with pytest.raises(SpecdecError, match="whole budget"):
        Engine(target, kv_memory=1000).add(Request([1, 2], drafter, max_new_tokens=8))
    assert recorded == [] and not engine.waiting


def test_the_server_parses_a_speculative_block_as_a_change_to_its_default_config(pair):
    target, drafter = pair
    service = Service(target, drafter, default=SpecConfig(gamma_max=12, tree_nodes=32), default_method="default")
    job = parse_job({"prompt": [1, 2], "speculative": {"method": "lookup", "gamma": 3}}, False, target.name,
                    service.default, service.default_method)
    assert job.method == "lookup"
    assert job.speculation == preset("lookup").replace(gamma_max=12, tree_nodes=32, gamma=3, schedule="fixed")
    plain = parse_job({"prompt": [1]}, False, target.name, service.default, service.default_method)
    assert plain.speculation is service.default and plain.method == "default"
    tree = parse_job({"prompt": [1], "speculative": {"method": "tree", "tree_nodes": 8}}, False, target.name,
                     service.default, service.default_method)
    assert tree.speculation == preset("tree").replace(gamma_max=12, tree_nodes=8)
    with pytest.raises(BadRequest, match="gamma_min") as caught:  # validated where it is made
        parse_job({"prompt": [1], "speculative": {"gamma_max": 1}}, False, target.name, SpecConfig(gamma_min=2))
    assert caught.value.param == "speculative"


def test_the_server_builds_a_requests_speculation_once_for_all_its_prompts_and_choices(pair, monkeypatch):
    target, drafter = pair
    builds = []
    monkeypatch.setattr(service_module, "build", lambda config, parts: builds.append(config) or build(config, parts))
    service = Service(target, drafter)
    job = parse_job({"prompt": [[1, 2], [3, 4]], "n": 3, "speculative": {"method": "sd", "gamma": 2}}, False,
                    target.name, service.default, service.default_method)
    requests = [r for ids in ([1, 2], [3, 4]) for r in service.requests(job, ids, 4)]
    assert len(requests) == 6 and builds == [job.speculation]
    assert all(r.speculation is requests[0].speculation for r in requests)
    assert requests[0].speculation.config is job.speculation and job.speculation.gamma == 2


def test_one_rule_says_which_backends_score_trees(pair, monkeypatch):
    target, drafter = pair
    assert runs_trees(target)
    monkeypatch.setattr(target, "tree_masks", False, raising=False)  # as llama.cpp's backend
    assert not runs_trees(target)
    with pytest.raises(SpecdecError, match="token trees are not supported") as direct:
        check_runs_trees(target)
    with pytest.raises(SpecdecError) as through_config:
        SpecConfig("tree", tree="sides").validate(target)
    with pytest.raises(SpecdecError) as through_sequence:
        speculative_generate(PROMPT, target, make_tree_drafter("lookup"), max_new_tokens=2)
    assert str(direct.value) == str(through_config.value) == str(through_sequence.value)


def test_serve_with_plain_decoding_keeps_its_sizing_flags_for_requests_that_ask_for_a_method(monkeypatch):
    """`serve --method ar --gamma-max 8 --tree-nodes 16`: a request's own method is sized by them."""
    from typer.testing import CliRunner

    from specdec.cli import app
    from specdec.models import loading

    made = {}

    class Stop(Exception):
        pass

    def capture(*args, default=None, **kwargs):
        made["default"] = default
        raise Stop

    monkeypatch.setattr(loading, "load", lambda *a, **k: tiny_model(0))
    monkeypatch.setattr(service_module, "Service", capture)
    result = CliRunner().invoke(app, ["serve", "--target", "tiny", "--method", "ar", "--gamma-max", "8",
                                      "--tree-nodes", "16"])
    assert "default" in made, result.output  # the server was made (then stopped: no need to serve)
    assert made["default"].method == "ar"
    assert (made["default"].gamma_max, made["default"].tree_nodes) == (8, 16)
