"""Workloads shared by the benchmark and the simulator (imports nothing of pdd above it).

Modules: ``records`` (Mooncake-format JSONL records: read, write, cap, retime, the agentic and
fixed-shape generators, prefix-hit histograms), ``replay`` (records -> scaled requests of
deterministic token ids: ``Scale``, ``TokenSpace``, ``build_requests``, ``fit_scale``).
"""
