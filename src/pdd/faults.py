"""Fault injection against a running topology (tests, ``pdd bench``).

Faults (issue 5, "fault injection"):
  - ``wan_outage``: the emulated WAN drops every byte for a time, without resetting any
    connection (``pdd.transfer.link`` outage: both directions freeze);
  - ``wan_slowdown``: the WAN line rate divided by a factor (until :meth:`FaultInjector.restore_wan`);
  - ``cross_traffic``: other traffic takes that many Gbit/s of the WAN line from now on (the link's
    ``cross_gbps``, docs/LINK.md; until :meth:`FaultInjector.restore_wan`);
  - ``kill``: SIGKILL of one instance's real process (:meth:`pdd.launch.Topology.kill`);
  - ``client_disconnect``: a streaming client closes its connection (:class:`StreamClient`).

Each injection returns an :class:`Injection` record with the phase the request was in when the
fault landed: the gateway's own view (``GET /pdd/requests``: the phase held on the request,
:mod:`pdd.gateway.phase`; a fault is injected in one of ``prefill``, ``transfer``, ``rld_decode``,
``handoff``, ``md_decode``) read right before the fault
is applied, and again right after it (``phase_after``). A fault that lands between phases shows
two different values; tests assert both.

Faults can be chosen by phase: :meth:`FaultInjector.wait_phase` polls the gateway until a live
request is in a phase (use timing controls, e.g. a slowed WAN, to make the phase last).
:func:`parse_fault` reads the ``KIND[:ARG]@PHASE`` specs a benchmark takes (``wan_outage:3@transfer``,
``wan_slowdown:10@md_decode``, ``kill:md0@handoff``, ``kill:main_decode@md_decode``: the MD
serving the request).
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import httpx

from pdd.gateway.state import PHASES  # the request phases a fault can be injected in (pdd.gateway.phase)

KINDS = ("wan_outage", "wan_slowdown", "cross_traffic", "kill", "client_disconnect")
ROLES = ("prefill", "relay_decode", "main_decode")


class FaultError(RuntimeError):
    """A fault could not be injected (bad spec, phase never reached, no link ...)."""


@dataclass
class Injection:
    """One injected fault. ``phase`` / ``phase_after``: the target request's phase read from
    the gateway right before / right after the fault was applied (None: no live request)."""

    kind: str
    target: Optional[str]  # instance name (kill) or None
    rid: Optional[str]
    phase: Optional[str]
    phase_after: Optional[str]
    t_mono: float  # time.monotonic() when the fault was applied
    apply_ms: float  # time the fault took to apply (e.g. SIGKILL + reap)
    detail: dict = field(default_factory=dict)
    request: dict = field(default_factory=dict)  # the gateway's view of the request before the fault

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class FaultSpec:
    """``KIND[:ARG]@PHASE``: kind, its argument (seconds of outage, slowdown factor, instance
    name or role to kill) and the phase to inject in."""

    kind: str
    arg: Optional[str]
    phase: str


def parse_fault(spec: str) -> FaultSpec:
    """Parse ``KIND[:ARG]@PHASE``; raises FaultError naming what is wrong."""
    if "@" not in spec:
        raise FaultError(f"fault {spec!r}: expected KIND[:ARG]@PHASE, e.g. wan_outage:3@transfer")
    head, phase = spec.rsplit("@", 1)
    kind, _, arg = head.partition(":")
    if kind not in KINDS:
        raise FaultError(f"fault {spec!r}: kind must be one of {KINDS}")
    if phase not in PHASES:
        raise FaultError(f"fault {spec!r}: phase must be one of {PHASES}")
    if kind in ("wan_outage", "wan_slowdown"):
        try:
            v = float(arg)
        except ValueError:
            raise FaultError(f"fault {spec!r}: {kind} needs a number (seconds / factor)") from None
        if not math.isfinite(v):
            raise FaultError(f"fault {spec!r}: {kind} needs a finite number (seconds / factor), got {v}")
        if v <= 0 or (kind == "wan_slowdown" and v < 1):
            want = "seconds > 0" if kind == "wan_outage" else "a factor >= 1 (the line's rate divided by it)"
            raise FaultError(f"fault {spec!r}: {kind} needs {want}, got {arg}")
    if kind == "cross_traffic":
        try:
            v = float(arg)
        except ValueError:
            raise FaultError(f"fault {spec!r}: cross_traffic needs a number (Gbit/s)") from None
        if not math.isfinite(v):
            raise FaultError(f"fault {spec!r}: cross_traffic needs a finite number (Gbit/s), got {v}")
        if not v >= 0:
            raise FaultError(f"fault {spec!r}: cross_traffic argument out of range")
    if kind == "kill" and not arg:
        raise FaultError(f"fault {spec!r}: kill needs an instance name or a role {ROLES}")
    return FaultSpec(kind, arg or None, phase)


class FaultInjector:
    """Injects faults into a :class:`pdd.launch.Topology` (its processes, its WAN emulator) and
    records the phase each one landed in."""

    def __init__(self, topo, poll_s: float = 0.003):
        self.topo = topo
        self.url = topo.url
        self.poll_s = poll_s
        self.records: list[Injection] = []
        self._http = httpx.Client(timeout=10, trust_env=False)
        self._wan_base: Optional[dict] = None
        self._cross_base: Optional[float] = None  # the cross traffic before cross_traffic() changed it
        self._outage_timer: Optional[threading.Timer] = None

    def close(self) -> None:
        if self._outage_timer is not None:
            self._outage_timer.cancel()
        self._http.close()

    # ------------------------------------------------------------------ the gateway's view
    def live_requests(self) -> dict:
        """rid -> {"phase", "pipeline", "names", "attempt", ...} of every live request."""
        r = self._http.get(self.url + "/pdd/requests")
        r.raise_for_status()
        return r.json()

    def phase_of(self, rid: Optional[str]) -> Optional[str]:
        if rid is None:
            return None
        try:
            v = self.live_requests().get(rid)
        except httpx.HTTPError:
            return None
        return v["phase"] if v else "done"

    def wait_phase(self, phase: str, timeout_s: float = 30.0, need: Optional[str] = None) -> tuple[str, dict]:
        """Wait until a live request is in ``phase`` (and, with ``need`` a role, has an instance of
        that role routed); returns (rid, its view). Raises FaultError on timeout."""
        if phase not in PHASES:
            raise FaultError(f"unknown phase {phase!r}; one of {PHASES}")
        deadline = time.monotonic() + timeout_s
        seen = set()
        while time.monotonic() < deadline:
            for rid, v in self.live_requests().items():
                seen.add(v["phase"])
                if v["phase"] == phase and (need is None or need in v.get("names", {})):
                    return rid, v
            time.sleep(self.poll_s)
        raise FaultError(f"no request reached phase {phase!r} within {timeout_s} s (phases seen: {sorted(seen)})")

    def _record(self, kind: str, target: Optional[str], rid: Optional[str], before: Optional[dict], apply,
                **detail) -> Injection:
        phase = before["phase"] if before else None
        t0 = time.monotonic()
        out = apply()
        t1 = time.monotonic()
        rec = Injection(kind, target, rid, phase, self.phase_of(rid), t0, round((t1 - t0) * 1000, 2),
                        {**detail, **(out or {})}, dict(before or {}))
        self.records.append(rec)
        return rec

    def _view(self, rid: Optional[str]) -> Optional[dict]:
        if rid is None:
            return None
        v = self.live_requests().get(rid)
        return v if v is not None else {"phase": "done"}

    # ------------------------------------------------------------------ WAN
    def _link(self, **kw) -> dict:
        from pdd.transfer.link import set_link

        port = self.topo.layout.link_control_port
        if port is None:
            raise FaultError("this topology has no WAN emulator (mode without datacenter B)")
        return asyncio.run(set_link(self.topo.cfg.host, port, **kw))

    def set_wan(self, **kw) -> dict:
        """Change the WAN (gbps, rtt_ms, jitter_ms) as a timing control; :meth:`restore_wan` undoes it."""
        st = self._link()
        if self._wan_base is None:
            self._wan_base = {k: st[k] for k in ("gbps", "rtt_ms", "jitter_ms")}
        return self._link(**kw)

    def restore_wan(self) -> dict:
        """End any outage and put rate, RTT and jitter back as they were before the first change."""
        if self._outage_timer is not None:
            self._outage_timer.cancel()
            self._outage_timer = None
        base = self._wan_base or {}
        self._wan_base = None
        if self._cross_base is not None:
            base["cross_gbps"] = self._cross_base
            self._cross_base = None
        return self._link(outage=False, **base)

    def wan_outage(self, duration_s: Optional[float] = None, rid: Optional[str] = None) -> Injection:
        """Freeze the WAN (no byte moves, no reset) now; end it after ``duration_s`` (None: at
        :meth:`end_outage` / :meth:`restore_wan`)."""
        before = self._view(rid)

        def apply():
            self._link(outage=True)
            if duration_s is not None:
                self._outage_timer = threading.Timer(duration_s, self.end_outage)
                self._outage_timer.daemon = True
                self._outage_timer.start()

        return self._record("wan_outage", None, rid, before, apply, duration_s=duration_s)

    def end_outage(self) -> dict:
        return self._link(outage=False)

    def wan_slowdown(self, factor: float, rid: Optional[str] = None) -> Injection:
        """Divide the WAN line rate by ``factor`` (until :meth:`restore_wan`)."""
        if factor < 1:
            raise FaultError("a slowdown factor must be >= 1")
        st = self._link()
        if self._wan_base is None:
            self._wan_base = {k: st[k] for k in ("gbps", "rtt_ms", "jitter_ms")}
        before = self._view(rid)
        gbps = st["gbps"] / factor
        return self._record("wan_slowdown", None, rid, before, lambda: {"gbps": self._link(gbps=gbps)["gbps"]},
                            factor=factor)

    def cross_traffic(self, gbps: float, rid: Optional[str] = None) -> Injection:
        """Other traffic takes ``gbps`` of the WAN line from now on (per direction; below the line
        rate, else the link refuses it), until :meth:`restore_wan`."""
        st = self._link()
        if self._cross_base is None:
            self._cross_base = float(st.get("cross_gbps") or 0.0)
        before = self._view(rid)
        return self._record("cross_traffic", None, rid, before,
                            lambda: {"cross_gbps": self._link(cross_gbps=gbps)["cross_gbps"]}, gbps=gbps)

    # ------------------------------------------------------------------ processes
    def kill(self, name: str, rid: Optional[str] = None) -> Injection:
        """SIGKILL instance ``name`` (or, given a role and ``rid``, the instance of that role
        serving the request)."""
        before = self._view(rid)
        if name in ROLES:
            if not before or name not in before.get("names", {}):
                raise FaultError(f"request {rid} has no {name} instance to kill")
            name = before["names"][name]
        return self._record("kill", name, rid, before, lambda: self.topo.kill(name))

    def restart(self, name: str, timeout_s: float = 60.0) -> None:
        """Start a killed instance again and wait until the gateway reaches it (``/health``)."""
        self.topo.restart(name)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._http.post(self.url + "/pdd/flush")  # makes the gateway reconnect closed peers
            h = self._http.get(self.url + "/health")
            if name not in h.json().get("down", []):
                return
            time.sleep(0.2)
        raise FaultError(f"{name} did not rejoin within {timeout_s} s")

    def client_disconnect(self, client: "StreamClient", rid: Optional[str] = None) -> Injection:
        before = self._view(rid)
        return self._record("client_disconnect", None, rid, before, client.disconnect)

    # ------------------------------------------------------------------ spec
    def inject(self, spec: FaultSpec, rid: str, client: Optional["StreamClient"] = None) -> Injection:
        """Apply a parsed spec to request ``rid`` (already in ``spec.phase``)."""
        if spec.kind == "wan_outage":
            return self.wan_outage(float(spec.arg), rid)
        if spec.kind == "wan_slowdown":
            return self.wan_slowdown(float(spec.arg), rid)
        if spec.kind == "cross_traffic":
            return self.cross_traffic(float(spec.arg), rid)
        if spec.kind == "kill":
            return self.kill(spec.arg, rid)
        if client is None:
            raise FaultError("client_disconnect needs the request's StreamClient")
        return self.client_disconnect(client, rid)


class StreamClient:
    """One streaming ``/v1/completions`` request in a thread: token ids as they arrive, the final
    summary (``pdd`` of the usage chunk), and :meth:`disconnect` to drop the connection."""

    def __init__(self, url: str, body: dict, timeout_s: float = 120.0):
        self.url, self.body, self.timeout_s = url, {**body, "stream": True,
                                                     "stream_options": {"include_usage": True}}, timeout_s
        self.tokens: list[int] = []
        self.tiers: list[str] = []
        self.finish_reason: Optional[str] = None
        self.summary: dict = {}
        self.error: Optional[str] = None
        self.status: Optional[int] = None
        self.rid: Optional[str] = None
        self.disconnected = False
        self.done = threading.Event()
        self._resp = None
        self._client = httpx.Client(timeout=timeout_s, trust_env=False)
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "StreamClient":
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            with self._client.stream("POST", self.url + "/v1/completions", json=self.body) as r:
                self._resp = r
                self.status = r.status_code
                if r.status_code != 200:
                    self.error = r.read().decode(errors="replace")
                    return
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    c = json.loads(line[6:])
                    if "error" in c:
                        self.error = json.dumps(c["error"])
                    if self.rid is None and c.get("id"):
                        self.rid = c["id"].split("-", 1)[1]
                    if c.get("choices"):
                        self.tokens.append(c["pdd"]["token_id"])
                        self.tiers.append(c["pdd"]["tier"])
                        if c["choices"][0].get("finish_reason"):
                            self.finish_reason = c["choices"][0]["finish_reason"]
                    elif c.get("usage"):
                        self.summary = c.get("pdd", {})
        except Exception as e:  # a disconnect we made, or a transport error
            if not self.disconnected:
                self.error = f"{type(e).__name__}: {e}"
        finally:
            self.done.set()

    def disconnect(self) -> dict:
        """Close the connection now (the client goes away mid-request)."""
        self.disconnected = True
        self._client.close()
        return {"tokens_before": len(self.tokens)}

    def wait(self, timeout_s: Optional[float] = None) -> bool:
        return self.done.wait(self.timeout_s if timeout_s is None else timeout_s)

    def close(self) -> None:
        self._client.close()
