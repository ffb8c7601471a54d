"""The engine's parts, each alone: the scheduler (admission order, the KV budget, prompt chunks)
without a pass, the `StepOutput` a step hands out (emitted, finished, failed: each once), a step
that fails outside every request's guard, the server's worker driving nothing but the engine's
public face, and the engine reading a sequence one hop deep."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from specdec import Engine, Request, autoregressive_generate
from specdec.backends.prompts import PREFILL_TOKENS
from specdec.decoding import sequence
from specdec.drafters import LookupDrafter
from specdec.engine import StepFailed, StepOutput
from specdec.engine.runner import Runner
from specdec.engine.scheduler import Scheduler, kv_need

from conftest import tiny_model

ENGINE = Path(__file__).resolve().parents[2] / "src" / "specdec" / "engine"


@pytest.fixture(scope="module")
def target():
    return tiny_model(0, vocab=32, exact_rows=True)


class _Cache:
    def __init__(self):
        self.length = 0

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, count: int) -> None:  # transformers' convention: minus the positions dropped
        self.length += count


class _Sequence:
    """What the scheduler reads of a `Decoding`, with no model behind it: its prompt is fed a
    chunk (`PREFILL_CHUNK`) a call, up to its last token (which its first pass scores)."""

    drafter_passes, caught_up, steerable, drafts_next, drafter_model = 0, None, None, False, None
    shares_prefill = False

    def __init__(self, request, target):
        self.sequence, self.target, self.remaining = list(request.prompt_ids), target, request.max_new_tokens
        self.cache = None

    def charged_positions(self) -> int:
        return len(self.sequence) + self.remaining

    def begin(self) -> None:
        self.cache = _Cache()

    @property
    def prefill_chunk(self) -> list[int]:
        return self.sequence[:min(len(self.sequence) - 1, self.cache.length + sequence.PREFILL_CHUNK) + 1]

    def prefill_step(self) -> bool:
        self.fed_from = self.cache.length  # where its own feed began (a rolled-back cache: where it was)
        self.cache.length = min(len(self.sequence) - 1, self.cache.length + sequence.PREFILL_CHUNK)
        return self.cache.length >= len(self.sequence) - 1

    def lag(self):
        return None

    def free(self) -> None:
        self.cache = None


def _scheduler(target, max_batch=8, kv_memory=None, fails=()):
    def make(request):
        if request.id in fails:
            raise RuntimeError("this request's own fault")
        return _Sequence(request, target)
    return Scheduler(target, max_batch, kv_memory, None, make)


def test_the_scheduler_admits_in_order_up_to_max_batch_and_a_request_that_fails_to_start_ends_alone(target):
    scheduler = _scheduler(target, max_batch=2, fails={1})
    for i in range(4):
        scheduler.waiting.append(SimpleNamespace(id=i, prompt_ids=[1, 2, 3], max_new_tokens=4))
    out = StepOutput()
    plan = scheduler.schedule(out)
    # 1 fails while starting: it leaves the queue, ends alone, and 2 takes its place
    assert out.started == [0, 1, 2] and list(out.failed) == [1] and "own fault" in str(out.failed[1])
    assert plan.ids == [0, 2] and [r.id for r in scheduler.waiting] == [3]
    out = StepOutput()
    assert scheduler.schedule(out).ids == [0, 2] and out.started == []  # the batch is full: 3 waits
    scheduler.settle(StepOutput(finished={0: None}))
    out = StepOutput()
    assert scheduler.schedule(out).ids == [2, 3] and out.started == [3] and not scheduler.waiting


class _SharedTarget:
    """A target whose shared prompt passes are counted, and fail when told to."""

    def __init__(self, fails: bool = False):
        self.calls, self.fails = [], fails

    def prefill_batch(self, prompts) -> None:
        self.calls.append([len(prompt) for prompt, _ in prompts])
        for prompt, cache in prompts:
            cache.length = len(prompt) - 1
        if self.fails:
            raise RuntimeError("the shared pass broke")


class _Short(_Sequence):
    """A sequence whose short prompt may share a prompt pass (`Decoding.shares_prefill`)."""

    def __init__(self, request, target):
        super().__init__(request, target)
        self.together = None

    @property
    def shares_prefill(self) -> bool:
        return len(self.sequence) <= 8 and self.cache.length < len(self.sequence) - 1

    def prefilled_together(self, seconds: float) -> bool:
        self.together = seconds
        return self.cache.length == len(self.sequence) - 1


class _Chunked(_Short):
    """A sequence whose every prompt chunk may share a prompt pass (a target with `shared_prefill`)."""

    @property
    def shares_prefill(self) -> bool:
        return self.cache.length < len(self.sequence) - 1


@pytest.mark.parametrize("fails", [False, True], ids=["shared", "fails"])
def test_short_prompts_are_fed_in_one_shared_pass_and_alone_where_it_fails(target, fails):
    """Short prompts go in one `prefill_batch` call, the long one behind them alone (a chunk of
    it, within the step's budget); where the shared pass fails, each short prompt is fed alone
    from its cache as it was, and nothing ends."""
    shared = _SharedTarget(fails)
    scheduler = Scheduler(shared, 8, None, None, lambda request: _Short(request, shared))
    for i, prompt in enumerate([[1] * 5, [1] * 3, [1] * 8, [1] * 300]):
        scheduler.waiting.append(SimpleNamespace(id=i, prompt_ids=prompt, max_new_tokens=4))
    out = StepOutput()
    plan = scheduler.schedule(out)
    assert shared.calls == [[5, 3, 8]] and not out.failed
    if fails:  # each fed alone by prefill_step, after its cache went back
        assert all(scheduler.running[i].together is None for i in (0, 1, 2))
    else:
        assert all(scheduler.running[i].together > 0 for i in (0, 1, 2))
    assert plan.ids == [0, 1, 2] and scheduler.prefilling[3].cache.length == sequence.PREFILL_CHUNK


def test_a_long_prompts_chunks_share_the_pass_of_short_prompts_and_it_runs_once_in(target):
    """Where every chunk may share a pass, a step's chunks (first come first served, about
    `prefill_tokens` of them) go in one `prefill_batch` call: a short prompt whole, a long one's
    next chunk (one a step); the long one runs once its last chunk is in, which rides in the running
    sequences' pass."""
    prompts = [[1] * 5, [1] * 300, [1] * 9]
    for budget, calls, first in ((sequence.PREFILL_CHUNK, [[5, sequence.PREFILL_CHUNK + 1], [300, 9]], [0]),
                                 (PREFILL_TOKENS, [[5, sequence.PREFILL_CHUNK + 1, 9], [300]], [0, 2])):
        shared = _SharedTarget(False)
        scheduler = Scheduler(shared, 8, None, None, lambda request: _Chunked(request, shared), budget)
        for i, prompt in enumerate(prompts):
            scheduler.waiting.append(SimpleNamespace(id=i, prompt_ids=prompt, max_new_tokens=4))
        plan = scheduler.schedule(StepOutput())
        assert shared.calls[:1] == calls[:1] and plan.ids == first
        assert scheduler.prefilling[1].cache.length == sequence.PREFILL_CHUNK and scheduler.prefilling[1].together > 0
        # the long prompt's last chunk (and what else is left) rides in the running sequences' pass
        plan = scheduler.schedule(StepOutput())
        assert shared.calls == calls[:1] and plan.ids == first
        assert [i for i, _, _ in plan.feeding] == [i for i in (1, 2) if i not in first]
        _ride(shared, scheduler, plan)
        assert shared.calls == calls and sorted(scheduler.running) == [0, 1, 2] and not scheduler.prefilling


