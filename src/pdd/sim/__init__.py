"""Discrete-event cluster simulator and planner on the runtime's own policy and scheduler code.

Modules: hardware (chips, roofline), models (model profiles), cluster (the SimPy simulator),
report (metrics), experiments (named experiments), plan (deployment sizing), profile
(`pdd profile`), validate (the simulator's half of `pdd sim validate`), recorded (a recorded
run and a profile, read and checked), live_measures (what a live run's records show), calibrate
(`pdd sim calibrate-roles`), heldout (`pdd sim validate-report`), cli (`pdd sim`, `pdd plan`). Workloads are `pdd.workload`; the simulator imports nothing of `pdd.bench`.
"""
