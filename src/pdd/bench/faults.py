"""``pdd bench --fault SPEC``: fault injection during a benchmark's main run.

SPEC = ``KIND[:ARG]@PHASE[#N]`` (:func:`pdd.faults.parse_fault`, plus ``#N``): inject ``KIND``
once, when the N-th request (default 1st) of the run that can take it reaches ``PHASE``
(the gateway's view, ``GET /pdd/requests``). ``kill:ARG`` takes an instance name (``md0``) or a
role (``prefill``/``p``, ``relay_decode``/``rld``, ``main_decode``/``md``/``d``: the instance of
that role serving the request); a request counts only if it has an instance of that role.
``N`` is at most :data:`MAX_FAULT_NTH` (1,000,000), and ``pdd bench`` refuses one past its
``--requests``: such a fault could never fire. ``client_disconnect`` is not offered (the bench
client owns its streams; tests use :class:`pdd.faults.StreamClient`).

A spec applies to every benchmarked mode whose topology has its phase and its target
(:func:`applicable`); the others record why not. ``recover_after_s`` seconds after an injection a
killed instance is restarted (:meth:`pdd.launch.Topology.restart`) and a WAN slowdown lifted;
None: at the end of the run. Either way everything is back before the run's drain, stats and
cache flush, so the leak check covers every instance. A restarted instance rejoins when the
gateway next routes to it; if it has not after 3 s, the bench posts ``/pdd/flush`` (which
reconnects closed peers, and empties the caches) until it has.

:func:`fault_report` is the report.json ``faults[mode]`` section: every injection (spec, kind,
target, request, phase before / after, time since the run began), specs never injected (and
why), and how many requests completed, failed, were recovered (a new attempt after a lost
instance) or degraded (finished on RLD without MD), with the injected requests' own outcomes.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from pdd.faults import FaultError, FaultInjector, FaultSpec, parse_fault
from pdd.topology import ROLE_MAIN, ROLE_PREFILL, ROLE_RELAY

ROLE_ALIASES = {"p": ROLE_PREFILL, "prefill": ROLE_PREFILL, "rld": ROLE_RELAY, "relay_decode": ROLE_RELAY,
                "md": ROLE_MAIN, "d": ROLE_MAIN, "main_decode": ROLE_MAIN}
DEFAULT_RECOVER_AFTER_S = 5.0
MAX_FAULT_NTH = 1_000_000  # #N: past a million requests no bench run counts (pdd sim's generated-workload cap)


@dataclass(frozen=True)
class BenchFault:
    text: str
    spec: FaultSpec
    nth: int = 1

    @property
    def role(self) -> Optional[str]:
        """The role a kill targets (None: an instance name, or not a kill)."""
        return ROLE_ALIASES.get(self.spec.arg or "") if self.spec.kind == "kill" else None


def parse_bench_fault(text: str) -> BenchFault:
    """``KIND[:ARG]@PHASE[#N]``; raises FaultError naming what is wrong."""
    head, sep, n = text.strip().partition("#")
    nth = 1
    if sep:
        try:
            nth = int(n)
        except ValueError:
            raise FaultError(f"fault {text!r}: #N must be a request count >= 1") from None
        if nth < 1:
            raise FaultError(f"fault {text!r}: #N must be a request count >= 1")
        if nth > MAX_FAULT_NTH:  # #99999999999999999999 passed: a fault that could never fire
            raise FaultError(f"fault {text!r}: #N must be at most {MAX_FAULT_NTH:,} (the most requests a run counts "
                             f"to), got {nth}")
    spec = parse_fault(head)
    if spec.kind == "client_disconnect":
        raise FaultError(f"fault {text!r}: client_disconnect is not offered by pdd bench (its client owns the "
                         "streams); use pdd.faults.StreamClient in a test")
    if spec.kind == "kill" and spec.arg in ROLE_ALIASES:
        spec = FaultSpec(spec.kind, ROLE_ALIASES[spec.arg], spec.phase)
    return BenchFault(text.strip(), spec, nth)


def applicable(f: BenchFault, layout) -> Optional[str]:
    """None if ``f`` can happen on this topology layout, else why not."""
    roles = {s.role for s in layout.engines}
    ph = f.spec.phase
    if ph in ("prefill", "transfer") and ROLE_PREFILL not in roles:
        return f"mode {layout.mode} has no prefill tier (phase {ph})"
    if ph in ("rld_decode", "handoff") and ROLE_RELAY not in roles:
        return f"mode {layout.mode} has no relay decode tier (phase {ph})"
    if f.spec.kind in ("wan_outage", "wan_slowdown", "cross_traffic") and layout.link_control_port is None:
        return f"mode {layout.mode} has no WAN"
    if f.spec.kind == "kill":
        if f.role is not None:
            if f.role not in roles:
                return f"mode {layout.mode} has no {f.role} instance"
        elif f.spec.arg not in {s.name for s in layout.engines}:
            return f"mode {layout.mode} has no instance {f.spec.arg!r}"
    return None


class FaultRunner:
    """Watches the gateway during one run and injects each fault once (module docstring)."""

    def __init__(self, topo, faults: Sequence[BenchFault], recover_after_s: Optional[float] = DEFAULT_RECOVER_AFTER_S,
                 poll_s: float = 0.005, rejoin_timeout_s: float = 60.0):
        self.topo, self.faults = topo, list(faults)
        self.recover_after_s, self.poll_s, self.rejoin_timeout_s = recover_after_s, poll_s, rejoin_timeout_s
        self.inj = FaultInjector(topo, poll_s=poll_s)
        self.injections: list[dict] = []
        self.not_injected: dict[str, str] = {}
        self._seen: dict[str, list[str]] = {f.text: [] for f in self.faults}
        self._pending = list(self.faults)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._recoveries: list[tuple[float, dict]] = []  # (due monotonic, injection record)
        self._threads: list[threading.Thread] = []
        self.t0 = time.monotonic()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="bench-faults")

    def start(self) -> "FaultRunner":
        self.t0 = time.monotonic()
        self._thread.start()
        return self

    # ------------------------------------------------------------------ watching
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._due_recoveries(time.monotonic())
            if self._pending:
                try:
                    view = self.inj.live_requests()
                except Exception:  # noqa: BLE001 - the gateway is busy or restarting: poll again
                    view = {}
                for f in list(self._pending):
                    rid = self._match(f, view)
                    if rid is not None:
                        self._pending.remove(f)
                        self._inject(f, rid)
            elif not self._recoveries:
                return
            self._stop.wait(self.poll_s)

    def _match(self, f: BenchFault, view: Mapping[str, dict]) -> Optional[str]:
        seen = self._seen[f.text]
        for rid, v in view.items():
            if v.get("phase") != f.spec.phase or rid in seen:
                continue
            if f.role is not None and f.role not in (v.get("names") or {}):
                continue
            seen.append(rid)
            if len(seen) == f.nth:
                return rid
        return None

    def _inject(self, f: BenchFault, rid: str) -> None:
        rec: dict[str, Any] = {"spec": f.text, "kind": f.spec.kind, "nth": f.nth, "rid": rid}
        try:
            inj = self.inj.inject(f.spec, rid)
            req = inj.request or {}
            rec.update(target=inj.target, phase=inj.phase, phase_after=inj.phase_after,
                       t_s=round(inj.t_mono - self.t0, 3), apply_ms=inj.apply_ms, detail=inj.detail,
                       request={k: req.get(k) for k in ("pipeline", "names", "attempt", "next_pos")})
            if f.spec.kind in ("kill", "wan_slowdown", "cross_traffic"):
                due = time.monotonic() + self.recover_after_s if self.recover_after_s is not None else float("inf")
                with self._lock:
                    self._recoveries.append((due, rec))
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            rec["error"] = f"{type(e).__name__}: {e}"
        self.injections.append(rec)

    # ------------------------------------------------------------------ recovery
    def _due_recoveries(self, now: float) -> None:
        with self._lock:
            due = [r for r in self._recoveries if r[0] <= now]
            self._recoveries = [r for r in self._recoveries if r[0] > now]
        for _, rec in due:
            th = threading.Thread(target=self._recover, args=(rec,), daemon=True)
            th.start()
            self._threads.append(th)

    def _recover(self, rec: dict) -> None:
        t = time.monotonic()
        out: dict[str, Any] = {"t_s": round(t - self.t0, 3)}
        try:
            if rec["kind"] in ("wan_slowdown", "cross_traffic"):
                self.inj.restore_wan()
                out["action"] = "wan restored"
            else:
                out["action"] = f"restarted {rec['target']}"
                self.topo.restart(rec["target"])
                out["flushed"] = self._rejoin(rec["target"])
            out["took_s"] = round(time.monotonic() - t, 3)
        except Exception as e:  # noqa: BLE001
            out["error"] = f"{type(e).__name__}: {e}"
        rec["recovery"] = out

    def _rejoin(self, name: str) -> bool:
        """Wait until the gateway reaches ``name`` again; True if it took a cache flush."""
        http = self.inj._http
        t0 = time.monotonic()
        flushed = False
        while time.monotonic() - t0 < self.rejoin_timeout_s:
            if name not in http.get(self.inj.url + "/health").json().get("down", []):
                return flushed
            if time.monotonic() - t0 > 3.0:
                http.post(self.inj.url + "/pdd/flush", timeout=60)  # reconnects closed peers
                flushed = True
            time.sleep(0.2)
        raise FaultError(f"{name} did not rejoin within {self.rejoin_timeout_s} s")

    def finish(self) -> None:
        """End of the run: stop watching, do every recovery still due now, wait for them (once)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=30)
        self._due_recoveries(float("inf"))
        for th in self._threads:
            th.join(timeout=self.rejoin_timeout_s + 60)
        if any(i["kind"] == "wan_outage" and "error" not in i for i in self.injections):
            try:  # an outage still running would freeze the drain (close() cancels its end timer)
                self.inj.end_outage()
            except Exception:  # noqa: BLE001 - no WAN left to restore
                pass
        for f in self._pending:
            self.not_injected[f.text] = (f"no eligible request reached {f.spec.phase} "
                                         f"(saw {len(self._seen[f.text])} of {f.nth})")
        self._pending = []
        self.inj.close()


def request_outcomes(records: Sequence[Mapping]) -> dict:
    """Completed / failed / recovered / degraded counts of a run's client records (recovered and
    degraded: of the completed; from the usage chunk's ``pdd.recoveries`` / ``pdd.degraded``)."""
    ok = [r for r in records if r.get("ok")]
    pdd = [r.get("pdd") or {} for r in ok]
    return {"requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
            "recovered": sum(1 for p in pdd if p.get("recoveries")),
            "degraded": sum(1 for p in pdd if p.get("degraded")),
            "errors": sorted({str(r.get("error"))[:200] for r in records if not r.get("ok")})}