def _ride(shared, scheduler, plan, fed=True):
    """What the runner's pass does with the prompts riding in it: feeds them (`prefill_batch`), or
    fails part way (`fed=False`: their caches grown by a few positions), or never runs (None)."""
    if fed:
        shared.prefill_batch([(d.prefill_chunk, d.cache) for _, d, _ in plan.feeding])
    elif fed is False:
        for _, d, _ in plan.feeding:
            d.cache.length += 2
    plan.fed, plan.pass_seconds = fed, 0.3
    scheduler.fed(plan, StepOutput())


@pytest.mark.parametrize("fed", [True, False, None], ids=["fed", "failed", "no-pass"])
def test_prompts_that_come_while_others_run_ride_in_their_pass(target, fed):
    """While sequences run, the scheduler feeds no shared prompt chunk itself: they ride in the step's
    scoring pass (`StepPlan.feeding`) and run from the next step; where that pass failed each is fed
    alone from its cache as it was; where no pass ran (every running sequence's drafting failed)
    they wait, untouched, for the next step's."""
    shared = _SharedTarget()
    scheduler = Scheduler(shared, 8, None, None, lambda request: _Short(request, shared))
    scheduler.waiting.append(SimpleNamespace(id=0, prompt_ids=[1] * 5, max_new_tokens=4))
    assert scheduler.schedule(StepOutput()).ids == [0] and not shared.calls  # alone: nothing runs yet
    scheduler.waiting += [SimpleNamespace(id=i, prompt_ids=[1] * (3 + i), max_new_tokens=4) for i in (1, 2)]
    plan = scheduler.schedule(StepOutput())
    assert plan.ids == [0] and [(i, length) for i, _, length in plan.feeding] == [(1, 0), (2, 0)]
    assert not shared.calls and all(scheduler.prefilling[i].cache.length == 0 for i in (1, 2))
    _ride(shared, scheduler, plan, fed)
    if fed is None:
        assert sorted(scheduler.prefilling) == [1, 2] and all(d.cache.length == 0 for d in scheduler.prefilling.values())
        assert [i for i, _, _ in scheduler.schedule(StepOutput()).feeding] == [1, 2]
        return
    assert sorted(scheduler.running) == [0, 1, 2] and not scheduler.prefilling
    assert [scheduler.running[i].cache.length for i in (1, 2)] == [3, 4]
    assert [scheduler.running[i].together for i in (1, 2)] == ([pytest.approx(0.1)] * 2 if fed else [None, None])
    if not fed:  # each fed alone from its cache as it was before the pass grew it
        assert [scheduler.running[i].fed_from for i in (1, 2)] == [0, 0]
    assert shared.calls == ([[4, 5]] if fed else [])


