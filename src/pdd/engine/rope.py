"""Rotary position embedding (RoPE) frequencies for the rope types of real Llama / Qwen / Mistral
configs: ``default``, ``linear``, ``dynamic`` (NTK), ``yarn`` and ``llama3``.

Each formula is the one of ``transformers/modeling_rope_utils.py`` (transformers 5.x:
``_compute_linear_scaling_rope_parameters``, ``_compute_dynamic_ntk_parameters``,
``_compute_yarn_parameters``, ``_compute_llama3_parameters``; ``dynamic_rope_update`` for when
the dynamic frequencies change), written with the same float32 operations in the same order
so cos / sin agree with transformers to the last bit on CPU. ``params`` is the normalised
``ModelConfig.rope_scaling`` dict (see :meth:`pdd.engine.config.ModelConfig.from_dict`).
"""

from __future__ import annotations

import math

import torch


def _base_inv_freq(theta: float, dim: int, device) -> torch.Tensor:
    """[dim // 2] float32: ``1 / theta ** (2i / dim)``."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))


def _linear(theta, dim, p, device):
    # modeling_rope_utils._compute_linear_scaling_rope_parameters: positions / factor == inv_freq / factor
    inv = _base_inv_freq(theta, dim, device)
    inv /= p["factor"]
    return inv, 1.0


def _llama3(theta, dim, p, device):
    # modeling_rope_utils._compute_llama3_parameters (Llama 3.1 / 3.2)
    inv_freq = _base_inv_freq(theta, dim, device)
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_ctx = p["original_max_position_embeddings"]
    low_freq_wavelen = old_ctx / low
    high_freq_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama), 1.0


def yarn_attention_factor(p: dict) -> float:
    """YaRN's cos / sin multiplier (``attention_factor``; from ``factor``, ``mscale`` and
    ``mscale_all_dim`` when not given), as modeling_rope_utils._compute_yarn_parameters."""
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])

    def get_mscale(scale, mscale=1):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    factor, mscale, mscale_all_dim = p["factor"], p.get("mscale"), p.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
    return get_mscale(factor)


def _yarn(theta, dim, p, device):
    # modeling_rope_utils._compute_yarn_parameters
    factor = p["factor"]
    orig = p["original_max_position_embeddings"]
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def find_correction_dim(num_rotations):
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = find_correction_dim(beta_fast), find_correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers: prevent singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1).to(device)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    inv_extrapolation = 1.0 / pos_freqs
    inv_interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv = inv_interpolation * (1 - extrapolation_factor) + inv_extrapolation * extrapolation_factor
    return inv, yarn_attention_factor(p)


def dynamic_inv_freq(theta: float, dim: int, factor: float, max_pos: int, seq_len: int, device) -> torch.Tensor:
    """Dynamic-NTK frequencies for a sequence of ``seq_len`` tokens
    (modeling_rope_utils._compute_dynamic_ntk_parameters; the base grows once ``seq_len``
    exceeds ``max_position_embeddings``, below it the frequencies are the default ones)."""
    seq = torch.maximum(torch.tensor(seq_len), torch.tensor(max_pos))
    base = theta * ((factor * seq / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim))


_STATIC = {"linear": _linear, "llama3": _llama3, "yarn": _yarn}


class Rotary:
    """RoPE for one model: rotate-half layout, cos / sin computed in float32, multiplied by the
    rope type's attention factor (YaRN), then cast to the activation dtype, as transformers.

    ``dynamic`` scaling depends on the sequence length: each token is rotated with the
    frequencies of ``seq_len`` = its sequence's length at the forward call that computes it
    (the last position of the chunk + 1), which is what transformers' ``dynamic_rope_update``
    does for one sequence generated token by token (cached keys keep the rotation they were
    written with).
    """

    def __init__(self, head_dim: int, theta: float, device, scaling: dict | None = None,
                 max_position_embeddings: int = 4096):
        self.dim, self.theta, self.device = head_dim, theta, device
        self.scaling = scaling or {}
        self.rope_type = self.scaling.get("rope_type", "default")
        self.max_pos = max_position_embeddings
        self.attention_factor = 1.0
        if self.rope_type in _STATIC:
            self.inv_freq, self.attention_factor = _STATIC[self.rope_type](theta, head_dim, self.scaling, device)
        else:  # default, and dynamic below max_position_embeddings
            self.inv_freq = _base_inv_freq(theta, head_dim, device)
        self._dynamic: dict[int, torch.Tensor] = {}

    def _inv_freq_for(self, seq_len: int) -> torch.Tensor:
        if seq_len <= self.max_pos:
            return self.inv_freq
        inv = self._dynamic.get(seq_len)
        if inv is None:
            inv = dynamic_inv_freq(self.theta, self.dim, self.scaling["factor"], self.max_pos, seq_len, self.device)
            if len(self._dynamic) > 4096:
                self._dynamic.clear()
            self._dynamic[seq_len] = inv
        return inv

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype,
                seq_lens: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64 -> cos, sin: [T, 1, D].

        seq_lens: one int per token (its sequence's length at this call); used by ``dynamic``
        only, required there."""
        if self.rope_type == "dynamic":
            if seq_lens is None or len(seq_lens) != positions.shape[0]:
                raise ValueError("dynamic rope scaling needs one seq_len per token")
            if max(seq_lens) <= self.max_pos:
                inv = self.inv_freq[None, :]
            else:
                rows = {n: self._inv_freq_for(n) for n in set(seq_lens)}
                inv = torch.stack([rows[n] for n in seq_lens])  # [T, D/2]
            freqs = positions.float()[:, None] * inv
        else:
            freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]
