"""``pdd.gateway.membership``: add, drain and remove instances on a real orchestrator over fake
connections (no processes), and the HTTP endpoints' answers and error bodies."""

import asyncio
import types

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from pdd.config import ClusterConfig
from pdd.gateway.membership import JOIN_RETRIES, Membership, MembershipError, parse_address
from pdd.gateway.membership_api import add_membership_routes
from pdd.gateway.orchestrator import Orchestrator
from pdd.gateway.state import ReqState
from pdd.policy.membership import ACTIVE, DRAINING, REMOVED, STANDBY
from pdd.topology import ROLE_MAIN, layout
from pdd.types import SamplingParams
from tests.gateway.fake_peer import FakePeer


class PoolPeer(FakePeer):
    """Answers ``stats`` with ``held`` pages not free of 64, ``cached`` of them held only by the
    prefix cache (``pages_cached``, as an instance's ``StatsOk``), ``flush`` with ``leaked`` left."""

    def __init__(self, held=5, leaked=0, cached=0):
        super().__init__()
        self.held, self.leaked, self.cached = held, leaked, cached

    async def call(self, h, payload=b"", timeout=None):
        self.sent.append(dict(h))
        if h.get("t") == "stats":
            return {"pages_total": 64, "pages_free": 64 - self.held, "running": 0, "pages_cached": self.cached}, b""
        if h.get("t") == "flush":
            return {"pages_total": 64, "pages_free": 64 - self.leaked, "live_requests": 0}, b""
        return {"t": "ok"}, b""


def _setup(standby=("md1",), **inst):
    cfg = ClusterConfig.model_validate({"mode": "pdd", "base_port": 18000, "standby": list(standby),
                                        "instances": {"prefill": 1, "relay_decode": 1, "main_decode": 2, **inst}})
    lay = layout(cfg)
    o = Orchestrator(cfg, lay)
    ms = Membership(o, lay, cfg.standby)
    o.peers = {s.name: PoolPeer() for s in o.layout.engines}
    connects = []

    async def connect(name, retries):
        connects.append((name, retries))
        return PoolPeer(held=0)

    o._connect = connect
    return o, ms, connects


def test_standby_slot_is_not_in_the_gateway_layout():
    o, ms, _ = _setup()
    assert [s.name for s in o.layout.engines] == ["p0", "rld0", "md0"]
    states = {m["name"]: (m["state"], m["address"], m["reached_at"]) for m in ms.listing()["data"]}
    assert states == {"p0": (ACTIVE, "127.0.0.1:18010", "127.0.0.1:18010"),
                      "rld0": (ACTIVE, "127.0.0.1:18040", "127.0.0.1:18040"),
                      "md0": (ACTIVE, "127.0.0.1:18070", "127.0.0.1:18001"),
                      "md1": (STANDBY, "127.0.0.1:18071", "127.0.0.1:18002")}
    assert o.health() == {"status": "ok", "mode": "pdd", "down": [], "missing": []}


def test_add_drain_remove_and_routing_follows():
    o, ms, connects = _setup()

    async def run():
        assert await o._route(ROLE_MAIN, [1] * 40) == "md0"
        rep = await ms.add("main_decode", address="127.0.0.1:18071")  # by address: the md1 slot
        assert (rep["name"], rep["state"], rep["source"], rep["connected"]) == ("md1", ACTIVE, "joined", True)
        assert connects == [("md1", JOIN_RETRIES)]
        assert [s.name for s in o.layout.by_role(ROLE_MAIN)] == ["md0", "md1"]
        assert len(o.prefix_index["md1"]) == 0
        o.inflight["md0"] = 2  # two requests still decoding there
        rep = await ms.drain("md0")
        assert (rep["state"], rep["in_flight"]) == (DRAINING, 2)
        assert {k: v for k, v in rep["prefix_cache"].items() if k.startswith("pages_")} == {
            "pages_in_use": 5, "pages_cached": 0, "pages_free": 59, "pages_total": 64}
        for i in range(3):  # every new request goes to md1, whatever the cache says
            assert await o._route(ROLE_MAIN, [1] * 40) == "md1"
        with pytest.raises(MembershipError) as ei:
            await ms.remove("md0")
        assert ei.value.status == 409 and "still has 2 in-flight" in ei.value.message
        o.inflight["md0"] = 0
        o.prefix_index["md0"].insert([1] * 48)
        peer0 = o.peers["md0"]
        rep = await ms.remove("md0")
        assert rep["state"] == REMOVED and rep["leaked_pages"] == 0 and rep["forced"] is False
        assert rep["prefix_cache"]["pages_dropped"] == 5
        assert rep["prefix_cache"]["tokens_dropped"] == 5 * o.cfg.engine_for("md0").page_size
        assert rep["prefix_cache"]["gateway_index_pages_forgotten"] == 48 // o.cfg.engine_for("md0").page_size
        assert [h["t"] for h in peer0.sent[-2:]] == ["stats", "flush"] and peer0.closed
        assert "md0" not in o.peers and "md0" not in o.prefix_index
        assert [s.name for s in o.layout.by_role(ROLE_MAIN)] == ["md1"]
        assert o.health()["status"] == "ok"
        assert ms.changes == {"add": 1, "drain": 1, "remove": 1}
        assert [(e["op"], e["instance"], e["from"], e["to"]) for e in ms.events] == [
            ("add", "md1", STANDBY, ACTIVE), ("drain", "md0", ACTIVE, DRAINING), ("remove", "md0", DRAINING, REMOVED)]
        # a removed slot is free again: it can be added back
        rep = await ms.add("main_decode")
        assert (rep["name"], rep["state"]) == ("md0", ACTIVE)

    asyncio.run(run())


