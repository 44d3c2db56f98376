"""Model configuration read from an HF-format ``config.json`` (Llama family: llama, mistral,
qwen2, qwen3).

Only the fields the built-in engine needs are kept. ``kv_bytes_per_token`` is a model
property (MLA / hybrid models would override it), never a constant elsewhere. A config that
asks for something the engine does not compute (an unknown ``rope_scaling.rope_type``, MoE,
MLA, another activation, ...) is refused at load with :class:`UnsupportedModelConfig`, whose
message names the config.json field; a malformed one with ``ValueError`` naming the field.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "dynamic", "linear", "llama3", "yarn")

# Fields whose presence (with a truthy value) means an architecture the engine does not compute.
_UNSUPPORTED_FIELDS = {
    "num_experts": "mixture-of-experts", "num_local_experts": "mixture-of-experts",
    "n_routed_experts": "mixture-of-experts", "moe_intermediate_size": "mixture-of-experts",
    "num_experts_per_tok": "mixture-of-experts",
    "kv_lora_rank": "multi-head latent attention (MLA)", "q_lora_rank": "multi-head latent attention (MLA)",
    "use_mrope": "multimodal RoPE", "mlp_bias": "MLP biases",
}
# Keys each rope type needs (besides rope_type), and the ones it may have.
_ROPE_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
                  "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
_ROPE_OPTIONAL = {"default": (), "linear": (), "dynamic": (), "llama3": ("original_max_position_embeddings",),
                  "yarn": ("original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
                           "mscale", "mscale_all_dim", "truncate")}


class UnsupportedModelConfig(NotImplementedError):
    """A config.json feature the engine does not implement; the message names the field."""


def _rope_scaling(d: dict, max_pos: int) -> tuple[float, dict | None]:
    """(rope_theta, normalised scaling dict or None for plain RoPE) from ``rope_scaling`` (HF
    4.x configs; legacy key ``type``) or ``rope_parameters`` (HF 5.x), as transformers'
    ``standardize_rope_params`` reads them."""
    key = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
    rp = d.get(key) or {}
    if not isinstance(rp, dict):
        raise ValueError(f"config.json {key}: expected an object, got {rp!r}")
    theta = d.get("rope_theta")
    if theta is None:
        theta = rp.get("rope_theta", 10000.0)
    rtype = rp.get("rope_type", rp.get("type", "default")) if rp else "default"
    if rtype not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelConfig(f"config.json {key}.rope_type={rtype!r} is not supported "
                                     f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    prf = rp.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if prf not in (None, 1, 1.0):
        raise UnsupportedModelConfig(f"config.json partial_rotary_factor={prf!r} is not supported (only 1.0)")
    if rtype == "default":
        return float(theta), None
    out: dict = {"rope_type": rtype}
    if rtype == "yarn" and rp.get("factor") is None and rp.get("original_max_position_embeddings"):
        rp = {**rp, "factor": max_pos / rp["original_max_position_embeddings"]}  # transformers' fallback
    for k in _ROPE_REQUIRED[rtype]:
        if rp.get(k) is None:
            raise ValueError(f"config.json {key}.{k}: required by rope_type {rtype!r}")
    for k in _ROPE_REQUIRED[rtype] + _ROPE_OPTIONAL[rtype]:
        if rp.get(k) is not None:
            out[k] = rp[k]
    for k in [k for k in out if k not in ("rope_type", "truncate", "original_max_position_embeddings")]:
        if isinstance(out[k], bool) or not isinstance(out[k], (int, float)):
            raise ValueError(f"config.json {key}.{k}: expected a number, got {out[k]!r}")
        out[k] = float(out[k])
    if out["factor"] < 1.0:
        raise ValueError(f"config.json {key}.factor: must be >= 1, got {out['factor']}")
    if rtype in ("yarn", "llama3"):  # transformers: a top-level original_max_position_embeddings wins, else max_pos
        orig = d.get("original_max_position_embeddings") or out.get("original_max_position_embeddings") or max_pos
        out["original_max_position_embeddings"] = orig
    if "original_max_position_embeddings" in out:
        o = out["original_max_position_embeddings"]
        if isinstance(o, bool) or not isinstance(o, int) or o < 1:
            raise ValueError(f"config.json {key}.original_max_position_embeddings: expected a positive integer, "
                             f"got {o!r}")
    if rtype == "llama3" and out["high_freq_factor"] <= out["low_freq_factor"]:
        raise ValueError(f"config.json {key}.high_freq_factor: must exceed low_freq_factor")
    return float(theta), out


def _sliding(d: dict, mt: str, layers: int) -> tuple[int | None, list[int]]:
    """(window, layers that use it) as transformers' Mistral (every layer) / Qwen2 / Qwen3
    (``use_sliding_window``: layers from ``max_window_layers`` on, or ``layer_types``) do."""
    w = d.get("sliding_window")
    if mt == "llama" or w is None:
        return None, []
    if mt in ("qwen2", "qwen3") and not d.get("use_sliding_window"):
        return None, []
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        raise ValueError(f"config.json sliding_window: expected a positive integer or null, got {w!r}")
    types = d.get("layer_types")
    if types is not None and mt != "mistral":
        bad = sorted(set(types) - {"full_attention", "sliding_attention"})
        if bad:
            raise UnsupportedModelConfig(f"config.json layer_types: {bad} not supported "
                                         f"(full_attention, sliding_attention)")
        if len(types) != layers:
            raise ValueError(f"config.json layer_types: {len(types)} entries for {layers} layers")
        return w, [i for i, t in enumerate(types) if t == "sliding_attention"]
    if mt == "mistral":
        return w, list(range(layers))
    start = int(d.get("max_window_layers", layers))
    return w, [i for i in range(layers) if i >= start]

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


# config.json's size fields: each a positive integer; the optional ones may be left out (or null)
_REQUIRED_SIZES = ("num_attention_heads", "hidden_size", "vocab_size", "intermediate_size", "num_hidden_layers")
_OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings")


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
    # RoPE scaling, normalised: None (plain RoPE) or {"rope_type": "linear" | "dynamic" | "yarn" |
    # "llama3", "factor": float, ...the type's own keys (see engine/rope.py)}
    rope_scaling: dict | None = None
    sliding_window: int | None = None  # tokens a query sees (itself included) on sliding_window_layers
    sliding_window_layers: list[int] = field(default_factory=list)
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
        mt = str(d.get("model_type", "llama"))
        if mt not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelConfig(f"config.json model_type={mt!r} is not supported "
                                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        for k, what in _UNSUPPORTED_FIELDS.items():
            if d.get(k):
                raise UnsupportedModelConfig(f"config.json {k}={d[k]!r}: {what} is not supported")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelConfig(f"config.json hidden_act={act!r} is not supported (only silu)")
        for k in _REQUIRED_SIZES:
            if k not in d:
                raise ValueError(f"config.json {k}: missing")
        for k in _REQUIRED_SIZES + _OPTIONAL_SIZES:  # a string or a negative size was int()'s or torch's traceback
            v = d.get(k)
            if v is None and k in _OPTIONAL_SIZES:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"config.json {k}: expected a positive integer, got {v!r}")
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        layers = int(d["num_hidden_layers"])
        kv_heads = int(d.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"config.json num_key_value_heads: {kv_heads} does not divide num_attention_heads {heads}")
        if not d.get("head_dim") and hidden % heads:
            raise ValueError(f"config.json hidden_size: {hidden} is not a multiple of num_attention_heads {heads} "
                             "(give head_dim)")
        max_pos = int(d.get("max_position_embeddings", 4096))
        rope_theta, scaling = _rope_scaling(d, max_pos)
        window, window_layers = _sliding(d, mt, layers)
        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            max_position_embeddings=max_pos,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)) and mt != "qwen2",
            qkv_bias=mt == "qwen2",
            qk_norm=mt == "qwen3",
            rope_scaling=scaling,
            sliding_window=window,
            sliding_window_layers=window_layers,
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
