"""Model configuration read from an HF-format ``config.json`` (Llama family: llama, qwen2, qwen3).

Only the fields the built-in engine needs are kept. ``kv_bytes_per_token`` is a model
property (MLA / hybrid models would override it), never a constant elsewhere.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def dtype_name(dtype) -> str:
    """Normalise a dtype given as a string ("bf16", "float32") or a ``torch.dtype`` to a name."""
    s = str(dtype).replace("torch.", "")
    aliases = {"fp32": "float32", "f32": "float32", "fp16": "float16", "half": "float16",
               "bf16": "bfloat16", "float": "float32"}
    s = aliases.get(s, s)
    if s not in _DTYPE_BYTES:
        raise ValueError(f"unsupported dtype {dtype!r}")
    return s


def dtype_bytes(dtype) -> int:
    """Bytes per element of a dtype name or ``torch.dtype``."""
    return _DTYPE_BYTES[dtype_name(dtype)]


@dataclass
class ModelConfig:
    """Shape of a Llama-family decoder (HF names)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q, k, v and o projections (llama / qwen3 option)
    qkv_bias: bool = False  # bias on q, k, v only (qwen2)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (qwen3)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    model_type: str = "llama"
    torch_dtype: str = "float32"
    name: str = ""

    # -- derived -------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        return self.num_key_value_heads

    @property
    def num_heads(self) -> int:
        return self.num_attention_heads

    def kv_bytes_per_token(self, dtype="float32") -> int:
        """KV bytes one token occupies: 2 (K and V) x layers x kv_heads x head_dim x elem bytes."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes(dtype)

    def to_dict(self) -> dict:
        return asdict(self)

    # -- loading -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict, name: str = "") -> "ModelConfig":
        """Build from an HF config dict (``LlamaForCausalLM`` and compatible)."""
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        rope_theta = d.get("rope_theta")
        rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if rope_theta is None:
            rope_theta = rp.get("rope_theta", 10000.0)
        rtype = rp.get("rope_type", rp.get("type", "default")) if rp else "default"
        if rtype not in ("default", None):
            raise NotImplementedError(f"rope scaling {rtype!r} not supported")
        mt = str(d.get("model_type", "llama"))
        if mt not in SUPPORTED_MODEL_TYPES:
            raise NotImplementedError(f"model_type {mt!r} not supported ({', '.join(SUPPORTED_MODEL_TYPES)})")
        if d.get("use_sliding_window"):
            raise NotImplementedError("sliding-window attention not supported")
        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)) and mt != "qwen2",
            qkv_bias=mt == "qwen2",
            qk_norm=mt == "qwen3",
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            model_type=mt,
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
            name=name or str(d.get("_name_or_path", "")),
        )

    @classmethod
    def from_pretrained(cls, path: str) -> "ModelConfig":
        """Read ``path/config.json``; eos ids are merged from ``generation_config.json`` if present."""
        with open(os.path.join(path, "config.json")) as f:
            d = json.load(f)
        cfg = cls.from_dict(d, name=os.path.basename(os.path.normpath(path)))
        gpath = os.path.join(path, "generation_config.json")
        if os.path.exists(gpath):
            with open(gpath) as f:
                g = json.load(f)
            eos = g.get("eos_token_id")
            if eos is not None:
                for e in [eos] if isinstance(eos, int) else eos:
                    if int(e) not in cfg.eos_token_ids:
                        cfg.eos_token_ids.append(int(e))
        return cfg
