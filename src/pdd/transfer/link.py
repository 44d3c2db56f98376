"""WAN line emulator: a TCP proxy in its own process that models ONE shared line.

Run it as ``python -m pdd.transfer.link --config JSON_OR_PATH`` or ``run_link(cfg)``; it prints
``LINK READY`` on stdout once every port listens. In tests, ``await Link(cfg).start()``.

Config (dict, or an object with ``model_dump()``)::

    host          listen host (default "127.0.0.1")
    routes        [{"listen_port", "target_host", "target_port"}]   (also accepted:
                  "listen": [{"port", "target": [host, port]}]); listen_port 0 picks a free port
    gbps          line rate per direction, Gbit/s (10^9 bit/s)
    rtt_ms        round-trip time, ms (each direction adds rtt_ms / 2)
    jitter_ms     per-chunk extra one-way delay, uniform in [-jitter_ms, +jitter_ms] ms (clipped
                  at 0, never reordering a connection's bytes), from random.Random(seed)
    seed          RNG seed (default 0)
    chunk_bytes   largest chunk read and scheduled at once, bytes (default 65536)
    max_chunk_s   on a slow line, a chunk is at most what the line serialises in this many seconds
                  (at least ``MIN_SLICE_BYTES``; default ``MAX_CHUNK_S``, 0.1; 0: ``chunk_bytes``
                  at any rate), so one connection's chunk never holds the others off the line
                  for longer (:meth:`Link.read_bytes`)
    control_port  port of the control server (our wire protocol), None = none, 0 = pick
    loss_rate     packet loss probability p in [0, 1) (default 0): each connection's throughput is
                  capped at TCP's loss-limited rate (Mathis et al. 1997, ``pdd.policy.tcp_model``)
    mss_bytes     TCP segment size of that formula, bytes (default 1460)
    cross_traffic [[t_s, gbps], ...]: other traffic on the line, per direction, from t_s seconds
                  after the link started (piecewise constant, 0 before the first point; default none)

Model. Side "a" is the connecting client, side "b" the target. Each direction (a_to_b, b_to_a)
is one line shared by all connections through the emulator (all routes). A chunk read from a
connection at time ``now`` is serialised onto its direction's line after everything admitted
before it (``start = max(now, line_free)``, ``end = start + bytes*8/(gbps*1e9)``), then
delivered to the other side at ``end + rtt_ms/2 + jitter``, in slices as the line serialises it:
a chunk that takes longer than ``SLICE_S`` (5 ms) is cut into slices of about that much line
time (at least ``MIN_SLICE_BYTES``, 1 KiB), each delivered at the instant its last byte is
serialised plus the same delay (the last one at ``end`` plus it), so a slow line trickles bytes
as a real one does (a receiver's dead-peer timeout sees them arrive). Cross traffic takes its rate off the
line (``end`` integrates ``max(gbps - cross, 1% of gbps)`` over the schedule), and with loss a
connection's chunk also cannot end sooner than its previous one plus ``bytes*8 / mathis``: one
connection alone moves N bytes in ``N*8 / min(gbps - cross, mathis)`` s, while the line stays
free for other connections (``pdd.policy.tcp_model.chunk_times``). Bytes are never dropped
(TCP retransmits); loss shows as throughput. A connection does not read its
next chunk until the line has (nearly) finished its previous one, so a fast sender is held
back by real TCP backpressure (its socket buffers fill) instead of queueing in the proxy;
the proxy holds at most about one bandwidth-delay product in flight. A slow receiver
back-pressures too (reading stops while its socket's write buffer is full). Concurrent
connections interleave chunk by chunk: they share the line fairly. A chunk is at most
``max_chunk_s`` (0.1 s) of line time (:meth:`Link.read_bytes`): 64 KiB take 5.2 s at 1e-4
Gbit/s, and a connection with a heartbeat to send waited that long behind another's chunk,
past the receiver's dead-peer timeout (5 s), where TCP interleaves the flows packet by packet.

Control port messages: ``stats`` -> ``stats {bytes_a_to_b, bytes_b_to_a, connections, ...}``
(bytes delivered, all connections, framing included; ``in_flight_*``: admitted, not yet
delivered, so admitted = delivered + in flight while no connection closed with bytes queued, which are dropped); ``set {gbps?, rtt_ms?, jitter_ms?,
outage?: bool, loss_rate?, cross_gbps?}`` (:class:`pdd.transfer.messages.LinkSet`) -> the new
stats (``cross_gbps`` replaces the schedule by that rate from now on; a rate change re-times the
bytes the line holds but has not serialised, :meth:`Link.set`).
An outage freezes the line: no byte moves and no connection is reset; when it ends, bytes in
flight resume their remaining delay. Helpers: :func:`query_stats`, :func:`set_link`.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import json
import logging
import os
import random
from collections import deque
from typing import Any, Optional

from pdd.policy import tcp_model
from pdd.stop_signals import stop_waiter

from . import messages
from .client import connect
from .server import Server

__all__ = ["Link", "run_link", "serve_link", "query_stats", "set_link", "normalize_config", "main"]

log = logging.getLogger("pdd.transfer.link")

DEFAULT_CHUNK_BYTES = 64 << 10
RESUME_LEAD_S = 0.004  # let a connection read its next chunk this long before the line frees
DELIVER_SLACK_S = 0.0002  # deliver chunks due within this window together
WRITE_HIGH_WATER = 1 << 20
# a chunk is delivered in slices of about this much line time, so that a slow line trickles bytes
# as a real one does instead of handing a chunk over whole after its serialisation (1.3 s for
# 64 KiB at 0.4 Mbit/s: the receiver's dead-peer timeout could see seconds of silence)
SLICE_S = 0.005
MIN_SLICE_BYTES = 1024  # and of at least this many bytes
MAX_CHUNK_S = 0.1  # a chunk read from one connection takes at most this much line time (>= MIN_SLICE_BYTES)
# chunks a connection's socket may hold unread while the line is busy with other flows: what a
# real line's bottleneck buffer holds is bounded, so a sender learns through TCP back-pressure,
# not by filling an autotuned receive buffer of MBs that the line then drains in arrival order
RECV_BUFFER_CHUNKS = 1


def _slices(n: int, ser_s: float) -> int:
    """How many slices a chunk of ``n`` bytes that the line serialises in ``ser_s`` seconds is
    delivered in: one per :data:`SLICE_S` of line time, at most one per :data:`MIN_SLICE_BYTES`,
    at least one (a chunk serialised within ``SLICE_S`` goes whole, as on a fast line)."""
    if ser_s <= SLICE_S or n <= MIN_SLICE_BYTES:
        return 1
    return max(1, min(math.ceil(ser_s / SLICE_S), n // MIN_SLICE_BYTES))


def normalize_config(cfg: Any) -> dict:
    """Accept the documented config forms; returns a plain dict with defaults filled in."""
    if hasattr(cfg, "model_dump"):
        cfg = cfg.model_dump()
    elif isinstance(cfg, str):
        cfg = json.loads(cfg)
    cfg = dict(cfg)
    routes = []
    for r in cfg.get("routes", []) or []:
        routes.append(
            {
                "listen_port": int(r["listen_port"]),
                "target_host": str(r.get("target_host", "127.0.0.1")),
                "target_port": int(r["target_port"]),
            }
        )
    for r in cfg.get("listen", []) or []:
        th, tp = r["target"]
        routes.append({"listen_port": int(r.get("port", 0)), "target_host": str(th), "target_port": int(tp)})
    out = {
        "host": cfg.get("host", "127.0.0.1"),
        "routes": routes,
        "gbps": float(cfg.get("gbps", 1.0)),
        "rtt_ms": float(cfg.get("rtt_ms", 0.0)),
        "jitter_ms": float(cfg.get("jitter_ms", 0.0)),
        "seed": int(cfg.get("seed", 0)),
        "chunk_bytes": int(cfg.get("chunk_bytes", DEFAULT_CHUNK_BYTES)),
        "max_chunk_s": float(cfg.get("max_chunk_s", MAX_CHUNK_S)),
        "control_port": cfg.get("control_port"),
        "loss_rate": tcp_model.check_loss_rate(cfg.get("loss_rate", 0.0) or 0.0, "loss_rate"),
        "mss_bytes": int(cfg.get("mss_bytes", tcp_model.DEFAULT_MSS_BYTES)),
        "cross_traffic": [list(p) for p in tcp_model.check_schedule(cfg.get("cross_traffic") or (), "cross_traffic")],
    }
    if out["mss_bytes"] < 1:
        raise ValueError("mss_bytes must be >= 1")
    check_line(out["gbps"], out["rtt_ms"], out["jitter_ms"])
    if out["chunk_bytes"] < 1024:
        raise ValueError("chunk_bytes must be >= 1024")
    if not (math.isfinite(out["max_chunk_s"]) and out["max_chunk_s"] >= 0):
        raise ValueError(f"max_chunk_s must be a number of seconds >= 0, got {out['max_chunk_s']}")
    return out


def check_line(gbps: float, rtt_ms: float, jitter_ms: float) -> None:
    """The line's rate (Gbit/s, finite and at least :data:`pdd.policy.tcp_model.MIN_LINK_GBPS`),
    RTT and jitter (ms, finite >= 0 and at most :data:`pdd.policy.tcp_model.MAX_LINE_DELAY_MS`).
    Raises ValueError naming the first bad one (NaN and inf included: a NaN rate made every
    transfer's time NaN; a subnormal one, 1e-312, overflowed a chunk's time to inf)."""
    for name, v, strict in (("gbps", gbps, True), ("rtt_ms", rtt_ms, False), ("jitter_ms", jitter_ms, False)):
        if not (math.isfinite(v) and (v > 0 if strict else v >= 0)):
            raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} 0, got {v!r}")
        if not strict and v > tcp_model.MAX_LINE_DELAY_MS:
            raise ValueError(f"{name} must be <= {tcp_model.MAX_LINE_DELAY_MS:g} ms, got {v!r}")
        slow = strict and tcp_model.slow_line_problem(v, name)
        if slow:
            raise ValueError(slow)


class _Line:
    """One direction of the shared line."""

    __slots__ = ("name", "free_at", "bytes_delivered", "bytes_admitted", "busy_s", "flows")

    def __init__(self, name: str):
        self.name = name
        self.free_at = 0.0  # loop time at which all admitted bytes are serialised
        self.bytes_delivered = 0
        self.bytes_admitted = 0
        self.busy_s = 0.0
        self.flows: set["_Flow"] = set()


class _Flow:
    """One direction of one proxied connection: reads ``src``, delivers to ``dst`` in order."""

    __slots__ = (
        "link", "line", "src", "dst", "queue", "queued_bytes", "last_deliver", "timer",
        "resume_timer", "line_hold", "eof_read", "eof_sent", "dead", "finished", "free_at", "sched_s",
        "bytes_admitted",
    )

    def __init__(self, link: "Link", line: _Line, src: "_Side", dst: "_Side"):
        self.link = link
        self.line = line
        self.src = src
        self.dst = dst
        self.queue: deque = deque()  # (deliver_at, bytes | None=EOF, serialised_at: its line end)
        self.queued_bytes = 0
        self.last_deliver = 0.0
        self.timer: Optional[asyncio.TimerHandle] = None
        self.resume_timer: Optional[asyncio.TimerHandle] = None
        self.line_hold = False
        self.eof_read = False
        self.eof_sent = False
        self.dead = False
        self.finished = False  # EOF delivered, or killed
        self.free_at = 0.0  # loop time at which this connection's admitted bytes are serialised
        # seconds of schedule this connection's bytes took beyond the time it was idle: alone on
        # the line, bytes_admitted * 8 / min(available rate, loss-limited rate), exactly
        self.sched_s = 0.0
        self.bytes_admitted = 0

    # -- admission (source side)
    def admit(self, data) -> None:
        if self.dead:
            return  # the destination is gone: drop, as the network would
        link = self.link
        loop = link.loop
        now = loop.time()
        n = len(data)
        line = self.line
        start = line.free_at if line.free_at > now else now
        if link._plain:
            ser = n * link._s_per_byte
            end = start + ser
            line.free_at = end
        else:
            t0 = link.t0
            _, line_end, end = tcp_model.chunk_times(now - t0, n, line.free_at - t0, self.free_at - t0,
                                                     link.gbps, link.cross_schedule, link.conn_gbps)
            line_end += t0
            end += t0
            ser = line_end - start
            line.free_at = line_end
        prev = self.free_at if self.free_at > now else now
        self.sched_s += end - prev
        self.free_at = end
        self.bytes_admitted += n
        line.busy_s += ser
        line.bytes_admitted += n
        delay = link._one_way_s
        if link._jitter_s:
            delay += link.rng.uniform(-link._jitter_s, link._jitter_s)  # one draw per chunk
        if delay < 0:
            delay = 0.0  # never delivered before its bytes are serialised
        # the line trickles a chunk's bytes out as it serialises them: slices of about
        # SLICE_S of its time (at least MIN_SLICE_BYTES), slice i ending at the same fraction of
        # [start, end] as its last byte of the chunk; the last one ends at ``end`` exactly
        k = _slices(n, end - start)
        q, last, t_ser = self.queue, self.last_deliver, start
        for i in range(1, k + 1):
            a, b = (i - 1) * n // k, i * n // k
            t_ser = end if i == k else start + (end - start) * b / n
            deliver = t_ser + delay
            if deliver < last:
                deliver = last  # a connection's bytes are never reordered
            last = deliver
            q.append((deliver, data if k == 1 else memoryview(data)[a:b], t_ser))
        self.last_deliver = last
        self.queued_bytes += n
        if self.timer is None and not link.outage:
            self.timer = loop.call_at(q[0][0], self.flush)
        # hold the source until the line has (nearly) serialised this chunk
        hold_until = end - RESUME_LEAD_S
        if hold_until > now:
            self.line_hold = True
            self.src.update_reading()
            self.resume_timer = loop.call_at(hold_until, self._line_free)

    def _line_free(self) -> None:
        self.resume_timer = None
        self.line_hold = False
        self.src.update_reading()

    def admit_eof(self) -> None:
        if self.eof_read or self.dead:
            return
        self.eof_read = True
        loop = self.link.loop
        deliver = max(self.last_deliver, self.line.free_at + self.link._one_way_s)
        self.last_deliver = deliver
        self.queue.append((deliver, None, self.line.free_at))
        if self.timer is None and not self.link.outage:
            self.timer = loop.call_at(deliver, self.flush)

    # -- delivery (destination side)
    def flush(self) -> None:
        self.timer = None
        if self.dead or self.link.outage:
            return
        q = self.queue
        loop = self.link.loop
        horizon = loop.time() + DELIVER_SLACK_S
        tr = self.dst.transport
        delivered = 0
        eof = False
        while q and q[0][0] <= horizon:
            _, data, _ = q.popleft()
            if data is None:
                eof = True
                break
            if tr is not None:
                tr.write(data)
                delivered += len(data)
            else:
                self.queued_bytes -= len(data)
        if delivered:
            self.queued_bytes -= delivered
            self.line.bytes_delivered += delivered
        if eof:
            self.eof_sent = self.finished = True
            if tr is not None and tr.can_write_eof():
                try:
                    tr.write_eof()
                except (OSError, RuntimeError):
                    pass
            self.dst.conn.maybe_close()
            return
        if q:
            self.timer = loop.call_at(q[0][0], self.flush)

    def shift(self, d: float) -> None:
        """Delay everything in flight by ``d`` seconds (end of an outage)."""
        if self.queue:
            self.queue = deque((t + d, x, e + d) for t, x, e in self.queue)
        self.last_deliver += d
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.queue:
            self.timer = self.link.loop.call_at(self.queue[0][0], self.flush)

    def retime(self, pivot: float, k: float) -> None:
        """The line's rate changed at loop time ``pivot``: what this connection had admitted but
        the line had not serialised by then is serialised ``k`` times as long from ``pivot`` on
        (``k`` = old rate / new rate), and delivered that much later or sooner, in order; its
        source's hold is moved with its last chunk (:meth:`admit`)."""
        if self.free_at > pivot:
            new = pivot + (self.free_at - pivot) * k
            self.sched_s += new - self.free_at
            self.free_at = new
        if any(e > pivot for _, _, e in self.queue):
            q, last = deque(), 0.0
            for deliver, data, end in self.queue:
                if end > pivot:
                    new = pivot + (end - pivot) * k
                    deliver, end = deliver + new - end, new
                if deliver < last:
                    deliver = last  # a connection's bytes are never reordered
                last = deliver
                q.append((deliver, data, end))
            self.queue, self.last_deliver = q, last
            if self.timer is not None:
                self.timer.cancel()
                self.timer = self.link.loop.call_at(q[0][0], self.flush)
        if self.resume_timer is not None and not self.link.outage:
            self.resume_timer.cancel()
            self.resume_timer = self.link.loop.call_at(self.free_at - RESUME_LEAD_S, self._line_free)

    def kill(self) -> None:
        self.dead = self.finished = True
        for h in (self.timer, self.resume_timer):
            if h is not None:
                h.cancel()
        self.timer = self.resume_timer = None
        self.queue.clear()
        self.queued_bytes = 0
        self.line.flows.discard(self)