def test_busy_counts_live_requests_pending_transfers_and_kv_on_its_way():
    o, ms, _ = _setup()
    st = ReqState("r1", [1, 2, 3], SamplingParams(max_tokens=4))
    st.names = {"prefill": "p0", "main_decode": "md0"}
    o.reqs["r1"] = st
    o.planned_src["t2"] = "p0"
    o.awaiting_kv["t3"] = ("p0", "md0")
    assert ms.busy("md0") == 2 and ms.busy("p0") == 3 and ms.busy("rld0") == 0


def test_forced_remove_recovers_its_requests_as_after_a_loss():
    """Its requests are recovered, the gateway's connection closed, and its cache flushed over a
    fresh connection (the gateway's own is gone)."""
    o, ms, connects = _setup(standby=())
    lost = []
    o._peer_closed = lambda name, peer=None, removed=None: lost.append(name)
    o.inflight["md1"] = 1
    peer1 = o.peers["md1"]

    async def run():
        with pytest.raises(MembershipError):
            await ms.remove("md1")
        return await ms.remove("md1", force=True)

    rep = asyncio.run(run())
    assert lost == ["md1"] and rep["forced"] is True and rep["leaked_pages"] == 0
    assert rep["state"] == REMOVED and rep["prefix_cache"]["flushed"] is True
    assert peer1.closed and peer1.sent == [] and connects == [("md1", 2)]


def test_last_active_of_a_role_is_not_drained_or_removed():
    o, ms, _ = _setup()

    async def run():
        for op in (ms.drain, ms.remove):
            with pytest.raises(MembershipError) as ei:
                await op("p0")
            assert ei.value.status == 409
            assert ei.value.message == "instance p0 is the last active prefill instance: add another first (or force)"

    asyncio.run(run())


@pytest.mark.parametrize("addr", ["18071", "host:", "127.0.0.1:99999", "127.0.0.1:port", "a b:1",
                                  "127.0.0.1:\u00b2", "127.0.0.1:\u0669\u0663\u0664\u0661"])
def test_bad_address(addr):
    with pytest.raises(MembershipError) as ei:
        parse_address(addr)
    assert (ei.value.status, ei.value.param, ei.value.code) == (400, "address", "bad_address")


def test_parse_address_forms():
    assert parse_address("http://127.0.0.1:18071/") == ("127.0.0.1", 18071)
    assert parse_address("localhost:1") == ("localhost", 1)


def _client():
    o, ms, connects = _setup()
    app = FastAPI()
    add_membership_routes(app, ms)
    return TestClient(app), o, ms


