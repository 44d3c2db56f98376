"""Simulated links: a :class:`Line` shared by its :class:`Flow` s (processor sharing, or the
runtime's WAN send order via ``pdd.policy.wan_order.pick_next``) plus propagation delay."""

from __future__ import annotations

from typing import Callable

import pdd.policy.wan_order as pol_wan


class Flow:
    __slots__ = ("rid", "remaining", "seq", "cb", "total", "line", "done", "t_start", "t_end", "t_served",
                 "on_sent")

    def __init__(self, rid, nbytes, seq, cb, on_sent=None):
        self.rid = rid
        self.remaining = float(nbytes)
        self.total = float(nbytes)
        self.seq = seq
        self.cb = cb
        self.line = None
        self.done = False
        self.t_start = self.t_end = None
        self.t_served = None  # when the line first sent bytes of it (its first frame)
        self.on_sent = on_sent  # called when its last byte has left (before the propagation)


def _noop() -> None:
    return None


class Line:
    """One link: serialises flows at ``gbps`` (processor sharing or a send-order policy from
    ``pdd.policy.wan_order``), then delivers after ``owd_s`` of propagation."""

    def __init__(self, sim: "ClusterSim", name: str, gbps: float, owd_s: float, order: str = "ps"):
        self.sim = sim
        self.name = name
        self.rate = gbps * 1e9 / 8.0
        self.owd = owd_s
        self.order = order
        self.flows: list[Flow] = []
        self.last_t = 0.0
        self.version = 0
        self.bytes_sent = 0.0
        self.busy_s = 0.0
        self.seq = 0

    def _advance(self):
        now = self.sim.env.now
        dt = now - self.last_t
        self.last_t = now
        if dt <= 0 or not self.flows:
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

    def _chosen(self) -> int:
        views = [pol_wan.TransferView(f.rid, int(max(0.0, f.remaining)), f.seq) for f in self.flows]
        return pol_wan.pick_next(views, self.order)

    def _reschedule(self):
        self.version += 1
        if not self.flows:
            return
        if self.order == "ps":
            dt = min(f.remaining for f in self.flows) * len(self.flows) / self.rate
        else:
            dt = self.flows[self._chosen()].remaining / self.rate
        v = self.version
        self.sim.after(max(0.0, dt), self._timer, v)

    def _timer(self, v):
        if v != self.version:
            return
        self._advance()
        eps = 1e-6 * self.rate  # a microsecond's worth of bytes
        done = [f for f in self.flows if f.remaining <= eps]
        if not done:  # numerical leftovers
            done = [min(self.flows, key=lambda f: f.remaining)]
        for f in done:
            self.flows.remove(f)
            f.done = True
            f.t_end = self.sim.env.now
            self.bytes_sent += max(0.0, f.remaining)
            f.remaining = 0.0
            self.sim.after(self.owd, f.cb)
            if f.on_sent is not None:
                f.on_sent()
        self._reschedule()

    def send(self, rid, nbytes: float, cb: Callable[[], None],
             on_sent: Callable[[], None] | None = None) -> Flow:
        """Queue ``nbytes`` on the line; ``cb`` runs when the last byte arrives (propagation
        included), ``on_sent`` (optional) when it has left."""
        f = Flow(rid, nbytes, self.seq, cb, on_sent)
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
        if self.order == "ps":
            f.t_served = f.t_start  # processor sharing serves every flow at once
        self._reschedule()
        return f

    def cancel(self, f: Flow, committed: float = 0.0) -> float:
        """Stop a flow; returns the bytes it will not send. A flow already on the line keeps up
        to ``committed`` bytes (written to the sockets, beyond recall): they still occupy the line,
        delivered to nobody."""
        if f.done or f not in self.flows:
            return 0.0
        self._advance()
        left = max(0.0, f.remaining)
        keep = min(left, committed) if f.t_served is not None else 0.0
        if keep > 1e-6 * self.rate:
            f.remaining = keep
            f.cb = _noop
            self._reschedule()
            return left - keep
        self.flows.remove(f)
        f.done = True
        self._reschedule()
        return left
