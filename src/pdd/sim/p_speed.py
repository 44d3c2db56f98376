"""How much of a validation's TTFT error is P's speed during that run (``pdd sim validate``).

The simulator's P step is fitted on one calibration run (:mod:`pdd.sim.calibrate`): scale x the
profile + a per-step overhead, at the level where the simulated mean P step equals that run's.
A held-out run's own live P step can differ from what the fit predicts for it: the shared
machine runs faster or slower from one run to the next (P's engine time per computed prompt
token over the recorded runs of docs/SIM.md spans 202-242 us), or the fit misses how the
workload loads P. :func:`at_live_p_speed` re-simulates the run with P's level set so that the
simulated mean P step equals the run's own (live ``engine_busy_s / engine_steps``), every other
fit unchanged, and reports the TTFT errors there. It is a diagnostic, never the simulator's
result: it reads the run it is judged on. An error that vanishes at the run's own P speed is
P's speed; one that stays is elsewhere in the model (decode, transfer, handoff, routing).
:func:`at_live_speed` sets every role (P, RLD, MD) to its own live mean step the same way.
"""

from __future__ import annotations

from pathlib import Path

from pdd.sim.calibrate import calibrate_p_level
from pdd.sim.validate import compare, sim_role_steps, simulate

# |level - 1| above this: the run's P stepped at another speed than the fit's. Runs of one quiet
# day spread x0.950-x1.011 around their calibration run (docs/SIM.md, the held-out table's last
# column); the committed fit (2026-12-05) judged on a run of 2026-12-06 was x0.774
SPEED_WARN = 0.15


def at_live_p_speed(cfg, profile: str | Path, prof: dict, block_tokens: int, requests, live_records: list[dict],
                    live_p_step_s: float | None, overheads: dict, profile_b: str | Path | None = None) -> dict | None:
    """The run re-simulated at its own P speed: ``level`` (the factor on the fitted P step, scale
    and overhead alike, :func:`pdd.sim.calibrate.calibrate_p_level`), the live and the simulated
    mean P step there (ms), and the TTFT P50 / P90 / P99 errors (``err_*``, (sim - live) / live)
    and decision match at that level. ``overheads``: the profile's per-role step overheads
    (seconds); ``live_p_step_s``: the run's mean live P step (seconds). None when the profile has
    no fitted P step (``role_step_scale["P"]``) or the run no live P step."""
    scale = (prof.get("role_step_scale") or {}).get("P")
    if not scale or not live_p_step_s:
        return None
    ovh = dict(overheads)
    lam = calibrate_p_level(cfg, profile, prof, block_tokens, requests, live_p_step_s, float(scale),
                            float(ovh.get("P", 0.0)), ovh, profile_b=profile_b)
    p = {**prof, "role_step_scale": {**(prof.get("role_step_scale") or {}), "P": lam * scale}}
    sim = simulate(cfg, profile, p, block_tokens, requests, {**ovh, "P": lam * ovh.get("P", 0.0)},
                   profile_b=profile_b)
    c = compare(live_records, sim)
    return {"level": lam, "live_p_step_ms": live_p_step_s * 1e3,
            "sim_p_step_ms": (sim_role_steps(sim)["P"]["mean_step_s"] or 0.0) * 1e3,
            **{k: c[k] for k in ("err_p50_ttft_ms", "err_p90_ttft_ms", "err_p99_ttft_ms", "decision_match_share")}}


SPEED_ROLES = ("P", "RLD", "MD")
SPEED_ROUNDS = 4  # fixed-point rounds; the mean steps then agree to well under 0.1% on the recorded runs


