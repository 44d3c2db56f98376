"""What pdd's pipeline choice would do with a workload per TTFT budget, priced before any run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from pdd.bench.extras import _pct
from pdd.config import ClusterConfig

PREVIEW_BUDGETS_MS = (25.0, 40.0, 50.0, 60.0, 80.0, 100.0)


def kv_bytes_per_token(model_dir: str | Path, dtype: str = "float32") -> int:
    """KV bytes per token of the model in ``model_dir`` (config.json): layers x 2 (K, V) x KV
    heads x head_dim x bytes per element (float32 4, bfloat16/float16 2)."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    heads = int(c.get("num_key_value_heads") or c["num_attention_heads"])
    head_dim = int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
    return int(c["num_hidden_layers"]) * 2 * heads * head_dim * (4 if dtype == "float32" else 2)


def pipeline_preview(requests: Sequence, config: ClusterConfig, kv_bytes: int,
                     budgets_ms: Sequence[float] = PREVIEW_BUDGETS_MS) -> dict:
    """What pdd's pipeline choice would do with this workload, per TTFT budget, before any run.

    Each request's missing KV is its prompt minus its ideal prefix hit (an infinite cache holding
    every earlier prompt, whole pages, one token always computed:
    :func:`pdd.workload.replay.ideal_prefix_hits`), priced by :func:`pdd.policy.pipeline.expected_wan_seconds`
    at the configured line rate and RTT. Per budget (ms): ``relayed_share`` (requests planned
    P->RLD->MD), ``relayed_output_share`` (their share of output tokens: an upper bound of RLD's
    share of output tokens, reached when RLD decodes them to the end), ``p_md_expected_wan_ms_p90``
    (P90 of the planned P->MD requests' expected WAN time). ``configured_budget_ms`` is the
    config's. Live MD caches are finite and the live WAN estimate varies, so the run's mix differs a
    little; the run reports its own (``pipeline_mix``).
    """
    from pdd.workload.replay import ideal_prefix_hits
    from pdd.policy.pipeline import PipelineInputs, expected_wan_seconds

    hits = ideal_prefix_hits(requests, config.engine_for("main_decode").page_size, 1)  # MD's cache: its pages
    exp_ms = [1000.0 * expected_wan_seconds(PipelineInputs(
        mode="pdd", prompt_tokens=len(r.prompt_ids), md_cached_tokens=h, kv_bytes_per_token=kv_bytes,
        wan_gbps_estimate=config.link.wan_gbps, wan_rtt_ms=config.link.wan_rtt_ms)) for r, h in zip(requests, hits)]
    outs = [r.max_tokens for r in requests]
    total_out = sum(outs) or 1
    rows = {}
    for b in sorted({*budgets_ms, float(config.policy.pipeline_ttft_budget_ms)}):
        relay = [e > b + 1e-9 or b <= 0 for e in exp_ms]
        pmd = [e for e, rl in zip(exp_ms, relay) if not rl]
        rows[f"{b:g}"] = {"relayed_share": sum(relay) / len(relay) if relay else 0.0,
                          "relayed_output_share": sum(o for o, rl in zip(outs, relay) if rl) / total_out,
                          "p_md_expected_wan_ms_p90": _pct(pmd, 90)}
    return {"configured_budget_ms": float(config.policy.pipeline_ttft_budget_ms), "kv_bytes_per_token": kv_bytes,
            "expected_wan_ms": {"p50": _pct(exp_ms, 50), "p90": _pct(exp_ms, 90), "p95": _pct(exp_ms, 95)},
            "by_budget_ms": rows}
