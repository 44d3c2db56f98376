"""Discrete-event cluster simulator and planner on the runtime's own policy and scheduler code.

Modules: hardware (chips, roofline), models (model profiles), cluster (the SimPy simulator),
workloads (traces, agentic generator), report (metrics), experiments (named experiments),
plan (deployment sizing), cli (`pdd sim`, `pdd plan`).
"""