def test_http_endpoints_and_error_bodies():
    c, o, ms = _client()
    r = c.get("/pdd/instances")
    assert r.status_code == 200 and [m["state"] for m in r.json()["data"]] == [ACTIVE, ACTIVE, ACTIVE, STANDBY]

    def err(r, status, code, param):
        assert r.status_code == status, r.text
        e = r.json()["error"]
        assert (e["code"], e["param"], e["type"]) == (code, param, "invalid_request_error")
        return e["message"]

    assert err(c.post("/pdd/instances", json={"role": "decoder"}), 400, "unknown_role", "role") == \
        "unknown role 'decoder'; expected one of prefill, relay_decode, main_decode, colocated"
    assert err(c.post("/pdd/instances", json={"role": "colocated"}), 400, "unknown_role", "role") == \
        "the pdd topology has no colocated instances (roles: main_decode, prefill, relay_decode)"
    err(c.post("/pdd/instances", json={"name": "md1"}), 400, "invalid_body", "role")
    err(c.post("/pdd/instances", json={"role": "main_decode", "bogus": 1}), 400, "invalid_body", "bogus")
    assert err(c.post("/pdd/instances", content=b'{"role": "main_decode"}', headers={"content-type": "text/plain"}),
               415, "unsupported_media_type", None).startswith("Unsupported Media Type")
    err(c.post("/pdd/instances", content=b"{not json", headers={"content-type": "application/json"}), 400,
        "invalid_body", None)
    assert err(c.post("/pdd/instances", json={"role": "main_decode", "name": "md7"}), 404, "instance_not_found",
               "name").startswith("no instance named 'md7'")
    err(c.post("/pdd/instances", json={"role": "main_decode", "address": "nohost"}), 400, "bad_address", "address")
    err(c.post("/pdd/instances", json={"role": "main_decode", "address": "127.0.0.1:18070"}), 409,
        "duplicate_address", "address")
    err(c.post("/pdd/instances", json={"role": "main_decode", "name": "md1", "address": "127.0.0.1:18072"}), 409,
        "address_conflict", "address")
    err(c.post("/pdd/instances", json={"role": "main_decode", "address": "127.0.0.1:18079"}), 404,
        "instance_not_found", "address")
    assert err(c.post("/pdd/instances", json={"role": "main_decode", "name": "md0"}), 409, "duplicate", "name") == \
        "instance md0 is already a member (active)"
    err(c.post("/pdd/instances", json={"role": "prefill", "name": "md1"}), 400, "role_mismatch", "role")
    err(c.post("/pdd/instances/nope/drain"), 404, "instance_not_found", "name")
    err(c.delete("/pdd/instances/nope"), 404, "instance_not_found", "name")
    err(c.delete("/pdd/instances/md1"), 409, "conflict", "name")  # standby: not a member

    r = c.post("/pdd/instances", json={"role": "main_decode", "name": "md1"})
    assert r.status_code == 200 and r.json()["state"] == ACTIVE
    err(c.post("/pdd/instances", json={"role": "main_decode"}), 409, "no_free_slot", "role")
    o.inflight["md0"] = 1
    r = c.post("/pdd/instances/md0/drain", json={})
    assert r.status_code == 200 and r.json()["state"] == DRAINING and r.json()["in_flight"] == 1
    assert err(c.delete("/pdd/instances/md0"), 409, "in_flight", "name").startswith("instance md0 still has 1")
    o.inflight["md0"] = 0
    r = c.delete("/pdd/instances/md0")
    assert r.status_code == 200 and r.json()["state"] == REMOVED and r.json()["leaked_pages"] == 0


def test_remove_of_a_removed_instance_still_counting_in_flight_is_a_conflict_not_in_flight():
    """A second DELETE (two operators, or a retried call) of an instance already removed whose
    requests are still counted there (forced: being recovered elsewhere) is refused as "not a
    member", code ``conflict``; before, its code said ``in_flight`` while its message said "is
    removed: not a member"."""
    c, o, ms = _client()
    r = c.delete("/pdd/instances/md0?force=true")
    assert r.status_code == 200 and r.json()["state"] == REMOVED
    o.inflight["md0"] = 2  # its forced requests, recovered elsewhere, not yet unassigned
    r = c.delete("/pdd/instances/md0?force=true")
    assert r.status_code == 409
    assert r.json()["error"] == {"message": "instance md0 is removed: not a member", "type": "invalid_request_error",
                                 "param": "name", "code": "conflict"}
    r = c.delete("/pdd/instances/md0")
    assert (r.status_code, r.json()["error"]["code"]) == (409, "conflict")


def test_metrics_collector():
    from prometheus_client import generate_latest

    o, ms, _ = _setup()
    o.routed["md0"] = 7
    text = generate_latest(o.metrics.registry).decode()
    assert 'pdd_gateway_routed_total{instance="md0",role="main_decode"} 7.0' in text
    assert 'pdd_gateway_instance_state{instance="md1",role="main_decode",state="standby"} 1.0' in text
    assert 'pdd_gateway_instance_in_flight{instance="md0",role="main_decode"} 0.0' in text


class RolePeer(PoolPeer):
    """Answers ``set_role`` as an instance that flushed ``held`` pages (``leaked`` left)."""

    async def call(self, h, payload=b"", timeout=None):
        if h.get("t") == "set_role":
            self.sent.append(dict(h))
            return {"t": "set_role_ok", "role": h["role"], "pages_dropped": self.held - self.leaked,
                    "tokens_dropped": (self.held - self.leaked) * 16, "pages_total": 64,
                    "pages_free": 64 - self.leaked}, b""
        return await super().call(h, payload, timeout)


def _rerole_setup(rerole=("rld0",)):
    cfg = ClusterConfig.model_validate({"mode": "pdd", "base_port": 18000, "rerole": list(rerole),
                                        "instances": {"prefill": 1, "relay_decode": 2, "main_decode": 1},
                                        "policy": {"pipeline_ttft_budget_ms": 0}})  # relayed at once unless an MD is in A
    lay = layout(cfg)
    o = Orchestrator(cfg, lay)
    ms = Membership(o, lay, cfg.standby)
    o.peers = {s.name: RolePeer(held=0) for s in o.layout.engines}
    return o, ms


