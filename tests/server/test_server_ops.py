"""`specdec serve` as clients and attackers meet it: slow and stalled clients, the cap on
connections, the key file's pitfalls, and the first start's cost measuring."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time

import httpx
import pytest
from typer.testing import CliRunner

from specdec.cli import app as cli
from specdec.errors import SpecdecError
from specdec.server.app import create_app
from specdec.server.service import Limits, Service

from test_server import live, serving, NAME, _metric, _metrics
from conftest import steady_batch_timings, tiny_model


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(0, exact_rows=True, name=NAME)


def test_the_key_file_skips_comments_warns_when_others_may_read_it_and_refuses_non_ascii(tmp_path, caplog):
    from specdec.server.app import api_key_from

    path = tmp_path / "keys"
    path.write_text("# the team's keys\nfirst\n  # an old one: revoked\nsecond\n")
    path.chmod(0o600)
    with caplog.at_level(logging.WARNING, logger="specdec.server"):
        assert api_key_from(None, path) == ["first", "second"]
    assert not caplog.records
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="specdec.server"):
        api_key_from(None, path)
    assert len(caplog.records) == 1 and str(path) in caplog.text and "chmod 600" in caplog.text
    path.chmod(0o600)
    path.write_text("ascii\nclé\n", encoding="utf-8")
    with pytest.raises(SpecdecError, match=r"\(key 2\): a key must be printable ASCII"):
        api_key_from(None, path)
    with pytest.raises(SpecdecError, match="--api-key: a key must be printable ASCII"):
        api_key_from("schlüssel", None)


def test_the_bearer_scheme_is_case_insensitive_and_only_the_key_matches(tiny):
    with serving(lambda: Service(tiny, None), api_key=["one", "two"]) as (url, _):
        for header, status in (("Bearer two", 200), ("bearer one", 200), ("BEARER two", 200), ("Bearer  one", 200),
                               ("Basic one", 401), ("Bearer", 401), ("one", 401), ("Bearer one two", 401),
                               ("Bearer on", 401), ("Bearer clé".encode("utf-8"), 401)):
            response = httpx.get(url + "/v1/models", headers={"Authorization": header})
            assert response.status_code == status, header
            if status == 401:
                assert response.json()["error"]["code"] == "invalid_api_key"


@contextlib.contextmanager
def _uvicorn(load, config: dict | None = None, send_buffer: int | None = None, **options):
    """As `serving`, with uvicorn's own settings (`config`) too, and on a listening socket whose
    connections get a fixed `send_buffer` (none grown by the kernel) -> (base URL, app)."""
    app = create_app(load, **options)
    listening = socket.socket()
    if send_buffer is not None:  # accepted connections inherit it
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    listening.bind(("127.0.0.1", 0))
    try:
        with live(app, config=config, sockets=[listening]) as url:
            yield url, app
    finally:
        listening.close()


def _connect(url: str, receive_buffer: int | None = None) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    conn = socket.socket()
    if receive_buffer is not None:  # before connecting: the window the server may fill
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    conn.settimeout(30)
    conn.connect((host, int(port)))
    return conn


def _answer(conn: socket.socket) -> bytes:
    answer = b""
    while b"\r\n\r\n" not in answer:
        piece = conn.recv(65536)
        assert piece, "the server closed the connection without an answer"
        answer += piece
    return answer


def test_a_trickled_body_is_408_after_the_body_timeout_and_the_server_goes_on(tiny):
    with serving(lambda: Service(tiny, None, limits=Limits(body_timeout=0.5))) as (url, app):
        with _connect(url) as conn:
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 60\r\n\r\n{\"prompt\": [1, 2], ")  # and the rest never comes
            answer = _answer(conn)
            while b"}}" not in answer and (piece := conn.recv(65536)):  # the body, if it came apart
                answer += piece
        assert answer.startswith(b"HTTP/1.1 408") and b'"code":"body_timeout"' in answer, answer[:400]
        ok = httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "temperature": 0})
        assert ok.status_code == 200


def test_a_client_that_stops_reading_its_stream_is_cancelled_after_the_write_timeout():
    """The client asks for a long stream and reads none of it: once the socket buffers are full,
    the server's send blocks; past --write-timeout the request is cancelled (its sequence freed)
    and the connection dropped, where it would otherwise wait on the client for ever."""
    target = tiny_model(0, exact_rows=True, name=NAME, max_positions=2048)
    with _uvicorn(lambda: Service(target, None, limits=Limits(write_timeout=0.5)), send_buffer=4096) as (url, app):
        # some 700 bytes a token: 1.4 MB in all, and some 100 kB fill the buffers on the way
        request = json.dumps({"prompt": [1, 2], "max_tokens": 2000, "temperature": 1, "logprobs": 15,
                              "stream": True, "ignore_eos": True}).encode()
        with _connect(url, receive_buffer=4096) as conn:
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(request), request))
            deadline = time.monotonic() + 60
            while _metric(_metrics(url), "specdec:requests_total", status="cancelled") < 1:
                assert time.monotonic() < deadline, "the stalled stream was never cancelled"
                time.sleep(0.1)
            worker = app.state.specdec["worker"]
            while worker.running or worker.waiting:
                assert time.monotonic() < deadline, "the stalled stream's sequence was not freed"
                time.sleep(0.05)
            read = 0
            try:  # what the socket holds, then the end the server made of the connection
                while piece := conn.recv(65536):
                    read += len(piece)
            except ConnectionResetError:
                pass
        assert read < 2000 * 200  # the server dropped the stream, it did not finish it
        ok = httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "temperature": 0})
        assert ok.status_code == 200


def test_connections_past_the_cap_are_503(tiny):
    # what `serve --max-connections 1` asks of uvicorn, which counts the connection asking too
    with _uvicorn(lambda: Service(tiny, None), {"limit_concurrency": 2}) as (url, _):
        with _connect(url):  # an idle connection holds the only place
            time.sleep(0.2)  # accepted by the server's loop (uvicorn counts it from then)
            assert httpx.get(url + "/health").status_code == 503
        deadline = time.monotonic() + 20
        while httpx.get(url + "/health").status_code != 200:  # the place is free again once it closes
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_serve_passes_the_connection_cap_and_timeouts_on(monkeypatch):
    import signal

    import specdec.cli.serve as serve_module
    import uvicorn as uvicorn_module

    calls, loaders = [], []
    monkeypatch.setattr(uvicorn_module, "run", lambda app, **options: calls.append(options))
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # this process's own handlers stay
    loader = serve_module._service_loader
    monkeypatch.setattr(serve_module, "_service_loader", lambda *args: loaders.append(args) or loader(*args))
    result = CliRunner().invoke(cli, ["serve", "--target", "no-such-model", "--max-connections", "7",
                                      "--body-timeout", "3", "--write-timeout", "4"])
    assert result.exit_code == 0, result.output
    (options,), (args,) = calls, loaders
    assert options["limit_concurrency"] == 8  # uvicorn counts the connection asking too
    limits = next(a for a in args if isinstance(a, Limits))
    assert (limits.body_timeout, limits.write_timeout) == (3, 4)


@pytest.mark.parametrize("args, message", [
    (["--max-connections", "0"], "--max-connections must be >= 1"),
    (["--body-timeout", "0"], "--body-timeout must be > 0"),
    (["--write-timeout", "-1"], "--write-timeout must be > 0"),
    (["--write-timeout", "nan"], "--write-timeout must be > 0"),
])
def test_serve_checks_the_connection_cap_and_timeouts_before_loading(args, message):
    result = CliRunner().invoke(cli, ["serve", "--target", "no-such-model"] + args)
    assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output


def test_health_says_how_far_the_first_starts_cost_measuring_has_come(tiny):
    release, progress = threading.Event(), {"phase": "measuring pass costs (2 of 4)"}

    def load():
        assert release.wait(20)
        return Service(tiny, None)

    with serving(load, wait=False, loading=lambda: progress["phase"]) as (url, _):
        response = httpx.get(url + "/health")
        assert response.status_code == 503
        assert "loading: measuring pass costs (2 of 4)" in response.json()["error"]["message"]
        release.set()
        deadline = time.monotonic() + 20
        while httpx.get(url + "/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)


class _Phases(dict):
    """A loader's progress that keeps every phase the load went through, in order ("seen")."""

    def __setitem__(self, key, value):
        self.setdefault("seen", []).append(value)
        super().__setitem__(key, value)


