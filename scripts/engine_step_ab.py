"""Engine step time, this checkout against a baseline commit, side by side in one process.

The baseline's ``src/pdd/engine`` (``git show REF:...``) is loaded as a package of its own
(``pdd_engine_base``; it shares this checkout's ``pdd.types``), and for every shape both engines
get the same checkpoint, settings and prompts. Their steps are then timed alternately (A B, B A,
...) so that a loaded machine slows both alike, on the thread's CPU clock (``--wall``: the wall clock),
so that time slices lost to other processes do not count; the ratio printed is median(base) /
median(new) step seconds (above 1: this checkout is faster). Every step's sampled tokens must be equal in the
two engines (greedy), else the script stops with the first difference; the last column is the
largest difference between the two engines' logits in one more (untimed) step.

Shapes: ``decode:B:C``: B sequences of C prompt tokens, prefilled untimed, then decode steps of
one token each; ``ragged:B:C``: the same with prompts of C/16 to C tokens; ``prefill:B:C``: one step computing B fresh prompts of C tokens (released after);
``mixed:B:C``: the decode steps of ``decode:B:C``, each beside the prefill of a fresh 128-token
prompt (released after its step); ``chunked:B:C``: B prompts of C tokens prefilled in chunks of
512 tokens (the config's default ``max_batch_tokens`` and ``prefill_chunk_tokens``): every
chunk's step is timed, the later ones extends over the cached chunks.

    PYTHONPATH=src python scripts/engine_step_ab.py --base main --model small --reps 30
    PYTHONPATH=src python scripts/engine_step_ab.py --base main --shapes decode:32:2048,prefill:1:512
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

DEFAULT_SHAPES = ("decode:1:64,decode:8:512,decode:32:512,decode:32:2048,mixed:8:512,"
                  "prefill:1:64,prefill:1:512,prefill:8:256,chunked:1:2048")
MIXED_PROMPT = 128
CLOCK = time.thread_time  # CPU seconds of this thread: time slices lost to other processes do not count
CHUNK = 512


def load_base_engine(ref: str, repo: str) -> object:
    """Import ``src/pdd/engine`` of commit ``ref`` as package ``pdd_engine_base``; returns its
    ``engine`` module."""
    out = tempfile.mkdtemp(prefix="pdd_engine_base_")
    pkg = os.path.join(out, "pdd_engine_base")
    os.makedirs(pkg)
    names = subprocess.run(["git", "-C", repo, "ls-tree", "--name-only", f"{ref}:src/pdd/engine"],
                           check=True, capture_output=True, text=True).stdout.split()
    for name in names:
        if name.endswith(".py"):
            src = subprocess.run(["git", "-C", repo, "show", f"{ref}:src/pdd/engine/{name}"],
                                 check=True, capture_output=True, text=True).stdout
            with open(os.path.join(pkg, name), "w") as f:
                f.write(src)
    sys.path.insert(0, out)
    return importlib.import_module("pdd_engine_base.engine")


def make_checkpoint(preset: str, family: str) -> str:
    from pdd.modelgen import make_model

    return make_model(os.path.join(tempfile.mkdtemp(prefix="pdd_ab_"), preset), preset=preset, seed=0,
                      family=family)


class Pair:
    """The baseline and the new engine on one checkpoint, fed the same prompts."""

    def __init__(self, base_mod, new_mod, path: str, b: int, c: int, page_size: int, dtype: str,
                 chunk: int | None = None):
        kw = dict(num_pages=2 * b * (c // page_size + 8) + 64, page_size=page_size, dtype=dtype,
                  max_batch_tokens=chunk or max(b * c, b, 2048), prefill_chunk_tokens=chunk or max(c, 1),
                  max_running=max(b, 1), enable_prefix_cache=False)
        self.engines = [base_mod.Engine.from_pretrained(path, **kw), new_mod.Engine.from_pretrained(path, **kw)]
        self.rng = np.random.default_rng(0)
        self.ids = itertools.count()
        self.vocab = self.engines[1].model_cfg.vocab_size

    def add(self, b: int, c: int, ragged: bool = False) -> list:
        """b fresh prompts of c tokens (``ragged``: of c/16 to c tokens, evenly spread), added to
        both engines; returns [(seq_a, seq_b)]."""
        from pdd.types import SamplingParams

        sp = SamplingParams(max_tokens=1 << 30, ignore_eos=True)
        out = []
        for i in range(b):
            n = c // 16 + (c - c // 16) * i // max(1, b - 1) if ragged else c
            prompt = [int(x) for x in self.rng.integers(2, self.vocab, n)]
            sid = next(self.ids)
            pair = tuple(e.new_sequence(sid, prompt, sp, use_cache=False) for e in self.engines)
            for e, s in zip(self.engines, pair):
                e.add(s)
            out.append(pair)
        return out

    def timed_steps(self, k: int, times: list[list[float]]) -> None:
        """One step of each engine, the one going first alternating with ``k``; the sampled
        tokens must agree."""
        order = (0, 1) if k % 2 == 0 else (1, 0)
        events = [None, None]
        for i in order:
            t0 = CLOCK()
            events[i] = self.engines[i].step()
            times[i].append(CLOCK() - t0)
        got = [[(ev.seq_id, ev.token_id) for ev in evs] for evs in events]
        if got[0] != got[1]:
            raise SystemExit(f"tokens differ: base {got[0][:8]} new {got[1][:8]}")

    def logits_diff(self) -> float:
        """More steps of each engine (untimed), up to one that samples, keeping its logits rows:
        the largest absolute difference between the two engines' rows."""
        for e in self.engines:
            e.keep_logits, e.last_logits = True, {}
        while not self.engines[0].last_logits:  # a prefill in chunks samples after its last
            self.timed_steps(0, [[], []])
        a, b = (e.last_logits for e in self.engines)
        for e in self.engines:
            e.keep_logits = False
        return max(float((a[k] - b[k]).abs().max()) for k in a)

    def release(self, seqs) -> None:
        for pair in seqs:
            for e, s in zip(self.engines, pair):
                if s.seq_id in e.seqs:
                    e.remove(s.seq_id)
                e.release(s, cache=False)


