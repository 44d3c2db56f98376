"""Simulated links: a :class:`Line` shared by its :class:`Flow` s (processor sharing, or the
runtime's WAN send order via ``pdd.policy.wan_order.pick_next``) plus propagation delay.

The WAN line models what the runtime's link emulator (``pdd.transfer.link``) does, with the same
pure functions (``pdd.policy.tcp_model``):

- **Loss**: each flow (one transfer: the runtime sends it over one connection) moves at most
  ``mathis_gbps(mss, rtt, p)`` (Mathis et al. 1997); the line's rate not taken stays free for
  other flows (processor sharing: each of ``n`` active flows gets ``min(rate / n, conn)``; a send
  order: the chosen flow gets ``min(rate, conn)``).
- **Cross traffic**: a schedule ``((t_s, gbps), ...)`` on the simulation clock; from each point
  on the line's rate is ``available_gbps(line, cross)`` (at least 1% of the line).
- **Connections**: with a send order, the flows of one connection (one sender's lane to one
  target: ``conn`` of :meth:`Line.send`, and the express lane, a connection of its own for a flow
  of at most ``express_bytes``) go one at a time in that order, and the connections with a flow to
  send share the line equally (the emulator interleaves their chunks; processor sharing across
  connections, each capped by the loss as above).
- **Layer-wise streaming**: a flow may start with ``held`` bytes not yet computed (its prefill is
  still running); :meth:`Line.release` hands them over. A flow with nothing released takes no
  share; with a send order, flows whose KV is complete go before prefilling ones (the runtime's
  ``LayeredTransfer``: a prefilling transfer sends only when no finished one has a frame ready).

Without loss, cross traffic, held bytes or a second connection every step is the original
processor-sharing / send-order arithmetic, bit for bit.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from typing import Callable

import pdd.policy.tcp_model as tcp_model
import pdd.policy.wan_order as pol_wan


class Flow:
    __slots__ = ("rid", "remaining", "seq", "cb", "total", "line", "done", "t_start", "t_end", "t_served",
                 "on_sent", "held", "wait_s", "idle_since", "sent_lead", "lane", "hist_t", "hist_b")

    def __init__(self, rid, nbytes, seq, cb, on_sent=None, held: float = 0.0, sent_lead: float = 0.0,
                 lane=None):
        self.rid = rid
        self.remaining = float(nbytes)
        self.total = float(nbytes)
        self.seq = seq
        self.cb = cb
        self.line = None
        self.done = False
        self.t_start = self.t_end = None
        self.t_served = None  # when the line first sent bytes of it (its first frame)
        # called once its last byte has been written: all its bytes computed (``held`` 0) and at
        # most ``sent_lead`` of them not yet on the line (the sender's socket buffers hold them);
        # ``sent_lead`` 0: when its last byte has left (before the propagation)
        self.on_sent = on_sent
        self.sent_lead = float(sent_lead)
        self.held = float(held)  # bytes of ``remaining`` not yet computed (layer-wise streaming)
        self.wait_s = 0.0  # seconds, after its first frame, it had nothing released to send
        self.idle_since = None
        self.lane = lane  # the connection it goes over (Line.send): flows of one lane go in turn
        # a tracked flow's bytes on the line over time (Line.send's ``track``): at each of the
        # line's events, seconds and bytes sent so far; between two the rate was constant
        self.hist_t = self.hist_b = None


def _noop() -> None:
    return None


class Line:
    """One link: serialises flows at ``gbps`` (processor sharing or a send-order policy from
    ``pdd.policy.wan_order``), then delivers after ``owd_s`` of propagation.

    ``conn_gbps``: one flow's largest rate, Gbit/s (``tcp_model.mathis_gbps`` of the line's loss;
    ``inf`` = no cap). ``cross``: cross-traffic schedule ``((t_s, gbps), ...)``, seconds of
    simulation time and Gbit/s, each below ``gbps`` (ValueError otherwise). ``express_bytes``:
    with a send order, a flow of at most this many bytes goes over its sender's express lane, a
    connection of its own that shares the line with the bulk one (``pdd.policy.wan_order.wan_lane``;
    0: one connection)."""

    def __init__(self, sim: "ClusterSim", name: str, gbps: float, owd_s: float, order: str = "ps",
                 conn_gbps: float = math.inf, cross=(), express_bytes: float = 0.0):
        self.sim = sim
        self.name = name
        self.gbps = gbps
        self.cross = tcp_model.check_schedule(cross, f"{name} cross traffic", gbps)
        self.rate = tcp_model.available_gbps(gbps, tcp_model.cross_gbps_at(self.cross, 0.0)) * 1e9 / 8.0 \
            if self.cross else gbps * 1e9 / 8.0
        self.conn_rate = conn_gbps * 1e9 / 8.0 if conn_gbps != math.inf else math.inf
        self.owd = owd_s
        self.order = order
        self.express_bytes = float(express_bytes)  # flows of at most this many bytes: a connection of their own
        self.flows: list[Flow] = []
        self.last_t = 0.0
        self.version = 0
        self.bytes_sent = 0.0
        self.busy_s = 0.0
        self.seq = 0
        self.n_held = 0  # flows with bytes not yet released
        self.n_tracked = 0  # flows on the line whose bytes over time are recorded (send's track)
        # stalled flows -> a callback each, run once the line sends bytes of that flow again
        # (:meth:`when_sending`); dropped unrun when the flow leaves the line
        self.resume_waiters: dict[Flow, Callable[[], None]] = {}
        self.lanes: dict = {}  # connection (Flow.lane) -> how many of its flows are on the line (a send order)
        for t, _g in self.cross:
            if t > 0:
                sim.after(t, self._cross_change)

    def _general(self) -> bool:
        return self.conn_rate != math.inf or self.n_held > 0 or len(self.lanes) > 1

    def _lane_add(self, f: Flow) -> None:
        if self.order != "ps":
            self.lanes[f.lane] = self.lanes.get(f.lane, 0) + 1

    def _lane_drop(self, f: Flow) -> None:
        if self.order != "ps":
            n = self.lanes[f.lane] - 1
            if n:
                self.lanes[f.lane] = n
            else:
                del self.lanes[f.lane]

    def _served(self, act: list[Flow]) -> list[Flow]:
        """The flows the line sends now among ``act`` (those with bytes to send): every one
        (processor sharing), or each connection's pick of the send order (:meth:`_pick`)."""
        if self.order == "ps":
            return act
        by: dict = {}
        for f in act:
            by.setdefault(f.lane, []).append(f)
        return [v[0] if len(v) == 1 else self._pick(v) for v in by.values()]

    def _per_flow(self, n_served: int) -> float:
        """Bytes/s of each of ``n_served`` flows served at once: an equal share, at most one
        connection's loss-limited rate."""
        return min(self.rate / n_served, self.conn_rate)

    def _cross_change(self) -> None:
        """A cross-traffic schedule point: bytes so far at the old rate, the rest at the new."""
        self._advance()
        now = self.sim.env.now
        self.rate = tcp_model.available_gbps(self.gbps, tcp_model.cross_gbps_at(self.cross, now)) * 1e9 / 8.0
        self._reschedule()

    def _active(self) -> list[Flow]:
        return [f for f in self.flows if f.remaining - f.held > 0.0]

    def _advance(self):
        now = self.sim.env.now
        dt = now - self.last_t
        self.last_t = now
        if dt <= 0 or not self.flows:
            return
        if self._general():
            self._advance_general(now, dt)
            if self.n_tracked:
                self._record(now)
            return
        self.busy_s += dt
        amount = self.rate * dt
        if self.order == "ps":
            share = amount / len(self.flows)
            for f in self.flows:
                f.remaining -= share
        else:
            f = self.flows[self._chosen()]
            f.remaining -= amount
            if f.t_served is None:
                f.t_served = now - dt
        self.bytes_sent += amount
        if self.n_tracked:
            self._record(now)

    def _record(self, now: float) -> None:
        """Each tracked flow's bytes sent so far, at ``now`` (after an advance)."""
        for f in self.flows:
            if f.hist_t is not None:
                f.hist_t.append(now)
                f.hist_b.append(f.total - f.remaining)

    def sent_at(self, f: Flow, t: float) -> float:
        """Bytes of tracked flow ``f`` (``send(track=True)``) that had left on the line by time
        ``t`` (simulated seconds, at or after its send, at most now): its record, linear between
        two of the line's events (its rate was constant there), after the last at its current
        rate. Its receiver has them ``owd_s`` later. ValueError for a flow not tracked."""
        ts, bs = f.hist_t, f.hist_b
        if ts is None:
            raise ValueError(f"flow {f.rid!r} is not tracked (Line.send track=True)")
        i = bisect_right(ts, t)
        if i >= len(ts):  # after its last record: still on the line (its record is the line's last event)
            if f.done or f not in self.flows:
                return bs[-1]
            return bs[-1] + min(self._rate_of(f) * (t - ts[-1]), max(0.0, f.remaining - f.held))
        if i == 0:
            return 0.0
        t0, t1 = ts[i - 1], ts[i]
        if t1 <= t0:
            return bs[i]
        return bs[i - 1] + (bs[i] - bs[i - 1]) * (t - t0) / (t1 - t0)

    def next_sent_s(self, f: Flow, t: float) -> float | None:
        """The first time at or after ``t`` (simulated seconds) at which the line sends bytes of
        tracked flow ``f`` (a frame of it leaves), up to now, or None when it sends none from
        ``t`` to now (stalled: queued behind others, its rest not computed yet; or done). Its
        record (:meth:`sent_at`): a stretch between two of the line's events in which its bytes
        grew; after the last, its current rate while its computed bytes last. ValueError for a
        flow not tracked."""
        ts, bs = f.hist_t, f.hist_b
        if ts is None:
            raise ValueError(f"flow {f.rid!r} is not tracked (Line.send track=True)")
        for j in range(max(1, bisect_right(ts, t)), len(ts)):
            if bs[j] > bs[j - 1] and ts[j] > t:
                return max(t, ts[j - 1])
        if f.done or f not in self.flows:
            return None
        rate = self._rate_of(f)
        room = f.remaining - f.held
        if rate <= 0.0 or room <= 0.0:
            return None
        start = max(t, ts[-1])
        return start if start < ts[-1] + room / rate and start <= self.sim.env.now else None

    def first_sent_s(self, f: Flow) -> float | None:
        """When the line first sent bytes of tracked flow ``f`` (its first frame left), or None
        while none has: its ``t_served``, else the line's last event when it is served now."""
        if f.t_served is not None:
            return f.t_served
        if f.done or f not in self.flows or self._rate_of(f) <= 0.0:
            return None
        return self.last_t

    def _advance_general(self, now: float, dt: float) -> None:
        act = self._active()
        if not act:
            return
        self.busy_s += dt
        served = self._served(act)
        per = self._per_flow(len(served)) * dt
        for f in served:
            got = min(per, f.remaining - f.held)
            f.remaining -= got
            self.bytes_sent += got
            if f.t_served is None:
                f.t_served = now - dt

    def _pick(self, act: list[Flow]) -> Flow:
        """The send order's choice among flows with bytes to send (of one connection): complete
        ones first."""
        ready = [f for f in act if f.held == 0.0] or act
        views = [pol_wan.TransferView(f.rid, int(max(0.0, f.remaining)), f.seq) for f in ready]
        return ready[pol_wan.pick_next(views, self.order)]

    def _chosen(self) -> int:
        views = [pol_wan.TransferView(f.rid, int(max(0.0, f.remaining)), f.seq) for f in self.flows]
        return pol_wan.pick_next(views, self.order)

    def when_sending(self, f: Flow, fn: Callable[[], None]) -> None:
        """Run ``fn`` (at once, as an event) once the line sends bytes of ``f`` at one of its
        events (now, if it does); never if ``f`` leaves the line first."""
        self.resume_waiters[f] = fn
        self._wake_resumed()

    def _wake_resumed(self) -> None:
        for f, fn in list(self.resume_waiters.items()):
            if f.done or f not in self.flows:
                del self.resume_waiters[f]
            elif f.remaining - f.held > 0 and self._rate_of(f) > 0.0:
                del self.resume_waiters[f]
                self.sim.after(0.0, fn)

    def _reschedule(self):
        self.version += 1
        if self.resume_waiters:
            self._wake_resumed()
        if not self.flows:
            return
        if self._general():
            act = self._active()
            if not act:
                return  # every flow waits for its prefill (release reschedules)
            served = self._served(act)
            dt = min(f.remaining - f.held for f in served) / self._per_flow(len(served))
        elif self.order == "ps":
            dt = min(f.remaining for f in self.flows) * len(self.flows) / self.rate
        else:
            dt = self.flows[self._chosen()].remaining / self.rate
        lead = self._next_sent_s()
        if lead is not None and lead < dt:
            dt = lead
        v = self.version
        self.sim.after(max(0.0, dt), self._timer, v)

    def _rate_of(self, f: Flow) -> float:
        """``f``'s current rate on the line, bytes/s (0: not served now)."""
        if self._general():
            act = self._active()
            if f not in act:
                return 0.0
            served = self._served(act)
            return self._per_flow(len(served)) if f in served else 0.0
        if self.order == "ps":
            return self.rate / len(self.flows)
        return self.rate if self.flows[self._chosen()] is f else 0.0

    def _queue_ahead(self) -> dict[int, float]:
        """With a send order: for each flow (by ``id``), the bytes its connection sends before
        that flow's last byte, its own remaining included, if the order serves the flows now
        queued on it one after another (complete ones first, as :meth:`_pick`). The runtime's
        sender writes a transfer's frames only after the transfers the order serves before it on
        that connection: its last byte enters the socket buffers once no more than the buffers'
        worth of the queue is left ahead of it, its own bytes included."""
        lanes: dict = {}
        for f in self.flows:
            if f.remaining - f.held > 0.0 or f.held == 0.0:
                lanes.setdefault(f.lane, []).append(f)
        out = {}
        for rest in lanes.values():
            cum = 0.0
            while rest:
                f = self._pick(rest)
                cum += max(0.0, f.remaining)
                out[id(f)] = cum
                rest.remove(f)
        return out

    def _written_bytes(self, f: Flow, ahead: dict | None) -> float:
        """Bytes still to go on the line before ``f`` is written out: its own remaining (processor
        sharing: each flow has its own connection) or its connection's queue ahead of and
        including it (a send order, :meth:`_queue_ahead`)."""
        if ahead is None:  # its own connection
            return f.remaining
        return ahead.get(id(f), f.remaining)

    def _next_sent_s(self) -> float | None:
        """Seconds until the next flow's written-out point (the bytes to go before its last one,
        :meth:`_written_bytes`, down to its ``sent_lead``), at the current rates; None when no
        flow has one ahead."""
        best = None
        ahead = None
        for f in self.flows:
            if f.on_sent is None or f.sent_lead <= 0.0 or f.held > 0.0:
                continue
            if ahead is None and self.order != "ps":  # once a call: the queues and who is served now
                ahead = self._queue_ahead()
                served = self._served(self._active())
                sending, per = {s.lane for s in served}, self._per_flow(len(served)) if served else 0.0
            left = self._written_bytes(f, ahead)
            if left <= f.sent_lead:
                continue
            if ahead is None:
                r = self._rate_of(f)
            else:  # the queue ahead of it drains at its connection's served flow's rate
                r = per if f.lane in sending else 0.0
            if r > 0.0:
                t = (left - f.sent_lead) / r
                best = t if best is None or t < best else best
        return best

    def _is_written(self, f: Flow, eps: float = 0.0, ahead: dict | None = None) -> bool:
        return (f.on_sent is not None and f.held == 0.0 and f.sent_lead > 0.0
                and self._written_bytes(f, ahead) <= f.sent_lead + eps)

    def _fire_sent(self, eps: float) -> bool:
        """Call ``on_sent`` of each flow written out by now (see :class:`Flow`); True if any."""
        fired = False
        ahead = self._queue_ahead() if self.order != "ps" and any(f.on_sent for f in self.flows) else None
        for f in list(self.flows):
            if self._is_written(f, eps, ahead):
                cb, f.on_sent = f.on_sent, None
                cb()
                fired = True
        return fired

    def _timer(self, v):
        if v != self.version:
            return
        self._advance()
        eps = 1e-6 * self.rate  # a microsecond's worth of bytes
        fired = self._fire_sent(eps)
        if self._general():
            self._timer_general(eps, fired)
            return
        done = [f for f in self.flows if f.remaining <= eps]
        if not done and fired:  # a written-out point, no flow's end
            self._reschedule()
            return
        if not done:  # numerical leftovers
            done = [min(self.flows, key=lambda f: f.remaining)]
        for f in done:
            self._finish(f)
        self._reschedule()

    def _timer_general(self, eps: float, fired: bool = False) -> None:
        now = self.sim.env.now
        done, idle = [], []
        for f in self.flows:
            if f.remaining - f.held <= eps:
                (done if f.held == 0.0 else idle).append(f)
        if not done and not idle and fired:  # a written-out point, no flow's end
            self._reschedule()
            return
        if not done and not idle:  # numerical leftovers
            act = self._active()
            f = min(act, key=lambda f: f.remaining - f.held)
            (done if f.held == 0.0 else idle).append(f)
        for f in idle:  # all it has so far is sent (its last bytes within eps: counted): it waits for the prefill
            self.bytes_sent += max(0.0, f.remaining - f.held)
            f.remaining = f.held
            if f.idle_since is None:
                f.idle_since = now
        for f in done:
            self._finish(f)
        self._reschedule()

    def _untrack(self, f: Flow) -> None:
        """``f`` leaves the line: its record ends with what it sent."""
        if f.hist_t is not None:
            self.n_tracked -= 1
            f.hist_t.append(self.sim.env.now)
            f.hist_b.append(f.total - max(0.0, f.remaining))

    def _finish(self, f: Flow) -> None:
        self.flows.remove(f)
        self._lane_drop(f)
        f.done = True
        f.t_end = self.sim.env.now
        self.bytes_sent += max(0.0, f.remaining)
        f.remaining = 0.0
        self._untrack(f)
        self.sim.after(self.owd, f.cb)
        if f.on_sent is not None:
            cb, f.on_sent = f.on_sent, None
            cb()

    def send(self, rid, nbytes: float, cb: Callable[[], None],
             on_sent: Callable[[], None] | None = None, held: float = 0.0, sent_lead: float = 0.0,
             conn=None, track: bool = False) -> Flow:
        """Queue ``nbytes`` on the line; ``cb`` runs when the last byte arrives (propagation
        included), ``on_sent`` (optional) once the sender has written the last byte: when at most
        ``sent_lead`` bytes (its socket buffers, >= 0) are still to go on the line, all of them
        computed; ``sent_lead`` 0: when the last byte has left. ``held``: bytes of them not
        computed yet (0 <= held <= nbytes), sent only once :meth:`release` d. ``conn``: with a
        send order, the sender and target whose connections it takes (any hashable; flows of one
        ``conn`` share its bulk connection, or its express one when at most ``express_bytes``).
        ``track``: record its bytes on the line over time (:meth:`sent_at`, what its receiver's
        progress reports read); off, nothing is recorded."""
        express = self.order != "ps" and 0 < nbytes <= self.express_bytes
        f = Flow(rid, nbytes, self.seq, cb, on_sent, held if nbytes > 0 else 0.0, max(0.0, float(sent_lead)),
                 (conn, express))
        self.seq += 1
        f.line = self
        f.t_start = self.sim.env.now
        if nbytes <= 0:
            f.done = True
            self.sim.after(self.owd, cb)
            if on_sent is not None:
                self.sim.after(0.0, on_sent)
            return f
        self._advance()
        self.flows.append(f)
        self._lane_add(f)
        if track:
            f.hist_t, f.hist_b = [f.t_start], [0.0]
            self.n_tracked += 1
        if f.held > 0:
            self.n_held += 1
        if self.order == "ps" and not self._general():
            f.t_served = f.t_start  # processor sharing serves every flow at once
        if self._is_written(f, ahead=self._queue_ahead() if self.order != "ps" and f.on_sent else None):
            cb_sent, f.on_sent = f.on_sent, None  # it fits the socket buffers: written at once
            self.sim.after(0.0, cb_sent)
        self._reschedule()
        return f

    def release(self, f: Flow, held: float) -> None:
        """``f``'s bytes not yet computed are now ``held`` (<= its current held; 0: its KV is
        complete). No-op for a finished or cancelled flow."""
        if f.done or f not in self.flows or held >= f.held:
            return
        self._advance()
        now = self.sim.env.now
        if f.idle_since is not None:
            f.wait_s += now - f.idle_since
            f.idle_since = None
        if f.remaining - f.held <= 0.0:  # idle: snapped to its held bytes
            f.remaining = f.held
        f.held = max(0.0, float(held))
        if f.held == 0.0:
            self.n_held -= 1
            if self._is_written(f, ahead=self._queue_ahead() if self.order != "ps" and f.on_sent else None):
                cb_sent, f.on_sent = f.on_sent, None  # its last computed bytes fit the buffers
                self.sim.after(0.0, cb_sent)
        self._reschedule()

    def cancel(self, f: Flow, committed: float = 0.0) -> float:
        """Stop a flow; returns the bytes it will not send. A flow already on the line keeps up
        to ``committed`` bytes (written to the sockets, beyond recall): they still occupy the line,
        delivered to nobody."""
        if f.done or f not in self.flows:
            return 0.0
        self._advance()
        left = max(0.0, f.remaining)
        if f.held > 0:  # bytes not computed were never written: only the released part may be kept
            self.n_held -= 1
            left_sent = max(0.0, f.remaining - f.held)
            f.held = 0.0
            f.remaining = left_sent
            keep = min(left_sent, committed) if f.t_served is not None else 0.0
        else:
            keep = min(left, committed) if f.t_served is not None else 0.0
        f.on_sent = None  # cut off: its KV is not all written
        if keep > 1e-6 * self.rate:
            f.remaining = keep
            f.cb = _noop
            self._reschedule()
            return left - keep
        self.flows.remove(f)
        self._lane_drop(f)
        f.done = True
        self._untrack(f)
        self._reschedule()
        return left
