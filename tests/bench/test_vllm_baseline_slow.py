"""pdd bench --modes vllm_colocated,colocated for real: stock vLLM's CPU build (``make vllm``) beside
pdd's colocated engine on one random-weight checkpoint. Skipped where ``.venv-vllm`` is absent
(CI does not install vLLM). The ``small`` preset is the smallest checkpoint vLLM's CPU attention
takes (``tiny``'s head_dim 16 is not among its head sizes)."""

from __future__ import annotations

import io
import json

import pytest

from pdd.bench import vllm_mode as vm
from pdd.vllm_tier import venv

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm_python():
    try:
        return venv.vllm_python()
    except venv.VllmMissing as ex:
        pytest.skip(f"vLLM's CPU build is not installed here ({ex})")


def test_vllm_colocated_beside_colocated(tmp_path, small_model, vllm_python):
    from rich.console import Console

    from pdd.bench.bench import run_bench
    from pdd.bench.report import read_jsonl
    from pdd.workload.replay import Scale
    from pdd.config import ClusterConfig
    from pdd.topology import free_port_block

    base = free_port_block()
    cfg = ClusterConfig.model_validate({"model_path": small_model, "base_port": base, "gateway_port": base + 95})
    scale = Scale(block_tokens=16, output_scale=1 / 8, min_output_tokens=8, max_output_tokens=24,
                  target_rate_rps=4.0, session_sample=1)
    out = tmp_path / "bench"
    n = 8
    report = run_bench(out, ("vllm_colocated", "colocated"), n, scale, cfg, slo={"ttft_ms": 60_000, "tpot_ms": 10_000},
                       sweep=None, request_timeout_s=120, progress=False, vllm_python=str(vllm_python),
                       console=(con := Console(file=io.StringIO(), record=True, width=200)))
    saved = json.loads((out / "report.json").read_text())
    assert saved == json.loads(json.dumps(report)) and "mode_errors" not in saved
    v, c = saved["modes"]["vllm_colocated"], saved["modes"]["colocated"]
    assert (v["completed"], v["failed"], c["completed"], c["failed"]) == (n, 0, n, 0)
    for m in (v, c):
        assert all(m[k] is not None for k in ("median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                                              "p90_itl_ms", "request_goodput", "slo_attainment"))
    assert v["not_applicable"] == list(vm.NOT_APPLICABLE) and all(v[k] is None for k in vm.NOT_APPLICABLE)
    assert c["leaked_pages"] == 0 and c["wan_bytes"] == 0  # pdd's mode keeps its own fields
    assert v["vllm"]["version"] == "0.32.0" and v["vllm"]["command"][0] == str(vllm_python)
    recs = [r for r in read_jsonl(out / "requests.jsonl") if r["mode"] == "vllm_colocated"]
    assert all(None not in r["token_ids"] and len(r["token_ids"]) == r["max_tokens"] for r in recs)
    a = saved["vllm_agreement"]
    # fp32 on both engines: the same greedy tokens (a random-weight near-tie could break this: the
    # report lists the first divergences, which this assertion would show)
    assert (a["requests_compared"], a["missing_token_ids"]) == (n, 0)
    assert a["requests_identical"] == n and a["tokens_equal"] == a["tokens_compared"], a["diverged"]
    assert "greedy agreement vllm_colocated vs colocated: 8/8 requests identical" in con.export_text()
