"""What a live run's records show, measured for the simulator's fits and its comparison: each
role's step counts and times (:func:`live_role_steps`, from ``server_stats.json``), the client
delay, the WAN RTT the gateway's decisions read, decode token gaps with P busy or quiet
(:func:`live_decode_gaps`, :func:`live_decode_interference`), the P -> RLD fast path, the
prefills P ran alone (:func:`isolated_prefills`) and the WAN payload bytes. Pure functions of the
recorded dicts (``requests.jsonl`` records, the ``server_stats.json`` entry).
"""

from __future__ import annotations

import numpy as np

from pdd.sim.sim_config import DECODE_ROLES

ROLE_TIER = {"prefill": "P", "relay_decode": "RLD", "main_decode": "MD"}


def live_role_steps(entry: dict) -> dict:
    """Per tier (P, RLD, MD): engine steps, their summed wall time (the worker thread's
    ``engine.step()`` inside the live role: GIL and core contention included) and the mean, over
    the measured replay (``stats`` less ``stats_before``)."""
    out = {}
    before = (entry.get("stats_before") or {}).get("instances", {})
    for name, st in (entry.get("stats") or {}).get("instances", {}).items():
        tier = ROLE_TIER.get(st.get("role"))
        if tier is None:
            continue
        b = before.get(name, {})
        n = st.get("engine_steps", 0) - b.get("engine_steps", 0)
        busy = st.get("engine_busy_s", 0.0) - b.get("engine_busy_s", 0.0)
        d = out.setdefault(tier, {"steps": 0, "busy_s": 0.0})
        d["steps"] += n
        d["busy_s"] += busy
    for d in out.values():
        d["mean_step_s"] = d["busy_s"] / d["steps"] if d["steps"] else None
    return out


def live_client_delay_s(live_records: list[dict]) -> float | None:
    """Median of (client's first token - the gateway's ``first_token`` event) over a live run: the
    HTTP streaming path the simulator does not otherwise see."""
    d = [rec["token_times_s"][0] - rec["send_s"] - rec["pdd"]["events_ms"]["first_token"] / 1000.0
         for rec in live_records if rec.get("ok") and rec.get("token_times_s")
         and "first_token" in ((rec.get("pdd") or {}).get("events_ms") or {})]
    return float(np.median(d)) if d else None


def live_gateway_rtt_ms(live_records: list[dict]) -> float | None:
    """Median WAN RTT (ms) the live gateway's pipeline decisions read (their recorded
    ``wan_rtt_ms`` input: its windowed minimum of MD reservation round trips, software included),
    over a run's requests; None without recorded pipeline decisions."""
    v = [d["inputs"]["wan_rtt_ms"] for rec in live_records if rec.get("ok")
         for d in ((rec.get("pdd") or {}).get("decisions") or [])
         if d.get("policy") == "pipeline" and isinstance((d.get("inputs") or {}).get("wan_rtt_ms"), (int, float))]
    return float(np.median(v)) if v else None


HANDOFF_EVENTS = ("handoff_call", "handoff", "switch")


def _same_tier_gaps(rec: dict, tiers: list, margin_s: float):
    """``(i, a, b)`` for each gap of ``rec`` between its tokens ``i`` and ``i + 1`` (client times,
    seconds) that one tier decoded both of (``tiers``: a tier per token), from its second token
    on (the first token is P's) and not within ``margin_s`` of its handoff events."""
    tt = rec["token_times_s"]
    ev = (rec.get("pdd") or {}).get("events_ms") or {}
    t0 = float(rec["send_s"])
    ho = [t0 + ev[k] / 1000.0 for k in HANDOFF_EVENTS if k in ev]
    lo, hi = (min(ho) - margin_s, max(ho) + margin_s) if ho else (None, None)
    for i in range(1, len(tt) - 1):
        a, b = tt[i], tt[i + 1]
        if tiers[i] == tiers[i + 1] and not (lo is not None and a < hi and b > lo):
            yield i, a, b


