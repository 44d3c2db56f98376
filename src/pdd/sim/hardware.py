"""Chip profiles and the roofline step-time model.

Chips are data (data/hardware/chips.json, datasheet numbers cited per chip). A forward pass
over a batch plan costs

    t = overhead_s + max(F / (peak_flops * eff_compute * g), B / (hbm_bw * eff_mem * g))

with ``g`` GPUs per instance (tensor parallel, ideal scaling times ``tp_eff`` for g > 1),
``F = flops_per_token * N + 4 * layers * attn_dim * sum_i n_i * (s_i + (n_i + 1) / 2)``
(linear layers plus causal attention of ``n_i`` new tokens over ``s_i`` cached ones) and
``B = weight_bytes + kv_bytes_per_token * sum_i (s_i + n_i)`` (weights once, the context's KV
read, the new KV written).

The three efficiencies are *fitted* to a measured profile (``fit_profile``): by default the
H200 calibration in ../shared/calibration (graph replay), see ``calibration_report``.
A measured profile JSON of the same format can be passed for any chip (``--profile``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Sequence

from pdd.sim.models import ModelProfile, get_model, load_profiles, pick

CHIP_FIGURES = ("bf16_tflops", "hbm_gb", "hbm_tbps", "interconnect_gbps", "nic_gbps", "usd_per_hour")

# a copy of shared/calibration (measured on an H200, 2026-11-30), so a fresh clone has it
CALIBRATION_DIR = Path(__file__).resolve().parents[2].parent / "data" / "calibration"
DEFAULT_CALIBRATION = CALIBRATION_DIR / "h200-llama3-8b-cudagraph.json"


@dataclass(frozen=True)
class Chip:
    name: str
    bf16_tflops: float
    hbm_gb: float
    hbm_tbps: float
    interconnect_gbps: float
    nic_gbps: float
    usd_per_hour: float
    source: str = ""
    # figure name -> its source (a datasheet line, or "assumption: ..."); see chips.json
    cite: dict = field(default_factory=dict, compare=False, hash=False)

    def priced(self, usd_per_hour: float) -> "Chip":
        return replace(self, usd_per_hour=usd_per_hour)


def load_chips(path: str | Path | None = None) -> dict[str, Chip]:
    return load_profiles(path, "chips.json", Chip)


def get_chip(name: str, path: str | Path | None = None) -> Chip:
    return pick(load_chips(path), "chip", name)


@dataclass(frozen=True)
class Efficiency:
    """Fitted fractions of datasheet peak, and a fixed per-step overhead (launch, sampling)."""

    # Defaults = fit_profile() on ../shared/calibration/h200-llama3-8b-cudagraph.json
    # (mean |rel err| 3.5%, max 9.9% over 14 rows; see calibration_report / `pdd sim calibrate`).
    compute: float = 0.65
    mem: float = 0.92
    overhead_s: float = 0.00125
    extend_overhead_s: float = 0.0116  # extra per step holding a multi-token item over cached context
    tp_eff: float = 0.9
    mem_reserve_frac: float = 0.10  # HBM kept for activations / graphs, not KV


class StepCostModel:
    """Roofline step time of one instance (chip x model x GPUs)."""

    def __init__(self, chip: Chip, model: ModelProfile, gpus: int | None = None, eff: Efficiency | None = None):
        self.chip = chip
        self.model = model
        self.gpus = gpus or model.gpus_per_instance
        self.eff = eff or default_efficiency()
        g = self.gpus * (1.0 if self.gpus == 1 else self.eff.tp_eff)
        self._flops_rate = chip.bf16_tflops * 1e12 * self.eff.compute * g
        self._mem_rate = chip.hbm_tbps * 1e12 * self.eff.mem * g
        self._attn_k = 4.0 * model.layers * model.attn_dim
        self._fpt = model.flops_per_token
        self._kvb = model.kv_bytes_per_token
        self._w = model.weight_bytes

    # --- capacity -------------------------------------------------------------------------
    def kv_capacity_tokens(self) -> int:
        hbm = self.chip.hbm_gb * 1e9 * self.gpus * (1.0 - self.eff.mem_reserve_frac)
        return max(0, int((hbm - self.model.weight_bytes) // self.model.kv_bytes_per_token))

    @property
    def price_per_hour(self) -> float:
        return self.chip.usd_per_hour * self.gpus

    # --- time ------------------------------------------------------------------------------
    def time(self, new_tokens: float, attn_pairs: float, ctx_tokens: float, extend: bool = False) -> float:
        """Step time from aggregates: N new tokens, sum n_i*(s_i+(n_i+1)/2), sum (s_i + n_i);
        ``extend``: the batch holds a multi-token item over cached context."""
        f = self._fpt * new_tokens + self._attn_k * attn_pairs
        b = self._w + self._kvb * ctx_tokens
        t = self.eff.overhead_s + max(f / self._flops_rate, b / self._mem_rate)
        return t + self.eff.extend_overhead_s if extend else t

    def step_time(self, items: Iterable[tuple[int, int]]) -> float:
        """Step time of a batch given ``(start, num_tokens)`` per plan item."""
        n_tot = 0
        pairs = 0.0
        ctx = 0
        ext = False
        for s, n in items:
            n_tot += n
            pairs += n * (s + (n + 1) / 2.0)
            ctx += s + n
            if n > 1 and s > 0:
                ext = True
        return self.time(n_tot, pairs, ctx, ext)

    def decode_time(self, batch: int, sum_ctx: float) -> float:
        """A pure decode step of ``batch`` sequences whose contexts sum to ``sum_ctx``."""
        return self.time(batch, sum_ctx + batch, sum_ctx + batch)

    def prefill_time(self, tokens: int, cached: int = 0) -> float:
        return self.step_time([(cached, tokens)])


# --- calibration ---------------------------------------------------------------------------

def _profile_rows(prof: dict) -> list[tuple[str, list[tuple[int, int]], float]]:
    rows = []
    for r in prof.get("prefill", []):
        rows.append((f"prefill {r['tokens']}", [(0, r["tokens"])], r["seconds"]))
    for r in prof.get("decode", []):
        rows.append((f"decode b{r['batch']} ctx{r['context']}", [(r["context"], 1)] * r["batch"], r["seconds_per_step"]))
    for r in prof.get("extend", []):
        rows.append((f"extend {r['tokens']} ctx{r['context']}", [(r["context"], r["tokens"])], r["seconds"]))
    return rows


def load_profile(path: str | Path) -> dict:
    """The JSON of a calibration or measured profile file (:func:`pdd.files.read_text`: a regular
    file, bounded). Raises OSError, json.JSONDecodeError or pdd.files.InputFileError."""
    from pdd.files import read_text

    return json.loads(read_text(path, what="give a profile JSON file"))


def fit_profile(prof: dict, chip: Chip, model: ModelProfile) -> tuple[Efficiency, float]:
    """Fit the roofline to a measured profile.

    1. Grid-search (compute eff, mem eff, per-step overhead) minimising the squared log error
       over the prefill and decode rows.
    2. ``extend_overhead_s`` = median excess of the multi-token extend rows over that model
       (plain-PyTorch attention of a few queries over a long cached context runs a slower,
       non-fused path; production flash kernels make this ~0, so it is a conservative term).
    Returns (efficiency, mean abs relative error over all rows)."""
    import math
    import statistics

    rows = _profile_rows(prof)
    base = [r for r in rows if not r[0].startswith("extend")]
    best = None
    for oh in [x * 0.00025 for x in range(0, 21)]:
        for ec in [x / 100 for x in range(40, 100, 1)]:
            for em in [x / 100 for x in range(60, 101, 1)]:
                m = StepCostModel(chip, model, 1, Efficiency(ec, em, oh, 0.0))
                err = sum(math.log(m.step_time(it) / t) ** 2 for _, it, t in base)
                if best is None or err < best[0]:
                    best = (err, Efficiency(ec, em, oh, 0.0))
    eff = best[1]
    m = StepCostModel(chip, model, 1, eff)
    ext = [t - m.step_time(it) for name, it, t in rows if name.startswith("extend") and it[0][1] > 1]
    if ext:
        eff = replace(eff, extend_overhead_s=max(0.0, statistics.median(ext)))
    m = StepCostModel(chip, model, 1, eff)
    mare = sum(abs(m.step_time(it) / t - 1) for _, it, t in rows) / len(rows)
    return eff, mare


def calibration_report(path: str | Path = DEFAULT_CALIBRATION) -> dict:
    """Fit the roofline to the H200 calibration and list per-row model vs measured."""
    prof = load_profile(path)
    chip = get_chip("H200-SXM-141GB")
    model = get_model("llama3-8b-calib")
    eff, mare = fit_profile(prof, chip, model)
    m = StepCostModel(chip, model, 1, eff)
    rows = [
        {"row": name, "measured_s": t, "model_s": m.step_time(it), "rel_err": m.step_time(it) / t - 1}
        for name, it, t in _profile_rows(prof)
    ]
    return {
        "profile": str(path),
        "efficiency": eff.__dict__,
        "mean_abs_rel_err": mare,
        "max_abs_rel_err": max(abs(r["rel_err"]) for r in rows),
        "rows": rows,
    }


def default_efficiency() -> Efficiency:
    """The efficiencies fitted to the H200 graph-replay calibration (constants, so a run does
    not re-fit; tests/sim check they still match the fit)."""
    return Efficiency()


def cost_model(chip: str | Chip, model: str | ModelProfile, gpus: int | None = None,
               profile: str | Path | None = None) -> StepCostModel:
    """Build a step-cost model; with ``profile`` (a measured JSON like the calibration files)
    the efficiencies are fitted to it instead of the default; a ``pdd profile`` file
    (``format: pdd-profile/1``) gives a :class:`pdd.step_profile.MeasuredStepModel` instead."""
    c = get_chip(chip) if isinstance(chip, str) else chip
    m = get_model(model) if isinstance(model, str) else model
    eff = None
    if profile is not None:
        prof = load_profile(profile)
        if prof.get("format") == "pdd-profile/1":  # measured by `pdd profile`: interpolate, no roofline
            from pdd.step_profile import MeasuredStepModel

            return MeasuredStepModel(prof)
        eff, _ = fit_profile(prof, c, m)
    return StepCostModel(c, m, gpus, eff)
