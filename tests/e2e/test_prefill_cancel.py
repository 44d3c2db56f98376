"""A client that goes away during prefill stops the prefill (issue 26): the cancel reaches P
within one chunk, every tier frees the request's pages, and it is counted cancelled.

A pdd topology whose P prefills in small chunks, each forward pass held to ``STEP_MS``
(``engine.min_step_ms``), so a long prompt takes many chunks. Nothing here assumes where the
prefill is when the client leaves: each test waits (polling P's own counters in /pdd/stats,
bounded) until P has run at least one chunk of the request, then closes the connection, and
asserts from P's counters (``prefill_cancels``: chunks run, chunks run after the abort reached
P) that at most one chunk ran after the cancel reached P and the prefill did not finish. Then
0 leaked pages on every instance, no request left in /pdd/requests, nothing pending on the
WAN, and ``pdd_gateway_outcomes_total{outcome="cancelled"}`` one higher.

Bad timing: a request still queued at P behind another's prefill, and one whose KV is on the
fast path to RLD (a slow fast path makes that phase last), end the same way. A disconnect
during the handoff is a cell of the fault matrix (tests/faults/test_fault_matrix.py,
``client_disconnect__handoff``): it needs the WAN's round trip stretched while the request is
in flight, which that module's link controls do.
"""

from __future__ import annotations

import json
import random
import re
import socket
import threading
import time
from urllib.parse import urlparse

import httpx
import pytest

from pdd.faults import StreamClient
from pdd.launch import Topology
from tests.e2e.conftest import make_cfg

pytestmark = pytest.mark.slow

STEP_MS = 40.0
CHUNK = 32  # prefill chunk = the step's token budget: a second prompt waits behind the first
LONG = 2400  # prompt tokens: 75 chunks, >= 3 s of prefill
WAIT_S = 60.0  # bound of every wait on the topology


def _prompt(seed: int, n: int = LONG) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 4000) for _ in range(n)]


@pytest.fixture(scope="module")
def topo(tmp_path_factory, small_model):
    cfg = make_cfg(small_model, "pdd", engine={"device": "cpu", "min_step_ms": STEP_MS, "prefill_chunk_tokens": CHUNK,
                                               "max_batch_tokens": CHUNK},
                   link={"wan_gbps": 0.05, "wan_rtt_ms": 20.0, "wan_jitter_ms": 0.0, "fast_gbps": 0.02},
                   request_timeout_s=60.0)
    t = Topology(cfg, log_dir=tmp_path_factory.mktemp("cancel-logs"))
    t.start()
    yield t
    t.stop()


def _until(pred, what: str, timeout_s: float = WAIT_S, poll_s: float = 0.02):
    """``pred()``'s first truthy value, polled every ``poll_s`` for at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    stop = threading.Event()
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        stop.wait(poll_s)


def _p(topo) -> dict:
    return httpx.get(topo.url + "/pdd/stats", timeout=30).json()["instances"]["p0"]


def _live(topo) -> dict:
    return httpx.get(topo.url + "/pdd/requests", timeout=30).json()


def _cancelled_total(topo) -> float:
    text = httpx.get(topo.url + "/metrics", timeout=30).text
    m = re.search(r'^pdd_gateway_outcomes_total\{outcome="cancelled"\} (\S+)$', text, re.M)
    return float(m.group(1))


class RawClient:
    """One POST /v1/completions over a plain socket, closed whenever the test says (the client
    goes away; nothing of the response need have arrived)."""

    def __init__(self, topo, body: dict):
        u = urlparse(topo.url)
        self.sock = socket.create_connection((u.hostname, u.port), timeout=WAIT_S)
        payload = json.dumps(body).encode()
        self.sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {u.hostname}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _one_live(topo) -> tuple[str, dict] | None:
    live = _live(topo)
    return next(iter(live.items())) if len(live) == 1 else None


def _settled(topo, before_cancelled: float) -> None:
    """No request left anywhere, every page free, nothing pending on the WAN, one more cancelled."""
    _until(lambda: not _live(topo), "/pdd/requests to empty")
    assert topo.wait_idle(timeout_s=WAIT_S), topo.last_busy
    st = topo.stats()
    assert st["transfers_pending"] == 0, st["totals"]
    assert st["wan_bytes"] == st["wan_bytes_expected"], st["totals"]  # planned = sent + cancelled
    fl = topo.flush()
    assert fl["leaked_pages"] == 0 and not fl["unreachable"], fl
    assert all(v["pages_free"] == v["pages_total"] for v in fl["instances"].values()), fl
    assert _cancelled_total(topo) == before_cancelled + 1


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non_stream"])
def test_disconnect_before_the_first_byte_stops_the_prefill_within_one_chunk(topo, stream):
    topo.flush()
    before = _cancelled_total(topo)
    p_before = _p(topo)["counters"]
    client = RawClient(topo, {"prompt": _prompt(1 if stream else 2), "max_tokens": 8, "temperature": 0,
                              "stream": stream})
    try:
        rid, view = _until(lambda: _one_live(topo), "the request to reach the gateway")
        trid = view["trid"]
        live = _until(lambda: (_p(topo)["prefill_live"].get(trid) or {}).get("chunks", 0) >= 1 and
                      _p(topo)["prefill_live"][trid], "P to run a chunk of it")
        assert live["prefilled_tokens"] < live["prompt_tokens"] == LONG
    finally:
        client.close()  # before any byte of the response
    entry = _until(lambda: next((c for c in _p(topo)["prefill_cancels"] if c["rid"] == trid), None),
                   "P to report the request's prefill cancelled")
    assert entry["chunks_after_cancel"] <= 1, entry  # at most the chunk in flight when the cancel came
    assert entry["prefilled_tokens"] < entry["prompt_tokens"] == LONG, entry  # it never finished
    assert entry["chunks"] < -(-LONG // CHUNK)
    p_after = _p(topo)["counters"]
    assert p_after.get("prefill_cancelled", 0) == p_before.get("prefill_cancelled", 0) + 1
    _settled(topo, before)


def test_disconnect_while_queued_behind_another_prefill(topo):
    """B waits at P behind A's prefill (the step's whole budget goes to A, first come first
    served); B's client leaves: B is dropped before any chunk of it ran, A completes."""
    topo.flush()
    before = _cancelled_total(topo)
    a = StreamClient(topo.url, {"prompt": _prompt(3), "max_tokens": 4, "temperature": 0, "ignore_eos": True},
                     timeout_s=WAIT_S).start()
    try:
        a_trid = _until(lambda: next((v["trid"] for v in _live(topo).values()), None), "A at the gateway")
        _until(lambda: (_p(topo)["prefill_live"].get(a_trid) or {}).get("chunks", 0) >= 1, "P to run a chunk of A")
        b = RawClient(topo, {"prompt": _prompt(4), "max_tokens": 4, "temperature": 0, "stream": True})
        try:
            b_trid = _until(lambda: next((v["trid"] for v in _live(topo).values() if v["trid"] != a_trid), None),
                            "B at the gateway")
            waiting = _until(lambda: _p(topo)["prefill_live"].get(b_trid), "B to be queued at P")
            assert waiting["chunks"] == 0, waiting
        finally:
            b.close()
        entry = _until(lambda: next((c for c in _p(topo)["prefill_cancels"] if c["rid"] == b_trid), None),
                       "P to report B cancelled")
        # still queued when the cancel reached P (A's prefill has seconds to go): no chunk of B ran
        assert entry["chunks"] == 0 and entry["chunks_after_cancel"] == 0 and entry["prefilled_tokens"] == 0, entry
        assert a.wait(WAIT_S) and a.error is None, a.error
        assert len(a.tokens) == 4 and a.finish_reason == "length"
    finally:
        a.close()
    _settled(topo, before)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non_stream"])