class _Side(asyncio.BufferedProtocol):
    """One socket of a proxied connection."""

    def __init__(self, conn: "_Conn", name: str):
        self.conn = conn
        self.name = name
        self.transport: Optional[asyncio.Transport] = None
        self.out: Optional[_Flow] = None  # flow that carries what this side sends
        self.into: Optional[_Flow] = None  # flow that delivers to this side
        self.write_paused = False
        self.reading = True
        self.ready = False  # both ends connected
        self._buf: Optional[bytearray] = None

    def connection_made(self, transport) -> None:
        from .wire import set_nodelay, set_socket_buffer

        set_nodelay(transport)
        set_socket_buffer(transport, RECV_BUFFER_CHUNKS * self.conn.link.chunk_bytes, send=False)
        self.transport = transport
        try:
            transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        except Exception:
            pass
        self.conn.side_made(self)

    def get_buffer(self, sizehint: int):
        n = self.conn.link.read_bytes()
        if self._buf is None or len(self._buf) != n:
            self._buf = bytearray(n)
        return self._buf

    def buffer_updated(self, nbytes: int) -> None:
        buf = self._buf
        if nbytes == len(buf):
            data = buf
            self._buf = None  # handed over; a fresh one for the next read
        elif nbytes <= len(buf) >> 2:
            data = bytes(memoryview(buf)[:nbytes])  # small: copy, keep the buffer
        else:
            data = memoryview(buf)[:nbytes]
            self._buf = None
        self.out.admit(data)

    def eof_received(self):
        self.out.admit_eof()
        self.reading = False
        return True  # keep the transport open: the other direction may still deliver

    def connection_lost(self, exc) -> None:
        self.transport = None
        self.conn.lost(self, exc)

    def pause_writing(self) -> None:
        self.write_paused = True
        if self.into is not None:
            self.into.src.update_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.into is not None:
            self.into.src.update_reading()

    def update_reading(self) -> None:
        """Read iff connected, the line took our last chunk, the receiver keeps up and no outage."""
        tr = self.transport
        if tr is None or self.out is None:
            return
        want = (
            self.ready
            and not self.out.line_hold
            and not self.out.eof_read
            and not self.out.dst.write_paused
            and not self.conn.link.outage
        )
        if want != self.reading:
            self.reading = want
            try:
                if want:
                    tr.resume_reading()
                else:
                    tr.pause_reading()
            except Exception:
                pass