def test_the_kv_budget_holds_a_request_that_does_not_fit_and_those_behind_it(target):
    big, small = [1] * 90, [1] * 2
    need_big = kv_need(len(big) + 4, [target])
    need_small = kv_need(len(small) + 4, [target])
    assert need_small < need_big
    scheduler = _scheduler(target, kv_memory=need_big + need_small)
    for i, prompt in enumerate([big, big, small]):
        scheduler.waiting.append(SimpleNamespace(id=i, prompt_ids=prompt, max_new_tokens=4))
    out = StepOutput()
    scheduler.schedule(out)
    # the second big one does not fit beside the first; the small one would, but waits behind it
    assert out.started == [0] and scheduler.reserved == {0: need_big}
    assert [r.id for r in scheduler.waiting] == [1, 2]
    scheduler.settle(StepOutput(finished={0: None}))  # the first ends: its charge is free
    out = StepOutput()
    scheduler.schedule(out)
    assert out.started == [1, 2] and scheduler.reserved == {1: need_big, 2: need_small}
    assert scheduler.cancel(2) and 2 not in scheduler.reserved and not scheduler.cancel(2)


def test_prompts_fed_alone_are_fed_about_a_chunk_a_step_first_come_first_served(target, monkeypatch):
    """A prompt fed in a pass of its own streams the weights again: about a chunk's worth a step,
    whatever `prefill_tokens` a shared pass would take."""
    monkeypatch.setattr(sequence, "PREFILL_CHUNK", 8)
    scheduler = _scheduler(target)
    for i in range(2):
        scheduler.waiting.append(SimpleNamespace(id=i, prompt_ids=list(range(20)), max_new_tokens=4))
    fed = []
    for _ in range(4):
        plan = scheduler.schedule(StepOutput())
        admitted = {**scheduler.prefilling, **scheduler.running}
        fed.append((admitted[0].cache.length, admitted[1].cache.length, None if plan is None else plan.ids))
    # 8 tokens a step go to the first prompt until it is in; a step it no longer fills (3 tokens)
    # feeds the next prompt its chunk too
    assert fed == [(8, 0, None), (16, 0, None), (19, 8, [0]), (19, 16, [0])]


