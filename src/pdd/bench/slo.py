"""The benchmark's SLO (fixed by formula before the measured runs) and goodput.

The SLO is derived from a *reference run*: a short replay of ``same_dc_pd`` with one request in
flight at a time (the physical TTFT/TPOT floor of the embedded topology). A request meets the
SLO when it completed and

    TTFT <= ttft_factor x (reference run's median TTFT)     (ttft_factor = 3.0)
    TPOT <= tpot_factor x (reference run's median TPOT)     (tpot_factor = 1.5)

A request with a single output token has no TPOT and is judged on TTFT alone (as in
``vllm bench serve --goodput``, where its TPOT is 0). Failed requests never meet it. Either
bound may be given absolutely instead (``--slo ttft:MS tpot:MS``); a bound given absolutely is
not taken from the reference run, and when both are given no reference run is needed.
The same SLO holds for every mode and every rate of a sweep.

Goodput (names as in ``vllm bench serve``): ``request_goodput`` = requests meeting the SLO /
duration (req/s), the duration being the mode's (last stream end - first send, as for
``request_throughput``). ``slo_attainment`` = requests meeting the SLO / all requests sent
(failed ones included), 0..1. A rate "meets the SLA" when ``slo_attainment >= 0.9``.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Iterable, Mapping

import numpy as np

from pdd.bench.report import is_completed, request_latencies

TTFT_FACTOR = 3.0
TPOT_FACTOR = 1.5
SLA_ATTAINMENT = 0.9  # share of requests that must meet the SLO for a rate to count (SLA goodput)


@dataclass(frozen=True)
class SLO:
    """Per-request bounds in ms (``None``: no bound on that metric).

    ``source``: "reference" (both from the reference run), "absolute" (both given), or "mixed".
    ``reference``: what the reference run measured (see :func:`reference_summary`), or None.
    """

    ttft_ms: float | None
    tpot_ms: float | None
    source: str = "absolute"
    ttft_factor: float = TTFT_FACTOR
    tpot_factor: float = TPOT_FACTOR
    reference: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        parts = []
        if self.ttft_ms is not None:
            parts.append(f"TTFT <= {self.ttft_ms:,.1f} ms")
        if self.tpot_ms is not None:
            parts.append(f"TPOT <= {self.tpot_ms:,.2f} ms")
        return " and ".join(parts) or "no bound"


def parse_slo(spec: str | Iterable[str] | None) -> dict[str, float]:
    """``"ttft:500 tpot:50"`` (or the tokens as a list, or comma separated) -> ``{"ttft_ms": 500.0,
    "tpot_ms": 50.0}``. Only ttft and tpot are accepted; values are ms, finite and > 0. ValueError
    naming ``--slo`` and the bad term otherwise; a number out of range (``ttft:-5``, ``tpot:0``,
    ``ttft:nan``, ``tpot:1e400``) is refused naming its metric."""
    if spec is None:
        return {}
    text = spec if isinstance(spec, str) else " ".join(spec)
    out: dict[str, float] = {}
    for tok in re.split(r"[\s,]+", text.strip()):
        if not tok:
            continue
        m = re.fullmatch(r"(ttft|tpot)[:=](-?(?:[0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?|nan|inf(?:inity)?))(ms)?",
                         tok.lower())  # a sign, nan and inf parse here, to be refused naming the metric
        if m is None:
            raise ValueError(f"--slo: bad term {tok!r}: expected ttft:MS or tpot:MS")
        v = float(m.group(2))
        if not 0 < v < math.inf:  # NaN fails too; 1e400 parses as inf: a bound nothing misses
            raise ValueError(f"--slo: the {m.group(1)} bound must be a positive, finite number of ms, got {tok!r}")
        out[f"{m.group(1)}_ms"] = v
    return out


def reference_summary(records: Iterable[Mapping], mode: str = "same_dc_pd") -> dict:
    """Medians of the reference run: ``{"mode", "requests", "completed", "median_ttft_ms",
    "median_tpot_ms"}`` (a median is None when nothing measured it)."""
    recs = list(records)
    lat = [request_latencies(r) for r in recs if is_completed(r)]
    ttft = [x["ttft_ms"] for x in lat]
    tpot = [x["tpot_ms"] for x in lat if x["tpot_ms"] is not None]
    return {
        "mode": mode,
        "requests": len(recs),
        "completed": len(lat),
        "median_ttft_ms": float(np.median(ttft)) if ttft else None,
        "median_tpot_ms": float(np.median(tpot)) if tpot else None,
    }


def make_slo(
    reference: Mapping | None = None,
    absolute: Mapping[str, float] | None = None,
    ttft_factor: float = TTFT_FACTOR,
    tpot_factor: float = TPOT_FACTOR,
) -> SLO:
    """The SLO from a reference summary (:func:`reference_summary`) and/or absolute bounds.

    Raises ``ValueError`` when a bound is neither given nor measurable by the reference run.
    """
    absolute = dict(absolute or {})
    ref = dict(reference) if reference is not None else None
    vals: dict[str, float] = {}
    for key, factor in (("ttft_ms", ttft_factor), ("tpot_ms", tpot_factor)):
        if key in absolute:
            vals[key] = float(absolute[key])
            continue
        med = (ref or {}).get(f"median_{key}")
        if med is None:
            if key == "tpot_ms" and ref is not None and ref.get("completed"):
                continue  # every reference request had one token: TPOT left unbounded
            raise ValueError(f"no {key[:4].upper()} bound: the reference run measured none and none was given")
        vals[key] = factor * float(med)
    n_abs = sum(k in absolute for k in ("ttft_ms", "tpot_ms"))
    source = "absolute" if n_abs == 2 else ("reference" if n_abs == 0 else "mixed")
    return SLO(vals.get("ttft_ms"), vals.get("tpot_ms"), source, ttft_factor, tpot_factor,
               ref if source != "absolute" else None)


def slo_miss(rec: Mapping, slo: SLO) -> str | None:
    """Why one request missed the SLO: "failed" (not completed), "ttft", "tpot", "both"; None: met."""
    if not is_completed(rec):
        return "failed"
    lat = request_latencies(rec)
    ttft = slo.ttft_ms is not None and lat["ttft_ms"] > slo.ttft_ms
    tpot = slo.tpot_ms is not None and lat["tpot_ms"] is not None and lat["tpot_ms"] > slo.tpot_ms
    return "both" if ttft and tpot else "ttft" if ttft else "tpot" if tpot else None


def meets_slo(rec: Mapping, slo: SLO) -> bool:
    """Whether one request record met the SLO (completed, TTFT and TPOT within bounds)."""
    return slo_miss(rec, slo) is None


def duration_s(records: Iterable[Mapping]) -> float:
    """Last ``end_s`` - first ``send_s`` (s; 0 without both), as in report.mode_metrics."""
    recs = list(records)
    sends = [r["send_s"] for r in recs if r.get("send_s") is not None]
    ends = [r["end_s"] for r in recs if r.get("end_s") is not None]
    return (max(ends) - min(sends)) if sends and ends else 0.0


def goodput(records: Iterable[Mapping], slo: SLO, threshold: float = SLA_ATTAINMENT) -> dict:
    """``{"slo_met", "slo_attainment", "request_goodput", "meets_sla", "slo_misses"}`` of one run's records.

    ``slo_attainment`` is over all requests (failed ones count as missing the SLO; None without
    requests); ``request_goodput`` in req/s over :func:`duration_s` (None when 0);
    ``meets_sla``: attainment >= ``threshold``; ``slo_misses``: requests that missed it by reason
    (``{"ttft", "tpot", "both", "failed"}``, see :func:`slo_miss`).
    """
    recs = list(records)
    misses = {"ttft": 0, "tpot": 0, "both": 0, "failed": 0}
    for r in recs:
        why = slo_miss(r, slo)
        if why is not None:
            misses[why] += 1
    met = len(recs) - sum(misses.values())
    dur = duration_s(recs)
    att = met / len(recs) if recs else None
    return {
        "slo_met": met,
        "slo_attainment": att,
        "request_goodput": met / dur if dur > 0 else None,
        "meets_sla": att is not None and att >= threshold,
        "slo_misses": misses,
    }