def test_rerole_drains_then_switches_and_routing_follows():
    o, ms = _rerole_setup()
    o.inflight["rld0"] = 1  # a relay still decoding there

    async def run():
        task = asyncio.ensure_future(ms.rerole("rld0", "main_decode"))
        await asyncio.sleep(0.01)
        assert ms.members["rld0"].state == DRAINING and not task.done()  # waits for the relay
        assert await o._route("relay_decode", [1] * 40) == "rld1"  # no new relay goes there
        assert [h["t"] for h in o.peers["rld0"].sent] == []  # not switched while busy
        o.inflight["rld0"] = 0
        rep = await task
        assert (rep["role"], rep["slot_role"], rep["state"], rep["role_from"], rep["drained_in_flight"]) == \
            ("main_decode", "relay_decode", ACTIVE, "relay_decode", 1)
        assert rep["leaked_pages"] == 0 and rep["prefix_cache"]["pages_dropped"] == 0
        assert o.peers["rld0"].sent == [{"t": "set_role", "role": "main_decode"}]
        mds = [(s.name, s.dc, s.port) for s in o.layout.by_role(ROLE_MAIN)]
        assert mds == [("rld0", "A", 18040), ("md0", "B", 18070)]
        assert [s.name for s in o.layout.by_role("relay_decode")] == ["rld1"]
        assert o._always_relay() is False  # an MD in A: the plan waits for MD's choice
        assert ms.changes == {"add": 0, "drain": 1, "remove": 0, "rerole": 1}
        # back: its MD cache (3 pages) is flushed and reported
        o.peers["rld0"].held = 3
        rep = await ms.rerole("rld0", "relay_decode")
        assert (rep["role"], rep["prefix_cache"]["pages_dropped"], rep["prefix_cache"]["tokens_dropped"]) == \
            ("relay_decode", 3, 48)
        assert [s.name for s in o.layout.by_role("relay_decode")] == ["rld0", "rld1"]
        assert o._always_relay() is True
        # the same role again: nothing to do
        rep = await ms.rerole("rld0", "relay_decode")
        assert rep["changed"] is False

    asyncio.run(run())


def test_rerole_refusals():
    o, ms = _rerole_setup()

    async def run():
        for name, role, status, code in (("rld1", "main_decode", 403, "rerole_not_allowed"),
                                         ("rld0", "prefill", 400, "unknown_role"),
                                         ("md0", "relay_decode", 403, "rerole_not_allowed"),
                                         ("nope", "main_decode", 404, "instance_not_found")):
            with pytest.raises(MembershipError) as ei:
                await ms.rerole(name, role)
            assert (ei.value.status, ei.value.code) == (status, code), ei.value.message
        await ms.drain("rld1")  # rld0 is the last active RLD now
        with pytest.raises(MembershipError) as ei:
            await ms.rerole("rld0", "main_decode")
        assert ei.value.status == 409 and "last active relay_decode" in ei.value.message
        # still busy after the wait: active again in its old role
        o.inflight["rld0"] = 1
        with pytest.raises(MembershipError) as ei:
            await ms.rerole("rld0", "main_decode", force=True, wait_s=0.0)
        assert ei.value.status == 409 and ei.value.code == "in_flight"
        assert (ms.members["rld0"].state, ms.members["rld0"].role) == (ACTIVE, "relay_decode")
        assert ms.changes["rerole_refused"] == 1 and "rerole" not in ms.changes
        assert await o._route("relay_decode", [1] * 40) == "rld0"  # routable again (rld1 is draining)

    asyncio.run(run())


def test_rerole_config_names_a_relay_decoder():
    with pytest.raises(ValueError, match="rerole: 'md0' is not a relay_decode instance"):
        ClusterConfig.model_validate({"mode": "pdd", "rerole": ["md0"]})
    with pytest.raises(ValueError, match="rerole: 'p0' is not a relay_decode instance"):
        ClusterConfig.model_validate({"mode": "pdd", "rerole": ["p0"]})
    with pytest.raises(ValueError, match=r"rerole: 'rld0' is not a relay_decode instance of the cross_dc_pd "
                                         r"topology \(relay decoders: none\)"):
        ClusterConfig.model_validate({"mode": "cross_dc_pd", "rerole": ["rld0"]})


def test_rerole_config_lists_each_relay_decoder_once():
    """`rerole: [rld0, rld0]` was accepted."""
    with pytest.raises(ValueError, match="rerole: 'rld0' listed more than once; list each relay decoder once"):
        ClusterConfig.model_validate({"mode": "pdd", "rerole": ["rld0", "rld0"]})
    cfg = ClusterConfig.model_validate({"mode": "pdd", "instances": {"relay_decode": 2}, "rerole": ["rld1", "rld0"]})
    assert cfg.rerole == ["rld1", "rld0"]


