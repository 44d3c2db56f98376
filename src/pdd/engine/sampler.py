"""Token sampling and stop rules.

Greedy (``temperature == 0``) is an argmax on the device. Random sampling uses one uniform
draw per (seed, output position) from a counter-based hash (SplitMix64), so two instances
(RLD and MD, CPU and CUDA) draw the same number for the same position; the draw is applied
by inverse CDF over the top-k / top-p filtered distribution computed in float64 on the CPU.
"""

from __future__ import annotations

import torch

from pdd.types import FinishReason, SamplingParams

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, position: int) -> float:
    """Deterministic draw in [0, 1) for (seed, position); same on every machine."""
    h = _splitmix64((_splitmix64(seed & _MASK64) ^ (position & _MASK64)) & _MASK64)
    return (h >> 11) * (1.0 / (1 << 53))


def sample_one(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """logits: [vocab] (any device/dtype) -> token id; ``position`` = output index (0-based)."""
    if params.temperature <= 0:
        return int(torch.argmax(logits).item())
    x = logits.detach().to("cpu", torch.float64) / params.temperature
    vals, idx = torch.sort(x, descending=True)
    if params.top_k and params.top_k > 0:
        vals, idx = vals[: params.top_k], idx[: params.top_k]
    probs = torch.softmax(vals, dim=0)
    if params.top_p < 1.0:
        cum = torch.cumsum(probs, dim=0)
        keep = int(torch.searchsorted(cum, torch.tensor([params.top_p], dtype=torch.float64)).item()) + 1
        probs = probs[:keep] / probs[:keep].sum()
        idx = idx[:keep]
    seed = params.seed if params.seed is not None else 0
    u = uniform(seed, position)
    cum = torch.cumsum(probs, dim=0)
    j = int(torch.searchsorted(cum, torch.tensor([u], dtype=torch.float64), right=True).item())
    return int(idx[min(j, len(idx) - 1)].item())


class Sampler:
    """Turns logits rows into token ids and decides when a sequence stops."""

    def __init__(self, eos_token_ids: list[int] | None = None):
        self.eos_token_ids = set(eos_token_ids or [])

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[int]:
        """logits: [N, vocab] float32; params/positions: one per row (position = output index
        of the token being sampled). Returns N token ids."""
        if all(p.temperature <= 0 for p in params):
            return torch.argmax(logits, dim=-1).tolist()
        return [sample_one(logits[i], p, positions[i]) for i, p in enumerate(params)]

    def check_stop(self, token_id: int, num_outputs: int, params: SamplingParams) -> FinishReason | None:
        """After appending ``token_id`` as output number ``num_outputs`` (1-based count)."""
        if token_id in params.stop_token_ids:
            return FinishReason.STOP
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return FinishReason.STOP
        if num_outputs >= params.max_tokens:
            return FinishReason.LENGTH
        return None
