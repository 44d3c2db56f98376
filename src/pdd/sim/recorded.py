"""A recorded live run (a ``pdd sim validate --out`` directory) and a step profile, read and
checked before anything is simulated or fitted: :func:`read_run` (``validate.json``,
``requests.jsonl``, ``server_stats.json``), :func:`check_record`, :func:`check_same_run` (a
reused run's workload arguments), :func:`load_profile_checked` with :func:`check_role_fits` (a
profile's per-role corrections), :func:`require_completed`. Every problem is a
:class:`RecordedRunError` naming the path and field (the CLIs print it as one usage line).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from pdd.sim.sim_config import DECODE_ROLES, ENGINE_ROLES, P_DISPATCH_MAX_S, P_REPLY_LAG_MAX_S


class RecordedRunError(ValueError):
    """A recorded run (``pdd sim validate --live-from DIR``, ``pdd sim calibrate-roles --run DIR``)
    or a profile that cannot be used: missing, not a directory, a file of it missing, unreadable or
    not JSON. The message names the path (the CLI prints it as a usage error); ``source`` is
    ``"run"`` (the recorded run), ``"profile"`` or ``"profile_b"`` (MD's profile)."""

    def __init__(self, message: str, source: str = "run"):
        super().__init__(message)
        self.source = source


class WorkloadMismatch(RecordedRunError):
    """A reused live run (``--live-from``) was made with other workload arguments."""


# validate.json "workload" / "config" keys a reused live run must share, and their flags (`pdd sim
# validate`'s; "seed" has none)
RUN_ARGS = (("workload", "requests", "--requests"), ("workload", "rate_rps", "--rate"),
             ("workload", "block_tokens", "--block-tokens"), ("workload", "session_sample", "--session-sample"),
             ("workload", "session_seed", "--session-seed"),
             ("workload", "max_output_tokens", "--max-output-tokens"), ("workload", "seed", "seed"),
             ("config", "pipeline_ttft_budget_ms", "--budget-ms"))


def recorded_run_args(run_dir: str | Path) -> dict:
    """The workload arguments a recorded run was made with, by ``pdd sim validate``'s argument
    names (``requests``, ``rate``, ``block_tokens``, ``session_sample``, ``session_seed``,
    ``max_output_tokens``, ``seed``, ``budget_ms``: :data:`RUN_ARGS`), read from its
    ``validate.json``; those it lacks are absent. Empty when the file is missing or not a JSON
    object (:func:`read_run` names that problem when the run is read)."""
    from pdd.files import MAX_DATA_BYTES, read_text

    try:
        v = json.loads(read_text(Path(run_dir) / "validate.json", MAX_DATA_BYTES))
    except (OSError, ValueError):
        return {}
    out = {}
    for sec, key, flag in RUN_ARGS:
        x = v.get(sec).get(key) if isinstance(v, dict) and isinstance(v.get(sec), dict) else None
        if _number(x):  # anything else is absent here: read_run names it
            out[flag.lstrip("-").replace("-", "_")] = x
    return out


def read_run(run_dir: str | Path, *, need_validate: bool = True) -> tuple[dict | None, list[dict], dict]:
    """A recorded ``pdd sim validate --out`` directory: (its ``validate.json``, or None when absent
    and not ``need_validate``; the ``requests.jsonl`` records; ``server_stats.json``). Raises
    :class:`RecordedRunError` naming the directory and the file (missing, not a directory, a file
    missing, unreadable or not JSON) before anything is computed."""
    d = Path(run_dir)
    what = "a `pdd sim validate --out` directory"
    if not d.exists():
        raise RecordedRunError(f"{d}: no such directory ({what})")
    if not d.is_dir():
        raise RecordedRunError(f"{d}: not a directory; give {what}")

    from pdd.files import MAX_DATA_BYTES, InputFileError, read_text

    def text(name: str) -> str:
        try:
            return read_text(d / name, MAX_DATA_BYTES, f"give {what}'s file")
        except InputFileError as e:  # a device or FIFO in its place, too large, not UTF-8: named as it is
            raise RecordedRunError(str(e)) from None
        except FileNotFoundError:
            raise RecordedRunError(f"{d}: no {name} in it (not {what})") from None
        except (OSError, UnicodeDecodeError) as e:
            raise RecordedRunError(f"{d / name}: cannot read it ({getattr(e, 'strerror', None) or e})") from None

    def parse(raw: str, where: str):
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise RecordedRunError(f"{where}: not JSON ({e})") from None
        if not isinstance(obj, dict):
            raise RecordedRunError(f"{where}: not a JSON object ({type(obj).__name__})")
        return obj

    v = parse(text("validate.json"), str(d / "validate.json")) \
        if need_validate or (d / "validate.json").exists() else None
    if v is not None:
        w = v.get("workload")
        if not isinstance(w, dict):
            raise RecordedRunError(f"{d / 'validate.json'}: no 'workload' object (not a `pdd sim validate` output)")
        for sec, key, _ in RUN_ARGS:  # the arguments that define the run: numbers where present
            x = v[sec].get(key) if isinstance(v.get(sec), dict) else None
            if x is not None and not _number(x):
                raise RecordedRunError(f"{d / 'validate.json'}: {sec}.{key} must be a number, got {x!r}")
    recs = [check_record(parse(x, f"{d / 'requests.jsonl'} line {i}"), f"{d / 'requests.jsonl'} line {i}")
            for i, x in enumerate(text("requests.jsonl").splitlines(), 1) if x.strip()]
    entry = parse(text("server_stats.json"), str(d / "server_stats.json"))
    check_stats(entry, d / "server_stats.json")
    return v, recs, entry


STEP_COUNTERS = ("engine_steps", "engine_busy_s")  # what live_measures.live_role_steps reads of an instance
TOTALS_READ = ("wan_bytes_planned", "wan_bytes_cancelled")  # ... and live_wan_payload_bytes of the totals


def check_stats(entry: dict, path: Path) -> None:
    """``server_stats.json``'s ``stats`` and ``stats_before``, when present: objects whose
    ``instances`` is an object of name -> object, each one's step counters numbers, its ``role`` a
    name and its ``hardware`` an object, and whose ``totals`` is an object whose WAN byte counts
    are numbers. Raises :class:`RecordedRunError` naming the file and field."""
    for key in ("stats", "stats_before"):
        st = entry.get(key)
        if st is None:
            continue
        if not isinstance(st, dict) or not isinstance(st.get("instances", {}), dict):
            raise RecordedRunError(f"{path}: {key} must be an object with an 'instances' object")
        for name, inst in st.get("instances", {}).items():
            if not isinstance(inst, dict):
                raise RecordedRunError(f"{path}: {key}.instances.{name} must be an object")
            for c in STEP_COUNTERS:
                if c in inst and not _number(inst[c]):
                    raise RecordedRunError(f"{path}: {key}.instances.{name}.{c} must be a number, got {inst[c]!r}")
            if "hardware" in inst and not isinstance(inst["hardware"], dict):
                raise RecordedRunError(f"{path}: {key}.instances.{name}.hardware must be an object")
            if inst.get("role") is not None and not isinstance(inst["role"], str):
                raise RecordedRunError(f"{path}: {key}.instances.{name}.role must be a role's name, got {inst['role']!r}")
        tot = st.get("totals")
        if tot is not None and not isinstance(tot, dict):
            raise RecordedRunError(f"{path}: {key}.totals must be an object")
        for c in TOTALS_READ:
            if tot and c in tot and not _number(tot[c]):
                raise RecordedRunError(f"{path}: {key}.totals.{c} must be a number, got {tot[c]!r}")


def run_engines(entry: dict) -> dict[str, tuple]:
    """The engine settings each instance ran with in a recorded run, from ``server_stats.json``
    (``stats.instances.<name>.hardware``: ``dtype``, ``page_size``): ``{name: (dtype,
    page_size)}`` for the instances that recorded them."""
    out = {}
    for name, inst in ((entry.get("stats") or {}).get("instances") or {}).items():
        hw = inst.get("hardware") or {}
        if "dtype" in hw and "page_size" in hw:
            out[name] = (hw["dtype"], hw["page_size"])
    return out


def check_same_requests(live: list[dict], prompt_tokens: list[int]) -> None:
    """Raise :class:`WorkloadMismatch` when a recorded run's records are not the workload's
    requests (``prompt_tokens``: each one's prompt length, in order): another count, or a record
    whose ``prompt_tokens`` differs from its request's (records and requests are matched by
    position; a record without it is not compared)."""
    if len(live) != len(prompt_tokens):
        raise WorkloadMismatch(f"live run has {len(live)} requests, the workload {len(prompt_tokens)}: not the same "
                               "workload (give the run's own workload arguments: its validate.json 'workload')")
    for i, (rec, n) in enumerate(zip(live, prompt_tokens)):
        if rec.get("prompt_tokens") is not None and rec["prompt_tokens"] != n:
            raise WorkloadMismatch(f"live run's request {i} has {rec['prompt_tokens']} prompt tokens, the workload's "
                                   f"{n}: not the same workload (give the run's own workload arguments: its "
                                   "validate.json 'workload')")


def check_same_engines(entry: dict, cfg) -> None:
    """Raise :class:`WorkloadMismatch` when a recorded run's instances ran other engine settings
    (KV dtype, page size: :func:`run_engines`) than ``cfg`` (a ``ClusterConfig``) gives them:
    re-simulating it on that config would model another topology. Names each instance, both
    settings and the flag to give."""
    diff = [f"{name} ran {dtype} on {page}-token pages (the config: {e.dtype} on {e.page_size})"
            for name, (dtype, page) in sorted(run_engines(entry).items())
            for e in [cfg.engine_for(name)] if (e.dtype, e.page_size) != (dtype, page)]
    if diff:
        raise WorkloadMismatch(f"not the same topology: {'; '.join(diff)}; give the run's own --config")


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _whole(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _decision_inputs() -> dict:
    """policy name -> the dataclass of its recorded ``inputs`` (the gateway records ``asdict`` of it)."""
    from pdd.policy.handoff import HandoffInputs
    from pdd.policy.pipeline import PipelineInputs

    return {"pipeline": PipelineInputs, "handoff": HandoffInputs}


_FIELD_TYPES = {"int": ("a whole number", lambda x: isinstance(x, int) and not isinstance(x, bool)),
                "float": ("a number", _number), "str": ("a string", lambda x: isinstance(x, str)),
                "bool": ("true or false", lambda x: isinstance(x, bool))}


def check_decisions(ds, bad) -> None:
    """``pdd.decisions`` of one record (None, or a list of ``{"policy", "inputs", "result"}``):
    ``policy`` pipeline or handoff, ``inputs`` an object of that policy's input fields
    (:class:`pdd.policy.pipeline.PipelineInputs`, :class:`pdd.policy.handoff.HandoffInputs`),
    each of its type, every one without a default present and no other; ``result`` a string
    (pipeline) or an object with ``mode`` a string and ``final`` true or false (handoff). Calls
    ``bad(field, why)`` (which raises) for the first problem."""
    import dataclasses

    if ds is None:
        return
    if not isinstance(ds, list):
        bad("pdd.decisions", "must be a list of decisions")
    classes = _decision_inputs()
    for k, d in enumerate(ds):
        at = f"pdd.decisions[{k}]"
        if not isinstance(d, dict) or not isinstance(d.get("policy"), str) or d["policy"] not in classes:
            bad(at, f"must be an object whose policy is {' or '.join(classes)}")
        inp = d.get("inputs")
        if not isinstance(inp, dict):
            bad(f"{at}.inputs", "must be an object")
        fs = {f.name: f for f in dataclasses.fields(classes[d["policy"]])}
        extra = sorted(str(x) for x in set(inp) - set(fs))
        if extra:
            bad(f"{at}.inputs", f"has {', '.join(extra)}, not an input of the {d['policy']} policy")
        for name, f in fs.items():
            if name not in inp:
                if f.default is dataclasses.MISSING:
                    bad(f"{at}.inputs.{name}", "is missing")
                continue
            what, ok = _FIELD_TYPES[getattr(f.type, "__name__", str(f.type))]
            if not ok(inp[name]):
                bad(f"{at}.inputs.{name}", f"must be {what}, got {inp[name]!r}")
        res = d.get("result")
        if d["policy"] == "pipeline" and not isinstance(res, str):
            bad(f"{at}.result", f"must be a pipeline's name, got {res!r}")
        if d["policy"] == "handoff" and not (isinstance(res, dict) and isinstance(res.get("mode"), str)
                                             and isinstance(res.get("final"), bool)):
            bad(f"{at}.result", f"must be an object with a mode and final (true or false), got {res!r}")


def check_record(rec: dict, where: str) -> dict:
    """``rec`` (one ``requests.jsonl`` record) when the fields the fits read have their types:
    ``send_s`` a number (present on a completed record with token times or gateway events),
    ``token_times_s`` a list of numbers, ``prompt_tokens`` a whole number, ``tiers`` a list of
    names, ``pdd`` an object whose ``events_ms`` is an object of numbers, whose cached token
    counts are whole numbers, ``pipeline`` a name and ``decisions`` the gateway's
    (:func:`check_decisions`), present on every completed record (``ok``): the gateway writes it on each request
    it completes, and a record without it would count as a request P never prefilled (its
    neighbours' prefills as isolated, the token gaps beside it as P quiet). Raises
    :class:`RecordedRunError` naming ``where`` and the field."""
    def bad(field: str, why: str):
        raise RecordedRunError(f"{where}: {field} {why} (not a `pdd sim validate` record)")

    tt = rec.get("token_times_s")
    if tt is not None and not (isinstance(tt, list) and all(_number(t) for t in tt)):
        bad("token_times_s", "must be a list of numbers")
    p = rec.get("pdd")
    if p is not None and not isinstance(p, dict):
        bad("pdd", "must be an object")
    if p is None and rec.get("ok"):  # absent, or null: no usage chunk carried the gateway's block
        bad("pdd", "is missing on a completed request (the gateway's per-request block: its events_ms and "
                   "decisions)")
    ev = (p or {}).get("events_ms")
    if ev is not None and not (isinstance(ev, dict) and all(_number(t) for t in ev.values())):
        bad("pdd.events_ms", "must be an object of numbers")
    for f in ("p_cached_tokens", "md_cached_tokens"):
        x = (p or {}).get(f)
        if x is not None and not _whole(x):
            bad(f"pdd.{f}", f"must be a whole number of tokens >= 0, got {x!r}")
    if (p or {}).get("pipeline") is not None and not isinstance(p["pipeline"], str):
        bad("pdd.pipeline", f"must be a pipeline's name, got {p['pipeline']!r}")
    check_decisions((p or {}).get("decisions"), bad)
    if rec.get("prompt_tokens") is not None and not _whole(rec["prompt_tokens"]):
        bad("prompt_tokens", f"must be a whole number of tokens >= 0, got {rec['prompt_tokens']!r}")
    tiers = rec.get("tiers")
    if tiers is not None and not (isinstance(tiers, list) and all(isinstance(t, str) for t in tiers)):
        bad("tiers", "must be a list of tier names (one a token)")
    if "send_s" in rec:
        if not _number(rec["send_s"]):
            bad("send_s", "must be a number")
    elif rec.get("ok") and (tt or ev):
        bad("send_s", "is missing")
    if tt:  # a token before its request was sent, or out of order, is a negative TTFT or token gap
        if any(b < a for a, b in zip(tt, tt[1:])):
            bad("token_times_s", "must be in the order the tokens came (non-decreasing)")
        if _number(rec.get("send_s")) and tt[0] < rec["send_s"]:
            bad("token_times_s", f"starts at {tt[0]}, before the request's send_s {rec['send_s']}")
    return rec


def check_same_run(recorded: dict, now: dict) -> None:
    """Raise :class:`WorkloadMismatch` naming every argument (and its flag) of ``now`` (a
    validate.json-shaped ``{"workload": ..., "config": ...}``) that differs from the recorded
    run's; an argument the recorded run lacks is not compared, except the budget (without it the
    directory is not a ``pdd sim validate`` output: :class:`RecordedRunError`)."""
    if not _number((recorded.get("config") or {}).get("pipeline_ttft_budget_ms")):
        raise RecordedRunError("validate.json: no config.pipeline_ttft_budget_ms (not a `pdd sim validate` output)")
    diff = []
    for sec, key, flag in RUN_ARGS:
        rec, cur = (recorded.get(sec) or {}).get(key), (now.get(sec) or {}).get(key)
        if rec is None or cur is None:
            continue
        same = abs(float(rec) - float(cur)) <= 1e-9 * max(1.0, abs(float(rec))) \
            if isinstance(rec, (int, float)) and isinstance(cur, (int, float)) else rec == cur
        if not same:
            diff.append(f"{flag} {cur} (the run's: {rec})")
    if diff:
        raise WorkloadMismatch("not the same workload: " + ", ".join(diff) + "; leave those flags out (a "
                               "reused run's own are the defaults) or give the run's own (its validate.json "
                               "'workload' and 'config.pipeline_ttft_budget_ms')")


def load_profile_checked(path: str | Path) -> dict:
    """``pdd.step_profile.load`` with its failures as :class:`RecordedRunError` naming the file."""
    from pdd.step_profile import load

    p = Path(path)
    if p.is_dir():
        raise RecordedRunError(f"{p}: is a directory; give a `pdd profile` JSON file", "profile")
    try:
        prof = load(p)
    except FileNotFoundError:
        raise RecordedRunError(f"{p}: no such file (a `pdd profile` JSON)", "profile") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RecordedRunError(f"{p}: cannot read it ({getattr(e, 'strerror', None) or e})", "profile") from None
    except json.JSONDecodeError as e:
        raise RecordedRunError(f"{p}: not JSON ({e})", "profile") from None
    except ValueError as e:  # not a pdd-profile/1 object: the message names the file
        raise RecordedRunError(str(e), "profile") from None
    check_step_rows(prof, p)
    check_role_fits(prof, p)
    return prof


# a profile's measured tables (pdd.sim.profile.measure_profile): table -> its numeric fields
STEP_ROWS = {"prefill": ("tokens", "seconds"), "decode": ("batch", "context", "seconds_per_step"),
             "extend": ("tokens", "context", "seconds")}


def check_step_rows(prof: dict, path: Path, need_model: bool = True) -> None:
    """Raises :class:`RecordedRunError` naming the file and field when the profile has no
    ``model`` object with ``kv_bytes_per_token`` (``need_model``: a roofline calibration file of
    data/calibration has none), a table of ``STEP_ROWS`` is not a list of
    objects whose fields are finite numbers > 0, or ``decode`` is empty (a hand-edited profile:
    the step model's fit divided by a string or by zero rows), or, with ``need_model``,
    ``kv_capacity_tokens`` is not a whole number >= 1 (the simulated instances' KV pool: a hand-edited
    0, string or 1e400 was a traceback in ``validate`` and ``calibrate-roles``), or, with
    ``need_model``, an ``engine`` block is not an object or names a KV dtype the runtime does not
    have (``pdd.transfer.layout.DTYPE_BYTES``)."""
    m = prof.get("model")
    if need_model and not (isinstance(m, dict) and _number(m.get("kv_bytes_per_token"))
                           and m["kv_bytes_per_token"] > 0):
        raise RecordedRunError(f"{path}: model must be an object with kv_bytes_per_token > 0, got {m!r}", "profile")
    kv = prof.get("kv_capacity_tokens")
    if need_model and not (_number(kv) and kv >= 1 and float(kv).is_integer()):
        raise RecordedRunError(f"{path}: kv_capacity_tokens must be a whole number of tokens >= 1 (the KV pool "
                               f"`pdd profile` measured), got {kv!r}", "profile")
    if need_model and "engine" in prof:
        from pdd.transfer.layout import DTYPE_BYTES

        eng = prof["engine"]
        if not isinstance(eng, dict):
            raise RecordedRunError(f"{path}: engine must be an object of the engine settings `pdd profile` measured "
                                   f"with, got {eng!r}"[:300], "profile")
        if "dtype" in eng and eng["dtype"] not in DTYPE_BYTES:
            raise RecordedRunError(f"{path}: engine.dtype must be one of {', '.join(sorted(DTYPE_BYTES))}, got "
                                   f"{eng['dtype']!r}"[:300], "profile")
    for table, fields in STEP_ROWS.items():
        rows = prof.get(table)
        if not isinstance(rows, list) or (table == "decode" and not rows):
            raise RecordedRunError(f"{path}: {table} must be a{' non-empty' if table == 'decode' else ''} list of "
                                   f"measured rows, got {rows!r}"[:300], "profile")
        for i, r in enumerate(rows):
            for f in fields:
                x = r.get(f) if isinstance(r, dict) else None
                if not (_number(x) and x > 0):
                    raise RecordedRunError(f"{path}: {table}[{i}].{f} must be a finite number > 0, got {x!r}",
                                           "profile")


SIM_ROLES = ENGINE_ROLES  # the simulator's roles (SimConfig.tiers)


# the scalar fits calibrate-roles writes: field -> (lowest value, closed, highest value or None;
# a hand-edited profile beyond it is refused: the highest is a bound no measurement reaches)
SCALAR_FITS = {"gateway_rtt_ms": (0.0, False, None), "gateway_rtt_line_ms": (0.0, True, None),
               "client_delay_s": (0.0, True, None), "wan_send_buffer_bytes": (0.0, True, None),
               "wan_written_lead_bytes": (0.0, True, None),
               "prefill_interference": (1.0, True, None), "p_dispatch_s": (0.0, True, P_DISPATCH_MAX_S),
               "p_reply_lag_s_per_token": (0.0, True, P_REPLY_LAG_MAX_S)}
# the per-role corrections: field -> (lowest value, closed)
ROLE_FITS = {"role_step_scale": (0.0, False), "role_step_overhead_s": (0.0, True), "decode_interference": (1.0, True)}


def check_role_fits(prof: dict, path: Path) -> None:
    """Raises :class:`RecordedRunError` naming the file and field when a per-role correction
    (``ROLE_FITS``) is not an object of role -> finite number in its range, a scalar fit
    (``SCALAR_FITS``) is not a finite number in its range, or ``fast_path`` is not an object of
    ``gbps`` > 0 and ``latency_s`` >= 0 (a hand-edited profile)."""
    for field, (lo, closed) in ROLE_FITS.items():
        v = prof.get(field)
        if v is None:
            continue
        if not isinstance(v, dict):
            raise RecordedRunError(f"{path}: {field} must be an object of role -> number, got {v!r}", "profile")
        for role, x in v.items():
            roles = DECODE_ROLES if field == "decode_interference" else SIM_ROLES
            if role not in roles:  # e.g. "rld": the simulator would ignore it; "P" has no decode step
                raise RecordedRunError(f"{path}: {field} has role {role!r}; roles are {', '.join(roles)}",
                                       "profile")
            if not (_number(x) and (x >= lo if closed else x > lo)):
                raise RecordedRunError(f"{path}: {field}[{role!r}] must be a finite number "
                                       f"{'>=' if closed else '>'} {lo:g}, got {x!r}", "profile")
    for field, (lo, closed, hi) in SCALAR_FITS.items():
        x = prof.get(field)
        if x is not None and not (_number(x) and (x >= lo if closed else x > lo) and (hi is None or x <= hi)):
            within = f" and <= {hi:g}" if hi is not None else ""
            raise RecordedRunError(f"{path}: {field} must be a finite number {'>=' if closed else '>'} {lo:g}"
                                   f"{within}, got {x!r}", "profile")
    fp = prof.get("fast_path")
    if fp is not None and not (isinstance(fp, dict) and _number(fp.get("gbps")) and fp["gbps"] > 0
                               and _number(fp.get("latency_s")) and fp["latency_s"] >= 0):
        raise RecordedRunError(f"{path}: fast_path must be an object with gbps > 0 and latency_s >= 0, got {fp!r}",
                               "profile")


def run_faults(live: list[dict], entry: dict) -> dict:
    """What went wrong in a recorded live run beyond failed requests: ``degraded`` (requests the
    gateway finished on a fallback path after losing an instance: their ``pdd.degraded``) and
    ``unreachable`` (instances the end-of-run flush could not reach: ``flush.unreachable`` of
    ``server_stats.json``). Such a run measured another topology than the one simulated."""
    unreach = (entry.get("flush") or {}).get("unreachable") if isinstance(entry.get("flush"), dict) else None
    return {"degraded": sum(1 for r in live if (r.get("pdd") or {}).get("degraded")),
            "unreachable": [str(x) for x in unreach] if isinstance(unreach, list) else []}


def faults_text(f: dict, n: int) -> str:
    """One phrase for :func:`run_faults`' result over ``n`` requests ('' when the run was clean)."""
    parts = ([f"{', '.join(f['unreachable'])} unreachable at the run's end"] if f["unreachable"] else []) \
        + ([f"{f['degraded']} of {n} requests degraded (an instance lost mid-run)"] if f["degraded"] else [])
    return "; ".join(parts)


def require_completed(live: list[dict], purpose: str) -> None:
    """Raises :class:`RecordedRunError` when the live run has no record (an empty
    ``requests.jsonl``) or none completed with tokens (every request failed: nothing to
    ``purpose``), naming up to three of its errors."""
    if not live:
        raise RecordedRunError(f"the live run has no request to {purpose} (its requests.jsonl has no records)")
    if not any(r.get("ok") and r.get("token_times_s") for r in live):
        errs = sorted({str(r.get("error"))[:80] for r in live})[:3]
        raise RecordedRunError(f"the live run has no completed request to {purpose} ({len(live)} failed: "
                               f"{'; '.join(errs)})")
