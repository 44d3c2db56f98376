"""Report metrics on synthetic records (exact values) and report.json == recomputation."""

import io
import json

import pytest
from rich.console import Console

from pdd.bench.report import (
    build_report,
    compute_modes,
    mode_metrics,
    print_table,
    recompute_report,
    write_jsonl,
    write_report,
)


def record(mode, send, times, end, tiers=None, ok=True, error=None, pdd=None, prompt_tokens=10, pos=None):
    return {
        "mode": mode,
        "idx": 0,
        "ok": ok,
        "error": error,
        "send_s": send,
        "end_s": end,
        "prompt_tokens": prompt_tokens,
        "token_times_s": times,
        "tiers": tiers or [None] * len(times),
        "pos": pos if pos is not None else list(range(len(times))),
        "token_ids": [7] * len(times),
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(times),
                  "prompt_tokens_details": {"cached_tokens": 4}} if ok else None,
        "pdd": pdd,
    }


def synthetic():
    recs = [
        record("pdd", 0.0, [0.125, 0.25, 0.5], 0.625, ["rld", "rld", "md"],
               pdd={"pipeline": "p_rld_md", "wan_bytes": 1000, "wan_bytes_expected": 1200, "md_cached_tokens": 0,
                    "p_cached_tokens": 0, "handoff_pos": 2}),
        record("pdd", 1.0, [1.5], 1.75, ["md"],
               pdd={"pipeline": "p_md", "wan_bytes": 500, "wan_bytes_expected": 600, "md_cached_tokens": 16,
                    "p_cached_tokens": 16, "handoff_pos": None}),
        record("pdd", 2.0, [], 2.25, ok=False, error="HTTP 500: boom"),
        record("cross_dc_pd", 0.0, [1.0, 1.25], 1.5, ["md", "md"],
               pdd={"pipeline": "p_md", "wan_bytes": 3000, "wan_bytes_expected": 3000}),
        record("cross_dc_pd", 0.5, [1.5, 2.0], 2.0, ["md", "md"], pos=[0, 2],
               pdd={"pipeline": "p_md", "wan_bytes": 100, "wan_bytes_expected": 100}),
    ]
    server = {
        "pdd": {"stats": {"mode": "pdd", "wan_line_bytes": 4096,
                          "instances": {"p": {"role": "p", "cpu_seconds": 1.5}, "rld": {"cpu_seconds": 0.25}}},
                "flush": {"instances": {}, "leaked_pages": 0}},
        "cross_dc_pd": {"stats": {"wan_line_bytes": 8192, "instances": {"p": {"cpu_seconds": 2.0}}},
                        "flush": {"leaked_pages": 3}},
    }
    return recs, server


def test_mode_metrics_exact():
    recs, server = synthetic()
    m = mode_metrics([r for r in recs if r["mode"] == "pdd"], server["pdd"])
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["mean_ttft_ms"] == 312.5 and m["median_ttft_ms"] == 312.5
    assert m["p90_ttft_ms"] == pytest.approx(125 + 0.9 * 375)
    assert m["p99_ttft_ms"] == pytest.approx(125 + 0.99 * 375)
    assert m["median_e2el_ms"] == 500.0  # (500 + 500) / 2
    assert m["median_tpot_ms"] == 187.5 and m["mean_tpot_ms"] == 187.5  # only the 3-token request
    assert m["median_itl_ms"] == 187.5 and m["p99_itl_ms"] == pytest.approx(125 + 0.99 * 125)
    assert m["duration_s"] == 2.25
    assert m["request_throughput"] == pytest.approx(2 / 2.25)
    assert m["output_throughput"] == pytest.approx(4 / 2.25)
    assert m["total_input_tokens"] == 20 and m["total_output_tokens"] == 4
    assert m["wan_bytes"] == 1500 and m["wan_bytes_expected"] == 1800
    assert m["rld_output_token_share"] == 0.5
    assert m["tier_tokens"] == {"md": 2, "rld": 2}
    assert m["pipelines"] == {"p_md": 1, "p_rld_md": 1}
    assert m["cached_tokens"] == 8 and m["md_cached_tokens"] == 16 and m["p_cached_tokens"] == 16
    assert m["wan_line_bytes"] == 4096 and m["cpu_seconds"] == 1.75 and m["leaked_pages"] == 0
    assert m["stream_errors"] == 0 and m["errors"] == {"HTTP 500": 1}


def test_compute_modes_order_and_stream_errors():
    recs, server = synthetic()
    modes = compute_modes(recs, server)
    assert list(modes) == ["cross_dc_pd", "pdd"]
    c = modes["cross_dc_pd"]
    assert c["completed"] == 2 and c["failed"] == 0 and c["stream_errors"] == 1
    assert c["median_ttft_ms"] == 1000.0 and c["rld_output_token_share"] == 0.0
    assert c["leaked_pages"] == 3 and c["cpu_seconds"] == 2.0
    empty = compute_modes([record("pdd", 0.0, [], 1.0, ok=False, error="ReadTimeout: x")])["pdd"]
    assert empty["completed"] == 0 and empty["median_ttft_ms"] is None and empty["cpu_seconds"] is None


