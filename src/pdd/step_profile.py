"""Measured step-time profiles (``format: pdd-profile/1``) and the step model fitted to them.

A profile is the JSON that ``pdd profile`` (:func:`pdd.sim.profile.measure_profile`) writes
from timed forward steps of the live engine (rows ``prefill``, ``decode``, ``extend``; the
format of ``../shared/calibration`` so the roofline can also be fitted to it), with the model's
shape and the KV pool of one instance. :class:`MeasuredStepModel` turns it into step times: a
non-negative least-squares fit (relative error) of

    t = c0 + c_tok x N + c_pair x sum_i n_i (s_i + (n_i + 1) / 2) + c_ctx x sum_i (s_i + n_i)
        + c_seq x items + c_ext x [a multi-token item over cached context]

over every measured row (N new tokens, ``n_i`` new over ``s_i`` cached tokens per item) --
interpolation between measured points instead of a datasheet roofline. A pure decode step (every
item one new token) is that fit times the measured / fitted ratio of the profile's decode grid
(batch x context) at the step's batch and mean context (:func:`_decode_residuals`), so the step
keeps what was measured where the engine's cost bends away from the fit. A step that computes a
chunk (an item of more than one new token) can read the prefill and extend rows the same way
(``chunk_grid``, :func:`_chunk_residuals`); it does not by default: against the recorded live
runs it moved the simulated prefills about 2% faster on every run and left the per-request error
larger on 8 of 13 held-out runs of three recorded sets (docs/SIM.md, "The step between measured
points")

Used by the simulator (``pdd.sim.hardware``), by an engine tier's ``profile`` (the emulated step
of ``pdd.roles.worker``) and by the config's check of that file (``pdd.config``); it imports
nothing of pdd, so each of them can.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT = "pdd-profile/1"
FEATURES = ("const", "tokens", "attn_pairs", "ctx_tokens", "items", "extend")


def _features(items) -> list[float]:
    n_tot, pairs, ctx, k, ext = 0, 0.0, 0, 0, 0.0
    for s, n in items:
        n_tot += n
        pairs += n * (s + (n + 1) / 2.0)
        ctx += s + n
        k += 1
        if n > 1 and s > 0:
            ext = 1.0
    return [1.0, float(n_tot), pairs, float(ctx), float(k), ext]


def profile_rows(prof: dict) -> list[tuple[str, list[tuple[int, int]], float]]:
    rows = []
    for r in prof.get("prefill", []):
        rows.append((f"prefill {r['tokens']}", [(0, r["tokens"])], r["seconds"]))
    for r in prof.get("decode", []):
        rows.append((f"decode b{r['batch']} ctx{r['context']}", [(r["context"], 1)] * r["batch"],
                     r["seconds_per_step"]))
    for r in prof.get("extend", []):
        rows.append((f"extend {r['tokens']} ctx{r['context']}", [(r["context"], r["tokens"])], r["seconds"]))
    return rows


def fit_linear(prof: dict) -> tuple[dict, float, float]:
    """Non-negative least squares of the step-time model on the profile's rows, minimising the
    relative error (each row weighted by 1/measured). Exhaustive over feature subsets (6
    features: 63 solves), keeping the best all-non-negative solution.
    Returns (coefficients by feature name, mean |rel err|, max |rel err|).
    Raises ValueError when the profile has fewer rows than features."""
    rows = profile_rows(prof)
    if len(rows) < len(FEATURES):
        raise ValueError(f"profile has {len(rows)} rows; need at least {len(FEATURES)}")
    X = np.array([_features(it) for _, it, _ in rows])
    y = np.array([t for _, _, t in rows])
    w = 1.0 / y
    best = None
    for k in range(1, len(FEATURES) + 1):
        for sub in itertools.combinations(range(len(FEATURES)), k):
            A = X[:, sub] * w[:, None]
            coef, *_ = np.linalg.lstsq(A, y * w, rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(len(FEATURES))
            full[list(sub)] = coef
            err = float(np.sum((X @ full * w - 1.0) ** 2))
            if best is None or err < best[0] - 1e-15:
                best = (err, full)
    c = best[1]
    rel = np.abs(X @ c / y - 1.0)
    return dict(zip(FEATURES, map(float, c))), float(rel.mean()), float(rel.max())


@dataclass(frozen=True)
class MeasuredChip:
    """What the simulator's summaries read of a chip, for a measured machine."""

    name: str
    usd_per_hour: float = 0.0
    nic_gbps: float = 0.0


