"""Where a TTFT error sits: each request's TTFT split at P's prefill reply, live and simulated,
by how many prompt tokens P computed.

A relayed request's (``p_rld_md``) time to first token is two phases: **to P's reply** (the
gateway's receipt to P's answer with the first token: P's queue and prefill steps; live, the
gateway's ``events_ms["p_first_token"]``; simulated, ``Req.t_prefill_done - Req.arrival``) and
**P's reply to the client's first token** (the rest of the TTFT: the KV's trip to RLD over the
fast path, RLD's receive, the token's way to the gateway and to the client; the simulator puts the
client's delay, ``client_delay_s``, at the end). A simulator can match a run's TTFT with both
phases wrong and cancelling; held out on another run, their sum moves. The buckets are of the
prompt tokens P computed (``prompt_tokens - p_cached_tokens`` of the live record): short prompts
are the TTFT P50's requests, where the second phase is a large share.
"""

from __future__ import annotations

import numpy as np

UNCACHED_EDGES = (0, 128, 512, 1024)  # bucket lower bounds, prompt tokens P computed; the last is open


def bucket_name(lo: int, hi: int | None) -> str:
    """``"0-127"`` for [0, 128), ``">=1024"`` for the open last bucket."""
    return f"{lo}-{hi - 1}" if hi is not None else f">={lo}"


def ttft_phases(live_records: list[dict], sim) -> list[dict]:
    """Per bucket of prompt tokens P computed (``UNCACHED_EDGES``): ``requests`` and the median
    (ms) of each phase, live and simulated: ``to_p_reply_ms`` and ``after_p_reply_ms``, each
    ``{"live", "sim"}``. Requests are matched by position (``sim.reqs[i]`` is
    ``live_records[i]``); a request counts where both runs relayed it (``p_rld_md``), the live
    record has TTFT and ``p_first_token`` and the simulated one a first token and a prefill end.
    Buckets without such a request are left out; an empty list when none counts."""
    edges = list(UNCACHED_EDGES) + [None]
    rows: dict[int, list[tuple[float, float, float, float]]] = {}
    for i, rec in enumerate(live_records):
        p = rec.get("pdd") or {}
        ev = p.get("events_ms") or {}
        tt = rec.get("token_times_s") or []
        if i >= len(sim.reqs) or not rec.get("ok") or not tt or p.get("pipeline") != "p_rld_md" \
                or "p_first_token" not in ev:
            continue
        req = sim.reqs[i]
        if req.t_first is None or req.t_prefill_done is None or getattr(req.pipeline, "value", None) != "p_rld_md":
            continue
        unc = int(rec.get("prompt_tokens") or 0) - int(p.get("p_cached_tokens") or 0)
        b = max(j for j, lo in enumerate(UNCACHED_EDGES) if unc >= lo) if unc >= 0 else 0
        l_ttft, l_p = (tt[0] - rec["send_s"]) * 1e3, float(ev["p_first_token"])
        s_ttft, s_p = (req.t_first - req.arrival) * 1e3, (req.t_prefill_done - req.arrival) * 1e3
        rows.setdefault(b, []).append((l_p, s_p, l_ttft - l_p, s_ttft - s_p))
    out = []
    for b in sorted(rows):
        a = np.array(rows[b])
        med = np.median(a, axis=0)
        out.append({"prompt_tokens_computed": bucket_name(edges[b], edges[b + 1]), "requests": len(a),
                    "to_p_reply_ms": {"live": float(med[0]), "sim": float(med[1])},
                    "after_p_reply_ms": {"live": float(med[2]), "sim": float(med[3])}})
    return out


def format_ttft_phases(phases: list[dict]) -> str:
    """One line per bucket for `pdd sim validate`'s output ("" for none)."""
    return "".join(f"\nTTFT phases, {ph['prompt_tokens_computed']} prompt tokens computed ({ph['requests']} "
                   f"relayed requests, medians): to P's reply live {ph['to_p_reply_ms']['live']:.1f} / sim "
                   f"{ph['to_p_reply_ms']['sim']:.1f} ms, then to the first token live "
                   f"{ph['after_p_reply_ms']['live']:.1f} / sim {ph['after_p_reply_ms']['sim']:.1f} ms"
                   for ph in phases)