def live_decode_gaps(live_records: list[dict], margin_s: float = 0.02) -> dict:
    """A live run's decode inter-token gaps (seconds, as the client saw them), by the tier that
    decoded both tokens (the record's per-token ``tiers``: ``"rld"``, ``"md"``, ...; ``"all"``
    for a record without them) and by what P did meanwhile: ``{tier: {"busy": [...], "quiet":
    [...]}}``. Busy: the gap's midpoint inside another request's P interval (its send to the
    gateway's ``p_first_token``: queued or prefilling at P); quiet: the gap overlaps no P
    interval (gaps that overlap one only in part are left out). A request's first token, gaps
    between two tiers' tokens and the gaps within ``margin_s`` of its handoff events
    (``handoff_call``, ``handoff``, ``switch``: RLD's stream giving way to MD's) are not decode
    gaps."""
    iv = []
    for rec in live_records:
        ev = (rec.get("pdd") or {}).get("events_ms") or {}
        if rec.get("ok") and "p_first_token" in ev:
            t0 = float(rec["send_s"])
            iv.append((id(rec), t0, t0 + ev["p_first_token"] / 1000.0))
    iv.sort(key=lambda x: x[1])
    starts = np.array([x[1] for x in iv])
    # the latest end among the intervals up to each one (sorted by start): those before the first
    # index whose running end passes a gap's start all ended before it, so none is scanned
    reach = np.maximum.accumulate([x[2] for x in iv]) if iv else np.array([])
    out: dict[str, dict[str, list[float]]] = {}
    for rec in live_records:
        tt = rec.get("token_times_s") or []
        if not rec.get("ok") or len(tt) < 3:
            continue
        tiers = rec.get("tiers")
        if not (isinstance(tiers, list) and len(tiers) == len(tt) and all(isinstance(t, str) for t in tiers)):
            tiers = ["all"] * len(tt)  # absent or malformed per-token tiers: the gaps count for no tier
        for i, a, b in _same_tier_gaps(rec, tiers, margin_s):
            mid, over, inside = (a + b) / 2, False, False
            # P intervals that start before b, from the first that may end after a
            for j in range(int(np.searchsorted(reach, a, side="right")), int(np.searchsorted(starts, b))):
                rid, pa, pb = iv[j]
                if rid == id(rec) or pb <= a:
                    continue
                over = True
                if pa <= mid < pb:
                    inside = True
                    break
            g = out.setdefault(str(tiers[i]), {"busy": [], "quiet": []})
            if inside:
                g["busy"].append(b - a)
            elif not over:
                g["quiet"].append(b - a)
    return out


DECODE_GAPS_MIN = 50  # token gaps of a tier with P busy, and with it quiet, to fit its factor
FAST_PATH_ALONE_LEAD_S = 0.002  # live_fast_path(alone=True): no other request from this long before P's reply


def live_decode_interference(live_records: list[dict], min_samples: int = DECODE_GAPS_MIN) -> dict | None:
    """How much slower each tier's decode step runs while P prefills on the same machine: the
    median decode gap while P is busy over the median while it is quiet (:func:`live_decode_gaps`;
    within one tier, so RLD's and MD's different step times do not mix), floored at 1, for each
    tier with ``min_samples`` gaps of both kinds. Returns ``{"factors": {role: factor}`` (roles as
    the simulator names them: ``"RLD"``, ``"MD"``), ``"tiers": {tier: {"ratio",
    "busy_median_s", "quiet_median_s", "busy_samples", "quiet_samples"}}}``, or None when no tier
    has enough gaps (records without per-token ``tiers`` count for none). A ratio also holds the
    larger decode batches that come with a busy P, which on a CPU, where a decode step reads the
    weights once whatever its batch, adds little."""
    tiers = {}
    for tier, g in sorted(live_decode_gaps(live_records).items()):
        if tier.upper() not in DECODE_ROLES or len(g["busy"]) < min_samples or len(g["quiet"]) < min_samples:
            continue
        b, q = float(np.median(g["busy"])), float(np.median(g["quiet"]))
        if q > 0:
            tiers[tier] = {"ratio": b / q, "busy_median_s": b, "quiet_median_s": q,
                           "busy_samples": len(g["busy"]), "quiet_samples": len(g["quiet"])}
    if not tiers:
        return None
    return {"factors": {t.upper(): max(1.0, g["ratio"]) for t, g in tiers.items()}, "tiers": tiers}