class MeasuredStepModel:
    """Step times interpolated from a measured profile (:func:`fit_linear`); the same interface
    as ``hardware.StepCostModel`` (``step_time``, ``decode_time``, ``prefill_time``,
    ``kv_capacity_tokens``)."""

    def __init__(self, prof: dict, kv_capacity_tokens: int | None = None, chunk_grid: bool = False):
        self.prof = prof
        self.coef, self.mean_rel_err, self.max_rel_err = fit_linear(prof)
        self._c = [self.coef[f] for f in FEATURES]
        self._grid = _decode_residuals(prof, self._t)
        # a chunk step on the prefill and extend rows' grid (module docstring), only when asked
        self._chunk_grid = _chunk_residuals(prof, self._t) if chunk_grid else None
        self.chip = MeasuredChip(prof.get("machine", "measured"))
        self.gpus = 1
        self._kv = int(kv_capacity_tokens if kv_capacity_tokens is not None else prof["kv_capacity_tokens"])

    def kv_capacity_tokens(self) -> int:
        return self._kv

    @property
    def price_per_hour(self) -> float:
        return 0.0

    def _t(self, f) -> float:
        c = self._c
        return c[0] + c[1] * f[1] + c[2] * f[2] + c[3] * f[3] + c[4] * f[4] + c[5] * f[5]

    def step_time(self, items) -> float:
        """Seconds of one engine step over ``items``, ``(cached tokens, new tokens)`` per sequence:
        a pure decode step on :meth:`decode_time`; any other the fit, times (with ``chunk_grid``)
        the chunk grid's ratio at its chunks' new tokens and their mean cached context, weighted
        by new tokens (:func:`_chunk_residuals`)."""
        items = list(items)
        if self._grid is not None and items and all(n == 1 for _, n in items):
            return self.decode_time(len(items), float(sum(s for s, _ in items)))
        t = self._t(_features(items))
        chunks = [(s, n) for s, n in items if n > 1]
        if self._chunk_grid is None or not chunks:
            return t
        new = sum(n for _, n in chunks)
        return float(t * self._chunk_grid(new, sum(s * n for s, n in chunks) / new))

    def decode_time(self, batch: int, sum_ctx: float) -> float:
        """Seconds of one decode step of ``batch`` sequences over ``sum_ctx`` cached tokens in
        all: the fit, times the measured / fitted ratio of the profile's decode rows interpolated
        at (batch, mean context) (:func:`_decode_residuals`)."""
        t = self._t([1.0, batch, sum_ctx + batch, sum_ctx + batch, batch, 0.0])
        if self._grid is None or batch < 1:
            return t
        return float(t * self._grid(batch, sum_ctx / batch))

    def prefill_time(self, tokens: int, cached: int = 0) -> float:
        return self.step_time([(cached, tokens)])


def _bilinear(xs: list[float], ys: list[float], ratio: dict):
    """``f(x, y)``: ``ratio[(x_i, y_j)]`` on the full grid ``xs`` x ``ys`` (sorted), interpolated
    bilinearly (in log2 x and in y) and held at the grid's edge beyond it."""
    ax = np.log2(xs)

    def at(axis, x):
        """(lower index, weight of the upper point) of ``x`` on the sorted ``axis``, clamped."""
        if x <= axis[0]:
            return 0, 0.0
        if x >= axis[-1]:
            return len(axis) - 2, 1.0
        i = int(np.searchsorted(axis, x)) - 1
        return i, (x - axis[i]) / (axis[i + 1] - axis[i])

    def interp(x: float, y: float) -> float:
        i, u = at(ax, float(np.log2(x)))
        j, v = at(ys, y)
        r = lambda a, c: ratio[(xs[a], ys[c])]  # noqa: E731
        return ((1 - u) * ((1 - v) * r(i, j) + v * r(i, j + 1))
                + u * ((1 - v) * r(i + 1, j) + v * r(i + 1, j + 1)))
    return interp


