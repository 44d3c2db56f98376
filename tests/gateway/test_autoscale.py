"""pdd.gateway.autoscale: the loop's measuring, applying and log, on a fake membership (no
sockets): scale-up adds a free slot, scale-down drains the least busy with remove_when_idle,
the cool-down holds, a refused operation is logged and the loop goes on."""

import asyncio
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from pdd.config import AutoscaleConfig, ClusterConfig, validation_summary
from pdd.gateway.autoscale import Autoscaler, add_autoscale_routes
from pdd.gateway.membership import MembershipError
from pdd.topology import layout


class FakeMembership:
    def __init__(self, full):
        self.full = full  # the config's layout: md0, md1 in B, rld0 in A
        self.members = {n: SimpleNamespace(name=n, role=full.get(n).role, dc=full.get(n).dc, state=s, source="config")
                        for n, s in (("rld0", "active"), ("md0", "active"), ("md1", "standby"))}
        self._busy_ops = set()
        self.calls = []
        self.refuse = False

    def busy(self, name):
        return 0

    def members_of(self, role=None, state="active"):  # Membership's public accessors
        return tuple(m for m in self.members.values()
                     if (role is None or m.role == role) and (state is None or m.state == state))

    @property
    def changing(self):
        return bool(self._busy_ops)

    async def add(self, role, name=None, address=None, start=False):
        self.calls.append(("add", role, start))
        if self.refuse:
            raise MembershipError(503, "instance md1 did not start", "start", "start_failed")
        m = next(m for m in self.members.values() if m.role == role and m.state in ("standby", "removed"))
        m.state, m.source = "active", "started"
        return {"name": m.name}

    async def rerole(self, name, role, force=False):
        self.calls.append(("rerole", name, role))
        if self.refuse:
            raise MembershipError(409, f"instance {name} still has 1 request(s) in flight after draining; it is "
                                       f"active as main_decode again", "name", "in_flight")
        self.members[name].role = role
        return {"name": name, "changed": True}

    async def drain(self, name, force=False, remove_when_idle=False):
        self.calls.append(("drain", name, remove_when_idle))
        self.members[name].state = "draining"
        return {"name": name}


class Clock:
    t = 100.0

    def __call__(self):
        return self.t


def make(**kw):
    cfg = ClusterConfig.model_validate({"instances": {"main_decode": 2}, "standby": ["md1"],
                                        "engine": {"max_running": 4}})
    orch = SimpleNamespace(cfg=cfg, inflight={}, reqs={}, membership=FakeMembership(layout(cfg)), wan_gbps_live=0.5)
    acfg = AutoscaleConfig(enabled=True, interval_s=1.0, cooldown_s=10.0, max={"main_decode": 2}, **kw)
    clock = Clock()
    return orch, Autoscaler(orch, acfg, clock=clock), clock


def test_scale_up_then_cooldown_then_down():
    orch, a, clock = make()
    ms = orch.membership
    orch.inflight["md0"] = 4  # 4 of max_running 4: utilisation 1.0
    orch.reqs = {"r1": SimpleNamespace(prompt_len=100, sampling=SimpleNamespace(max_tokens=20)),
                 "r2": SimpleNamespace(prompt_len=300, sampling=SimpleNamespace(max_tokens=40))}
    a.sample()
    clock.t += 1.0
    rec = asyncio.run(a.step())
    assert ms.calls == [("add", "main_decode", True)]
    assert rec["applied"] == [{"role": "main_decode", "op": "add", "instance": "md1"}]
    x = rec["inputs"]
    assert x["roles"] == [{"role": "main_decode", "active": 1, "utilisation": 1.0}]
    assert (x["arrival_rps"], x["prompt_tokens_mean"], x["output_tokens_mean"], x["wan_gbps"]) == (2.0, 200.0, 30.0, 0.5)
    assert x["since_last_change_s"] is None
    assert rec["decision"]["roles"][0]["reason"] == "utilisation 1.00 >= 0.75"
    # idle now, but within the cool-down: hold
    orch.inflight["md0"] = 0
    a.sample()
    clock.t += 5.0
    rec = asyncio.run(a.step())
    assert rec["decision"]["reason"] == "cool-down: 5.0 s since the last change < 10 s"
    assert rec["applied"] == [] and len(ms.calls) == 1
    # after the cool-down: drain the least busy, the latest added first (md1, started) on a tie
    a.sample()
    clock.t += 6.0
    rec = asyncio.run(a.step())
    assert rec["applied"] == [{"role": "main_decode", "op": "drain", "instance": "md1", "remove_when_idle": True}]
    assert ms.calls[-1] == ("drain", "md1", True)
    # while md1 drains nothing changes (pending), whatever the load
    orch.inflight["md0"] = 4
    a.sample()
    clock.t += 20.0
    rec = asyncio.run(a.step())
    assert rec["decision"]["reason"].startswith("a change is under way")
    v = a.view()
    assert v["applied"] == {"up": 1, "down": 1, "errors": 0}
    assert v["roles"] == {"main_decode": {"active": 1, "draining": 1, "min": 1, "max": 2}}
    assert len(v["decisions"]) == 4


def test_refused_add_is_logged_and_loop_goes_on():
    orch, a, clock = make()
    orch.membership.refuse = True
    orch.inflight["md0"] = 4
    a.sample()
    clock.t += 1.0
    rec = asyncio.run(a.step())
    assert rec["applied"] == [{"role": "main_decode", "op": "add", "error": "instance md1 did not start"}]
    assert a.applied == {"up": 0, "down": 0, "errors": 1} and a.last_change == 101.0
    # the cool-down spaces the retry
    a.sample()
    clock.t += 1.0
    rec = asyncio.run(a.step())
    assert rec["decision"]["reason"].startswith("cool-down") and len(orch.membership.calls) == 1
    a.sample()
    clock.t += 10.0
    orch.membership.refuse = False
    rec = asyncio.run(a.step())
    assert rec["applied"] == [{"role": "main_decode", "op": "add", "instance": "md1"}]


