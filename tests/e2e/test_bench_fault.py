"""pdd bench --fault end to end: a tiny pdd-mode bench whose first relayed request loses its RLD
while RLD decodes (MD already holds the KV); every request completes, the injection is recorded in
report.json with its phase, the RLD is restarted and every instance's pages are free at the end."""

import json

import pytest

from pdd.bench.bench import main
from tests.e2e.conftest import make_cfg

pytestmark = pytest.mark.slow


def test_bench_kill_rld_in_rld_decode(small_model, tmp_path):
    cfg = make_cfg(small_model, "pdd", policy={"pipeline_ttft_budget_ms": 0.0, "handoff_min_tokens": 20},
                   link={"wan_gbps": 1.0, "wan_rtt_ms": 5.0, "wan_jitter_ms": 0.0}, request_timeout_s=60.0)
    cfg_file = tmp_path / "cfg.json"
    cfg_file.write_text(cfg.model_dump_json())
    out = tmp_path / "bench"
    rc = main(["--config", str(cfg_file), "--out", str(out), "--modes", "pdd", "--requests", "5", "--rate", "4",
               "--min-output", "40", "--max-output", "40", "--max-input", "200", "--slo", "ttft:100000",
               "tpot:100000", "--sweep-rate", "none", "--no-warmup", "--no-progress",
               "--fault", "kill:rld@rld_decode", "--fault-recover-after", "1"])
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    fr = rep["faults"]["modes"]["pdd"]
    assert fr["not_injected"] == {} and fr["not_applicable"] == {}
    [inj] = fr["injections"]
    assert "error" not in inj, inj
    assert inj["kind"] == "kill" and inj["target"].startswith("rld") and inj["phase"] == "rld_decode"
    assert inj["recovery"].get("error") is None and inj["recovery"]["action"] == f"restarted {inj['target']}"
    assert inj["outcome"]["ok"] and inj["outcome"]["tokens"] == inj["outcome"]["max_tokens"]
    req = fr["requests"]
    assert req["requests"] == 5 and req["completed"] == 5 and req["failed"] == 0, req
    assert rep["modes"]["pdd"]["leaked_pages"] == 0
    flush = json.loads((out / "server_stats.json").read_text())["pdd"]["flush"]
    assert all("error" not in v and v["pages_free"] == v["pages_total"] for v in flush["instances"].values()), flush