def live_decode_alone_gaps(live_records: list[dict], margin_s: float = 0.02) -> dict:
    """Decode token gaps (seconds, as the client saw them) of a request decoding alone: no other
    request was in the system at any point of the gap (from its send to its last token at the
    client: queued or prefilling at P, its KV on the way to its decoder, or streaming), so the
    tier's step held one sequence and shared the cores with nothing but the serving path. Per
    tier (``"rld"``, ``"md"``: the record's per-token ``tiers``), a list of ``(gap_s,
    context_tokens)``: the gap between tokens ``i`` and ``i + 1`` of a request of ``p`` prompt
    tokens is a step over ``p + i`` tokens of context. As :func:`live_decode_gaps`, a request's
    first token, gaps between two tiers' tokens and gaps within ``margin_s`` of its handoff
    events are left out."""
    spans = []  # (from, to, record index) of every completed request: its send to its last token
    for k, rec in enumerate(live_records):
        if not rec.get("ok"):
            continue
        t0 = float(rec["send_s"])
        ev = (rec.get("pdd") or {}).get("events_ms") or {}
        tt = rec.get("token_times_s") or []
        end = t0 + ev["p_first_token"] / 1000.0 if "p_first_token" in ev else t0
        spans.append((t0, max(end, float(tt[-1])) if tt else end, k))
    ss = np.array([a for a, _, _ in spans]) if spans else np.zeros(0)
    se = np.array([b for _, b, _ in spans]) if spans else np.zeros(0)
    sk = np.array([k for _, _, k in spans]) if spans else np.zeros(0, dtype=int)
    out: dict[str, list[tuple[float, int]]] = {}
    for k, rec in enumerate(live_records):
        tt = rec.get("token_times_s") or []
        tiers = rec.get("tiers")
        if not rec.get("ok") or len(tt) < 3 or not (isinstance(tiers, list) and len(tiers) == len(tt)):
            continue
        prompt = int(rec.get("prompt_tokens") or 0)
        for i, a, b in _same_tier_gaps(rec, tiers, margin_s):
            if not isinstance(tiers[i], str):
                continue
            if np.any((ss < b) & (se > a) & (sk != k)):  # another request in the system during the gap
                continue
            out.setdefault(tiers[i], []).append((b - a, prompt + i))
    return out


def live_decode_scale(live_records: list[dict], step_models: dict, min_samples: int = DECODE_GAPS_MIN) -> dict | None:
    """Each decoding tier's step as the client sees it, against its bare engine's: the median of
    ``gap / step_model.decode_time(1, context)`` over the gaps of a request decoding alone
    (:func:`live_decode_alone_gaps`), for each tier in ``step_models`` (role as the simulator
    names it, ``"RLD"`` / ``"MD"`` -> a step model with ``decode_time(batch, sum_context)``,
    seconds) with at least ``min_samples`` such gaps. A factor, not an added constant: on this
    machine the live gap grows with the context faster than the bare step (docs/SIM.md "Where
    the decisions still differ"). Returns ``{"factors": {role: factor},
    "tiers": {tier: {"factor", "samples", "median_gap_s", "median_bare_s"}}}``, or None when no
    tier has enough gaps."""
    gaps = live_decode_alone_gaps(live_records)
    factors, tiers = {}, {}
    for tier, g in sorted(gaps.items()):
        role = tier.upper()
        model = step_models.get(role)
        if model is None or len(g) < min_samples:
            continue
        gap = np.array([x for x, _ in g])
        bare = np.array([model.decode_time(1, float(c)) for _, c in g])
        ok = bare > 0
        if ok.sum() < min_samples:
            continue
        f = float(np.median(gap[ok] / bare[ok]))
        factors[role] = f
        tiers[tier] = {"factor": f, "samples": int(ok.sum()), "median_gap_s": float(np.median(gap[ok])),
                       "median_bare_s": float(np.median(bare[ok]))}
    return {"factors": factors, "tiers": tiers} if factors else None


def _median_line(xs: np.ndarray, ys: np.ndarray, iters: int = 100) -> tuple[float, float]:
    """Intercept and slope of the least-absolute-deviations line through (xs, ys): the median
    regression, by iteratively reweighted least squares (weights 1 / |residual|, floored at 1e-9 of
    the ys' scale so an exact fit stays finite)."""
    a = np.vstack([np.ones(len(xs)), xs]).T
    w = np.ones(len(ys))
    floor = 1e-9 * max(float(np.max(np.abs(ys))), 1e-30)
    for _ in range(iters):
        sw = np.sqrt(w)
        (c0, c1), *_ = np.linalg.lstsq(a * sw[:, None], ys * sw, rcond=None)
        w = 1.0 / np.maximum(np.abs(ys - (c0 + c1 * xs)), floor)
    return float(c0), float(c1)


