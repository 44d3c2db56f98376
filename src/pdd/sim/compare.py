"""The step model against published profiles: `pdd sim compare-profiles`.

Two sources the roofline (``pdd.sim.hardware``) is checked against:

- **Vidur's operator profiles** (``data/hardware/vidur/linear-ops.json``, derived from
  microsoft/vidur's ``data/profiling/compute/<gpu>/<model>/mlp.csv``; see its README): per-layer
  medians of a block's non-attention operators on A100 and H100. Their sum times the layer count
  is compared with the simulator's step time with the attention terms removed, i.e.
  ``StepCostModel.time(N, 0, 0)`` = ``overhead_s + max(F_lin N / (peak eff_c g), W / (HBM eff_m g))``
  for a model whose ``F_lin`` and ``W`` come from the profile's shape (``shape_model``); the
  bare roofline (without ``overhead_s``) is listed beside it. Out of sample: nothing was fitted
  to these rows, and neither chip is the one the efficiencies were fitted on.
- **The H200 calibration** (``data/calibration``): whole steps (attention included). The default
  efficiencies are fitted to these rows, so this comparison is in sample.

Errors are ``predicted / source - 1``.
"""

from __future__ import annotations

import json
from pathlib import Path

from pdd.sim.hardware import DEFAULT_CALIBRATION, StepCostModel, _profile_rows, get_chip, load_profile
from pdd.sim.models import DATA_DIR, ModelProfile, get_model

DEFAULT_OP_PROFILE = DATA_DIR / "vidur" / "linear-ops.json"
DECODE_MAX_TOKENS = 256  # token counts up to this are labelled decode (one token per sequence), above prefill
_SHAPE_KEYS = ("layers", "n_head", "n_kv_head", "n_embd", "n_expanded_embd", "gated_mlp")


def load_op_profile(path: str | Path = DEFAULT_OP_PROFILE) -> dict:
    """Read a ``pdd-op-profile/1`` JSON; ValueError naming the field when it is malformed."""
    try:
        from pdd.files import read_text

        prof = json.loads(read_text(path, what="give a pdd-op-profile/1 JSON file"))
    except (OSError, ValueError) as e:  # json.JSONDecodeError, pdd.files.InputFileError
        raise ValueError(f"{path}: cannot read an op profile: {e}") from None
    if not isinstance(prof, dict) or prof.get("format") != "pdd-op-profile/1":
        raise ValueError(f"{path}: format must be 'pdd-op-profile/1'")
    if not isinstance(prof.get("profiles"), list) or not prof["profiles"]:
        raise ValueError(f"{path}: profiles must be a non-empty list")
    for i, p in enumerate(prof["profiles"]):
        for k in ("chip", "model", "tp", "shape", "rows"):
            if k not in p:
                raise ValueError(f"{path}: profiles[{i}].{k} is missing")
        for k in _SHAPE_KEYS:
            if k not in p["shape"]:
                raise ValueError(f"{path}: profiles[{i}].shape.{k} is missing")
        for j, r in enumerate(p["rows"]):
            if not isinstance(r.get("tokens"), int) or r["tokens"] <= 0:
                raise ValueError(f"{path}: profiles[{i}].rows[{j}].tokens must be a positive integer")
            if not isinstance(r.get("ops_ms"), dict) or not r["ops_ms"]:
                raise ValueError(f"{path}: profiles[{i}].rows[{j}].ops_ms must be a non-empty object")
    return prof


def linear_params_per_layer(shape: dict) -> int:
    """Parameters of one block's linear layers: QKV, output projection and the (gated) MLP."""
    h, nh, nkv, ffn = shape["n_embd"], shape["n_head"], shape["n_kv_head"], shape["n_expanded_embd"]
    hd = h // nh
    qkv = h * (nh + 2 * nkv) * hd
    out = nh * hd * h
    mlp = (3 if shape["gated_mlp"] else 2) * h * ffn
    return qkv + out + mlp


