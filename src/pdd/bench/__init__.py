"""Benchmark side of pdd: Mooncake trace replay, async streaming client, report, plots, demo.

Modules: ``trace`` (JSONL -> scaled token-id requests), ``client`` (open-loop SSE replay),
``report`` (vllm-bench-serve style metrics, report.json), ``plots`` (TTFT CDF, token timelines),
``demo`` (one fresh topology per mode, same workload, side-by-side report).
"""