class _Conn:
    """A proxied connection: side a (accepted) and side b (to the target)."""

    def __init__(self, link: "Link", route: dict):
        self.link = link
        self.route = route
        self.a = _Side(self, "a")
        self.b: Optional[_Side] = None
        self.closed = False

    def side_made(self, side: _Side) -> None:
        side.transport.pause_reading()  # until both ends are connected and the flows exist
        side.reading = False
        if side is self.a:
            self.link.conns.add(self)
            self.link.connections_total += 1
            self.link.loop.create_task(self._connect_b())

    async def _connect_b(self) -> None:
        link = self.link
        try:
            _, b = await link.loop.create_connection(
                lambda: _Side(self, "b"), self.route["target_host"], self.route["target_port"]
            )
        except OSError as e:
            log.warning("link: cannot reach %s:%s: %r", self.route["target_host"], self.route["target_port"], e)
            link.connect_failures += 1
            self.abort()
            return
        if self.closed or self.a.transport is None:
            b.transport.close()
            return
        self.b = b
        ab = _Flow(link, link.a_to_b, self.a, b)
        ba = _Flow(link, link.b_to_a, b, self.a)
        self.a.out, self.a.into = ab, ba
        b.out, b.into = ba, ab
        link.a_to_b.flows.add(ab)
        link.b_to_a.flows.add(ba)
        self.a.ready = b.ready = True
        self.a.update_reading()
        b.update_reading()

    def maybe_close(self) -> None:
        if self.b is None or self.a.out is None:
            return
        if self.a.out.finished and self.b.out.finished:
            self.close()

    def lost(self, side: _Side, exc) -> None:
        """A socket closed or reset: nothing more can go to it, but what it sent before is
        already on the line and is delivered (followed by EOF) before the other side closes."""
        if self.closed:
            return
        if side.out is None:
            self.abort()
            return
        side.into.kill()
        side.out.admit_eof()
        self.maybe_close()

    def _finish(self) -> None:
        self.closed = True
        self.link.conns.discard(self)
        for s in (self.a, self.b):
            if s is not None:
                for f in (s.out, s.into):
                    if f is not None:
                        f.kill()

    def close(self) -> None:
        if self.closed:
            return
        for s in (self.a, self.b):
            if s is not None and s.transport is not None:
                s.transport.close()
        self._finish()

    def abort(self) -> None:
        if self.closed:
            return
        for s in (self.a, self.b):
            if s is not None and s.transport is not None:
                s.transport.abort()
        self._finish()