def live_fast_path(live_records: list[dict], kv_bytes_per_token: int, max_gbps: float,
                   min_samples: int = 20, alone: bool = False, fit: str = "least_squares") -> dict | None:
    """The in-datacenter KV path P -> RLD as the live run shows it: least squares of (gateway's
    first token - P's prefill reply) over the prompt's KV bytes, for relayed requests whose plan
    was known before P finished (``md_reserved`` before ``p_first_token``), so the interval is
    the KV's trip, RLD's receive and its first token's trip to the gateway.

    ``alone``: only requests that had that path to themselves: no other request between its send
    and its gateway first token (at P, or its KV on the way to its decoder) from 2 ms before this
    one's ``p_first_token`` to its ``first_token`` (a diagnostic: ``scripts/sim_ablation.py
    --variant fast-path-alone``). On the committed calibration run about half the requests: 2.4 ms
    + 2.2 Gbit/s, against 9.2 ms + 3.2 Gbit/s over all of them (the other half's interval, a
    median 23 ms against 10, holds P's next step, a queue behind another request's KV and the
    cores the other requests take; docs/SIM.md "The P -> RLD path has two regimes").

    ``fit``: ``"least_squares"`` (the default), or ``"median"``, the least-absolute-deviations
    line: the typical request's trip, which the requests that waited (on P's next step, on another
    request's KV) do not pull up, as the simulator queues them on its own fast line (a diagnostic:
    ``scripts/sim_ablation.py --variant fast-path-median``; docs/SIM.md "Where the TTFT error
    sits"). ValueError for another ``fit``.

    Returns ``{"latency_s", "gbps", "samples", "median_s"}`` (latency >= 0, rate capped at
    ``max_gbps``, the configured pacing), or None with fewer than ``min_samples`` such requests
    or a non-positive fitted per-byte cost. The simulator then uses it as its fast line (rate,
    and twice the latency as RTT) instead of the configured rate: on this CPU the Python sender
    and receiver, not the 4 Gbit/s pacing, set the pace (2026-12-01: ~1.9-2.8 Gbit/s effective
    and a median of 18 ms for ~1,000-token prompts, against 4 ms at the configured rate)."""
    if fit not in ("least_squares", "median"):
        raise ValueError(f"fit must be 'least_squares' or 'median', got {fit!r}")
    spans = []  # alone: (index, send, gateway first token) of every request P answered, in seconds
    for i, rec in enumerate(live_records if alone else ()):
        ev = (rec.get("pdd") or {}).get("events_ms") or {}
        if "p_first_token" in ev and isinstance(rec.get("send_s"), (int, float)):
            end = ev.get("first_token", ev["p_first_token"])
            spans.append((i, float(rec["send_s"]), float(rec["send_s"]) + end / 1000.0))
    xs, ys = [], []
    for i, rec in enumerate(live_records):
        p = rec.get("pdd") or {}
        ev = p.get("events_ms") or {}
        if (not rec.get("ok") or p.get("pipeline") != "p_rld_md" or "first_token" not in ev
                or "p_first_token" not in ev or ev.get("md_reserved", float("inf")) > ev["p_first_token"]):
            continue
        if alone:
            if not isinstance(rec.get("send_s"), (int, float)):
                continue
            lo = float(rec["send_s"]) + ev["p_first_token"] / 1000.0 - FAST_PATH_ALONE_LEAD_S
            hi = float(rec["send_s"]) + ev["first_token"] / 1000.0
            if any(j != i and s < hi and e > lo for j, s, e in spans):
                continue
        xs.append(float(rec.get("prompt_tokens") or 0) * kv_bytes_per_token)
        ys.append((ev["first_token"] - ev["p_first_token"]) / 1000.0)
    if len(xs) < min_samples:
        return None
    if fit == "median":
        c0, c1 = _median_line(np.array(xs), np.array(ys))
    else:
        a = np.vstack([np.ones(len(xs)), np.array(xs)]).T
        (c0, c1), *_ = np.linalg.lstsq(a, np.array(ys), rcond=None)
    if c1 <= 0:
        return None
    gbps = min(max_gbps, 8.0 / c1 / 1e9)
    return {"latency_s": max(0.0, float(c0)), "gbps": float(gbps), "samples": len(xs),
            "median_s": float(np.median(ys))}


def _covered(a: float, b: float, spans: list[tuple[float, float]]) -> float:
    """Seconds of ``[a, b]`` inside the union of ``spans``."""
    cov, end = 0.0, a
    for x, y in sorted((max(a, x), min(b, y)) for x, y in spans if x < b and y > a):
        x = max(x, end)
        if y > x:
            cov, end = cov + y - x, y
    return cov