def run_shape(base_mod, new_mod, path, kind, b, c, reps, page_size, dtype) -> tuple[float, float, float, float]:
    """(base median step s, new median step s, their ratio, max logit difference) of one shape."""
    pair = Pair(base_mod, new_mod, path, b + 1, c, page_size, dtype, CHUNK if kind == "chunked" else None)
    times: list[list[float]] = [[], []]
    if kind in ("decode", "mixed", "ragged"):
        seqs = pair.add(b, c, ragged=kind == "ragged")
        while any(s.num_computed < s.prompt_len for s, _ in seqs):
            pair.timed_steps(0, [[], []])
        for k in range(reps + 3):  # 3 warm-up steps
            fresh = pair.add(1, MIXED_PROMPT) if kind == "mixed" else []
            pair.timed_steps(k, times if k >= 3 else [[], []])
            pair.release(fresh)
    elif kind == "chunked":
        k = 0
        while len(times[0]) < reps:
            seqs = pair.add(b, c)
            while any(s.num_computed < s.prompt_len for s, _ in seqs):
                pair.timed_steps(k, times if k >= 2 else [[], []])
                k += 1
            pair.release(seqs)
        seqs = pair.add(b, c)
    else:
        for k in range(reps + 2):
            seqs = pair.add(b, c)
            pair.timed_steps(k, times if k >= 2 else [[], []])
            pair.release(seqs)
        seqs = pair.add(b, c)
    diff = pair.logits_diff()
    pair.release(seqs)
    base, new = statistics.median(times[0]), statistics.median(times[1])
    return base, new, base / new, diff


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="main", help="git ref of the baseline engine (default main)")
    ap.add_argument("--model", default="tiny,small", help="presets of pdd make-model, comma-separated")
    ap.add_argument("--family", default="llama")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="kind:B:C,... (kind decode or prefill)")
    ap.add_argument("--reps", type=int, default=20, help="timed steps per engine and shape")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the config's torch_threads default)")
    ap.add_argument("--wall", action="store_true", help="time steps on the wall clock (needed with --threads > 1 "
                    "or on CUDA, whose work is not on this thread's CPU clock)")
    a = ap.parse_args(argv)
    if a.wall:
        global CLOCK
        CLOCK = time.perf_counter
    torch.set_num_threads(a.threads)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base_mod = load_base_engine(a.base, repo)
    new_mod = importlib.import_module("pdd.engine.engine")
    print(f"base {a.base} vs this checkout; {a.reps} steps each, alternated, {'wall' if a.wall else 'thread CPU'} "
          f"clock; dtype {a.dtype}, "
          f"page size {a.page_size}, {a.threads} torch thread(s)")
    print(f"{'model':6} {'shape':>16} {'base ms':>9} {'new ms':>9} {'base/new':>9} {'max |dlogit|':>10}")
    for preset in a.model.split(","):
        path = make_checkpoint(preset, a.family)
        for shape in a.shapes.split(","):
            kind, b, c = shape.split(":")
            base, new, ratio, diff = run_shape(base_mod, new_mod, path, kind, int(b), int(c), a.reps, a.page_size, a.dtype)
            print(f"{preset:6} {shape:>16} {base * 1e3:9.2f} {new * 1e3:9.2f} {ratio:9.2f} {diff:10.2g}", flush=True)


if __name__ == "__main__":
    main()
