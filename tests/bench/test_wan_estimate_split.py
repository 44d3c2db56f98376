"""scripts/wan_estimate_split.py (docs/LINK.md "Live estimates that decide") on hand-made
`pdd bench` records: the split lines of a run with WAN-estimate samples, "no samples" for a mode
without any, and one line with exit status 2 (no traceback) for a run with none at all, a
missing requests.jsonl, a bad N and a mode the run does not have."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "scripts" / "wan_estimate_split.py"


def _rec(mode: str, idx: int, pipeline: str, est: float | None, ok: bool = True) -> dict:
    decisions = [] if est is None else [{"policy": "pipeline", "inputs": {"wan_gbps_estimate": est},
                                         "result": pipeline}]
    return {"idx": idx, "mode": mode, "arrival_s": float(idx), "send_s": float(idx), "ok": ok,
            "token_times_s": [idx + 0.1 * (idx + 1), idx + 0.1 * (idx + 1) + 0.05, idx + 0.1 * (idx + 1) + 0.1],
            "pdd": {"pipeline": pipeline, "decisions": decisions}}


def _run_dir(tmp_path: Path, recs: list[dict]) -> Path:
    d = tmp_path / "out"
    d.mkdir()
    (d / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return d


def _split(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=60)


def test_split_lines_and_a_mode_without_samples(tmp_path):
    recs = [_rec("live", i, "p_md" if i < 2 else "p_rld_md", 0.025 if i < 2 else 0.0125) for i in range(4)]
    recs += [_rec("config", i, "p_md", 0.025) for i in range(4)]
    recs += [_rec("cross_dc_pd", i, "p_md", None) for i in range(4)]  # a baseline: no pipeline decision
    d = _run_dir(tmp_path, recs)
    r = _split(d, 3, "live", "config")
    assert r.returncode == 0 and r.stderr == ""
    lines = r.stdout.splitlines()
    assert len(lines) == 4
    assert lines[0] == ("live: n=4/4; TTFT P50/P90 all 250/370 ms; before the halving 150/190; from it 350/390; "
                        "TPOT P50 50.0 ms; pipelines before {'p_md': 2, 'p_rld_md': 0} from {'p_md': 0, 'p_rld_md': 2}; "
                        "estimate read first/min/last 0.0250/0.0125/0.0125; injected at [] s, lifted [] s")
    assert "; estimate read first/min/last 0.0250/0.0250/0.0250;" in lines[1]
    assert lines[2].startswith("cross_dc_pd: n=4/4;") and "; estimate read: no samples;" in lines[2]
    assert lines[3] == "same requests, pipeline changed: {'p_md (config) -> p_rld_md (live)': 2}"


def test_run_without_samples_is_one_line_exit_2(tmp_path):
    d = _run_dir(tmp_path, [_rec("cross_dc_pd", i, "p_md", None) for i in range(3)]
                 + [_rec("pdd", i, "p_md", 0.025, ok=False) for i in range(3)])  # pdd's all failed
    r = _split(d, 2)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == (f"wan_estimate_split.py: {d}/requests.jsonl: no WAN-estimate samples in any mode "
                        "(cross_dc_pd, pdd): no completed request has a pipeline decision reading "
                        "inputs.wan_gbps_estimate (only a pdd mode's requests do)\n")


def test_bad_input_is_one_line_exit_2(tmp_path):
    r = _split(tmp_path / "nothing", 2)
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == (f"wan_estimate_split.py: {tmp_path}/nothing/requests.jsonl: not found (OUT is the "
                        "directory a `pdd bench --out OUT` run wrote)\n")
    d = _run_dir(tmp_path, [_rec("pdd", i, "p_md", 0.025) for i in range(3)])
    for args, err in (((d, "0"), "N: '0' is not a whole number >= 1 (the request, in arrival order, the halving "
                                  "fell at)"),
                      ((d,), "expected OUT N or OUT N MODE_A MODE_B, got 1 argument(s); usage: "
                             "wan_estimate_split.py OUT N [MODE_A MODE_B]"),
                      ((d, 2, "pdd", "live"), f"mode 'live': not in {d}/requests.jsonl (its modes: pdd)")):
        r = _split(*args)
        assert (r.returncode, r.stdout, r.stderr) == (2, "", f"wan_estimate_split.py: {err}\n")