def test_a_prompt_whose_feed_fails_ends_alone_and_the_step_feeds_the_next(target):
    """The failed prompt's cache is freed as it ends: the step's count of fed tokens must not read it."""
    class Broken(_Sequence):
        def prefill_step(self) -> bool:
            if self.sequence == [9, 9, 9]:
                raise RuntimeError("its prompt's own fault")
            return super().prefill_step()

    scheduler = Scheduler(target, 8, None, None, lambda request: Broken(request, target))
    scheduler.waiting += [SimpleNamespace(id=0, prompt_ids=[9, 9, 9], max_new_tokens=4),
                          SimpleNamespace(id=1, prompt_ids=[1, 2, 3], max_new_tokens=4)]
    out = StepOutput()
    plan = scheduler.schedule(out)
    assert list(out.failed) == [0] and "own fault" in str(out.failed[0]) and plan.ids == [1]


def _failing_lookup():
    class Failing(LookupDrafter):
        calls = 0

        def propose(self, *args, **kwargs):
            self.calls += 1
            if self.calls == 2:
                raise RuntimeError("a drafter bug")
            return super().propose(*args, **kwargs)
    return Failing()


def test_a_step_hands_out_what_each_request_emitted_finished_and_failed_once(target):
    prompts = [[3, 4, 5, 3, 4, 5], [7, 8, 9], [10, 11, 12, 10, 11]]
    alone = [autoregressive_generate(p, target, max_new_tokens=6 + 2 * i, eos_token_ids=[]).tokens
             for i, p in enumerate(prompts)]
    engine = Engine(target, max_batch=3)
    drafters = [None, LookupDrafter, _failing_lookup]
    ids = [engine.add(Request(p, d, max_new_tokens=6 + 2 * i, eos_token_ids=[], logprobs=1))
           for i, (p, d) in enumerate(zip(prompts, drafters))]
    outputs = []
    while engine.busy:
        outputs.append(engine.step())
    streamed, ended = {i: [] for i in ids}, set()
    for out in outputs:
        for request_id, tokens in out.emitted.items():
            assert request_id not in ended, "tokens after the request ended"
            assert len(out.logprobs[request_id]) == len(tokens)
            streamed[request_id] += tokens
        ended |= {*out.finished, *out.failed}
    finished = [i for out in outputs for i in out.finished]
    failed = [i for out in outputs for i in out.failed]
    assert sorted(finished) == ids[:2] and failed == [ids[2]]  # each once
    results = {i: r for out in outputs for i, r in out.finished.items()}
    assert [results[i].tokens for i in ids[:2]] == alone[:2]
    assert [streamed[i] for i in ids[:2]] == alone[:2]  # the streamed tokens are the whole output
    error = next(out.failed[ids[2]] for out in outputs if ids[2] in out.failed)
    assert "a drafter bug" in str(error)
    assert not engine.scheduler.reserved and not engine.scheduler.running  # nothing kept once handed out


def test_a_step_that_breaks_outside_every_request_hands_out_what_it_had(target, monkeypatch):
    """The error comes out as `StepFailed` carrying what the step finished before it broke (the
    server answers those whole); the engine serves on, and `run` raises the error itself."""
    verify, broken = Runner.verify, []

    def breaking(self, plan, logits, out):
        verify(self, plan, logits, out)
        if out.finished and not broken:
            broken.append(1)
            raise RuntimeError("broke after verifying")

    monkeypatch.setattr(Runner, "verify", breaking)
    engine = Engine(target, max_batch=2)
    short = engine.add(Request([1, 2, 3], max_new_tokens=2, eos_token_ids=[]))
    long = engine.add(Request([5, 6], max_new_tokens=6, eos_token_ids=[]))
    with pytest.raises(StepFailed) as caught:
        while engine.busy:
            engine.step()
    assert isinstance(caught.value.error, RuntimeError) and list(caught.value.output.finished) == [short]
    expected = autoregressive_generate([1, 2, 3], target, max_new_tokens=2, eos_token_ids=[]).tokens
    assert caught.value.output.finished[short].tokens == expected
    assert list(engine.run()) == [long]  # the engine went on

    def always_breaking(self, plan, logits, out):
        raise RuntimeError("always broken")

    monkeypatch.setattr(Runner, "verify", always_breaking)
    engine.add(Request([1, 2], max_new_tokens=2))
    with pytest.raises(RuntimeError, match="always broken") as raised:
        engine.run()
    assert not isinstance(raised.value, StepFailed)