def test_report_json_equals_recomputation(tmp_path):
    recs, server = synthetic()
    write_jsonl(tmp_path / "requests.jsonl", recs[:3])
    write_jsonl(tmp_path / "requests.jsonl", recs[3:], append=True)
    (tmp_path / "server_stats.json").write_text(json.dumps(server))
    rep = build_report(recs, server, config={"mode": "pdd", "link": {"wan_gbps": 0.2, "wan_rtt_ms": 20.0,
                                                                       "fast_gbps": 8.0}},
                       seed=3, workload={"trace": "t", "requests": 3, "scale": {}}, commit="abc")
    write_report(tmp_path / "report.json", rep)
    loaded = json.loads((tmp_path / "report.json").read_text())
    assert loaded["modes"] == recompute_report(tmp_path / "requests.jsonl")
    assert loaded["link"] == {"wan_gbps": 0.2, "wan_rtt_ms": 20.0, "fast_gbps": 8.0}
    assert loaded["git_commit"] == "abc" and loaded["seed"] == 3
    assert loaded["ratios"]["pdd_over_cross_dc_pd_median_ttft_ms"] == pytest.approx(312.5 / 1000.0)
    for key in ("completed", "failed", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                "median_itl_ms", "median_e2el_ms", "wan_bytes", "wan_bytes_expected", "wan_line_bytes",
                "rld_output_token_share", "cpu_seconds", "leaked_pages"):
        assert key in loaded["modes"]["pdd"]


def test_print_table():
    recs, server = synthetic()
    buf = io.StringIO()
    print_table(build_report(recs, server, commit="x"), console=Console(file=buf, width=200))
    out = buf.getvalue()
    assert "TTFT P90" in out and "pdd" in out and "cross_dc_pd" in out and "x0.31" in out


def test_server_summary_deltas():
    from pdd.bench.report import server_summary

    entry = {
        "stats_before": {"wan_line_bytes": 100, "instances": {"p": {"cpu_seconds": 1.0}}},
        "stats": {"wan_line_bytes": 1100, "instances": {"p": {"cpu_seconds": 3.0}}},
        "flush": {"leaked_pages": 2},
    }
    assert server_summary(entry) == {"wan_line_bytes": 1000, "cpu_seconds": 2.0, "leaked_pages": 2}
    entry["proc_cpu_seconds_before"] = {"gw": 1.0, "p": 2.0}
    entry["proc_cpu_seconds"] = {"gw": 1.5, "p": 4.0, "link": float("nan")}
    assert server_summary(entry)["cpu_seconds"] == 2.5
    assert server_summary(None) == {"wan_line_bytes": None, "cpu_seconds": None, "leaked_pages": None}


def test_output_agreement():
    from pdd.bench.report import output_agreement

    def r(mode, idx, ids, ok=True):
        return {"mode": mode, "idx": idx, "ok": ok, "token_times_s": [0.0] * len(ids), "token_ids": ids}

    recs = [r("same_dc_pd", 0, [1, 2, 3]), r("same_dc_pd", 1, [4, 5]), r("same_dc_pd", 2, [6]),
            r("pdd", 0, [1, 2, 3]), r("pdd", 1, [4, 9]), r("pdd", 2, [6], ok=False),
            r("cross_dc_pd", 1, [4, 5, 7])]
    a = output_agreement(recs)
    assert a["reference"] == "same_dc_pd"
    assert a["modes"]["pdd"] == {"compared": 2, "identical": 1, "diverged": [{"idx": 1, "pos": 1}]}
    assert a["modes"]["cross_dc_pd"] == {"compared": 1, "identical": 0, "diverged": [{"idx": 1, "pos": 2}]}


def test_several_tokens_per_chunk_count_the_usage_tokens():
    # a server streaming 2 tokens per chunk without their ids (vLLM with speculative decoding):
    # the client timed 3 chunks, the usage says 6 tokens; TPOT = (E2E - TTFT) / (6 - 1), as
    # vllm bench serve computes it, not per chunk (it was 2 x too high), and the throughput counts 6
    rec = record("external", 0.0, [0.125, 0.375, 0.625], 1.0)
    rec["usage"]["completion_tokens"] = 6
    m = mode_metrics([rec])
    assert m["median_tpot_ms"] == 100.0 and m["median_ttft_ms"] == 125.0 and m["median_e2el_ms"] == 625.0
    assert m["median_itl_ms"] == 250.0  # the gaps the stream showed
    assert m["total_output_tokens"] == 6 and m["output_throughput"] == 6.0
    # a usage counting fewer tokens than were timed, or not an integer, changes nothing
    for bad in (2, "6", True, None):
        rec["usage"]["completion_tokens"] = bad
        m = mode_metrics([rec])
        assert m["median_tpot_ms"] == 250.0 and m["total_output_tokens"] == 3
    rec["usage"] = "x"
    assert mode_metrics([rec])["total_output_tokens"] == 3


@pytest.mark.parametrize("usage", ["x", [1], {"prompt_tokens_details": [1]},
                                   {"prompt_tokens_details": {"cached_tokens": "many"}}])
def test_another_servers_odd_usage_is_no_crash(usage):
    # the client keeps a usage chunk's "usage" as the server sent it; the report read it as an
    # OpenAI usage object and raised after the whole replay (AttributeError / "invalid literal")
    rec = record("external", 0.0, [0.125, 0.25], 0.5)
    rec["usage"] = usage
    m = mode_metrics([rec])
    assert m["cached_tokens"] == 0 and m["total_output_tokens"] == 2 and m["median_tpot_ms"] == 125.0