def shape_model(name: str, shape: dict, tp: int, bytes_per_param: int = 2) -> ModelProfile:
    """A model profile of a shape's decoder blocks only (no embedding, no LM head), bf16 weights:
    ``weight_bytes`` = ``flops_per_token`` = 2 x linear parameters (2 FLOPs and 2 bytes each)."""
    p = linear_params_per_layer(shape) * shape["layers"]
    return ModelProfile(name=name, layers=shape["layers"], attn_dim=shape["n_embd"],
                        kv_bytes_per_token=2 * shape["layers"] * shape["n_kv_head"] * (shape["n_embd"] // shape["n_head"]) * bytes_per_param,
                        weight_bytes=float(bytes_per_param * p), flops_per_token=2.0 * p, gpus_per_instance=tp,
                        source=f"derived from the shape {shape}")


def vidur_rows(prof: dict) -> list[dict]:
    """One row per (profile, token count): source and predicted seconds of the non-attention step."""
    rows = []
    for i, p in enumerate(prof["profiles"]):
        try:
            chip = get_chip(p["chip"])
        except KeyError as e:
            raise ValueError(f"profiles[{i}].chip: {e.args[0]}") from None
        m = StepCostModel(chip, shape_model(p["model"], p["shape"], p["tp"]), p["tp"])
        for r in p["rows"]:
            n = r["tokens"]
            src = sum(r["ops_ms"].values()) * p["shape"]["layers"] / 1e3
            pred = m.time(n, 0.0, 0.0)
            decode = n <= DECODE_MAX_TOKENS
            rows.append({
                "source": f"vidur {p.get('gpu', p['chip'])}", "chip": p["chip"], "shape": p["model"].split("/")[-1],
                "tp": p["tp"], "phase": "decode (no attn)" if decode else "prefill (no attn)",
                "batch": n if decode else 1, "tokens": n, "context": None,
                "source_s": src, "predicted_s": pred, "roofline_s": pred - m.eff.overhead_s,
                "err": pred / src - 1, "roofline_err": (pred - m.eff.overhead_s) / src - 1,
            })
    return rows


def calibration_rows(path: str | Path = DEFAULT_CALIBRATION) -> list[dict]:
    """The H200 calibration's whole steps against the default step model (in sample)."""
    prof = load_profile(path)
    m = StepCostModel(get_chip("H200-SXM-141GB"), get_model("llama3-8b-calib"), 1)
    rows = []
    for name, items, t in _profile_rows(prof):
        kind = name.split()[0]
        s, n = items[0]
        pred = m.step_time(items)
        rows.append({
            "source": "H200 calibration", "chip": "H200-SXM-141GB", "shape": "Llama-3-8B", "tp": 1,
            "phase": kind, "batch": len(items), "tokens": n * len(items), "context": s or None,
            "source_s": t, "predicted_s": pred, "roofline_s": pred - m.eff.overhead_s - (m.eff.extend_overhead_s if kind == "extend" and n > 1 else 0.0),
            "err": pred / t - 1, "roofline_err": None,
        })
    return rows


def compare_profiles(op_profile: str | Path = DEFAULT_OP_PROFILE,
                     calibration: str | Path = DEFAULT_CALIBRATION) -> dict:
    """All rows plus a per-source summary (mean and worst |error|, decode and prefill apart).
    ValueError naming the file (and the field) when either input is malformed."""
    try:
        vidur = vidur_rows(load_op_profile(op_profile))
    except ValueError as e:
        raise ValueError(f"{op_profile}: {e}" if not str(e).startswith(str(op_profile)) else str(e)) from None
    try:
        cal = calibration_rows(calibration)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise ValueError(f"{calibration}: not a measured step profile ({type(e).__name__}: {e})") from None
    if not cal:
        raise ValueError(f"{calibration}: no prefill, decode or extend rows")
    rows = vidur + cal
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(f"{r['source']} {r['shape']} TP{r['tp']} {r['phase'].split()[0]}", []).append(r)
    summary = [{"group": g, "rows": len(rs), "mean_abs_err": sum(abs(r["err"]) for r in rs) / len(rs),
                "max_abs_err": max(abs(r["err"]) for r in rs), "mean_err": sum(r["err"] for r in rs) / len(rs)}
               for g, rs in groups.items()]
    return {"op_profile": str(op_profile), "calibration": str(calibration), "rows": rows, "summary": summary}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:+.1f}%"


def format_compare(res: dict) -> str:
    """Markdown: the per-row table, then the per-group summary."""
    out = ["| source | chip | shape | TP | phase | batch | tokens | context | predicted ms | source ms | error "
           "| roofline alone: error |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        out.append(f"| {r['source']} | {r['chip']} | {r['shape']} | {r['tp']} | {r['phase']} | {r['batch']} | "
                   f"{r['tokens']} | {r['context'] or '-'} | {r['predicted_s'] * 1e3:.2f} | {r['source_s'] * 1e3:.2f} | "
                   f"{_pct(r['err'])} | {_pct(r['roofline_err'])} |")
    out += ["", "| group | rows | mean error | mean \\|error\\| | worst \\|error\\| |", "|---|---|---|---|---|"]
    for s in res["summary"]:
        out.append(f"| {s['group']} | {s['rows']} | {_pct(s['mean_err'])} | {s['mean_abs_err'] * 100:.1f}% | "
                   f"{s['max_abs_err'] * 100:.1f}% |")
    return "\n".join(out)
