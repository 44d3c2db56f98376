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


def load_profiles(path: str | Path | None, default_file: str, cls) -> dict:
    """``{name: cls(name=name, **fields)}`` of a JSON profile table at ``path`` (default
    ``DATA_DIR / default_file``; keys starting with ``_`` are comments); read once per path."""
    data = _load(str(path or DATA_DIR / default_file))
    return {k: cls(name=k, **v) for k, v in data.items() if not k.startswith("_")}


def pick(table: dict, kind: str, name: str):
    """``table[name]``; KeyError naming the ``kind`` and the known names otherwise."""
    if name not in table:
        raise KeyError(f"unknown {kind} {name!r}; known: {sorted(table)}")
    return table[name]


def load_models(path: str | Path | None = None) -> dict[str, ModelProfile]:
    return load_profiles(path, "models.json", ModelProfile)


def get_model(name: str, path: str | Path | None = None) -> ModelProfile:
    return pick(load_models(path), "model", name)