def test_disconnect_during_the_fast_path_send_to_rld(topo, stream):
    """P has prefilled and streams the KV to RLD (a 0.02 Gbit/s fast path: ~2 s for this prompt);
    no token has reached the client. The client leaves: P's streams are cancelled, every tier
    frees the request."""
    topo.flush()
    before = _cancelled_total(topo)
    client = RawClient(topo, {"prompt": _prompt(5 if stream else 6), "max_tokens": 8, "temperature": 0,
                              "stream": stream})
    try:
        rid, view = _until(lambda: _one_live(topo), "the request to reach the gateway")
        trid = view["trid"]

        def on_fast_path():
            v = _live(topo).get(rid)
            if v is None or v["phase"] != "transfer" or v["next_pos"] != 0:
                return None
            return v if trid not in _p(topo)["prefill_live"] else None

        v = _until(on_fast_path, "P to stream the KV to RLD")
        assert (v["phase"], v["next_pos"]) == ("transfer", 0)
    finally:
        client.close()
    _settled(topo, before)
    assert not any(c["rid"] == trid for c in _p(topo)["prefill_cancels"])  # its prefill had finished


def test_a_server_timeout_during_prefill_stops_it_too(tmp_path_factory, small_model):
    """``request_timeout_s`` shorter than the prefill: the gateway's call to P times out, the
    request fails and is aborted on every tier; P stops at its next chunk boundary."""
    cfg = make_cfg(small_model, "pdd", engine={"device": "cpu", "min_step_ms": STEP_MS, "prefill_chunk_tokens": CHUNK,
                                               "max_batch_tokens": CHUNK},
                   request_timeout_s=1.0)
    with Topology(cfg, log_dir=tmp_path_factory.mktemp("cancel-timeout-logs")) as t:
        r = httpx.post(t.url + "/v1/completions", json={"prompt": _prompt(7), "max_tokens": 4}, timeout=WAIT_S)
        assert r.status_code == 503, r.text
        assert "timed out" in r.json()["error"]["message"]
        p = _until(lambda: _p(t) if _p(t)["prefill_cancels"] else None, "P to report the prefill cancelled")
        (entry,) = p["prefill_cancels"]
        assert entry["chunks_after_cancel"] <= 1 and entry["prefilled_tokens"] < entry["prompt_tokens"], entry
        assert p["counters"]["prefill_cancelled"] == 1
        _until(lambda: not _live(t), "/pdd/requests to empty")
        assert t.wait_idle(timeout_s=WAIT_S), t.last_busy
        st = t.stats()
        assert st["totals"]["failed"] == 1 and st["totals"]["cancelled"] == 0
        assert st["transfers_pending"] == 0 and st["wan_bytes"] == st["wan_bytes_expected"], st["totals"]
        fl = t.flush()
        assert fl["leaked_pages"] == 0, fl
