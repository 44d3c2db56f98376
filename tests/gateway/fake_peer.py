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


class SocketWriter:
    """The gateway's side of an instance's socket, for a real :class:`pdd.transfer.peer.Peer`
    whose reader a test feeds: what the gateway writes is readable from ``out``."""

    def __init__(self):
        self.out = asyncio.StreamReader()
        self.transport = self

    def write(self, b) -> None:
        self.out.feed_data(bytes(b))

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass

    async def wait_closed(self) -> None:
        pass

    def get_extra_info(self, name, default=None):
        return default


def consume(o, st) -> tuple[asyncio.Task, list]:
    """A task reading the orchestrator's stream of ``st`` as the HTTP layer does, and the list
    of ``(pos, token_id, tier)`` it fills."""
    got: list = []

    async def run():
        async for t in o.stream(st):
            got.append((t.pos, t.token_id, t.tier))

    return asyncio.get_running_loop().create_task(run()), got


def streaming_request(o, pipeline, trid: str = "r1"):
    """A request ``r1`` (attempt ``trid``) registered with ``o`` whose decoder streamed 3 tokens
    (100-102) of ``max_tokens`` 6, MD reserved: relayed (``Pipeline.P_RLD_MD``: RLD decodes, MD's
    KV not complete; p0, rld0, md0) or P->MD (p0, md0)."""
    from pdd.gateway.phase import Phase
    from pdd.gateway.state import ReqState
    from pdd.types import Pipeline, SamplingParams

    st = ReqState("r1", 18, SamplingParams(max_tokens=6), trid=trid, prompt_ids=list(range(10, 28)),
                  pipeline=pipeline)
    st.names = {"prefill": "p0", "main_decode": "md0"}
    phases = (Phase.PREFILL, Phase.TRANSFER, Phase.MD_DECODE)
    if pipeline == Pipeline.P_RLD_MD:
        st.names["relay_decode"] = "rld0"
        phases = (Phase.PREFILL, Phase.TRANSFER, Phase.RLD_DECODE)
    for ph in phases:
        st.to(ph)
    st.next_pos, st.emitted = 3, [100, 101, 102]
    st.events["md_reserved"] = 0.0
    o.reqs[st.trid] = st
    return st
