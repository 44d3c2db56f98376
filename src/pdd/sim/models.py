"""Model profiles for the simulator (data, not code: data/hardware/models.json)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parents[3] / "data" / "hardware"


@dataclass(frozen=True)
class ModelProfile:
    name: str
    layers: int
    attn_dim: int  # query heads x head_dim
    kv_bytes_per_token: int
    weight_bytes: float
    flops_per_token: float  # 2 x active params per token (linear layers)
    max_context: int = 131072
    gpus_per_instance: int = 1
    source: str = ""

    def with_kv_bytes(self, kv_bytes_per_token: int) -> "ModelProfile":
        from dataclasses import replace

        return replace(self, kv_bytes_per_token=int(kv_bytes_per_token))


@lru_cache(maxsize=None)
def _load(path: str) -> dict:
    return json.loads(Path(path).read_text())


def load_models(path: str | Path | None = None) -> dict[str, ModelProfile]:
    data = _load(str(path or DATA_DIR / "models.json"))
    return {k: ModelProfile(name=k, **v) for k, v in data.items() if not k.startswith("_")}


def get_model(name: str, path: str | Path | None = None) -> ModelProfile:
    models = load_models(path)
    if name not in models:
        raise KeyError(f"unknown model {name!r}; known: {sorted(models)}")
    return models[name]
