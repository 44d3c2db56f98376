"""How much a percentile error depends on which requests a run happened to hold.

A held-out run is one sample of its workload: ~100-250 requests whose TTFT distribution is often
two-humped (P->MD and short prompts at tens of ms, long prefills at hundreds), with its P50 in
the sparse middle. There a handful of requests decide the percentile, and so its error. The
**paired bootstrap** (Efron & Tibshirani, *An Introduction to the Bootstrap*, 1993, ch. 13,
percentile interval) resamples the run's requests with replacement, each drawn with both its live
and its simulated value, and recomputes ``sim_q / live_q - 1`` on every resample: the interval
holding the central ``level`` of those values is the error a run of this size could have shown
with other requests of the same workload. The run-to-run noise floor (the same workload run live
twice) measures the live system's own variance; this interval measures the sample's.

Pure numpy, seeded: the same inputs give the same interval on any machine with the same numpy.
"""

from __future__ import annotations

import numpy as np

RESAMPLES = 2000  # bootstrap resamples (Efron & Tibshirani recommend >= 1,000 for percentile intervals)
LEVEL = 0.95  # central share of the resampled errors the interval holds
SEED = 0
_CELLS = 1 << 20  # values resampled at once (their indices and two gathers: ~24 MiB): flat for large runs


def paired_percentile_error_ci(live, sim, q: float, resamples: int = RESAMPLES, level: float = LEVEL,
                               seed: int = SEED) -> tuple[float, float] | None:
    """Interval of the relative error of the ``q``-th percentile, ``sim_q / live_q - 1``, over
    paired bootstrap resamples of the requests.

    ``live`` and ``sim``: one value per request (any unit, the same for both, e.g. TTFT seconds),
    request ``i`` of one paired with request ``i`` of the other. ``q`` in [0, 100] (numpy's
    linear interpolation, as the reported percentiles). Returns ``(lo, hi)``, dimensionless (e.g.
    -0.12, +0.40), the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of the resampled
    errors; resamples whose live percentile is not positive (or whose error overflows) are left
    out. None with fewer than two requests or no usable resample.

    Raises ValueError when the lengths differ, a value is not finite, ``q`` is outside [0, 100],
    ``level`` outside (0, 1) or ``resamples`` below 1."""
    x = np.asarray(live, dtype=float)
    y = np.asarray(sim, dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"live and sim must be two flat sequences of one length, got shapes {x.shape} and {y.shape}")
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise ValueError("live and sim must hold finite numbers only")
    if not (0.0 <= q <= 100.0):
        raise ValueError(f"q must be a percentile in [0, 100], got {q!r}")
    if not (0.0 < level < 1.0):
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    if not (isinstance(resamples, (int, np.integer)) and not isinstance(resamples, bool) and resamples >= 1):
        raise ValueError(f"resamples must be a whole number >= 1, got {resamples!r}")
    n = x.size
    if n < 2:
        return None
    rng = np.random.default_rng(seed)
    rows = max(1, _CELLS // n)
    errs = []
    done = 0
    while done < resamples:
        k = min(rows, resamples - done)
        idx = rng.integers(0, n, size=(k, n))
        lq = np.percentile(x[idx], q, axis=1)
        sq = np.percentile(y[idx], q, axis=1)
        ok = lq > 0
        with np.errstate(over="ignore", invalid="ignore"):  # a live percentile so small the ratio overflows
            e = sq[ok] / lq[ok] - 1.0
        errs.append(e[np.isfinite(e)])
        done += k
    e = np.concatenate(errs)
    if e.size == 0:
        return None
    lo, hi = np.percentile(e, [(1.0 - level) / 2 * 100, (1.0 + level) / 2 * 100])
    return float(lo), float(hi)


# the percentile metrics given an interval: name -> (percentile, which per-request value). Not
# P99: on runs of 100-250 requests it is set by their top one to three values, where the bootstrap's
# percentile interval does not hold (it can end at the estimate itself)
METRICS = (("p50_ttft_ms", 50, "ttft"), ("p90_ttft_ms", 90, "ttft"), ("p50_tpot_ms", 50, "tpot"))


def error_intervals(ttft_pairs, tpot_pairs, resamples: int = RESAMPLES, level: float = LEVEL,
                    seed: int = SEED) -> dict:
    """:func:`paired_percentile_error_ci` of each metric of ``METRICS``: ``{"p50_ttft_ms": [lo,
    hi], "p90_ttft_ms": ..., "p50_tpot_ms": ..., "level", "resamples"}`` (None for a metric without
    two pairs). ``ttft_pairs`` / ``tpot_pairs``: ``(reference, compared)`` per
    request (live, sim; or run 1, run 2 for the noise floor), seconds."""
    pairs = {"ttft": list(ttft_pairs), "tpot": list(tpot_pairs)}
    out: dict = {"level": level, "resamples": resamples}
    for name, q, kind in METRICS:
        p = pairs[kind]
        ci = paired_percentile_error_ci([a for a, _ in p], [b for _, b in p], q, resamples, level, seed) \
            if len(p) >= 2 else None
        out[name] = None if ci is None else [ci[0], ci[1]]
    return out


def share_interval(hits: int, n: int, level: float = LEVEL) -> tuple[float, float] | None:
    """Interval of a share (e.g. the decision match: ``hits`` of ``n`` requests decided alike):
    the **Wilson score interval** (E. B. Wilson, "Probable inference, the law of succession, and
    statistical inference", JASA 22, 1927; recommended over the normal approximation by Agresti
    & Coull, The American Statistician 52, 1998), the central ``level`` of the binomial share a
    run of ``n`` requests could have shown. Returns ``(lo, hi)`` in [0, 1], or None when ``n`` is 0.

    Raises ValueError when ``hits`` or ``n`` is not a whole number, ``hits`` is outside [0, n] or
    ``level`` outside (0, 1)."""
    from statistics import NormalDist

    for name, v in (("hits", hits), ("n", n)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"{name} must be a whole number, got {v!r}")
    if not (0 <= hits <= n):
        raise ValueError(f"hits must be in [0, n] = [0, {n}], got {hits}")
    if not (0.0 < level < 1.0):
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    if n == 0:
        return None
    z = NormalDist().inv_cdf((1.0 + level) / 2.0)
    p = hits / n
    den = 1.0 + z * z / n
    mid = (p + z * z / (2.0 * n)) / den
    half = z * np.sqrt(p * (1.0 - p) / n + z * z / (4.0 * n * n)) / den
    lo = 0.0 if hits == 0 else max(0.0, mid - half)  # exactly 0 / 1 at the ends (no rounding residue)
    hi = 1.0 if hits == n else min(1.0, mid + half)
    return float(lo), float(hi)
