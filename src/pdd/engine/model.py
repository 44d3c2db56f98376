"""Llama-family decoder (llama, mistral, qwen2 q/k/v bias, qwen3 q/k norm) in plain torch,
loading HF-format safetensors. RoPE (incl. ``linear`` / ``dynamic`` / ``yarn`` / ``llama3``
scaling) is in :mod:`.rope`; sliding-window attention is applied by the attention backend.

The model knows nothing about pages: each layer hands its fresh q/k/v to an *attention
backend* (``runner.PagedAttention``) that stores K/V and attends over the cached context.
All token tensors are flattened over the batch: ``T`` = total new tokens in the batch.
"""

from __future__ import annotations

import glob
import os
from typing import Protocol

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from .config import ModelConfig, dtype_name
from .rope import Rotary


class AttentionBackend(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] (RoPE applied) -> attention output [T, H, D]."""
        ...


def torch_dtype(name) -> torch.dtype:
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype_name(name)]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same order of operations as HF LlamaRMSNorm (float32 statistics).
        dt = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dt)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` [..., D] with its first half negated: the form :func:`apply_rope` takes."""
    h = sin.shape[-1] // 2
    return torch.cat((-sin[..., :h], sin[..., h:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin`` (``rotate_half(x) = cat(-x2, x1)``) to the
    last bit: ``rotate_half(x) * sin == roll(x, D/2) * signed_sin(sin)``, negation being exact.
    One roll instead of two slices, a negation and a cat per call."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * sin_signed


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.h, self.kvh, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        b = cfg.attention_bias or cfg.qkv_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.h * self.d, bias=b)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kvh * self.d, bias=b)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kvh * self.d, bias=b)
        self.o_proj = nn.Linear(self.h * self.d, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x, cos, sin_signed, backend: AttentionBackend):
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.h, self.d)
        k = self.k_proj(x).view(t, self.kvh, self.d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin_signed), apply_rope(k, cos, sin_signed)
        v = self.v_proj(x).view(t, self.kvh, self.d)
        o = backend.attend(self.layer, q, k, v)
        return self.o_proj(o.reshape(t, self.h * self.d))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin_signed, backend):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin_signed, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Inner(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # given its (uninitialised) weight rather than drawing one: the model is only built on the meta
        # device (load_model), its weights then assigned from the checkpoint, and Embedding's normal_
        # there imports torch._dynamo (its meta decomposition), ~1.5 s of CPU in every engine's start
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaModel(nn.Module):
    """Decoder + LM head. Parameter names equal HF's (``model.layers.N...``, ``lm_head.weight``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = _Inner(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary: Rotary | None = None

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def _rope(self) -> Rotary:
        if self.rotary is None or self.rotary.inv_freq.device != self.device:
            self.rotary = Rotary(self.cfg.head_dim, self.cfg.rope_theta, self.device, self.cfg.rope_scaling,
                                 self.cfg.max_position_embeddings)
        return self.rotary

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
                      seq_lens: list[int] | None = None):
        """input_ids, positions: [T] int64 -> final hidden states before the last norm, [T, hidden].

        seq_lens: per token, its sequence's length at this call (last position of its chunk + 1);
        needed by ``dynamic`` rope scaling only (ValueError there when missing)."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self._rope().cos_sin(positions, x.dtype, seq_lens)
        sin = signed_sin(sin)  # once per call, for every layer's apply_rope
        for layer in self.model.layers:
            x = layer(x, cos, sin, backend)
        return x

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] in float32."""
        return self.lm_head(self.model.norm(hidden)).float()


def load_model(path: str, cfg: ModelConfig | None = None, dtype="float32", device="cpu") -> LlamaModel:
    """Load HF-format ``*.safetensors`` from ``path`` into a :class:`LlamaModel` (eval mode)."""
    cfg = cfg or ModelConfig.from_pretrained(path)
    dt = torch_dtype(dtype)
    with torch.device("meta"):
        model = LlamaModel(cfg)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    state: dict[str, torch.Tensor] = {}
    for fn in files:
        with safe_open(fn, framework="pt", device="cpu") as f:
            for k in f.keys():
                if k.endswith("rotary_emb.inv_freq"):
                    continue
                state[k] = f.get_tensor(k).to(dtype=dt)
    if cfg.tie_word_embeddings or "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    expected = set(model.state_dict().keys())
    missing = expected - set(state)
    unexpected = set(state) - expected
    if missing or unexpected:
        raise ValueError(f"checkpoint mismatch: missing={sorted(missing)[:5]} unexpected={sorted(unexpected)[:5]}")
    model.load_state_dict(state, assign=True)
    model = model.to(device=device, dtype=dt).eval()
    model.requires_grad_(False)
    return model