def _tiny_loader(tmp_path, monkeypatch, progress, costs_first=False):
    """serve's loader of a tiny target "t" and drafter "d" at max batch 2, costs cached under tmp_path."""
    import specdec.models.loading
    from specdec.cli.serve import _service_loader
    from specdec.sizing import pass_costs as passcost

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    models = {"t": tiny_model(0, exact_rows=True, name=NAME), "d": tiny_model(1, layers=1, exact_rows=True, name="d")}
    monkeypatch.setattr(specdec.models.loading, "load", lambda name, **options: models[name])
    monkeypatch.setattr(passcost, "batch_pass_seconds", steady_batch_timings())
    return _service_loader("t", "d", "default", "auto", "auto", "cpu", 2, False, False, 8, 16, Limits(), 0, None,
                           "http://127.0.0.1:1/v1", progress, costs_first)


def test_the_loader_leaves_its_costs_to_take_between_requests_and_says_each_and_where_they_are_cached(
        tmp_path, monkeypatch, capsys):
    progress = _Phases()
    load = _tiny_loader(tmp_path, monkeypatch, progress)
    service = load()
    assert progress["seen"] == ["loading the models", None]  # it serves before any cost is taken
    assert service.costs is None and service.load_costs is None and service.measuring() == "pass costs (1 of 4)"
    assert " ms a pass" not in capsys.readouterr().err
    while service.measure_next():
        pass
    assert service.costs is not None and service.lookup_costs is not None and service.load_costs is not None
    said = capsys.readouterr().err
    assert all(f"pass costs ({k} of 4), between requests" in said for k in (1, 2, 3, 4))
    assert "2 sequences x 4 rows" in said and " ms a pass" in said  # the batched passes, size by size
    service = load()
    startup = [line for line in capsys.readouterr().err.splitlines() if line.startswith("serving ")]
    assert len(startup) == 1 and "pass-costs.json" in startup[0] and "cached in" in startup[0]
    while service.measure_next():  # a second start reads them back: nothing timed, nothing said of sizes
        pass
    assert service.load_costs is not None and " ms a pass" not in capsys.readouterr().err


