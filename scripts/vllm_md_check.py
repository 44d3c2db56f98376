"""Live check of ``PddConnector`` (docs/VLLM_TIER.md, "Results"): vLLM continues from KV that
pdd's engine computed, as MD does after a one-shot handoff.

For each prompt: pdd's engine (in process, page size 16, float32) prefills it and decodes
``--tokens`` greedy tokens (the single-engine oracle); the prompt's KV pages are staged as the MD
endpoint stages what P sent; then vLLM (``make vllm``'s venv, started here with the connector)
completes ``prompt + oracle[:k]`` (``k`` = the ids RLD would hand over) with
``kv_transfer_params`` naming the stage. vLLM's greedy tokens must equal ``oracle[k:]``.
Control: the same request with the staged KV zeroed (vLLM's prefix cache reset first) must
differ, or the check proves nothing about the load.

    PYTHONPATH=src .venv/bin/python scripts/vllm_md_check.py --model /tmp/pdd-vllm/small

Prints one JSON line per prompt and a summary line; exit 0 when every prompt matches and every
control differs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import torch


def oracle(model: str, prompts: list[list[int]], n: int):
    from pdd.engine.engine import Engine
    from pdd.types import SamplingParams

    torch.set_num_threads(1)
    eng = Engine.from_pretrained(model, num_pages=512, page_size=16)
    out = []
    for i, p in enumerate(prompts):
        s = eng.new_sequence(f"o{i}", p, SamplingParams(max_tokens=n, ignore_eos=True), use_cache=False)
        eng.add(s)
        while eng.has_work():
            eng.step()
        pages = eng.pool.buffer[eng.pool._index(s.page_table[: -(-len(p) // 16)])].clone()
        out.append((list(s.output_ids), pages))
        eng.release(s, cache=False)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=24, help="greedy tokens per prompt (pdd's oracle)")
    ap.add_argument("--handoff", type=int, default=5, help="ids RLD hands over (vLLM's prompt = prompt + these)")
    ap.add_argument("--log", default=None)
    a = ap.parse_args(argv)

    from pdd.vllm_tier.venv import free_port, vllm_python
    from pdd.config import ClusterConfig
    from pdd.vllm_tier.md import vllm_md_command, vllm_md_env
    from pdd.vllm_tier.staging import write_stage

    g = torch.Generator().manual_seed(7)
    lens = [40, 130, 300, 257, 77, 500, 16, 190][: a.prompts]
    prompts = [torch.randint(10, 4000, (n,), generator=g).tolist() for n in lens]
    t0 = time.perf_counter()
    ref = oracle(a.model, prompts, a.tokens)
    print(json.dumps({"oracle_s": round(time.perf_counter() - t0, 2)}), flush=True)

    cfg = ClusterConfig.model_validate({"model_path": a.model})
    port = free_port()
    cmd = vllm_md_command(vllm_python(), cfg, port, 2048, "float32")
    env = vllm_md_env(cfg, 1)
    env["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache for the control
    stage_dir = tempfile.mkdtemp(prefix="pdd-vllm-check-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    log_path = Path(a.log or Path(stage_dir) / "vllm.log")
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    ok = True
    try:
        while True:
            if proc.poll() is not None:
                print(log_path.read_text()[-3000:])
                raise SystemExit(f"vLLM exited with {proc.returncode}")
            try:
                if httpx.get(f"{url}/health", timeout=5, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > 400:
                raise SystemExit("vLLM not ready after 400 s")
            time.sleep(0.5)
        print(json.dumps({"vllm_ready_s": round(time.monotonic() - t0, 1), "command": cmd}), flush=True)
        c = httpx.Client(timeout=300, trust_env=False)
        k = a.handoff
        for i, (p, (outs, pages)) in enumerate(zip(prompts, ref)):
            res = {}
            for label, staged in (("staged", pages), ("zeroed", torch.zeros_like(pages))):
                c.post(f"{url}/reset_prefix_cache")
                st = write_stage(os.path.join(stage_dir, f"r{i}-{label}.kv"), staged, len(p))
                body = {"model": cfg.served_model_name, "prompt": p + outs[:k], "max_tokens": a.tokens - k,
                        "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                        "kv_transfer_params": st.params()}
                t1 = time.perf_counter()
                r = c.post(f"{url}/v1/completions", json=body)
                r.raise_for_status()
                j = r.json()
                res[label] = (j["choices"][0]["token_ids"], round((time.perf_counter() - t1) * 1000, 1),
                              (j.get("usage") or {}).get("prompt_tokens_details"))
            got, ms, det = res["staged"]
            same = got == outs[k:]
            control_differs = res["zeroed"][0] != outs[k:]
            first_div = next((j for j, (x, y) in enumerate(zip(got, outs[k:])) if x != y), None)
            ok = ok and same and control_differs
            print(json.dumps({"prompt_tokens": len(p), "handoff_ids": k, "equal_to_pdd": same,
                              "first_divergence": first_div, "control_zero_kv_differs": control_differs,
                              "ms": ms, "prompt_tokens_details": det}), flush=True)
        loaded = re.findall(r"pdd: loaded (\d+) staged tokens", log_path.read_text())
        print(json.dumps({"ok": ok, "connector_loads_logged": len(loaded),
                          "tokens_loaded": [int(x) for x in loaded], "vllm_log": str(log_path)}), flush=True)
    finally:
        import shutil
        import signal

        for f in Path(stage_dir).glob("*.kv"):
            f.unlink()
        if not any(Path(stage_dir).iterdir()):
            shutil.rmtree(stage_dir, ignore_errors=True)

        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except Exception:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