def isolated_prefills(live_records: list[dict], step_model, chunk_tokens: int) -> list[dict]:
    """The live requests P prefilled alone: P's interval (the client's send to the gateway's
    ``p_first_token`` event) overlaps no other request's. Each as ``{"tokens"`` (computed: prompt
    less P's cached prefix), ``"steps"`` (chunks of ``chunk_tokens``), ``"profile_s"`` (those
    chunks on ``step_model``, a ``MeasuredStepModel``: seconds), ``"live_s"`` (the interval,
    seconds), ``"decode_busy_frac"`` (the share of the interval in which another request was
    streaming tokens: its first to its last token at the client), ``"index"`` (the record's
    position in ``live_records``)``}``, in request order.
    ``chunk_tokens`` below 1 is a ValueError (the chunking would never end)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    iv = []
    decoding = []
    for idx, rec in enumerate(live_records):
        p = rec.get("pdd") or {}
        ev = p.get("events_ms") or {}
        tt = rec.get("token_times_s") or []
        if rec.get("ok") and len(tt) > 1:
            decoding.append((float(tt[0]), float(tt[-1])))
        if not rec.get("ok") or "p_first_token" not in ev:
            continue
        prompt, cached = int(rec.get("prompt_tokens") or 0), int(p.get("p_cached_tokens") or 0)
        t0 = float(rec["send_s"])
        # every P interval counts for the overlap test; only those with tokens to compute are samples
        iv.append((t0, t0 + ev["p_first_token"] / 1000.0, prompt, cached, idx))
    out = []
    for i, (a, b, prompt, cached, idx) in enumerate(iv):
        if prompt - cached < 1 or any(j != i and x[0] < b and x[1] > a for j, x in enumerate(iv)):
            continue
        s0, t, k = cached, 0.0, 0
        while s0 < prompt:
            n = min(chunk_tokens, prompt - s0)
            t += step_model.step_time([(s0, n)])
            s0 += n
            k += 1
        out.append({"tokens": prompt - cached, "steps": k, "profile_s": t, "live_s": b - a,
                    "decode_busy_frac": _covered(a, b, decoding) / (b - a) if b > a else 0.0, "index": idx})
    return out


def live_prefill_beside_decode(prefills: list[dict], quiet_below: float = 0.05, busy_from: float = 0.3,
                               min_samples: int = 8) -> dict | None:
    """How much slower P's isolated prefills (:func:`isolated_prefills`) run while other requests
    decode: the median live / profile time of those with ``decode_busy_frac`` below
    ``quiet_below`` and from ``busy_from``, and a least-squares fit, in relative error, of
    ``live / profile = a + b x decode_busy_frac`` whose ``factor`` ``1 + b / a`` is the slow-down
    of a prefill decoded beside all along. None with fewer than ``min_samples`` prefills. A
    measurement of this one-machine testbed (every tier, the gateway and the client share its
    cores), reported by ``scripts/prefill_interference.py``. The simulator's factor
    (``SimConfig.prefill_interference``) is fitted on P's engine step instead
    (:func:`pdd.sim.calibrate.calibrate_p_interference`): the intervals also hold the reply, which
    decoding beside slows more (docs/SIM.md)."""
    if len(prefills) < min_samples:
        return None
    fr = np.array([r["decode_busy_frac"] for r in prefills], dtype=float)
    y = np.array([r["live_s"] / r["profile_s"] for r in prefills], dtype=float)
    a_mat = np.vstack([np.ones_like(fr), fr]).T / y[:, None]
    (a, b), *_ = np.linalg.lstsq(a_mat, np.ones_like(y), rcond=None)
    quiet, busy = y[fr < quiet_below], y[fr >= busy_from]
    return {"samples": int(len(y)), "mean_busy_frac": float(fr.mean()),
            "quiet": {"n": int(len(quiet)), "median_ratio": float(np.median(quiet)) if len(quiet) else None},
            "busy": {"n": int(len(busy)), "median_ratio": float(np.median(busy)) if len(busy) else None},
            "fit": {"a": float(a), "b": float(b), "factor": float(1 + b / a) if a > 0 else None}}


def live_wan_payload_bytes(entry: dict) -> float:
    """KV bytes the live P senders wrote for the WAN over the replay (planned less cancelled before
    sending, the gateway's totals): what crossed the line, cut-off transfers' written part included."""
    def tot(st):
        t = (st or {}).get("totals", {})
        return t.get("wan_bytes_planned", 0) - t.get("wan_bytes_cancelled", 0)

    return float(tot(entry.get("stats")) - tot(entry.get("stats_before")))