def test_drain_picks_least_busy_and_never_the_last_active():
    orch, a, clock = make()
    ms = orch.membership
    assert a._victim("main_decode") is None  # one active MD: never drained
    ms.members["md1"].state = "active"  # both from the config now
    ms.members["md1"].source = "config"
    ms.busy = lambda name: {"md0": 0, "md1": 2}[name]
    assert a._victim("main_decode") == "md0"  # the least busy
    ms.busy = lambda name: 0
    assert a._victim("main_decode") == "md1"  # a tie: the later slot


def test_drain_never_leaves_a_rerolled_relay_decoder_as_the_only_main_decoder():
    """Found in review: the fewest-in-flight rule drained the only MD in datacenter B and left
    rld0, a relay decoder re-roled to main-decode duty in A, as the only main decoder. The
    re-roled one goes first, however busy (../shared/PDD.md: MD's place is datacenter B)."""
    orch, a, clock = make()
    ms = orch.membership
    ms.members["rld0"].role = "main_decode"  # POST /pdd/instances/rld0/role {"role": "main_decode"}
    ms.busy = lambda name: {"md0": 0, "rld0": 3, "md1": 0}[name]
    assert a._victim("main_decode") == "rld0"
    ms.members["md1"].state, ms.members["md1"].source = "active", "started"  # two MDs in B, both idle
    assert a._victim("main_decode") == "rld0"
    ms.members["rld0"].role = "relay_decode"  # back to relaying: the rule of the MDs in B alone
    assert a._victim("main_decode") == "md1"
    # the loop: idle after the cool-down, one MD in B and rld0 on MD duty: rld0 goes first, back
    # to relaying (its slot's role), not removed
    ms.members["rld0"].role, ms.members["md1"].state = "main_decode", "standby"
    orch.inflight = {"md0": 0, "rld0": 1}
    a.sample()
    clock.t += 1.0
    rec = asyncio.run(a.step())
    assert rec["inputs"]["roles"] == [{"role": "main_decode", "active": 2, "utilisation": 0.125}]
    assert rec["applied"] == [{"role": "main_decode", "op": "rerole", "instance": "rld0", "to": "relay_decode"}]
    assert ms.calls == [("rerole", "rld0", "relay_decode")]
    assert (ms.members["rld0"].role, ms.members["rld0"].state) == ("relay_decode", "active")
    assert a.applied == {"up": 0, "down": 1, "errors": 0}


def test_scale_down_of_a_rerolled_relay_decoder_switches_it_back_not_removes_it():
    """Found in review: a scale-down of MD that picked rld0 (re-roled to MD duty in A) drained and
    removed it, so the relay tier the config declared lost an instance no rule brings back. It is
    switched back to relay duty; a refused switch is logged as the loop's error, the instance
    stays where it was, and nothing is drained."""
    orch, a, clock = make()
    ms = orch.membership
    ms.members["rld0"].role = "main_decode"
    ms.refuse = True
    a.sample()
    clock.t += 1.0
    rec = asyncio.run(a.step())
    assert rec["applied"] == [{"role": "main_decode", "op": "rerole", "to": "relay_decode",
                               "error": "instance rld0 still has 1 request(s) in flight after draining; it is "
                                        "active as main_decode again"}]
    assert ms.calls == [("rerole", "rld0", "relay_decode")]
    assert (ms.members["rld0"].role, ms.members["rld0"].state) == ("main_decode", "active")
    assert a.applied == {"up": 0, "down": 0, "errors": 1}
    # an MD of its own slot (md1 in B, started by the loop) is still drained and removed
    ms.refuse, ms.members["rld0"].role = False, "relay_decode"
    ms.members["md1"].state, ms.members["md1"].source = "active", "started"
    a.sample()
    clock.t += 11.0
    rec = asyncio.run(a.step())
    assert rec["applied"] == [{"role": "main_decode", "op": "drain", "instance": "md1", "remove_when_idle": True}]


@pytest.mark.parametrize("block,msg", [
    ({"enabled": True}, "autoscale: max: name the roles to scale"),
    ({"down_at": 0.4}, "autoscale: down_at: 0.4 must be < up_at / 2 = 0.375"),
    ({"min": {"main_decode": 0}}, "autoscale: min.main_decode: must be >= 1"),
    ({"max": {"main_decode": 3}}, "autoscale.max.main_decode: 3 is more than the role's 2 slot(s)"),
    ({"max": {"colocated": 1}}, "autoscale.max.colocated: the pdd topology has no colocated instances"),
    ({"cooldown_s": -1}, "autoscale.cooldown_s: Input should be greater than or equal to 0"),
    ({"interval": 1}, "autoscale.interval: Extra inputs are not permitted"),
])
def test_config_names_bad_fields(block, msg):
    with pytest.raises(ValidationError) as e:
        ClusterConfig.model_validate({"instances": {"main_decode": 2}, "standby": ["md1"], "autoscale": block})
    assert msg in validation_summary(e.value)


def test_endpoint_when_off():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    app = FastAPI()
    add_autoscale_routes(app, SimpleNamespace())
    body = TestClient(app).get("/pdd/autoscale").json()
    assert isinstance(body.pop("time"), float)  # the gateway's clock, for windows over the membership log
    assert body == {"enabled": False, "decisions": []}