class _FacadeOnly:
    """The engine's public face and nothing else: a worker that reads or clears anything behind
    it (its queue, its sequences, kept results) fails here."""

    def __init__(self, engine):
        self._engine = engine

    def add(self, request):
        return self._engine.add(request)

    def cancel(self, request_id):
        return self._engine.cancel(request_id)

    def step(self):
        return self._engine.step()

    @property
    def busy(self):
        return self._engine.busy


class _Sink:
    def __init__(self):
        self.tokens_seen, self.logprobs_seen, self.result, self.error = [], [], None, None

    def tokens(self, ids, logprobs):
        self.tokens_seen += ids
        self.logprobs_seen += logprobs or []

    def done(self, result):
        self.result = result

    def failed(self, error):
        self.error = error


def test_the_worker_serves_from_step_outputs_alone(target):
    from specdec.server.worker import Worker

    worker = Worker(_FacadeOnly(Engine(target, max_batch=2)))
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
    sinks = [_Sink() for _ in prompts]
    for prompt, sink in zip(prompts, sinks):
        worker.submit(Request(prompt, max_new_tokens=5, eos_token_ids=[], logprobs=0), sink)
    doomed, cancelled = _Sink(), _Sink()
    worker.submit(Request([1, 2, 3], _failing_lookup, max_new_tokens=8, eos_token_ids=[]), doomed)
    worker.submit(Request([4, 5], max_new_tokens=8, eos_token_ids=[]), cancelled)
    assert worker.waiting == 5
    worker.cancel(cancelled)  # before it ran: it leaves the queue, and nothing reaches its sink
    turns = 0
    while any(s.result is None and s.error is None for s in [*sinks, doomed]):
        worker._turn()  # on this thread, so that an error inside it fails the test
        turns += 1
        assert turns < 200, "the worker stopped handing out"
        assert 0 <= worker.running <= 2 and worker.waiting >= 0
    for prompt, sink in zip(prompts, sinks):
        expected = autoregressive_generate(prompt, target, max_new_tokens=5, eos_token_ids=[]).tokens
        assert sink.result.tokens == sink.tokens_seen == expected and sink.error is None
        assert len(sink.logprobs_seen) == len(expected)
    assert "a drafter bug" in str(doomed.error) and doomed.result is None
    assert cancelled.tokens_seen == [] and cancelled.result is None and cancelled.error is None
    assert worker.waiting == 0 and worker.running == 0 and not worker._sinks


def _deep_reads(tree: ast.AST) -> list[str]:
    """`decoding.a.b`-like reads (two hops into a sequence) outside `_decide` (the batched
    verification, which moves to decoding/ with the verifier)."""
    found = []
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.Lambda)) or getattr(function, "name", "") == "_decide":
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
                base = node.value.value
                named = isinstance(base, ast.Name) and base.id in ("decoding", "d")
                indexed = isinstance(base, ast.Subscript) and isinstance(base.value, ast.Name) and \
                    base.value.id in ("decodings", "running", "prefilling")
                if named or indexed:
                    found.append(ast.unparse(node))
    return found


def test_the_engine_reads_a_sequence_one_hop_deep():
    deep = {path.name: _deep_reads(ast.parse(path.read_text())) for path in sorted(ENGINE.glob("*.py"))}
    assert all(not reads for reads in deep.values()), deep