class Link:
    """The emulated line (in-process). ``await link.start()``; ``link.ports`` lists the actual
    listen ports in route order; ``link.control_port`` the control server's port."""

    def __init__(self, cfg: Any):
        self.cfg = normalize_config(cfg)
        self.host = self.cfg["host"]
        self.chunk_bytes = self.cfg["chunk_bytes"]
        self.max_chunk_s = self.cfg["max_chunk_s"]
        self.rng = random.Random(self.cfg["seed"])
        self.a_to_b = _Line("a_to_b")
        self.b_to_a = _Line("b_to_a")
        self.conns: set[_Conn] = set()
        self.connections_total = 0
        self.connect_failures = 0
        self.outage = False
        self.outage_started: Optional[float] = None
        self.outage_total_s = 0.0
        self.ports: list[int] = []
        self.control_port: Optional[int] = None
        self._servers: list[asyncio.base_events.Server] = []
        self._control: Optional[Server] = None
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.t0 = 0.0  # loop time the cross-traffic schedule counts from (start())
        self.cross_schedule: tcp_model.Schedule = tcp_model.check_schedule(self.cfg["cross_traffic"])
        self.mss_bytes = self.cfg["mss_bytes"]
        self.loss_rate = self.cfg["loss_rate"]
        self._apply(self.cfg["gbps"], self.cfg["rtt_ms"], self.cfg["jitter_ms"])

    def _apply(self, gbps: float, rtt_ms: float, jitter_ms: float) -> None:
        check_line(gbps, rtt_ms, jitter_ms)
        self.gbps, self.rtt_ms, self.jitter_ms = float(gbps), float(rtt_ms), float(jitter_ms)
        self._s_per_byte = 8.0 / (self.gbps * 1e9)
        self._one_way_s = self.rtt_ms / 2000.0
        self._jitter_s = self.jitter_ms / 1000.0
        # one connection's loss-limited rate, Gbit/s (inf: no loss, or no RTT)
        self.conn_gbps = tcp_model.mathis_gbps(self.mss_bytes, self.rtt_ms, self.loss_rate)
        # neither loss nor cross traffic: the original arithmetic, bit for bit
        self._plain = self.conn_gbps == float("inf") and not self.cross_schedule

    def read_bytes(self) -> int:
        """Bytes the proxy reads from a connection at once, the largest chunk it schedules:
        ``chunk_bytes``, or on a slow line what the line (less cross traffic) serialises in
        ``max_chunk_s`` seconds, at least ``MIN_SLICE_BYTES`` (1,250 bytes at 1e-4 Gbit/s; 65,536
        from 5.3 Mbit/s up). A connection's next bytes wait for the chunks the others put on the
        line before them, so this bounds the silence a live connection shows its receiver behind
        a long transfer (its heartbeat one chunk per busy connection behind, not 5.2 s per 64 KiB)."""
        if not self.max_chunk_s:
            return self.chunk_bytes
        line_gbps = self.gbps if self._plain else self._rates()[0]  # plain: no loss, no cross traffic
        return max(MIN_SLICE_BYTES, min(self.chunk_bytes, int(line_gbps * 1e9 / 8 * self.max_chunk_s)))

    def cross_gbps(self) -> float:
        """Cross traffic on the line now, Gbit/s (per direction)."""
        now = self.loop.time() if self.loop is not None else self.t0
        return tcp_model.cross_gbps_at(self.cross_schedule, now - self.t0)

    async def start(self) -> "Link":
        self.loop = asyncio.get_running_loop()
        self.t0 = self.loop.time()
        for r in self.cfg["routes"]:
            srv = await self.loop.create_server(
                lambda r=r: _Conn(self, r).a, self.host, r["listen_port"], reuse_address=True
            )
            self._servers.append(srv)
            self.ports.append(srv.sockets[0].getsockname()[1])
        if self.cfg["control_port"] is not None:
            self._control = Server(
                self.host,
                int(self.cfg["control_port"]),
                {"stats": self._h_stats, "set": self._h_set},
                role="link",
                instance="link",
            )
            await self._control.start()
            self.control_port = self._control.port
        return self

    async def close(self) -> None:
        for s in self._servers:
            s.close()
        for c in list(self.conns):
            c.abort()
        if self._control is not None:
            await self._control.close()
        for s in self._servers:
            try:
                await asyncio.wait_for(s.wait_closed(), 1.0)
            except (asyncio.TimeoutError, TimeoutError):
                pass

    async def __aenter__(self) -> "Link":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # -- control
    def set(self, gbps: Optional[float] = None, rtt_ms: Optional[float] = None,
            jitter_ms: Optional[float] = None, outage: Optional[bool] = None,
            loss_rate: Optional[float] = None, cross_gbps: Optional[float] = None) -> dict:
        """Change rate (Gbit/s), RTT (ms), jitter (ms), loss probability ([0, 1)); replace the
        cross-traffic schedule by ``cross_gbps`` (>= 0) from now on; start/end an outage. RTT and
        jitter apply to bytes admitted from now on (bits already on their way keep their delay);
        a rate change (rate, loss or cross traffic) also re-times the bytes admitted but not yet
        serialised, as a real line's queue drains at its new rate (:meth:`_retime`): a line slowed
        to a trickle and restored does not keep the trickle's schedule for what it held (a 64 KiB
        chunk admitted at 1e-5 Gbit/s would otherwise take 52 s after the restore). Raises
        ValueError naming a bad value; then nothing is changed."""
        line = (self.gbps if gbps is None else gbps, self.rtt_ms if rtt_ms is None else rtt_ms,
                self.jitter_ms if jitter_ms is None else jitter_ms)
        check_line(*line)  # every value is checked before any is applied
        loss = self.loss_rate if loss_rate is None else tcp_model.check_loss_rate(loss_rate, "loss_rate")
        schedule = self.cross_schedule
        if cross_gbps is not None:
            now = self.loop.time() if self.loop is not None else self.t0
            keep = tuple(p for p in self.cross_schedule if p[0] < now - self.t0)
            schedule = tcp_model.check_schedule(keep + ((now - self.t0, cross_gbps),), "cross_gbps")
        before = self._rates()
        self.loss_rate, self.cross_schedule = loss, schedule
        self._apply(*line)
        after = self._rates()
        if self.loop is not None and after != before:
            self._retime(before, after)
        if outage is not None and bool(outage) != self.outage:
            now = self.loop.time()
            if outage:
                self.outage = True
                self.outage_started = now
                for line in (self.a_to_b, self.b_to_a):
                    for f in line.flows:
                        if f.timer is not None:
                            f.timer.cancel()
                            f.timer = None
                        f.src.update_reading()
            else:
                d = now - self.outage_started
                self.outage = False
                self.outage_total_s += d
                for line in (self.a_to_b, self.b_to_a):
                    if line.free_at > self.outage_started:
                        line.free_at += d
                    for f in list(line.flows):
                        if f.free_at > self.outage_started:
                            f.free_at += d
                        f.shift(d)
                        if f.resume_timer is not None:
                            f.resume_timer.cancel()
                            f.resume_timer = None
                            f.line_hold = False
                        f.src.update_reading()
        return self.stats()

    def _rates(self) -> tuple[float, float]:
        """``(line, connection)`` rates now, Gbit/s: the line's rate less the cross traffic
        (``tcp_model.available_gbps``), and one connection's, that capped by the loss
        (``conn_gbps``)."""
        now = self.outage_started if self.outage else (self.loop.time() if self.loop is not None else self.t0)
        line = tcp_model.available_gbps(self.gbps, tcp_model.cross_gbps_at(self.cross_schedule, now - self.t0))
        return line, min(line, self.conn_gbps)

    def _retime(self, before: tuple[float, float], after: tuple[float, float]) -> None:
        """Re-time the bytes admitted but not serialised when the rates went from ``before`` to
        ``after`` (:meth:`_rates`), from now (during an outage: from its start, the instant the
        line froze; its end then shifts them as everything in flight): each line's schedule by
        the ratio of its rates, each connection's by the ratio of a connection's. Exact without
        loss and cross traffic (one FIFO line); with them, the remaining schedule is scaled as a
        whole, where admission computes each chunk's time over the cross-traffic schedule."""
        pivot = self.outage_started if self.outage else self.loop.time()
        k_line, k_conn = before[0] / after[0], before[1] / after[1]
        for line in (self.a_to_b, self.b_to_a):
            if line.free_at > pivot:
                new = pivot + (line.free_at - pivot) * k_line
                line.busy_s += new - line.free_at
                line.free_at = new
            for f in list(line.flows):
                f.retime(pivot, k_conn)

    def stats(self) -> dict:
        """Counters; bytes are bytes delivered (all connections, framing included)."""
        return {
            "bytes_a_to_b": self.a_to_b.bytes_delivered,
            "bytes_b_to_a": self.b_to_a.bytes_delivered,
            "admitted_a_to_b": self.a_to_b.bytes_admitted,
            "admitted_b_to_a": self.b_to_a.bytes_admitted,
            "in_flight_a_to_b": sum(f.queued_bytes for f in self.a_to_b.flows),
            "in_flight_b_to_a": sum(f.queued_bytes for f in self.b_to_a.flows),
            "busy_s_a_to_b": self.a_to_b.busy_s,
            "busy_s_b_to_a": self.b_to_a.busy_s,
            "connections": len(self.conns),
            "connections_total": self.connections_total,
            "connect_failures": self.connect_failures,
            "gbps": self.gbps,
            "rtt_ms": self.rtt_ms,
            "jitter_ms": self.jitter_ms,
            "outage": self.outage,
            "outage_total_s": self.outage_total_s,
            "loss_rate": self.loss_rate,
            "mss_bytes": self.mss_bytes,
            "conn_gbps": None if self.conn_gbps == float("inf") else self.conn_gbps,
            "cross_gbps": self.cross_gbps(),
            "cross_traffic": [list(p) for p in self.cross_schedule],
            "ports": list(self.ports),
        }

    def _h_stats(self, peer, h, p):
        return dict(self.stats(), t="stats")

    def _h_set(self, peer, h, p):
        m = messages.LinkSet.decode(h)
        return dict(
            self.set(*(None if v is messages.OMIT else v
                       for v in (m.gbps, m.rtt_ms, m.jitter_ms, m.outage, m.loss_rate, m.cross_gbps))),
            t="stats",
        )


