import pytest

from pdd.sim.hardware import DEFAULT_CALIBRATION, Efficiency, calibration_report, cost_model
from pdd.workload.records import generate_agentic, generate_fixed, hit_histogram, load_trace, prefix_hits


def test_agentic_matches_report_figures():
    h = hit_histogram(generate_agentic(3000, seed=0, rate=2.0))
    assert 0.85 <= h["token_weighted_hit"] <= 0.95
    assert 0.70 <= h["frac_over_95"] <= 0.80
    assert h["frac_output_lt_500"] >= 0.85
    assert 0.03 <= h["frac_long_in_short_out"] <= 0.04
    assert len(h["bins"]) == 7 and sum(b["requests"] for b in h["bins"]) == 3000


def test_agentic_rate_and_format():
    recs = generate_agentic(1000, seed=1, rate=5.0)
    span = (recs[-1]["timestamp"] - recs[0]["timestamp"]) / 1000
    assert (len(recs) - 1) / span == pytest.approx(5.0, rel=1e-6)
    for r in recs[:50]:
        assert set(r) == {"timestamp", "input_length", "output_length", "hash_ids"}
        assert len(r["hash_ids"]) == -(-r["input_length"] // 512)


def test_fixed_hit_is_exact():
    recs = generate_fixed(50, 1.0, 20480, 10, 0.9, n_prefixes=1)
    assert prefix_hits(recs)[1:].min() == pytest.approx(0.9)


def test_trace_loads():
    recs = load_trace(limit=10)
    assert len(recs) == 10 and recs[0]["input_length"] == 6758


@pytest.mark.skipif(not DEFAULT_CALIBRATION.exists(), reason="calibration not present")
def test_roofline_defaults_match_calibration_fit():
    rep = calibration_report()
    assert rep["mean_abs_rel_err"] < 0.05 and rep["max_abs_rel_err"] < 0.12
    eff = rep["efficiency"]
    d = Efficiency()
    assert eff["compute"] == pytest.approx(d.compute, abs=0.02)
    assert eff["mem"] == pytest.approx(d.mem, abs=0.02)
    assert eff["overhead_s"] == pytest.approx(d.overhead_s, abs=0.0005)


def test_roofline_regimes():
    m = cost_model("H100-SXM5-80GB", "llama-3.1-8b")
    # decode is bandwidth-bound: weights 16 GB at 3.35 TB/s x mem eff
    assert m.decode_time(1, 1000) == pytest.approx(1.25e-3 + (16.06e9 + 1001 * 131072) / (3.35e12 * 0.92), rel=1e-6)
    # prefill is compute-bound and grows with tokens
    assert m.prefill_time(8192) > 8 * m.prefill_time(1024) * 0.9
    b = cost_model("H200-SXM-141GB", "llama-3.1-8b")
    assert b.kv_capacity_tokens() > 1.9 * m.kv_capacity_tokens()
