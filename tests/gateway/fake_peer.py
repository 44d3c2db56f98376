"""A stand-in for :class:`pdd.transfer.peer.Peer` in gateway unit tests: records every message
sent or called (headers only) and answers every call ``{"t": "ok"}``."""

from __future__ import annotations


class FakePeer:
    def __init__(self):
        self.closed = False
        self.sent: list[dict] = []

    async def send(self, h, payload=b""):
        self.sent.append(dict(h))

    async def call(self, h, payload=b"", timeout=None):
        self.sent.append(dict(h))
        return {"t": "ok"}, b""

    async def close(self):
        self.closed = True


def fake_orchestrator(**config):
    """An :class:`pdd.gateway.orchestrator.Orchestrator` of the config ``{"mode": "pdd",
    **config}`` whose every instance is a :class:`FakePeer` (no process, no socket)."""
    from pdd.config import ClusterConfig
    from pdd.gateway.orchestrator import Orchestrator
    from pdd.topology import layout

    cfg = ClusterConfig.model_validate({"mode": "pdd", **config})
    o = Orchestrator(cfg, layout(cfg))
    o.peers = {s.name: FakePeer() for s in o.layout.engines}
    return o
