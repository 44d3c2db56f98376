"""A stand-in for :class:`pdd.transfer.peer.Peer` in gateway unit tests: records every message
sent or called (headers only) and answers every call ``{"t": "ok"}``; :meth:`FakePeer.seen`
is an event a test can wait on for the first message of a type."""

from __future__ import annotations

import asyncio


class FakePeer:
    def __init__(self):
        self.closed = False
        self.sent: list[dict] = []
        self._seen: dict[str, asyncio.Event] = {}

    def _record(self, h) -> None:
        """Record ``h`` (a subclass's ``send`` / ``call`` calls this too) and wake :meth:`seen`."""
        self.sent.append(dict(h))
        ev = self._seen.get(h.get("t"))
        if ev is not None:
            ev.set()

    def seen(self, t: str) -> asyncio.Event:
        """An event set once a message of type ``t`` was sent or called (already set if one was)."""
        ev = self._seen.setdefault(t, asyncio.Event())
        if self.of(t):
            ev.set()
        return ev

    def of(self, t: str) -> list[dict]:
        """The headers of type ``t`` sent or called so far, in order."""
        return [h for h in self.sent if h.get("t") == t]

    async def send(self, h, payload=b""):
        self._record(h)

    async def call(self, h, payload=b"", timeout=None):
        self._record(h)
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
