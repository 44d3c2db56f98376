"""What a benchmarked topology's instances cost over a replay: instance-seconds from the gateway's
membership log, and the autoscaling loop's decisions in the same window (``pdd bench``,
docs/BENCH.md "Load ramps and autoscaling").

A snapshot is the gateway's ``GET /pdd/autoscale`` answer (``pdd.gateway.autoscale``): its clock
(``time``), every engine instance's state, the membership events and, with ``pdd serve
--autoscale``, the decisions. :func:`mode_autoscale` takes one just before the replay and one
when its last request has ended and computes, in the gateway's clock:

- ``instance_seconds``: :func:`pdd.policy.autoscale.instance_seconds` over that window: for every
  engine instance, the seconds it was a member (active, or draining what it holds), summed; a
  standby slot costs nothing until it is added; an instance the gateway starts counts from its
  join, not from the start of its process;
- ``scale_ups`` / ``scale_downs``: the loop's applied adds / drains whose decision time is in
  the window (``errors``: operations that failed);
- ``timeline``: members per role over the window (seconds since its start), for the plot.
"""

from __future__ import annotations

from typing import Mapping

import httpx

from pdd.policy.autoscale import instance_seconds


def snapshot(url: str, timeout_s: float = 30.0) -> dict | None:
    """``GET {url}/pdd/autoscale``; None when the server has none (vLLM, an older gateway) or
    its answer has no membership (nothing to count)."""
    try:
        r = httpx.get(url.rstrip("/") + "/pdd/autoscale", timeout=timeout_s, trust_env=False)
        body = r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    if not isinstance(body, dict) or "membership" not in body or "time" not in body:
        return None
    return body


def decision_counts(decisions, t0: float, t1: float) -> dict:
    """Scale-ups (adds) and scale-downs (drains) of the decisions timed in ``(t0, t1]``: applied,
    or still under way (an add whose process is starting), and the operations that failed."""
    out = {"scale_ups": 0, "scale_downs": 0, "errors": 0}
    for d in decisions or ():
        if not t0 < float(d.get("time", 0.0)) <= t1:
            continue
        for a in list(d.get("applied") or ()) + list(d.get("under_way") or ()):
            if "error" in a:
                out["errors"] += 1
            elif a.get("op") == "add":
                out["scale_ups"] += 1
            elif a.get("op") == "drain":
                out["scale_downs"] += 1
    return out


def mode_autoscale(before: Mapping | None, after: Mapping | None) -> dict | None:
    """The ``autoscale`` entry of a mode in report.json from the two snapshots (module
    docstring); None when either is missing."""
    if not before or not after:
        return None
    t0, t1 = float(before["time"]), float(after["time"])
    initial = {n: (v["role"], v["state"]) for n, v in before["membership"]["instances"].items()}
    seen = {(e["time"], e["instance"], e["op"]) for e in before["membership"].get("events") or ()}
    events = [e for e in after["membership"].get("events") or () if (e["time"], e["instance"], e["op"]) not in seen]
    used = instance_seconds(initial, events, t0, t1)
    window = t1 - t0
    out = {
        "enabled": bool(after.get("enabled")),
        "window_s": round(window, 3),
        "instance_seconds": round(used["total"], 3),
        "instance_seconds_by_role": {r: round(v, 3) for r, v in sorted(used["by_role"].items())},
        "mean_instances": round(used["total"] / window, 3) if window > 0 else None,
        **decision_counts(after.get("decisions"), t0, t1),
        "timeline": used["timeline"],
        "events": [{k: e.get(k) for k in ("time", "op", "instance", "role", "from", "to")} for e in events],
    }
    if after.get("config"):
        out["config"] = after["config"]
    return out


__all__ = ["snapshot", "decision_counts", "mode_autoscale"]
