"""The gateway's cache-aware load slack is the simulator's (the simulator's economics stand for the
runtime's): ``policy.load_slack`` (8 requests) on P and colocated instances, ``policy.md_load_slack``
(64) on MD, the defaults of ``SimConfig.load_slack`` / ``md_load_slack`` (one source,
``pdd.policy.routing``), and ``pdd sim validate`` simulates a live config with its own slack.
Before, the gateway used 4 on every tier, so a turn whose MD held its prefix went cold to another
MD (its whole KV across the WAN again) once that MD had 5 more requests in flight."""
import asyncio

import pytest

from pdd.config import ClusterConfig, PolicyConfig
from pdd.gateway.orchestrator import Orchestrator
from pdd.gateway.routing import ROUTING_MIN_HIT_FRAC
from pdd.sim.sim_config import SimConfig
from pdd.topology import ROLE_MAIN, ROLE_PREFILL, layout
from tests.gateway.fake_peer import FakePeer

SESSION = list(range(100, 420))  # 20 pages of 16


class PeekPeer(FakePeer):
    """A peer whose radix cache holds ``hit`` tokens of any prompt (its ``peek`` answer)."""

    def __init__(self, hit: int = 0):
        super().__init__()
        self.hit = hit

    async def call(self, h, payload=b"", timeout=None):
        self.sent.append(dict(h))
        return {"t": "peek_ok", "hit_tokens": self.hit}, b""


def _orch(**policy) -> Orchestrator:
    cfg = ClusterConfig.model_validate({"mode": "cross_dc_pd", "instances": {"prefill": 2, "main_decode": 3},
                                        "policy": policy})
    o = Orchestrator(cfg, layout(cfg))
    o.peers = {s.name: PeekPeer() for s in o.layout.engines}
    return o


def test_the_simulator_routes_with_the_gateways_defaults():
    pol, sim = PolicyConfig(), SimConfig()
    assert (pol.load_slack, pol.md_load_slack) == (sim.load_slack, sim.md_load_slack) == (8, 64)
    assert ROUTING_MIN_HIT_FRAC == sim.min_hit_frac == 0.5


@pytest.mark.parametrize("busier, slack, follows", [(5, None, True), (64, None, True), (65, None, False),
                                                     (5, 4, False), (4, 4, True)])
def test_an_md_holding_the_prefix_takes_the_turn_within_md_load_slack(busier, slack, follows):
    """md0's index holds the session's prefix; it has ``busier`` more requests in flight than md1
    and md2 (idle): the next turn goes to md0 within ``policy.md_load_slack`` (default 64), else
    to md1 (the idlest, first listed: no other MD holds a hit). The hit-and-load rule
    (``wan_estimate: config``: no transfer times)."""
    o = _orch(wan_estimate="config", **({} if slack is None else {"md_load_slack": slack}))
    assert asyncio.run(o._route(ROLE_MAIN, SESSION)) == "md0"
    o.inflight["md0"] = busier
    assert asyncio.run(o._route(ROLE_MAIN, SESSION + [7] * 40)) == ("md0" if follows else "md1")


@pytest.mark.parametrize("busier, slack, chosen", [(5, None, "md0"), (10, None, "md0"), (11, None, "md1"),
                                                   (5, 4, "md1")])
def test_with_live_wan_estimates_the_slack_bounds_the_mds_weighed_by_transfer_time(busier, slack, chosen):
    """``wan_estimate: live`` (default), 2,048 KV bytes a token on the default 0.05 Gbit/s line:
    md0 lacks 40 of the turn's 360 tokens, md1 all 360 (0.105 s more on the line); each request
    in flight costs 0.01 s (ROUTING_LOAD_COST_S), so md0 takes it while at most 10 busier, if
    ``md_load_slack`` lets it be weighed at all (4, the gateway's old slack on every tier: not at 5)."""
    o = _orch(**({} if slack is None else {"md_load_slack": slack}))
    o.kv_bytes_per_token = 2048  # the model's, as the gateway reads it from its config (fixed here)
    assert asyncio.run(o._route(ROLE_MAIN, SESSION)) == "md0"
    o.inflight["md0"] = busier
    assert asyncio.run(o._route(ROLE_MAIN, SESSION + [7] * 40)) == chosen


@pytest.mark.parametrize("busier, policy, chosen", [(5, {}, "p1"), (8, {}, "p1"), (9, {}, "p0"),
                                                    (5, {"load_slack": 4}, "p0"), (9, {"md_load_slack": 100}, "p0")])
def test_a_prefill_holding_the_prefix_takes_it_within_load_slack(busier, policy, chosen):
    """p1's cache holds the whole prompt (its peek), p0 none; p1 runs ``busier`` more prefills
    (its :attr:`holding`): p1 within ``policy.load_slack`` (default 8), else p0. MD's slack does
    not apply to P."""
    o = _orch(**policy)
    o.peers["p1"].hit = len(SESSION)
    o.holding["p1"] = busier
    assert asyncio.run(o._route(ROLE_PREFILL, SESSION)) == chosen


def test_sim_validate_simulates_the_live_slack():
    from pdd.sim.validate import sim_config

    prof = {"model": {"layers": 4, "attn_dim": 256, "kv_bytes_per_token": 2048, "weight_bytes": 19473408.0,
                      "flops_per_token": 7639552.0}, "engine": {"dtype": "float32"}}
    cfg = ClusterConfig.model_validate({"mode": "pdd", "policy": {"load_slack": 3, "md_load_slack": 17}})
    sc = sim_config(cfg, "data/profiles/this-machine.json", prof, 64, host_cores=0.0)
    assert (sc.load_slack, sc.md_load_slack, sc.min_hit_frac) == (3, 17, 0.5)
    sc = sim_config(ClusterConfig(mode="pdd"), "data/profiles/this-machine.json", prof, 64, host_cores=0.0)
    assert (sc.load_slack, sc.md_load_slack) == (8, 64)


@pytest.mark.parametrize("key", ["load_slack", "md_load_slack"])
def test_a_negative_slack_is_refused_naming_the_field(key):
    with pytest.raises(ValueError, match=rf"policy\.{key}"):
        ClusterConfig.model_validate({"policy": {key: -1}})