def test_with_costs_first_the_loader_takes_every_cost_before_it_serves(tmp_path, monkeypatch, capsys):
    """--costs-first: a server that will share the cores once it serves (a benchmark starting
    another server beside it) times its costs while they are its own: each taken during the load,
    /health's phase saying which, none left for between requests."""
    progress = _Phases()
    service = _tiny_loader(tmp_path, monkeypatch, progress, costs_first=True)()
    assert progress["seen"] == ["loading the models"] + [f"taking pass costs ({k} of 4)" for k in (1, 2, 3, 4)] + [None]
    assert not service.pending_costs and service.measuring() is None
    assert service.costs is not None and service.lookup_costs is not None and service.load_costs is not None
    said = capsys.readouterr().err
    assert "pass costs (1 of 4), before serving" in said and "cached in" in said and ", taken)" in said


def test_the_server_serves_while_its_costs_are_measured_between_requests(tiny):
    """A first start answers at once: /health 200 saying how far the costs have come, requests
    served (sized conservatively) between the measurements, and the batched profile becomes the
    engine's prior once taken."""
    from specdec.sizing.pass_costs import LoadCosts, PassCosts

    release, timed = threading.Event(), []

    def slow(value):
        def measure(should_stop):
            timed.append(1)
            assert release.wait(20)
            return value
        return measure

    profile = LoadCosts({(1, 1): 0.01, (2, 1): 0.012})

    def load():
        service = Service(tiny, None, limits=Limits(request_timeout=30))
        service.pending_costs = {"lookup_costs": slow(PassCosts({1: 0.01, 2: 0.011}, 0.0)),
                                 "load_costs": slow(profile)}
        return service

    with serving(load, prefill_tokens=300) as (url, app):  # ready (200) while the first measurement waits
        health = httpx.get(url + "/health").json()
        assert health["status"] == "ok" and health["measuring"] == "pass costs (1 of 2)"
        release.set()
        reply = httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 3, "temperature": 0},
                           timeout=30)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
        deadline = time.monotonic() + 20
        while httpx.get(url + "/health").json()["measuring"] is not None:
            assert time.monotonic() < deadline, "the costs were never taken"
            time.sleep(0.05)
        service, worker = app.state.specdec["service"], app.state.specdec["worker"]
        assert timed == [1, 1] and service.load_costs is profile and worker.engine.costs.prior is profile
        assert worker.engine.scheduler.prefill_tokens == 300  # what `serve --prefill-tokens` passes
