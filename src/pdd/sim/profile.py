"""Measured step-time profiles of the live engine, and the simulator's step model built on them.

``pdd profile`` (:func:`measure_profile`) loads the configured checkpoint into the real
``pdd.engine.Engine`` with the topology's engine settings (dtype, device, torch threads, page
size) and times single forward steps formed by the engine's own scheduler:

- ``prefill``: one cold sequence of ``tokens`` prompt tokens (one step);
- ``decode``: ``batch`` sequences each at ``context`` tokens, one token each (mean of several steps);
- ``extend``: ``tokens`` new tokens over ``context`` cached ones (a handoff's extend, or a
  prefill chunk after the first).

It writes a JSON profile (``format: pdd-profile/1``; the rows use the format of
``../shared/calibration`` so the roofline can also be fitted to it) with the model's shape and
the KV pool of one instance. :class:`MeasuredStepModel` turns it into step times for the
simulator: a non-negative least-squares fit (relative error) of

    t = c0 + c_tok x N + c_pair x sum_i n_i (s_i + (n_i + 1) / 2) + c_ctx x sum_i (s_i + n_i)
        + c_seq x items + c_ext x [a multi-token item over cached context]

over every measured row (N new tokens, ``n_i`` new over ``s_i`` cached tokens per item) --
interpolation between measured points instead of a datasheet roofline.
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
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

    def __init__(self, prof: dict, kv_capacity_tokens: int | None = None):
        self.prof = prof
        self.coef, self.mean_rel_err, self.max_rel_err = fit_linear(prof)
        self._c = [self.coef[f] for f in FEATURES]
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
        return self._t(_features(items))

    def decode_time(self, batch: int, sum_ctx: float) -> float:
        return self._t([1.0, batch, sum_ctx + batch, sum_ctx + batch, batch, 0.0])

    def prefill_time(self, tokens: int, cached: int = 0) -> float:
        return self.step_time([(cached, tokens)])


def load(path: str | Path) -> dict:
    prof = json.loads(Path(path).read_text())
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


# ----------------------------------------------------------------------------------------------
# measuring the live engine


def _time_steps(engine, n: int = 1) -> float:
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        engine.step()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def measure_profile(cfg, *, prefill_tokens=(16, 32, 64, 128, 256, 512),
                    decode_batches=(1, 2, 4, 8, 16, 32), decode_contexts=(64, 512, 2048),
                    extend_tokens=(4, 16, 64, 256, 512), extend_contexts=(256, 1024, 2048, 3072),
                    reps: int = 5, log=print) -> dict:
    """Time the live engine of ``cfg`` (a ``pdd.config.ClusterConfig``) as described in the
    module docstring. Lengths above the engine's ``max_model_len`` are skipped. Returns the
    profile dict (``format``, ``machine``, ``engine``, ``model``, ``kv_capacity_tokens``,
    ``prefill``, ``decode``, ``extend``, ``fit``)."""
    import platform

    import torch

    from pdd.engine.engine import Engine

    e = cfg.engine
    torch.set_num_threads(e.torch_threads)
    biggest = max(max(prefill_tokens), max(extend_tokens))
    max_len = e.max_model_len
    need_tokens = max(max(decode_batches) * (max(decode_contexts) + 8), 2 * max_len)
    pages = max(e.num_pages, -(-need_tokens // e.page_size) + 64)
    eng = Engine.from_pretrained(cfg.model_path, num_pages=pages, page_size=e.page_size, dtype=e.dtype,
                                 device=e.device, max_batch_tokens=max(biggest, max(decode_batches)),
                                 prefill_chunk_tokens=biggest, max_running=max(decode_batches),
                                 enable_prefix_cache=False)
    mc = eng.model_cfg
    vocab = mc.vocab_size
    rng = np.random.default_rng(0)
    ids = itertools.count()

    def prompt(n):
        return [int(x) for x in rng.integers(2, vocab, n)]

    def fresh(n):
        s = eng.new_sequence(("prof", next(ids)), prompt(n), use_cache=False)
        eng.add(s)
        return s

    def drain(seqs):
        for s in seqs:
            eng.release(s, cache=False)

    # warm-up (first-call costs: allocator, kernels)
    s = fresh(64)
    eng.step()
    eng.step()
    drain([s])
    out = {"prefill": [], "decode": [], "extend": []}
    for n in prefill_tokens:
        if n > max_len - 1:
            continue
        ts = []
        for _ in range(reps):
            s = fresh(n)
            ts.append(_time_steps(eng))
            drain([s])
        out["prefill"].append({"tokens": n, "seconds": statistics.median(ts)})
        log(f"prefill {n:5d} tokens: {out['prefill'][-1]['seconds'] * 1e3:8.2f} ms")
    for ctx in decode_contexts:
        if ctx + 16 > max_len:
            continue
        for b in decode_batches:
            seqs = [fresh(ctx) for _ in range(b)]
            while any(x.num_computed < x.prompt_len for x in seqs):
                eng.step()  # prefill them (each samples its first token)
            t = _time_steps(eng, max(3, reps))
            out["decode"].append({"batch": b, "context": ctx, "seconds_per_step": t})
            log(f"decode b{b:3d} ctx {ctx:5d}: {t * 1e3:8.2f} ms/step")
            drain(seqs)
    for ctx in extend_contexts:
        for n in extend_tokens:
            if ctx + n + 1 > max_len:
                continue
            ts = []
            for _ in range(reps):
                s = fresh(ctx)
                while s.num_computed < s.prompt_len:
                    eng.step()
                eng.append_tokens(s, prompt(n))
                ts.append(_time_steps(eng))
                drain([s])
            out["extend"].append({"tokens": n, "context": ctx, "seconds": statistics.median(ts)})
            log(f"extend {n:4d} over {ctx:5d}: {out['extend'][-1]['seconds'] * 1e3:8.2f} ms")
    kv_per_token = eng.pool.page_bytes // eng.pool.page_size  # what the runtime ships per token
    n_params = sum(p.numel() for p in eng.model.parameters())
    elem = next(eng.model.parameters()).element_size()
    emb = mc.vocab_size * mc.hidden_size
    prof = {
        "format": FORMAT,
        "machine": f"{platform.node()} {platform.machine()} {e.device} {e.dtype} x{e.torch_threads} threads",
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model_path": str(cfg.model_path),
        "engine": e.model_dump(),
        "model": {
            "layers": mc.num_hidden_layers,
            "attn_dim": mc.num_attention_heads * mc.head_dim,
            "kv_bytes_per_token": int(kv_per_token),
            "weight_bytes": float(n_params * elem),
            "flops_per_token": float(2 * (n_params - emb)),
        },
        "kv_capacity_tokens": e.num_pages * e.page_size,
        **out,
    }
    coef, mare, maxe = fit_linear(prof)
    prof["fit"] = {"coef": coef, "mean_abs_rel_err": mare, "max_abs_rel_err": maxe}
    return prof
