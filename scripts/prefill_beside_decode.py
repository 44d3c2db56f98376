"""Does a decode loop beside P slow P's prefill step on this machine? (docs/SIM.md "Prefill beside decoding")

    python scripts/prefill_beside_decode.py --model models/small --seconds 15

P: the engine with the embedded topology's settings (fp32, 16-token pages, one torch thread)
prefills 1,500-token prompts in 512-token chunks, each step timed. Beside it, in a second
process, an MD-like engine decodes a batch of 4 sequences at 1,500 tokens of context without a
pause, with each of: nothing, fp32 / bf16 KV, 16- / 32-token pages. Each setting runs twice, in
the order A..E E..A, and the pooled median and mean of P's step are printed per setting.
Bare engines only: no sockets, no transfers, no gateway.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

REFILL_STEPS = 200  # decode steps before the loop's sequences are replaced (context stays near 1,500)


def engine(model: str, dtype: str, page: int):
    import torch

    from pdd.engine.engine import Engine

    torch.set_num_threads(1)
    return Engine.from_pretrained(model, num_pages=2048, page_size=page, dtype=dtype, device="cpu",
                                  max_batch_tokens=512, prefill_chunk_tokens=512, max_running=64,
                                  enable_prefix_cache=False)


def decode_loop(model: str, dtype: str, page: int, batch: int, ctx: int, stop: str) -> None:
    """Decode ``batch`` sequences of ``ctx`` prompt tokens until the file ``stop`` exists (fresh
    sequences every 200 steps, so the context stays near ``ctx``); prints ``ready`` once
    prefilled, then its step count."""
    from pdd.types import SamplingParams

    eng = engine(model, dtype, page)
    rng, ids, vocab = np.random.default_rng(1), itertools.count(), eng.model_cfg.vocab_size
    # every sequence decodes until its refill (the default max_tokens, 16, had them finish after
    # 16 of every 200 steps, so the loop mostly stepped an empty batch)
    sampling = SamplingParams(max_tokens=2 * REFILL_STEPS, ignore_eos=True)  # a later-prefilled one starts decoding later

    def fill():
        seqs = []
        for _ in range(batch):
            s = eng.new_sequence(("md", next(ids)), [int(x) for x in rng.integers(2, vocab, ctx)], sampling,
                                 use_cache=False)
            eng.add(s)
            seqs.append(s)
        while any(x.num_computed < x.prompt_len for x in seqs):
            eng.step()
        return seqs

    seqs = fill()
    print("ready", flush=True)
    n, busy = 0, 0.0
    while not os.path.exists(stop):
        t0 = time.perf_counter()
        eng.step()
        busy += time.perf_counter() - t0
        n += 1
        assert not any(x.is_finished for x in seqs), "a decode sequence finished before its refill"
        if n % REFILL_STEPS == 0:
            for s in seqs:
                eng.release(s, cache=False)
            seqs = fill()  # its prefill steps are not counted
    print(f"decode steps {n}, {busy / max(n, 1) * 1e3:.2f} ms each", flush=True)


def prefill_steps(model: str, seconds: float, prompt: int = 1500) -> list[float]:
    """P's step times (seconds) over ``seconds`` of back-to-back prefills (two warm-up prompts)."""
    eng = engine(model, "float32", 16)
    rng, ids, vocab = np.random.default_rng(0), itertools.count(), eng.model_cfg.vocab_size
    ts, warm, t_end = [], 2, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        s = eng.new_sequence(("p", next(ids)), [int(x) for x in rng.integers(2, vocab, prompt)], use_cache=False)
        eng.add(s)
        while s.num_computed < s.prompt_len:
            t0 = time.perf_counter()
            eng.step()
            if warm <= 0:
                ts.append(time.perf_counter() - t0)
        warm -= 1
        eng.release(s, cache=False)
    return ts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/small", help="checkpoint directory (pdd make-model)")
    ap.add_argument("--seconds", type=float, default=15.0, help="P's prefill loop per setting")
    ap.add_argument("--batch", type=int, default=4, help="sequences the decode loop holds")
    ap.add_argument("--decode-loop", nargs=3, metavar=("DTYPE", "PAGE", "STOP"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.decode_loop:
        decode_loop(a.model, a.decode_loop[0], int(a.decode_loop[1]), a.batch, 1500, a.decode_loop[2])
        return 0
    if not a.seconds > 0:
        ap.error(f"--seconds must be > 0, got {a.seconds}")
    if a.batch < 1:
        ap.error(f"--batch must be >= 1, got {a.batch}")
    cfg = os.path.join(a.model, "config.json")
    if not os.path.isfile(cfg):
        ap.error(f"--model {a.model}: no checkpoint's config.json in it (make one with: pdd make-model --out DIR)")
    try:
        with open(cfg) as f:
            json.load(f)
    except (OSError, ValueError) as e:
        ap.error(f"--model {a.model}: cannot read config.json ({e})")
    settings = [None, ("float32", 16), ("bfloat16", 16), ("float32", 32), ("bfloat16", 32)]
    pooled: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k, c in enumerate(settings + settings[::-1]):
            stop = os.path.join(tmp, f"stop{k}")
            proc, note = None, ""
            if c:
                proc = subprocess.Popen([sys.executable, __file__, "--model", a.model, "--batch", str(a.batch),
                                         "--decode-loop", c[0], str(c[1]), stop], stdout=subprocess.PIPE, text=True)
                if proc.stdout.readline().strip() != "ready":
                    proc.kill()
                    sys.exit(f"the decode loop ({c}) did not start")
            ts = prefill_steps(a.model, a.seconds)
            if proc:
                open(stop, "w").close()
                note = proc.stdout.read().strip()
                proc.wait()
            pooled.setdefault(c, []).extend(ts)
            print(f"beside {c or 'nothing'}: P step median {statistics.median(ts) * 1e3:.1f} ms (n={len(ts)}) {note}",
                  flush=True)
    print("pooled:")
    for c, ts in pooled.items():
        print(f"  beside {c or 'nothing'}: P step median {statistics.median(ts) * 1e3:.1f} ms, "
              f"mean {statistics.mean(ts) * 1e3:.1f} ms (n={len(ts)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