def fault_line(mode: str, fr: Mapping) -> str:
    """The console line of ``fr`` (a :func:`fault_report`) for ``mode``: each injection as
    ``SPEC -> TARGET in PHASE`` (``: ERROR`` when it failed), the specs not injected and why, and
    the requests' outcomes. Plain text: print it without console markup (its specs are not tags)."""
    inj = [f"{i['spec']}{' -> ' + i['target'] if i.get('target') else ''} in {i.get('phase')}"
           f"{': ' + i['error'] if i.get('error') else ''}" for i in fr["injections"]]
    line = f"faults {mode}: {len(inj)} injected" + (f" ({'; '.join(inj)})" if inj else "")
    if fr["not_injected"]:
        line += "; not injected: " + "; ".join(f"{k} ({v})" for k, v in fr["not_injected"].items())
    q = fr["requests"]
    return line + (f"; requests: {q['requests']}, {q['completed']} completed, {q['failed']} failed, "
                   f"{q['recovered']} recovered, {q['degraded']} degraded")


def fault_report(runner: Optional[FaultRunner], records: Sequence[Mapping], skipped: Mapping[str, str],
                 recover_after_s: Optional[float]) -> dict:
    """report.json ``faults[mode]`` (module docstring)."""
    by_rid = {(r.get("pdd") or {}).get("rid"): r for r in records if (r.get("pdd") or {}).get("rid")}
    injections = []
    for rec in (runner.injections if runner else []):
        r = by_rid.get(rec.get("rid"))
        p = (r or {}).get("pdd") or {}
        rec = dict(rec, outcome=None if r is None else {
            "ok": bool(r.get("ok")), "tokens": len(r.get("token_times_s") or []), "max_tokens": r.get("max_tokens"),
            "recoveries": p.get("recoveries"), "degraded": p.get("degraded"), "pipeline": p.get("pipeline")})
        if r is None:
            rec["outcome"] = {"ok": False, "note": "no usage chunk for this request (it failed)"}
        injections.append(rec)
    return {"recover_after_s": recover_after_s, "injections": injections,
            "not_injected": dict(runner.not_injected if runner else {}), "not_applicable": dict(skipped),
            "requests": request_outcomes(records)}
