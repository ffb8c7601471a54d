"""`specdec serve` as clients and attackers meet it: slow and stalled clients, the cap on
connections, the key file's pitfalls, and the first start's cost measuring."""

from __future__ import annotations

import logging
import socket
import time

import httpx
import pytest

from specdec.errors import SpecdecError
from specdec.server.service import Limits, Service

from test_server import serving, _client, NAME
from conftest import tiny_model


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
