"""Benchmark side of pdd: async streaming client, report, plots, demo, the live half of validation.

Modules: ``client`` (open-loop SSE replay), ``report`` (vllm-bench-serve style metrics,
report.json), ``plots`` (TTFT CDF, token timelines), ``demo`` (one fresh topology per mode, same
workload, side-by-side report), ``live_validate`` (the live half of ``pdd sim validate``). The
trace replay (JSONL -> scaled token-id requests) is ``pdd.workload.replay``.
"""