def _decode_residuals(prof: dict, model):
    """``ratio(batch, context)``: the profile's decode rows' measured / ``model`` step time, on
    their (batch, context) grid, interpolated bilinearly (in log2 batch and in context) and held
    at the grid's edge beyond it; None when the decode rows do not form a full grid of at least
    2 x 2 points. A linear fit of every row at once misses where a chip's decode cost bends (a
    bf16 CPU engine at 2,048 tokens of context: 7.1 ms measured, 5.0 ms fitted); the grid keeps
    what was measured between its points and the fit's shape beyond them."""
    rows = [(int(r["batch"]), float(r["context"]), float(r["seconds_per_step"])) for r in prof.get("decode", [])]
    bs, cs = sorted({b for b, _, _ in rows}), sorted({c for _, c, _ in rows})
    if len(bs) < 2 or len(cs) < 2 or len(rows) != len(bs) * len(cs):
        return None
    ratio = {}
    for b, c, t in rows:
        f = model([1.0, b, b * c + b, b * c + b, b, 0.0])
        if not (f > 0 and t > 0):
            return None
        ratio[(b, c)] = t / f
    if len(ratio) != len(bs) * len(cs):
        return None
    return _bilinear(bs, cs, ratio)


def _chunk_residuals(prof: dict, model):
    """``ratio(new_tokens, context)``: the measured / ``model`` time of the profile's rows that
    compute a chunk (``prefill``: new tokens over no cached context; ``extend``: over a cached
    context), on the grid of the chunk sizes measured at every context (the extend rows'
    contexts and 0), interpolated bilinearly (in log2 new tokens and in context) and held at the
    grid's edge beyond it; None without a full grid of at least 2 x 2 points. The linear fit of
    every row at once is 20% under a CPU engine's 512-token chunk at no context
    (``data/profiles/this-machine.json``: 46.1 ms measured, 36.8 fitted; 143.2 and 145.6 at
    3,072 tokens of context) and puts a long prompt's chunks 4% over in sum; the grid keeps what
    was measured."""
    rows = {}
    for r in prof.get("prefill", []):
        rows[(int(r["tokens"]), 0.0)] = float(r["seconds"])
    for r in prof.get("extend", []):
        rows[(int(r["tokens"]), float(r["context"]))] = float(r["seconds"])
    cs = sorted({c for _, c in rows})
    ns = sorted(n for n in {n for n, _ in rows} if n > 1 and all((n, c) in rows for c in cs))
    if len(ns) < 2 or len(cs) < 2:
        return None
    ratio = {}
    for n in ns:
        for c in cs:
            f, t = model(_features([(int(c), n)])), rows[(n, c)]
            if not (f > 0 and t > 0):
                return None
            ratio[(n, c)] = t / f
    return _bilinear(ns, cs, ratio)


def load(path: str | Path) -> dict:
    """The ``pdd profile`` JSON at ``path``. Raises OSError (unreadable), json.JSONDecodeError, or
    ValueError naming the file when it is not a pdd-profile/1 object, not a regular file, larger
    than :data:`pdd.files.MAX_JSON_BYTES` or not UTF-8 (:func:`pdd.files.read_text`)."""
    from pdd.files import read_text

    prof = json.loads(read_text(path, what=f"give a {FORMAT} JSON file (pdd profile)"))
    if not isinstance(prof, dict):
        raise ValueError(f"{path}: not a {FORMAT} profile (a JSON {type(prof).__name__}, not an object)")
    if prof.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} profile (format={prof.get('format')!r})")
    return prof


def load_step_model(path: str | Path) -> MeasuredStepModel:
    """:class:`MeasuredStepModel` of the profile at ``path`` (an engine tier's ``profile``).
    Raises ValueError naming the file: missing, not JSON, not pdd-profile/1, too few rows."""
    try:
        prof = load(path)
    except OSError as e:
        raise ValueError(f"profile {path}: cannot read it ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"profile {path}: not JSON ({e})") from None
    try:
        return MeasuredStepModel(prof)
    except (KeyError, TypeError) as e:
        raise ValueError(f"profile {path}: malformed ({type(e).__name__}: {e})") from None
    except ValueError as e:
        raise ValueError(f"profile {path}: {e}") from None
