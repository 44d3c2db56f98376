#!/usr/bin/env python3
"""Derive data/hardware/vidur/linear-ops.json from Vidur's published operator profiles.

Reads ``data/profiling/compute/<gpu>/<model>/mlp.csv`` from a local git copy of the Vidur
repository (``git show COMMIT:path``, no work tree needed) and keeps, for a few shapes and token
counts, the per-layer medians (milliseconds) of the operators Vidur's own step model sums for a
transformer block's non-attention part (QKV and output projections, RoPE, the two RMSNorms, the
gated MLP's up / act / down, the residual add). Where the CSV holds two rows for the same
(tokens, TP) the mean of their medians is kept.

    scripts/import_vidur_profiles.py --repo /path/to/vidur.git [--commit SHA] [--out FILE]

Only derived numbers are written (no Vidur code); attribution goes in data/hardware/vidur/README.md.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import subprocess
from pathlib import Path

OPS = ["input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
       "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add"]
TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
# (vidur gpu folder, pdd chip, HF model id, layers from the model's config.json, TP degree)
PROFILES = [
    ("a100", "A100-SXM4-80GB", "meta-llama/Meta-Llama-3-8B", 32, 1),
    ("h100", "H100-SXM5-80GB", "meta-llama/Llama-2-7b-hf", 32, 1),
    ("a100", "A100-SXM4-80GB", "meta-llama/Meta-Llama-3-70B", 80, 4),
    ("h100", "H100-SXM5-80GB", "meta-llama/Llama-2-70b-hf", 80, 4),
]


def _git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "-C", repo, *args], check=True, capture_output=True, text=True).stdout


def derive(repo: str, commit: str) -> dict:
    out = []
    for gpu, chip, model, layers, tp in PROFILES:
        path = f"data/profiling/compute/{gpu}/{model}/mlp.csv"
        rows = [r for r in csv.DictReader(io.StringIO(_git(repo, "show", f"{commit}:{path}")))
                if int(r["num_tensor_parallel_workers"]) == tp]
        first = rows[0]
        kept = []
        for n in TOKENS:
            same = [r for r in rows if int(r["num_tokens"]) == n]
            if not same:
                continue
            ops = {op: round(sum(float(r[f"time_stats.{op}.median"]) for r in same) / len(same), 4) for op in OPS}
            kept.append({"tokens": n, "ops_ms": ops})
        out.append({
            "gpu": gpu, "chip": chip, "model": model, "path": path, "tp": tp,
            "shape": {"layers": layers, "n_head": int(first["n_head"]), "n_kv_head": int(first["n_kv_head"]),
                      "n_embd": int(first["n_embd"]), "n_expanded_embd": int(first["n_expanded_embd"]),
                      "gated_mlp": first["use_gated_mlp"] == "True"},
            "rows": kept,
        })
    return {
        "format": "pdd-op-profile/1",
        "about": "Per-layer median operator times (ms, one GPU's shard at degree tp) of a transformer "
                 "block's non-attention part, derived from Vidur's profiling CSVs; see README.md.",
        "source": {"repository": "microsoft/vidur", "commit": commit, "licence": "MIT",
                   "copyright": "Copyright (c) Microsoft Corporation."},
        "ops": OPS,
        "profiles": out,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", required=True, help="a git copy of microsoft/vidur")
    ap.add_argument("--commit", default="HEAD")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "data/hardware/vidur/linear-ops.json"))
    a = ap.parse_args()
    commit = _git(a.repo, "rev-parse", a.commit).strip()
    Path(a.out).write_text(json.dumps(derive(a.repo, commit), indent=1) + "\n")
    print(f"wrote {a.out} from microsoft/vidur@{commit}")


if __name__ == "__main__":
    main()
