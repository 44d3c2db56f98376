"""SLO formula and goodput math on synthetic records (exact values)."""

import pytest

from pdd.bench.slo import SLO, goodput, make_slo, meets_slo, parse_slo, reference_summary, slo_miss


def rec(send, ttft_ms, tpot_ms=None, n=1, ok=True, end=None, idx=0):
    """A record whose first token comes ttft_ms after send and the rest every tpot_ms."""
    t0 = send + ttft_ms / 1000.0
    times = [t0 + k * (tpot_ms or 0) / 1000.0 for k in range(n)]
    return {"idx": idx, "mode": "m", "ok": ok, "send_s": send, "end_s": end if end is not None else (times[-1] if times else send),
            "token_times_s": times}


def test_parse_slo():
    assert parse_slo("ttft:500 tpot:50") == {"ttft_ms": 500.0, "tpot_ms": 50.0}
    assert parse_slo(["ttft:250.5", "tpot=12ms"]) == {"ttft_ms": 250.5, "tpot_ms": 12.0}
    assert parse_slo("TTFT:1e3,") == {"ttft_ms": 1000.0}
    assert parse_slo(None) == {} and parse_slo("") == {}
    for bad in ("e2el:5", "ttft", "ttft:-1", "ttft:0", "tpot:abc"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_reference_summary_medians():
    recs = [rec(0, 100, 10, n=5), rec(1, 300, 30, n=5), rec(2, 200, 20, n=3), rec(3, 50, n=1),
            rec(4, 10, 1, n=4, ok=False)]  # failed: ignored
    s = reference_summary(recs)
    assert s["mode"] == "same_dc_pd" and s["requests"] == 5 and s["completed"] == 4
    assert s["median_ttft_ms"] == pytest.approx(150.0)  # median of 100, 300, 200, 50
    assert s["median_tpot_ms"] == pytest.approx(20.0)  # 10, 30, 20 (the 1-token request has none)


def test_make_slo_formula_and_overrides():
    ref = {"mode": "same_dc_pd", "requests": 4, "completed": 4, "median_ttft_ms": 150.0, "median_tpot_ms": 20.0}
    slo = make_slo(ref)
    assert (slo.ttft_ms, slo.tpot_ms, slo.source) == (450.0, 30.0, "reference")
    assert slo.reference == ref and slo.ttft_factor == 3.0 and slo.tpot_factor == 1.5
    mixed = make_slo(ref, {"tpot_ms": 5.0})
    assert (mixed.ttft_ms, mixed.tpot_ms, mixed.source) == (450.0, 5.0, "mixed")
    absolute = make_slo(None, {"ttft_ms": 100.0, "tpot_ms": 5.0})
    assert (absolute.ttft_ms, absolute.tpot_ms, absolute.source, absolute.reference) == (100.0, 5.0, "absolute", None)
    # a reference of one-token requests bounds TTFT only
    one_tok = make_slo({"completed": 2, "median_ttft_ms": 10.0, "median_tpot_ms": None})
    assert (one_tok.ttft_ms, one_tok.tpot_ms) == (30.0, None)
    with pytest.raises(ValueError):
        make_slo({"completed": 0, "median_ttft_ms": None, "median_tpot_ms": None})
    with pytest.raises(ValueError):
        make_slo(None, {"ttft_ms": 1.0})


def test_meets_slo_bounds_are_inclusive():
    slo = SLO(ttft_ms=250.0, tpot_ms=125.0)
    assert meets_slo(rec(0, 250, 125, n=3), slo)  # exactly at both bounds
    assert not meets_slo(rec(0, 250.1, 125, n=3), slo)
    assert not meets_slo(rec(0, 250, 125.5, n=3), slo)
    assert meets_slo(rec(0, 125, n=1), slo)  # one token: judged on TTFT alone
    assert not meets_slo(rec(0, 10, 10, n=3, ok=False), slo)  # failed never meets it
    assert not meets_slo(rec(0, 10, n=0), slo)  # no tokens
    assert meets_slo(rec(0, 10_000, 10_000, n=3), SLO(None, None))


def test_goodput_exact():
    slo = SLO(ttft_ms=250.0, tpot_ms=125.0)
    recs = [
        rec(0.0, 125, 125, n=3),  # meets; ends at 0.375
        rec(0.5, 500, 125, n=2),  # TTFT too long
        rec(1.0, 125, 250, n=2),  # TPOT too long
        rec(1.5, 250, n=1),  # meets (one token)
        rec(2.0, 125, 125, n=2, ok=False, end=4.0),  # failed; its end still bounds the duration
    ]
    g = goodput(recs, slo)
    assert g["slo_met"] == 2
    assert g["slo_attainment"] == pytest.approx(2 / 5)
    assert g["request_goodput"] == pytest.approx(2 / 4.0)  # duration = 4.0 - 0.0
    assert g["meets_sla"] is False
    assert g["slo_misses"] == {"ttft": 1, "tpot": 1, "both": 0, "failed": 1}
    assert slo_miss(rec(0, 500, 500, n=2), slo) == "both" and slo_miss(rec(0, 1, 1, n=2), slo) is None
    assert goodput(recs[:1] + recs[3:4], slo)["meets_sla"] is True
    assert goodput([], slo) == {"slo_met": 0, "slo_attainment": None, "request_goodput": None, "meets_sla": False,
                                "slo_misses": {"ttft": 0, "tpot": 0, "both": 0, "failed": 0}}
    # exactly 90% meets the SLA
    nine = [rec(i, 100, 100, n=2) for i in range(9)] + [rec(9, 1000, 100, n=2)]
    g = goodput(nine, slo)
    assert g["slo_attainment"] == pytest.approx(0.9) and g["meets_sla"] is True