def at_live_speed(cfg, profile: str | Path, prof: dict, block_tokens: int, requests, live_records: list[dict],
                  live_steps_s: dict, overheads: dict, profile_b: str | Path | None = None,
                  rounds: int = SPEED_ROUNDS) -> dict | None:
    """The run re-simulated with every role at its own speed in that run: each role's fitted
    step (``role_step_scale`` and ``overheads`` alike) times a factor, found by ``rounds``
    fixed-point rounds of factor x= live mean step / simulated mean step, so that the simulated
    mean P, RLD and MD steps equal the run's live ones (``live_steps_s``: role -> seconds, the
    live ``engine_busy_s / engine_steps``). A diagnostic, like :func:`at_live_p_speed`, never the
    simulator's result: it reads the run it is judged on. What it leaves is the model's error at
    the machine's speed of that run, the part that is not the machine moving between the
    calibration run and this one (docs/SIM.md "The 400-request set"). Returns ``factors`` (role
    -> factor), ``live_step_ms`` and ``sim_step_ms`` (role -> ms, after the last round), the TTFT
    P50 / P90 / P99 errors (``err_*``, (sim - live) / live) and the decision match; None when the
    profile has no fitted P step or the run lacks a live mean step of a role."""
    scale = dict(prof.get("role_step_scale") or {})
    live = {r: (live_steps_s or {}).get(r) for r in SPEED_ROLES}
    if not scale.get("P") or not all(live.values()):
        return None
    f = dict.fromkeys(SPEED_ROLES, 1.0)

    def run():
        p = {**prof, "role_step_scale": {**scale, **{r: scale.get(r, 1.0) * f[r] for r in SPEED_ROLES}}}
        ovh = {**overheads, **{r: overheads.get(r, 0.0) * f[r] for r in SPEED_ROLES}}
        sim = simulate(cfg, profile, p, block_tokens, requests, ovh, profile_b=profile_b)
        return sim, sim_role_steps(sim)

    for _ in range(rounds):
        _, steps = run()
        for r in SPEED_ROLES:
            if steps[r]["mean_step_s"]:
                f[r] *= live[r] / steps[r]["mean_step_s"]
    sim, steps = run()
    c = compare(live_records, sim)
    return {"factors": f, "live_step_ms": {r: live[r] * 1e3 for r in SPEED_ROLES},
            "sim_step_ms": {r: (steps[r]["mean_step_s"] or 0.0) * 1e3 for r in SPEED_ROLES},
            **{k: c[k] for k in ("err_p50_ttft_ms", "err_p90_ttft_ms", "err_p99_ttft_ms", "decision_match_share")}}


def speed_warning(ps: dict | None, calibration_run: str | None = None) -> str | None:
    """One line for ``pdd sim validate``'s output when the run's own P speed (``ps``:
    :func:`at_live_p_speed`'s result) is more than :data:`SPEED_WARN` off the fit's: the
    profile was then fitted on another day's or machine's speed (``calibration_run``: the run it
    was fitted on), and most of the run's TTFT error is that, not the model. None otherwise."""
    if not ps or not ps.get("level") or round(abs(ps["level"] - 1.0), 9) <= SPEED_WARN:
        return None
    faster = "faster" if ps["level"] < 1.0 else "slower"
    cal = f" ({calibration_run})" if calibration_run else ""
    return (f"WARNING: this run's P stepped {faster} than the profile's calibration run{cal} predicts (P's "
            f"step x{ps['level']:.3f}: mean {ps['live_p_step_ms']:.1f} ms live): the profile was fitted on "
            f"another day's or machine's speed, and the TTFT errors above are mostly that (at the run's own P "
            f"speed: P50 {ps['err_p50_ttft_ms'] * 100:+.1f}%, P90 {ps['err_p90_ttft_ms'] * 100:+.1f}%). Run it "
            f"again with --calibrate (a calibration run recorded and fitted first, on this machine today), or "
            f"see docs/SIM.md \"Measure this machine and validate the simulator\" and "
            f"scripts/record_validation.py")


def unfitted_warning(profile: dict | None) -> str | None:
    """One line for ``pdd sim validate``'s output when its profile (validate.json's ``profile``
    block) carries no live-run fit (``role_overhead_from`` None: a bare-engine profile, e.g. the
    one a run without ``--profile`` measures): the simulator then runs the bare engine's steps,
    without the live roles' step factors and overheads, the fast path or the interference, and
    comes out fast (seed 3 re-simulated so: TTFT P50 -33.7% against +3.2% with the committed
    fit). None when the profile has a fit."""
    if not isinstance(profile, dict) or profile.get("role_overhead_from"):
        return None
    path = profile.get("path") or "PROFILE"
    return ("WARNING: the profile carries no live-run fit (a bare engine's steps, without the live roles' step "
            "factors and overheads, the P -> RLD path's measured speed or the interference), so these errors are "
            "not the fitted simulator's. If this run is your calibration run, fit it: pdd sim calibrate-roles "
            f"--run OUT --profile {path} (docs/SIM.md \"Measure this machine and validate the simulator\"); "
            "else give the fitted profile with --profile (data/profiles/this-machine.json for the committed runs), "
            "or run with --calibrate to record and fit a calibration run first, today")