def test_role_endpoint_and_strict_bools():
    o, ms = _rerole_setup()
    app = FastAPI()
    add_membership_routes(app, ms)
    c = TestClient(app)
    r = c.post("/pdd/instances/rld0/role", json={"role": "main_decode"})
    assert r.status_code == 200 and r.json()["role"] == "main_decode", r.text
    r = c.post("/pdd/instances/rld1/role", json={"role": "main_decode"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "rerole_not_allowed"
    for path, body, field in (("/pdd/instances", {"role": "main_decode", "start": "yes"}, "start"),
                              ("/pdd/instances/md0/drain", {"force": 1}, "force"),
                              ("/pdd/instances/md0/drain", {"remove_when_idle": "true"}, "remove_when_idle"),
                              ("/pdd/instances/rld0/role", {"role": "relay_decode", "force": "no"}, "force")):
        r = c.post(path, json=body)
        assert r.status_code == 400, r.text
        assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("invalid_body", field)


def test_bad_query_value_carries_a_code():
    from pdd.gateway.api import create_app

    class Tok:  # what the app reads of a tokenizer when it is built
        def get_vocab_size(self, with_added_tokens=True):
            return 256

    o, ms, _ = _setup()
    c = TestClient(create_app(o.cfg, o, Tok()))
    r = c.delete("/pdd/instances/md0?force=maybe")
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    assert (e["code"], e["param"]) == ("invalid_query", "force"), e


def test_removed_md_leaves_the_wan_peer_metrics():
    from prometheus_client import generate_latest

    o, ms, _ = _setup(standby=())
    o.wan_peers.add_rtt("md1", 20.0)
    o.wan_peers.add_goodput("md1", 5.0)
    text = generate_latest(o.metrics.registry).decode()
    assert 'pdd_wan_peer_rtt_seconds{instance="md1"}' in text and 'pdd_wan_peer_goodput_bytes_per_second{instance="md1"}' in text

    async def run():
        await ms.drain("md1")
        await ms.remove("md1")

    asyncio.run(run())
    text = generate_latest(o.metrics.registry).decode()
    assert 'instance="md1"}' not in "".join(l for l in text.splitlines() if l.startswith("pdd_wan_peer"))


def test_public_accessors_are_snapshots():
    o, ms, _ = _setup()
    act = ms.members_of("main_decode")
    assert [(m.name, m.state, m.source) for m in act] == [("md0", ACTIVE, "config")]
    assert [m.name for m in ms.members_of(None, None)] == ["p0", "rld0", "md0", "md1"]
    assert [m.name for m in ms.members_of("main_decode", STANDBY)] == ["md1"]
    with pytest.raises(Exception):
        act[0].state = DRAINING  # read-only
    assert ms.changing is False
    ms._busy_ops.add("md1")
    assert ms.changing is True


def test_admission_capacities_follow_membership():
    from pdd.gateway.admission import Admission, resolve_limits

    cfg = ClusterConfig.model_validate({
        "mode": "pdd", "base_port": 18000, "standby": ["md2"], "rerole": ["rld0"],
        "engine": {"max_running": 8, "num_pages": 100, "page_size": 16},
        "tiers": {"relay_decode": {"engine": {"max_running": 4}}},
        "instances": {"prefill": 2, "relay_decode": 2, "main_decode": 3}})
    lay = layout(cfg)
    o = Orchestrator(cfg, lay)
    ms = Membership(o, lay, cfg.standby)
    o.peers = {s.name: RolePeer(held=0) for s in o.layout.engines}

    async def connect(name, retries):
        return RolePeer(held=0)

    o._connect = connect
    adm = Admission.from_config(cfg, o.layout)
    ms.admission = adm

    def caps():
        lim = adm.limits
        return lim.max_inflight, lim.max_queued_tokens, lim.max_choices, lim.max_prefills

    # MD slots x (max_running + tier_max_waiting, default one batch); P's pool in tokens; the
    # choices per request the active RLDs (2 x (4 + 4)) and MDs (2 x (8 + 8)) hold, the smaller;
    # the prefills at once the active Ps hold (2 x (8 + 8))
    assert caps() == ((8 + 8) * 2, 100 * 16 * 2, 16, 32)
    assert resolve_limits(cfg, ms.serving_layout()) == adm.limits

    async def run():
        out = []
        await ms.add("main_decode", name="md2")
        out.append(caps())
        await ms.drain("md0")  # draining: takes no new request, so no capacity for one
        out.append(caps())
        await ms.remove("md0")
        out.append(caps())
        await ms.rerole("rld0", "main_decode")  # an MD in A with its own engine block (max_running 4)
        out.append(caps())
        await ms.drain("p1")
        out.append(caps())
        await ms.rerole("rld0", "relay_decode")
        out.append(caps())
        return out

    # re-roled, rld0 leaves the relay decoders (8 places, rld1's, now the smallest) for the MDs
    assert asyncio.run(run()) == [(48, 3200, 16, 32), (32, 3200, 16, 32), (32, 3200, 16, 32), (32 + 8, 3200, 8, 32),
                                  (40, 1600, 8, 16), (32, 1600, 16, 16)]
    # configured (non-derived) limits stay as set
    cfg2 = cfg.model_copy(update={"limits": cfg.limits.model_copy(update={"max_inflight_requests": 5})})
    assert resolve_limits(cfg2, ms.serving_layout()).max_inflight == 5


def test_health_is_degraded_while_a_role_has_no_active_member():
    """Draining the only relay decoder leaves P and an MD serving (requests go P->MD): /health
    says degraded, not ok, though no connection is down; active again, ok."""
    o, ms, _ = _setup()

    async def run():
        assert o.health()["status"] == "ok"
        await ms.drain("rld0", force=True)
        assert o.health() == {"status": "degraded", "mode": "pdd", "down": [], "missing": ["relay_decode"]}

    asyncio.run(run())


def test_an_operator_body_that_is_not_utf8_says_so_and_a_utf8_bom_is_ignored():
    """As on /v1 (pdd.gateway.openai_schemas.not_utf8): a UTF-16 body said "body: Invalid JSON:
    expected value at line 1 column 1"; a UTF-8 byte-order mark (RFC 8259 8.1: a parser MAY
    ignore one) was refused the same way."""
    c, o, ms = _client()
    for body, why in ((b"\xff\xfe", "byte 0xff at offset 0"),
                      ('{"force": true}'.encode("utf-16-le"), "byte 0x00 at offset 1: it reads as UTF-16-LE")):
        r = c.post("/pdd/instances/md0/drain", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"] == {"message": f"request body is not valid JSON: it is not UTF-8 text ({why}); "
                                                "send JSON encoded as UTF-8", "type": "invalid_request_error",
                                     "param": None, "code": "invalid_body"}
    r = c.post("/pdd/instances", content=b'\xef\xbb\xbf{"role": "decoder"}', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_role", r.text  # the body was read


class SlowFlushPeer(PoolPeer):
    """A PoolPeer whose ``flush`` answers only once ``release`` is set (``flushing`` is set when
    it is asked)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.flushing, self.release = asyncio.Event(), asyncio.Event()

    async def call(self, h, payload=b"", timeout=None):
        if h.get("t") == "flush":
            self.flushing.set()
            await self.release.wait()
        return await super().call(h, payload, timeout)


def test_an_instance_being_removed_takes_no_new_request_while_its_cache_is_flushed():
    """Removing an idle active instance flushes it (two calls) before it leaves the membership: a
    request routed in between went to it, and lost its instance (its connection closed without
    recovery, the peer gone from the gateway) once the removal went on."""
    o, ms, _ = _setup(standby=())
    o.inflight["md0"] = 3  # md1 is the less loaded: it would take a new request

    async def run():
        slow = o.peers["md1"] = SlowFlushPeer()
        rm = asyncio.ensure_future(ms.remove("md1"))
        await slow.flushing.wait()
        routed = await o._route(ROLE_MAIN, [1] * 40)
        slow.release.set()
        return routed, await rm

    routed, rep = asyncio.run(run())
    assert routed == "md0"
    assert (rep["state"], rep["leaked_pages"], rep["forced"]) == (REMOVED, 0, False)


def test_a_request_that_reached_an_instance_during_its_removal_is_recovered():
    """One routed there before the removal began but assigned while its cache was flushed (routing
    awaits a peek before the assignment) is recovered as after a loss, not left pointing at an
    instance whose connection the removal closes."""
    o, ms, _ = _setup(standby=())
    lost = []
    o._peer_closed = lambda name, peer=None, removed=None: lost.append(name)

    async def run():
        slow = o.peers["md1"] = SlowFlushPeer()
        rm = asyncio.ensure_future(ms.remove("md1"))
        await slow.flushing.wait()
        o.inflight["md1"] = 1
        slow.release.set()
        return await rm

    rep = asyncio.run(run())
    assert lost == ["md1"]
    assert (rep["state"], rep["in_flight_recovered"], rep["forced"]) == (REMOVED, 1, False)


def test_health_follows_a_role_whose_every_instance_was_removed():
    """/health read "ok" with the only P removed (force): a role with no member left dropped out
    of the gateway's layout, so nothing counted it missing, and every request was a 503."""
    o, ms, _ = _setup()

    async def run():
        out = []
        await ms.remove("rld0", force=True)  # P and an MD serve, P->MD
        out.append((o.health()["status"], o.health()["missing"]))
        await ms.remove("p0", force=True)  # nothing can be prefilled: /health says which role is missing
        out.append((o.health()["status"], o.health()["missing"]))
        await ms.add("prefill")
        await ms.add("relay_decode")
        out.append((o.health()["status"], o.health()["missing"]))
        return out

    assert asyncio.run(run()) == [("degraded", ["relay_decode"]), ("unavailable", ["prefill", "relay_decode"]),
                                  ("ok", [])]


def test_a_request_routed_to_an_instance_removed_since_starts_again_elsewhere():
    """A forced removal pops the instance's connection while a request that had routed to it is
    still starting: looking it up raised KeyError, which failed the request with a 503 reading
    "'p0'" though another P was up; it is a ConnectionError now, which start_request retries on
    live instances as after a loss."""
    o, ms, _ = _setup(prefill=2)
    st = types.SimpleNamespace(names={"prefill": "p0"})
    assert o._peer(st, "prefill") == ("p0", o.peers["p0"])

    async def run():
        await ms.remove("p0", force=True)
    asyncio.run(run())
    with pytest.raises(ConnectionError, match="instance p0 was removed"):
        o._peer(st, "prefill")


def test_a_drain_that_removes_when_idle_says_the_gateway_removes_it():
    """``drain {remove_when_idle: true}`` answered "remove it when in_flight is 0" though the
    gateway removes it itself (found by a new user); a plain drain still tells the operator to."""
    o, ms, _ = _setup(standby=(), main_decode=3)

    async def run():
        o.inflight["md0"] = 1  # one request still decoding there: the watcher waits
        plain = await ms.drain("md1")
        assert plain["message"].endswith("; remove it when in_flight is 0")
        rep = await ms.drain("md0", remove_when_idle=True)
        assert rep["remove_when_idle"] is True
        assert rep["message"] == ("no new requests go to md0; its 1 in-flight request(s) finish there; "
                                  "the gateway removes it once in_flight is 0")
        ms._watchers.pop("md0").cancel()

    asyncio.run(run())


def test_an_operator_body_nested_too_deeply_says_so():
    """As on /v1 (pdd.gateway.openai_schemas.too_deep)."""
    c, o, ms = _client()
    r = c.post("/pdd/instances/md0/drain", content='{"force": ' + "[" * 100_000 + "]" * 100_000 + "}",
               headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": "request body is nested too deeply: JSON arrays and objects may nest at "
                                            "most 512 levels deep", "type": "invalid_request_error", "param": None,
                                 "code": "invalid_body"}


def test_delete_of_the_last_active_instance_with_requests_in_flight_is_a_conflict_naming_both():
    """It answered 409 ``in_flight`` ("drain it and wait"), though the role's last active instance
    cannot be drained either: ``conflict``, the message naming both reasons."""
    c, o, ms = _client()  # md0 the only active main decoder (md1 standby)
    o.inflight["md0"] = 2
    r = c.delete("/pdd/instances/md0")
    assert r.status_code == 409, r.text
    assert r.json()["error"] == {
        "message": "instance md0 is the last active main_decode instance and still has 2 in-flight request(s) or "
                   "transfer(s): add another first, then drain it and wait until in_flight is 0 (or force)",
        "type": "invalid_request_error", "param": "name", "code": "conflict"}
    assert ms.view("md0")["state"] == ACTIVE


def test_a_refusal_echoes_a_huge_value_bounded():
    """An address of 1,000,000 characters got a 409 holding it twice (2,000,156 bytes): each value
    a message echoes is cut to ``SHOWN_CHARS`` characters, then its full length
    (``pdd.text.shown``)."""
    c, o, ms = _client()
    addr = "a" * 1_000_000 + ":1"
    r = c.post("/pdd/instances", json={"role": "main_decode", "address": addr})
    assert r.status_code == 409, r.text[:300]
    cut = "'" + "a" * 119
    assert r.json()["error"] == {
        "message": f"address {cut}... (1000002 characters): host {cut}... (1000000 characters) is not this "
                   "topology's host 127.0.0.1", "type": "invalid_request_error", "param": "address",
        "code": "address_conflict"}
    assert len(r.content) < 500
    r = c.post("/pdd/instances", json={"role": "x" * 10_000})
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        f"unknown role '{'x' * 119}... (10000 characters); expected one of prefill, relay_decode, main_decode, "
        "colocated")
    r = c.post("/pdd/instances", json={"role": "main_decode", "address": "b" * 10_000})
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        f"address '{'b' * 119}... (10000 characters) is not host:port (port 1-65535)")


def test_shown_keeps_a_short_value_whole():
    from pdd.text import shown

    assert shown("md0") == "'md0'" and shown(None) == "None" and shown([1, 2]) == "[1, 2]"
    assert shown("a" * 118) == repr("a" * 118)  # 120 characters with its quotes
    assert shown("a" * 119) == "'" + "a" * 119 + "... (119 characters)"
    assert shown(list(range(100))) == repr(list(range(100)))[:120] + "... (100 items)"


def test_a_path_with_a_trailing_slash_is_an_unknown_path_not_a_redirect():
    """``DELETE /pdd/instances/`` was a 307 with an empty body to ``/pdd/instances`` (FastAPI's
    redirect_slashes), where the DELETE got 405: now a 404 in the OpenAI error shape, as any
    unknown path."""
    from pdd.gateway.api import create_app

    class Tok:
        def get_vocab_size(self, with_added_tokens=True):
            return 256

    o, ms, _ = _setup()
    c = TestClient(create_app(o.cfg, o, Tok()), follow_redirects=False)
    not_found = {"error": {"message": "Not Found", "type": "invalid_request_error", "param": None, "code": None}}
    for method, path in (("DELETE", "/pdd/instances/"), ("GET", "/pdd/instances/"), ("GET", "/health/"),
                         ("POST", "/v1/completions/"), ("GET", "/no/such/path")):
        r = c.request(method, path)
        assert (r.status_code, r.json()) == (404, not_found), (method, path, r.status_code, r.text)
    assert c.get("/pdd/instances").status_code == 200


def test_an_operator_body_with_an_integer_past_the_digit_limit_says_so():
    """As on /v1 (pdd.gateway.openai_schemas.too_many_digits): pydantic's parser said "body:
    Invalid JSON: number out of range at line 1 column 4310"."""
    c, o, ms = _client()
    r = c.post("/pdd/instances/md0/drain", content='{"force": ' + "1" * 5000 + "}",
               headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": "request body has a number with too many digits (5000): a JSON integer "
                                            "may have at most 4300 digits", "type": "invalid_request_error",
                                 "param": None, "code": "invalid_body"}


def test_start_on_a_slot_whose_instance_already_runs_joins_it():
    # pdd serve's md1, removed (by the autoscaler's scale-down, or DELETE): its process keeps
    # running idle on md1's port. An add with start (the autoscaler's scale-up) spawned a second
    # md1, which failed "ports ... already in use": 503 start_failed on every scale-up
    import socket

    from pdd.gateway.membership import JOIN_RETRIES

    with socket.socket() as lsn:
        lsn.bind(("127.0.0.1", 0))  # an OS-chosen port stands for md1's (base_port + 71)
        lsn.listen()
        base = lsn.getsockname()[1] - 71
        cfg = ClusterConfig.model_validate({"mode": "pdd", "base_port": base, "gateway_port": base + 95,
                                            "instances": {"prefill": 1, "relay_decode": 1, "main_decode": 2}})
        lay = layout(cfg)
        o = Orchestrator(cfg, lay)
        ms = Membership(o, lay, ())
        o.peers = {s.name: PoolPeer() for s in o.layout.engines}
        connects = []

        async def connect(name, retries):
            connects.append((name, retries))
            return PoolPeer(held=0)

        def spawn(m):
            raise AssertionError(f"a second {m.name} process was started")

        o._connect = connect
        ms._start_process = spawn

        async def run():
            o.inflight["md1"] = 0
            await ms.drain("md1")
            await ms.remove("md1")
            rep = await ms.add("main_decode", start=True)  # the first free slot: md1
            assert (rep["name"], rep["state"], rep["source"], rep["connected"]) == ("md1", ACTIVE, "joined", True)
            assert connects[-1] == ("md1", JOIN_RETRIES)
            assert ms.members["md1"].proc is None  # not the gateway's: a later remove leaves it running

        asyncio.run(run())


def test_drain_reports_pages_held_by_requests_and_cached_apart_as_the_engine_metrics():
    """``prefix_cache`` of a drain: ``pages_in_use`` held by requests, ``pages_cached`` held only
    by the prefix cache, as ``pdd_kv_pages{state}`` (free + cached + in_use = total); it counted
    the cached pages as in use (total - free)."""
    o, ms, _ = _setup(standby=())
    o.peers["md0"] = PoolPeer(held=12, cached=9)
    o.inflight["md0"] = 1
    rep = asyncio.run(ms.drain("md0"))
    cache = rep["prefix_cache"]
    assert {k: v for k, v in cache.items() if k.startswith("pages_")} == {
        "pages_in_use": 3, "pages_cached": 9, "pages_free": 52, "pages_total": 64}


def test_drain_of_an_instance_that_does_not_report_its_cached_pages_leaves_the_split_unknown():
    o, ms, _ = _setup(standby=())
    peer = o.peers["md0"] = PoolPeer(held=12)
    real = peer.call

    async def older(h, payload=b"", timeout=None):
        rep, b = await real(h, payload, timeout)
        rep.pop("pages_cached", None)
        return rep, b

    peer.call = older
    o.inflight["md0"] = 1
    cache = asyncio.run(ms.drain("md0"))["prefix_cache"]
    assert {k: v for k, v in cache.items() if k.startswith("pages_")} == {
        "pages_in_use": None, "pages_cached": None, "pages_free": 52, "pages_total": 64}
