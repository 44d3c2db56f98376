"""Adding an instance checks who answers at its slot's address: the instance's hello must name
the slot. Before, the gateway took whatever pdd instance listened there (without TLS, whose
certificate names the instance, nothing said who it was): a relay decoder of another topology
listening at the standby ``p1``'s port became an active prefill member, and every prefill routed
to it failed. A real instance (the tiny model's engine, in process, no security) at ``p1``'s port
that names itself ``rld0``; the gateway's real orchestrator and membership connect to it."""

from __future__ import annotations

import pytest

from pdd.gateway.membership import Membership, MembershipError
from pdd.gateway.orchestrator import Orchestrator
from pdd.policy.membership import STANDBY
from pdd.roles.relay_decode import RelayDecodeInstance
from pdd.topology import ROLE_RELAY, InstanceSpec, layout
from tests.gateway.fake_peer import FakePeer
from tests.roles.md_tiny import tiny_config


async def test_an_instance_naming_another_slot_is_not_added(tiny_model):
    cfg = tiny_config(tiny_model, {"prefill": 2, "relay_decode": 1, "main_decode": 1})
    cfg = cfg.model_copy(update={"standby": ["p1"]})
    lay = layout(cfg)
    o = Orchestrator(cfg, lay)
    ms = Membership(o, lay, cfg.standby)
    o.peers = {s.name: FakePeer() for s in o.layout.engines}
    host, port, _ = ms.full.address_from_a("p1")
    other = RelayDecodeInstance(cfg, InstanceSpec("rld0", ROLE_RELAY, "A", port), lay)  # not p1
    await other.start()
    try:
        with pytest.raises(MembershipError) as err:
            await ms.add("prefill", "p1")
        e = err.value
        assert (e.status, e.param, e.code) == (409, "address", "identity_mismatch")
        assert e.message == (f"the instance at {host}:{port} is 'rld0' ('relay_decode'), not p1: another instance "
                             "listens at this slot's address")
        assert ms.members["p1"].state == STANDBY and "p1" not in o.peers
    finally:
        await other.stop()
        await o.close()
