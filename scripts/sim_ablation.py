"""The held-out table of docs/SIM.md with one part of the simulator's model taken out at a time:

    python scripts/sim_ablation.py --out runs/ablation [--variant NAME ...] [--runs data/validation]
        [--profile FILE]

Each variant reruns ``scripts/sim_heldout.py`` (the fit on the calibration run, every run
re-simulated, the report) with ``pdd.sim`` patched in a process of its own, and prints one row of
the ablation table: TTFT P50 and P90 error, per-request TTFT error's median and |error|'s median
(%) and decision match (%), the calibration run first, then the held-out runs in the manifest's order,
and the mean |error| (ms) of the two TTFT phases over every run's prompt-size buckets
(``pdd.sim.ttft_phases``: to P's reply, then to the first token). Variants:

- ``all``: nothing taken out (the held-out table);
- ``one-lane``: one WAN connection per sender, no express lane of its own (``links.Line.send``
  with no ``conn`` and ``express_bytes`` 0);
- ``no-reply-lag``: P's quiet fit without its reply-lag term (``calibrate.fit_quiet_step``
  with ``with_lag`` False: scale and per-step overhead; the dispatch takes what is left);
- ``no-decode-scale``: RLD's step without its factor over the bare step
  (``live_measures.live_decode_scale`` gives None: RLD's step is the profile's plus a per-step
  overhead fitted on the mean step alone, as MD's);
- ``no-interference``: no prefill interference (``calibrate.calibrate_p_interference`` gives
  None, so P's level is fitted on its mean step at a factor of 1);
- ``block-hits``: P's cache hit in whole blocks, not pages (``SimConfig.page_tokens`` None);
- ``schedule``: requests replayed at the schedule's times, not as the client sent them
  (``validate.as_sent`` the identity);
- ``no-index``: the gateway plans and routes on MD's cache itself, not on its prefix index of MD
  (``SimConfig.md_prefix_index`` False);
- ``pairs-as-live``: a diagnostic, not a part of the model: of two requests sent within 2 ms of
  each other, the first one whose live prefill interval (its send to P's first token) is more
  than 25 ms longer than simulated (the live P ran it in one step with the second one's first
  chunk: which of the two P received first, and whether its step had begun, is decided live
  within a millisecond) is simulated as sent at the second one's time, so the simulated P forms
  that step too (``validate.simulate`` run twice per re-simulation; the fit is the calibration
  run's own, unchanged);
- ``rtt-as-live``: a diagnostic too: each request's pipeline decision reads the WAN RTT estimate
  the live gateway's decision read for it (its recorded ``wan_rtt_ms`` input, a windowed minimum
  of reservation round trips that moves from request to request) instead of the calibration
  run's median (``ClusterSim._pipeline_inputs`` patched; the fit redone with it);
- ``chunk-grid``: added rather than taken out, a step that computes a chunk (prefill, extend)
  is the profile's linear fit times the measured / fitted ratio of its prefill and extend rows
  (``step_profile.MeasuredStepModel`` with ``chunk_grid``; the fit redone with it);
- ``written-at-committed``: P has written MD's KV (its ``xfer_done``, the early handoff's
  start) where the bytes a cut-off cannot recall are still to go, not at the lead fitted on the
  live ``xfer_done`` (``calibrate.calibrate_wan_written_lead`` gives None);
- ``fast-path-alone``: the P -> RLD path fitted on the requests that had it to themselves
  (``live_measures.live_fast_path`` with ``alone`` True: no other request at P or on its way to
  its decoder around this one's KV trip) instead of on every relayed request, whose other half
  waited on P's next step, on another request's KV or on the cores;
- ``fast-path-median``: the P -> RLD path fitted on every relayed request as the median
  (least-absolute-deviations) line rather than least squares (``live_measures.live_fast_path``
  with ``fit`` ``"median"``): the typical request's trip, which the ones that waited do not pull up.

Nothing live is started; about 10 s of CPU a variant. Exit status 2 for an unknown variant, else
that of the first variant that fails.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

VARIANTS = ("all", "one-lane", "no-reply-lag", "no-decode-scale", "no-interference", "block-hits", "schedule",
            "no-index", "pairs-as-live", "rtt-as-live", "fast-path-alone", "fast-path-median", "chunk-grid",
            "written-at-committed")
PAIR_WITHIN_S = 0.002  # pairs-as-live: two requests sent at most this far apart ...
PAIR_SLOWER_S = 0.025  # ... the first one's live prefill interval this much longer than simulated


def live_rtt_estimates(live: list[dict]) -> dict:
    """Request index (the simulator's rid) -> the WAN RTT estimate (ms) the live gateway's first
    pipeline decision of it read (``rtt-as-live``); requests without one are left out."""
    out = {}
    for i, rec in enumerate(live):
        for d in (rec.get("pdd") or {}).get("decisions") or []:
            x = (d.get("inputs") or {}).get("wan_rtt_ms") if d.get("policy") == "pipeline" else None
            if isinstance(x, (int, float)) and not isinstance(x, bool):
                out[i] = float(x)
                break
    return out


def pairs_as_live(requests, live: list[dict], sim) -> list:
    """``requests`` (as sent) with the first of each pair the live P ran in one step moved to
    its partner's send time (the ``pairs-as-live`` rule above); ``sim`` is their simulation."""
    import dataclasses

    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    out = list(requests)
    for i, j in zip(order, order[1:]):
        if requests[j].arrival_s - requests[i].arrival_s > PAIR_WITHIN_S or i >= len(live):
            continue
        ev, q = (live[i].get("pdd") or {}).get("events_ms") or {}, sim.reqs[i]
        if "p_first_token" in ev and q.t_prefill_done is not None \
                and ev["p_first_token"] / 1e3 > q.t_prefill_done - q.arrival + PAIR_SLOWER_S:
            out[i] = dataclasses.replace(requests[i], arrival_s=requests[j].arrival_s)
    return out


def patch(variant: str) -> None:
    """Take ``variant``'s part out of ``pdd.sim`` in this process."""
    import pdd.sim.calibrate as cal
    import pdd.sim.links as links
    import pdd.sim.validate as val

    if variant == "one-lane":
        send = links.Line.send

        def one_lane(self, *a, conn=None, **k):
            keep, self.express_bytes = self.express_bytes, 0.0
            try:
                return send(self, *a, **k)
            finally:
                self.express_bytes = keep
        links.Line.send = one_lane
    elif variant == "no-reply-lag":
        fit = cal.fit_quiet_step
        cal.fit_quiet_step = lambda *a, **k: fit(*a, **k, with_lag=False)
    elif variant == "no-decode-scale":
        cal.live_decode_scale = lambda *a, **k: None
    elif variant == "no-interference":
        cal.calibrate_p_interference = lambda *a, **k: None
    elif variant in ("block-hits", "no-index"):
        sim_config = val.sim_config
        off = {"page_tokens": None} if variant == "block-hits" else {"md_prefix_index": False}
        val.sim_config = lambda *a, **k: sim_config(*a, **k).replace(**off)
    elif variant == "schedule":
        def same(reqs, live):
            return list(reqs)
        cal.as_sent = val.as_sent = same
    elif variant == "pairs-as-live":
        sent, simulate, last = val.as_sent, val.simulate, {}

        def as_sent_kept(reqs, live):
            last["reqs"], last["live"] = sent(reqs, live), live
            return last["reqs"]

        def simulate_pairs(cfg, profile, prof, block_tokens, requests, *a, **k):
            sim = simulate(cfg, profile, prof, block_tokens, requests, *a, **k)
            if last.get("reqs") is not requests:  # not validate's re-simulation of a run
                return sim
            moved = pairs_as_live(requests, last["live"], sim)
            return simulate(cfg, profile, prof, block_tokens, moved, *a, **k)
        val.as_sent, val.simulate = as_sent_kept, simulate_pairs
    elif variant == "rtt-as-live":
        import dataclasses

        import pdd.sim.cluster as cluster

        sent, rtt = val.as_sent, {}

        def as_sent_rtt(reqs, live):
            rtt.clear()
            rtt.update(live_rtt_estimates(live))
            return sent(reqs, live)

        inputs = cluster.ClusterSim._pipeline_inputs

        def pipeline_inputs(self, req):
            inp = inputs(self, req)
            return inp if req.rid not in rtt else dataclasses.replace(inp, wan_rtt_ms=rtt[req.rid])
        cal.as_sent = val.as_sent = as_sent_rtt
        cluster.ClusterSim._pipeline_inputs = pipeline_inputs
    elif variant == "written-at-committed":
        cal.calibrate_wan_written_lead = lambda *a, **k: None
    elif variant == "chunk-grid":
        import functools

        import pdd.step_profile as step_profile

        step_profile.MeasuredStepModel.__init__ = functools.partialmethod(step_profile.MeasuredStepModel.__init__,
                                                                          chunk_grid=True)
    elif variant == "fast-path-alone":
        import functools

        cal.live_fast_path = functools.partial(cal.live_fast_path, alone=True)
    elif variant == "fast-path-median":
        import functools

        cal.live_fast_path = functools.partial(cal.live_fast_path, fit="median")


def phase_errors(validates: list[dict]) -> tuple[float, float] | None:
    """Mean |simulated - live| (ms) of each TTFT phase's median, to P's reply and after it, over
    every prompt-size bucket of every run (their ``validate.json``'s ``ttft_phases``,
    :mod:`pdd.sim.ttft_phases`); None when no run has one."""
    cells = [ph for v in validates for ph in v.get("ttft_phases") or []]
    if not cells:
        return None
    return tuple(sum(abs(ph[k]["sim"] - ph[k]["live"]) for ph in cells) / len(cells)
                 for k in ("to_p_reply_ms", "after_p_reply_ms"))


def row(variant: str, out: Path) -> str:
    """One table row from ``out`` (a ``sim_heldout.py --out`` directory)."""
    rep = json.loads((out / "report-0.json").read_text())
    cal = json.loads((out / Path(rep["calibration"]).name / "validate.json").read_text())
    rows = [cal] + rep["held_out"]
    pe = phase_errors([cal] + [json.loads((out / Path(r["run"]).name / "validate.json").read_text())
                               for r in rep["held_out"]])

    def col(f):
        return f"{f(rows[0])}; " + ", ".join(f(r) for r in rows[1:])

    return "| " + " | ".join([variant, col(lambda r: f"{r['err_p50_ttft_ms'] * 100:+.1f}"),
                              col(lambda r: f"{r['err_p90_ttft_ms'] * 100:+.1f}"),
                              col(lambda r: f"{r['ttft_error_per_request']['median'] * 100:+.1f}"),
                              col(lambda r: f"{r['ttft_error_per_request']['abs_p50'] * 100:.1f}"),
                              col(lambda r: f"{r['decision_match_share'] * 100:.0f}"),
                              "-" if pe is None else f"{pe[0]:.1f} / {pe[1]:.1f}"]) + " |"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for each variant's sim_heldout.py output (made)")
    ap.add_argument("--variant", action="append", default=None, help=f"one of {', '.join(VARIANTS)} (repeatable; "
                    "default: all of them)")
    ap.add_argument("--runs", default="data/validation", help="the recorded runs (default: data/validation)")
    ap.add_argument("--profile", default=None, help="the bare-engine profile the fit starts from, as "
                    "sim_heldout.py's --profile (default: its default; a recorded set's own, e.g. "
                    "data/validation-subset/profile.json)")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a variant in this process
    a = ap.parse_args(argv)
    variants = a.variant or list(VARIANTS)
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        ap.error(f"--variant: unknown {', '.join(bad)}; variants are {', '.join(VARIANTS)}")
    out = Path(a.out)
    sys.path.insert(0, str(Path(__file__).parent))
    import sim_heldout

    if not a.one:  # the runs and --out checked once, before the table's head (each variant would refuse them)
        if a.profile is not None and not Path(a.profile).is_file():
            ap.error(f"--profile: no such file {a.profile}")
        try:
            sim_heldout.load_runs(Path(a.runs))
        except ValueError as e:
            ap.error(f"--runs: {e}")
        try:
            for d in [out, *(out / v for v in variants)]:
                sim_heldout.make_out(d)
        except ValueError as e:
            ap.error(str(e))
    if a.one:
        (variant,) = variants
        patch(variant)
        # the re-simulations' stderr (a workload line each, nine a variant, which split the table's
        # rows on a terminal) is shown only when the variant fails
        err, rc = io.StringIO(), 1
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                rc = sim_heldout.main(["--out", str(out / variant), "--runs", a.runs]
                                      + (["--profile", a.profile] if a.profile else []))
        finally:
            if rc:
                sys.stderr.write(err.getvalue())
        if rc == 0:
            print(row(variant, out / variant), flush=True)
        return rc
    print("| model | TTFT P50 error | TTFT P90 error | per-request median | per-request \\|error\\| median | "
          "decision match | TTFT phases, mean \\|error\\| ms: to P's reply / after |")
    print("|---|---|---|---|---|---|---|", flush=True)
    for v in variants:
        rc = subprocess.call([sys.executable, __file__, "--one", "--variant", v, "--out", str(out), "--runs", a.runs]
                             + (["--profile", a.profile] if a.profile else []))
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
