"""Greedy agreement across mixed KV dtypes (docs/ARCHITECTURE.md "OpenAI API contract").

Starts a ``cross_dc_pd`` topology whose MD runs another dtype than P (``--md-dtype``, P fp32),
sends ``--prompts`` seeded random prompts (greedy, ``--max-tokens`` each, EOS ignored) and compares
each output with two single in-process engines: one in P's dtype (fp32) and one in MD's. Prints
JSON: per reference, outputs identical, and the mean share of tokens before the first divergence.

    python scripts/hetero_agreement.py --model models/small --md-dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile

import torch

from pdd.config import ClusterConfig
from pdd.engine.engine import Engine
from pdd.faults import StreamClient
from pdd.launch import Topology
from pdd.topology import free_port_block
from pdd.types import SamplingParams


def oracle(model: str, dtype: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    eng = Engine.from_pretrained(model, num_pages=2048, page_size=16, dtype=dtype)
    outs = []
    for i, p in enumerate(prompts):
        s = eng.new_sequence(f"r{i}", p, SamplingParams(max_tokens=n, ignore_eos=True), use_cache=False)
        eng.add(s)
        while eng.has_work():
            eng.step()
        outs.append(list(s.output_ids))
        eng.release(s, cache=False)
    return outs


def agreement(got: list[list[int]], ref: list[list[int]]) -> dict:
    def prefix(a, b):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        return k

    shares = [prefix(g, r) / len(r) for g, r in zip(got, ref)]
    return {"identical": sum(g == r for g, r in zip(got, ref)), "compared": len(ref),
            "mean_share_before_divergence": round(sum(shares) / len(shares), 4)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/small")
    ap.add_argument("--md-dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--md-page-size", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(a.seed)
    prompts = [[rng.randrange(5, 4000) for _ in range(rng.randrange(8, 400))] for _ in range(a.prompts)]
    base = free_port_block()
    cfg = ClusterConfig.model_validate({
        "mode": "cross_dc_pd", "model_path": a.model, "base_port": base, "gateway_port": base + 95,
        "engine": {"page_size": 16}, "security": {"tls": False},
        "tiers": {"main_decode": {"engine": {"dtype": a.md_dtype, "page_size": a.md_page_size}}}})
    got = []
    with Topology(cfg, log_dir=tempfile.mkdtemp(prefix="pdd-agree-")) as topo:
        for p in prompts:
            c = StreamClient(topo.url, {"model": cfg.served_model_name, "prompt": p, "max_tokens": a.max_tokens,
                                        "temperature": 0, "ignore_eos": True}).start()
            if not c.wait(120) or c.error is not None:
                raise SystemExit(f"request failed: {c.error}")
            got.append(c.tokens)
        topo.wait_idle(timeout_s=30)
        st = topo.stats()
        leaked = topo.flush()["leaked_pages"]
    ref32 = oracle(a.model, "float32", prompts, a.max_tokens)
    ref_md = oracle(a.model, a.md_dtype, prompts, a.max_tokens)
    print(json.dumps({"md_dtype": a.md_dtype, "md_page_size": a.md_page_size, "prompts": a.prompts,
                      "max_tokens": a.max_tokens, "leaked_pages": leaked,
                      "wan_bytes": st["wan_bytes"], "wan_bytes_expected": st["wan_bytes_expected"],
                      "first_token_equal_fp32": sum(g[0] == r[0] for g, r in zip(got, ref32)),
                      "vs_float32_engine": agreement(got, ref32),
                      f"vs_{a.md_dtype}_engine": agreement(got, ref_md)}, indent=1))

if __name__ == "__main__":
    main()
