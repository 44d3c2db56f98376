"""A short real demo run: three modes on fresh topologies, then the report's invariants."""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import free_port_block

pytestmark = pytest.mark.slow


def test_demo_three_modes_report_invariants(tmp_path, small_model):
    from pdd.bench.demo import DEFAULT_SCALE, run_demo
    from pdd.bench.report import recompute_report
    from pdd.config import ClusterConfig

    base = free_port_block()
    cfg = ClusterConfig.model_validate({"model_path": small_model, "base_port": base, "gateway_port": base + 95})
    out = tmp_path / "demo"
    report = run_demo(out, ("same_dc_pd", "cross_dc_pd", "pdd"), n_requests=12, scale=DEFAULT_SCALE, config=cfg,
                      progress=False)
    modes = report["modes"]
    for name, m in modes.items():
        assert m["completed"] == 12 and m["failed"] == 0, name
        assert m["leaked_pages"] == 0, name
    for name in ("cross_dc_pd", "pdd"):
        assert modes[name]["wan_bytes"] == modes[name]["wan_bytes_expected"] > 0
        assert modes[name]["wan_line_bytes"] >= modes[name]["wan_bytes"]
    assert modes["same_dc_pd"]["wan_bytes"] == 0
    assert modes["same_dc_pd"]["rld_output_token_share"] == 0.0 and modes["pdd"]["rld_output_token_share"] > 0
    # report.json is exactly what requests.jsonl + server_stats.json recompute to
    again = recompute_report(out / "requests.jsonl", out / "server_stats.json")
    on_disk = json.loads((out / "report.json").read_text())
    assert again == on_disk["modes"]
    for key in ("git_commit", "config", "seed", "workload", "link", "modes"):
        assert key in on_disk
    assert (out / "ttft_cdf.png").stat().st_size > 0
    # greedy decoding: every mode produced the same tokens for every request
    recs = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    by_idx: dict = {}
    for r in recs:
        by_idx.setdefault(r["idx"], {})[r["mode"]] = r["token_ids"]
    assert all(len({tuple(v) for v in d.values()}) == 1 for d in by_idx.values())
