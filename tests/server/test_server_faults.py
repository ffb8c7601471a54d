"""One request's fault stays its own: a failure at any per-request call site of the engine (its
start, its prompt's feeding, its drafter's lag, accept and finish, its logit rules, its
verification, its pass) ends that request alone with a 5xx and a JSON body that shows no
internals, while the requests beside it finish equal to the target's run alone; a step that fails
as a whole still delivers what finished in it; /health turns 503 when steps keep failing or none
completes while work waits. Tiny random models, a live server on loopback.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from specdec.drafters.base import Drafter
from specdec.drafters.model import ModelDrafter
from specdec.drafters.suffix import SuffixDrafter
from specdec.errors import ModelFault
from specdec.decoding.sequence import Decoding
from specdec.decoding.loop import autoregressive_generate
from specdec.core.penalties import LogitRules
from specdec.sizing.schedules import AssumedCosts
from specdec.server.service import Limits, Service

from conftest import tiny_model
from test_server import NAME, _client, serving

DOOMED = [13, 14]  # a prompt that starts so is the one each test's fault hits
GOOD = [[1, 2, 3], [5, 6], [7, 8, 9, 10]]
SECRET = "/home/someone/weights.bin"  # what an internal error may say and a client must not see


@pytest.fixture(scope="module")
def pair():
    return tiny_model(0, exact_rows=True, name=NAME), tiny_model(1, layers=1, exact_rows=True, name="tiny-drafter")


@pytest.fixture(scope="module")
def live(pair):
    target, drafter = pair
    # steered by costs taken as given: the engine asks drafters their lag (the step-level call site)
    service = lambda: Service(target, drafter, limits=Limits(max_tokens=24, request_timeout=30),  # noqa: E731
                              assumed=AssumedCosts(drafter=0.05, slope=0.0))
    with serving(service, max_batch=4, steer=True) as (url, app):
        yield url, app


def _doomed(ids) -> bool:
    return list(ids[:2]) == DOOMED


def _inject(site: str, monkeypatch, target) -> None:
    """Make `site` raise for the doomed request alone."""
    fault = RuntimeError(f"injected fault reading {SECRET}")
    doomed_objects: set[int] = set()  # drafters and caches of the doomed request

    def when(check, original):
        def wrapped(self, *args, **kwargs):
            if check(self, *args):
                raise fault
            return original(self, *args, **kwargs)
        return wrapped

    if site == "begin":
        monkeypatch.setattr(Decoding, "begin", when(lambda d: _doomed(d.sequence), Decoding.begin))
    elif site == "prefill":  # a prompt fed alone, or after a pass shared with other short prompts
        monkeypatch.setattr(Decoding, "prefill_step", when(lambda d: _doomed(d.sequence), Decoding.prefill_step))
        monkeypatch.setattr(Decoding, "prefilled_together",
                            when(lambda d, seconds: _doomed(d.sequence), Decoding.prefilled_together))
    elif site == "lag":
        monkeypatch.setattr(ModelDrafter, "lag", when(lambda d, context: _doomed(context), ModelDrafter.lag))
    elif site == "accept":
        start = ModelDrafter.start

        def marking(self, prompt):
            start(self, prompt)
            if _doomed(prompt):
                doomed_objects.add(id(self))
        monkeypatch.setattr(ModelDrafter, "start", marking)
        monkeypatch.setattr(ModelDrafter, "accept", when(lambda d, *a: id(d) in doomed_objects, Drafter.accept))
    elif site == "finish":
        monkeypatch.setattr(SuffixDrafter, "finish", when(lambda d, sequence: _doomed(sequence), SuffixDrafter.finish))
    elif site == "rules":
        monkeypatch.setattr(LogitRules, "apply", when(lambda r, logits, prompt, *a: _doomed(list(prompt)),
                                                      LogitRules.apply))
    elif site == "apply":
        monkeypatch.setattr(Decoding, "apply", when(lambda d, *a: _doomed(d.sequence), Decoding.apply))
    elif site == "target pass":  # a backend call that fails (llama.cpp's decode): batched, then alone again
        begin, forward_batch, forward = Decoding.begin, target.forward_batch, target.forward

        def marking_begin(self):
            begin(self)
            if _doomed(self.sequence):
                doomed_objects.add(id(self.cache))
        monkeypatch.setattr(Decoding, "begin", marking_begin)

        def batch(segments):
            if any(id(s.cache) in doomed_objects for s in segments):
                raise ModelFault("the backend failed to decode 9 tokens (status 1)")
            return forward_batch(segments)

        def alone(ids, cache, *args, **kwargs):
            if id(cache) in doomed_objects:
                raise ModelFault("the backend failed to decode 3 tokens (status 1)")
            return forward(ids, cache, *args, **kwargs)
        monkeypatch.setattr(target, "forward_batch", batch)
        monkeypatch.setattr(target, "forward", alone)
    else:
        raise AssertionError(site)


SITES = ["begin", "prefill", "lag", "accept", "finish", "rules", "apply", "target pass"]


@pytest.mark.parametrize("site", SITES)
def test_a_fault_at_a_per_request_call_site_ends_that_request_alone(live, pair, monkeypatch, site):
    url, app = live
    target = pair[0]
    speculative = {"method": "suffix"} if site == "finish" else None
    extra = {"presence_penalty": 0.5} if site == "rules" else {}
    # the good requests' outputs as the target gives them alone (the fault not yet injected)
    alone = {tuple(p): autoregressive_generate(p, target, max_new_tokens=12).tokens for p in GOOD}
    _inject(site, monkeypatch, target)
    client = _client(url)

    def ask(prompt, **fields):
        return client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0,
                                         extra_body={"speculative": speculative, **fields})

    with ThreadPoolExecutor(4) as pool:
        bad = pool.submit(ask, DOOMED + [1, 2], **extra)
        good = [pool.submit(ask, p) for p in GOOD]
        with pytest.raises(openai.InternalServerError) as caught:
            bad.result()
        for prompt, future in zip(GOOD, good):
            reply = future.result()
            assert reply.usage.completion_tokens == 12
            assert reply.choices[0].text == target.decode(alone[tuple(prompt)])
    assert caught.value.status_code == 500
    error = caught.value.body
    assert error["type"] == "server_error" and SECRET not in error["message"] and "injected" not in error["message"]
    monkeypatch.undo()
    assert ask([1, 2]).usage.completion_tokens == 12  # and the server serves on
    assert httpx.get(url + "/health").status_code == 200
    worker = app.state.specdec["worker"]
    engine = worker.engine
    assert not engine.busy and worker.running == 0 and worker.waiting == 0


def test_a_step_that_fails_as_a_whole_still_delivers_what_finished_in_it(pair, monkeypatch):
    """A failure outside every sequence's own guard (here after verification) ends the requests
    still running (500) but not one that finished in that step: it is answered whole, at once."""
    from specdec.engine.runner import Runner

    target = pair[0]
    expected = target.decode(autoregressive_generate([1, 2, 3], target, max_new_tokens=5).tokens)
    verify = Runner.verify
    failed = []

    def failing(self, plan, logits, out):
        verify(self, plan, logits, out)
        if out.finished and not failed:  # the step in which the short request ended
            failed.append(1)
            raise RuntimeError(f"the step broke after verifying ({SECRET})")

    monkeypatch.setattr(Runner, "verify", failing)
    with serving(lambda: Service(target, None, limits=Limits(request_timeout=20))) as (url, app):
        client = _client(url)
        with ThreadPoolExecutor(2) as pool:
            # the long one is running when the short one, sent after it, finishes
            long = pool.submit(client.completions.create, model=NAME, prompt=[5, 6], max_tokens=200, temperature=0)
            short = pool.submit(client.completions.create, model=NAME, prompt=[1, 2, 3], max_tokens=5, temperature=0)
            assert short.result().choices[0].text == expected
            with pytest.raises(openai.InternalServerError) as caught:
                long.result()
        assert SECRET not in caught.value.body["message"]
        assert failed == [1]
        assert client.completions.create(model=NAME, prompt=[1, 2], max_tokens=3, temperature=0).usage \
            .completion_tokens == 3


def test_health_is_503_while_steps_keep_failing_and_ok_again_after_one_succeeds(pair, monkeypatch):
    from specdec.server import worker as worker_module

    with serving(lambda: Service(pair[0], None, limits=Limits(request_timeout=20))) as (url, app):
        worker = app.state.specdec["worker"]
        step = worker.engine.step

        def broken():
            raise RuntimeError(f"a broken step ({SECRET})")

        monkeypatch.setattr(worker.engine, "step", broken)
        client = _client(url)
        assert httpx.get(url + "/health").status_code == 200
        with pytest.raises(openai.InternalServerError) as caught:  # its steps fail: it ends, never waits for ever
            client.completions.create(model=NAME, prompt=[1, 2], max_tokens=3, temperature=0)
        assert caught.value.status_code == 500 and SECRET not in caught.value.body["message"]
        assert worker.failed_in_a_row == worker_module.FAILED_STEPS
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and "failed" in health.json()["error"]["message"]
        assert SECRET not in health.text
        monkeypatch.setattr(worker.engine, "step", step)
        assert client.completions.create(model=NAME, prompt=[1, 2], max_tokens=3, temperature=0).usage \
            .completion_tokens == 3
        health = httpx.get(url + "/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"


def test_health_is_503_when_no_step_completes_while_work_waits(pair, monkeypatch):
    """A wedged engine (a step that never returns) is reported once no step has completed for
    `stall_timeout` seconds while requests wait; idle, an old last step is no stall."""
    with serving(lambda: Service(pair[0], None, limits=Limits(request_timeout=20)), stall_timeout=0.5) as (url, app):
        worker = app.state.specdec["worker"]
        step, release = worker.engine.step, threading.Event()

        def wedged():
            release.wait(15)
            return step()

        client = _client(url)
        client.completions.create(model=NAME, prompt=[1, 2], max_tokens=2, temperature=0)
        time.sleep(0.6)  # idle past the stall timeout: still healthy
        assert httpx.get(url + "/health").status_code == 200
        monkeypatch.setattr(worker.engine, "step", wedged)
        with ThreadPoolExecutor(1) as pool:
            reply = pool.submit(client.completions.create, model=NAME, prompt=[1, 2], max_tokens=2, temperature=0)
            deadline = time.monotonic() + 10
            while (health := httpx.get(url + "/health")).status_code == 200:
                assert time.monotonic() < deadline, "a wedged engine still answers /health 200"
                time.sleep(0.05)
            assert health.status_code == 503 and "no engine step" in health.json()["error"]["message"]
            release.set()
            assert reply.result().usage.completion_tokens == 2
        assert httpx.get(url + "/health").status_code == 200


def test_a_failing_streak_stops_showing_once_the_stall_timeout_has_passed(pair, monkeypatch):
    """Steps that failed three times in a row make /health 503, but not for ever: once
    `stall_timeout` has passed without another failure, the idle server reports ok again, so
    that a load balancer sends it work to try."""
    with serving(lambda: Service(pair[0], None, limits=Limits(request_timeout=20)), stall_timeout=0.5) as (url, app):
        worker = app.state.specdec["worker"]
        step = worker.engine.step

        def broken():
            raise RuntimeError("a broken step")

        monkeypatch.setattr(worker.engine, "step", broken)
        with pytest.raises(openai.InternalServerError):
            _client(url).completions.create(model=NAME, prompt=[1, 2], max_tokens=3, temperature=0)
        assert httpx.get(url + "/health").status_code == 503
        monkeypatch.setattr(worker.engine, "step", step)
        deadline = time.monotonic() + 10
        while httpx.get(url + "/health").status_code != 200:
            assert time.monotonic() < deadline, "an idle server stayed 503 after its failures"
            time.sleep(0.05)


def test_a_request_that_fails_to_start_lets_go_of_its_caches_and_a_failed_crop_ends_one_alone(pair, monkeypatch):
    import gc
    import weakref

    from specdec.engine import Engine, Request

    target = pair[0]
    engine = Engine(target, max_batch=2)
    made = []
    begin = Decoding.begin

    def failing_begin(self):
        begin(self)
        made.append(weakref.ref(self.cache))
        if _doomed(self.sequence):
            raise RuntimeError("its drafter would not start")

    monkeypatch.setattr(Decoding, "begin", failing_begin)
    bad = engine.add(Request(DOOMED + [1], None, max_new_tokens=4))
    good = engine.add(Request([1, 2, 3], None, max_new_tokens=4))
    out = engine.step()
    gc.collect()
    assert bad in out.failed and made[0]() is None  # the failed one's cache is gone, though its error is kept
    monkeypatch.undo()
    # a cache that cannot be put back after a failed batched pass ends that sequence alone
    import specdec.engine.runner as engine_module

    crop = engine_module.crop_layers  # a batched pass's caches go back layer by layer

    def batch(segments):
        raise RuntimeError("the batched pass failed")

    def failing_crop(cache, length):
        if cache is doomed_cache:
            raise RuntimeError("this cache cannot be cropped")
        return crop(cache, length)

    other = engine.add(Request([5, 6], None, max_new_tokens=4))
    engine.step()  # admits the other one
    doomed_cache = engine.scheduler.running[good].cache
    monkeypatch.setattr(target, "forward_batch", batch)
    monkeypatch.setattr(engine_module, "crop_layers", failing_crop)
    out = engine.step()
    assert good in out.failed and (other in engine.scheduler.running or other in out.finished)
