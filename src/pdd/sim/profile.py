"""``pdd profile``: measure the live engine's step times into a profile (``format: pdd-profile/1``).

:func:`measure_profile` loads the configured checkpoint into the real ``pdd.engine.Engine``
with the topology's engine settings (dtype, device, torch threads, page size) and times single
forward steps formed by the engine's own scheduler:

- ``prefill``: one cold sequence of ``tokens`` prompt tokens (one step);
- ``decode``: ``batch`` sequences each at ``context`` tokens, one token each (mean of several steps);
- ``extend``: ``tokens`` new tokens over ``context`` cached ones (a handoff's extend, or a
  prefill chunk after the first).

The profile's format, its fit and the step model built on it are :mod:`pdd.step_profile`.
"""

from __future__ import annotations

import itertools
import statistics
import time

import numpy as np

from pdd.step_profile import FORMAT, fit_linear


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