# ---------------------------------------------------------------- control clients
def _strip(h: dict) -> dict:
    return {k: v for k, v in h.items() if k not in ("t", "cid", "reply")}


async def query_stats(host: str, port: int, timeout: float = 5.0) -> dict:
    """Ask a running link's control port for its stats (one short-lived connection)."""
    peer = await connect(host, port, role="link-client", connect_timeout_s=timeout)
    try:
        h, _ = await peer.call(messages.Stats().wire(), timeout=timeout)
        return _strip(h)
    finally:
        await peer.close()


async def set_link(host: str, port: int, timeout: float = 5.0, **kw) -> dict:
    """``set_link(host, port, gbps=?, rtt_ms=?, jitter_ms=?, outage=?, loss_rate=?, cross_gbps=?)`` -> new stats."""
    peer = await connect(host, port, role="link-client", connect_timeout_s=timeout)
    try:
        h, _ = await peer.call(messages.LinkSet(**{k: v for k, v in kw.items() if v is not None}).wire(), timeout=timeout)
        return _strip(h)
    finally:
        await peer.close()


# ---------------------------------------------------------------- process entry
async def serve_link(cfg: Any, ready_line: str = "LINK READY") -> int:
    """Start the link, print ``ready_line`` on stdout, serve until SIGTERM, SIGINT or SIGHUP (one
    ignored at start, ``nohup``, stays ignored); returns that signal's number."""
    link = Link(cfg)
    await link.start()
    stop = stop_waiter()
    log.info("link %s gbps=%s rtt_ms=%s ports=%s control=%s", link.host, link.gbps, link.rtt_ms, link.ports, link.control_port)
    print(ready_line, flush=True)
    try:
        return await stop
    finally:
        await link.close()


def run_link(cfg: Any) -> int | None:
    """Blocking: run the link in this process until SIGTERM, SIGINT or SIGHUP; returns the signal."""
    return asyncio.run(serve_link(cfg))


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pdd.transfer.link", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="JSON text or path to a JSON file")
    args = ap.parse_args(argv)
    text = args.config
    if not text.lstrip().startswith("{") and os.path.exists(text):
        with open(text) as f:
            text = f.read()
    from pdd.logs import configure_logging

    try:
        configure_logging()  # pdd's format and PDD_LOG_LEVEL, as under pdd launch --role link
    except ValueError as e:
        raise SystemExit(f"python -m pdd.transfer.link: {e}")
    run_link(json.loads(text))


if __name__ == "__main__":
    main()
