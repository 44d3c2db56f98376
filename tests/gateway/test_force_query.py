"""``DELETE /pdd/instances/{name}?force=...``: ``1`` / ``true`` force, ``0`` / ``false`` do not,
anything else is a 400 naming ``force`` (``invalid_query``). FastAPI's lax bool took ``yes``,
``on``, ``t``, ``TRUE`` as true and ``no``, ``off`` as false, so a typo could force a removal
with requests in flight, though the operator bodies' booleans are strict."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from pdd.gateway.membership_api import add_membership_routes
from tests.gateway.test_membership import _setup


class Tok:  # what the app reads of a tokenizer when it is built
    def get_vocab_size(self, with_added_tokens=True):
        return 256


def _clients():
    """(the gateway's whole app, the membership routes alone), each over its own membership
    whose md1 has a request in flight (so only a forced removal is done)."""
    from pdd.gateway.api import create_app

    out = []
    for whole in (True, False):
        o, ms, _ = _setup(standby=())
        o.inflight["md1"] = 1
        o._peer_closed = lambda name, peer=None, removed=None: None
        if whole:
            app = create_app(o.cfg, o, Tok())
        else:
            app = FastAPI()
            add_membership_routes(app, ms)
        out.append(TestClient(app))
    return out


@pytest.mark.parametrize("value", ["1", "true"])
def test_force_true(value):
    for c in _clients():
        r = c.delete(f"/pdd/instances/md1?force={value}")
        assert (r.status_code, r.json()["forced"]) == (200, True), r.text


@pytest.mark.parametrize("value", ["0", "false"])
def test_force_false(value):
    for c in _clients():
        r = c.delete(f"/pdd/instances/md1?force={value}")
        assert (r.status_code, r.json()["error"]["code"]) == (409, "in_flight"), r.text


@pytest.mark.parametrize("value", ["yes", "on", "t", "TRUE", "True", "no", "off", "2", "", "maybe"])
def test_anything_else_is_a_400_naming_force(value):
    _refused(f"force={value}", f"force: must be true or false (or 1 or 0), got {value!r}")


def test_no_force_is_false():
    for c in _clients():
        r = c.delete("/pdd/instances/md1")
        assert (r.status_code, r.json()["error"]["code"]) == (409, "in_flight"), r.text


@pytest.mark.parametrize("query,shown", [
    ("force=maybe&force=0", "'maybe', '0'"),
    ("force=true&force=maybe", "'true', 'maybe'"),
    ("force=1&force=1", "'1', '1'"),
    ("force=0&force=true", "'0', 'true'"),
    ("&".join(["force=1"] * 6), "'1', '1', '1', '1', ... (6 values)"),
])
def test_a_repeated_force_is_a_400_naming_force(query, shown):
    """Before, the last value counted: ``?force=maybe&force=0`` removed (the typo ignored) while
    ``?force=true&force=maybe`` was a 400. Either is ambiguous for an operator."""
    _refused(query, f"force: given more than once ({shown}); give it once")


def _refused(query: str, message: str) -> None:
    """``DELETE /pdd/instances/md1?<query>`` is a 400 ``invalid_query`` naming ``force``, on
    every client."""
    for c in _clients():
        r = c.delete(f"/pdd/instances/md1?{query}")
        assert r.status_code == 400, r.text
        assert r.json() == {"error": {"message": message, "type": "invalid_request_error", "param": "force",
                                      "code": "invalid_query"}}
