"""Token sampling, logit processing, logprobs and stop rules.

Every tier (P for the first token, RLD, MD, a single engine) samples a position the same way:

1. the raw float32 logits row goes to the CPU as float64;
2. logit processors, in vLLM's order: ``allowed_token_ids`` (every other id to -inf);
   ``bad_words`` (:func:`banned_ids`: a word's last token id to -inf when the outputs so far
   end with its other ids); ``logit_bias``; ``min_tokens`` (EOS and
   ``stop_token_ids`` masked while fewer outputs exist); penalties that depend only on the
   sequence's tokens so far: ``repetition_penalty`` over prompt + outputs (positive logits
   divided, negative multiplied), ``frequency_penalty`` x count and ``presence_penalty`` x
   [count > 0] over the outputs; when the masks leave no id, the fallback of
   :func:`process_logits` (never an id outside ``allowed_token_ids``, never an all -inf row);
3. greedy (``temperature < GREEDY_EPS``): argmax. Otherwise divide by the temperature, softmax,
   keep the tokens with ``p >= min_p * p_max``, then the ``top_k`` most likely, renormalise,
   then the smallest prefix whose cumulative probability reaches ``top_p``, renormalise;
4. one uniform draw per (seed, output position) from a counter-based hash (SplitMix64: pure
   integer arithmetic, so the same number on every machine, device and batch), applied by
   inverse CDF over the kept tokens sorted by probability.

So RLD and MD (or CPU and CUDA) pick the same token for a position whenever their logits agree
to float noise, and can differ only when the draw (or top-p / min-p cut) lies within that noise
of a cumulative-probability boundary: :func:`decision_margin` measures how close that was.

Logprobs (``SamplingParams.logprobs = k``) are the log-softmax of the *raw* logits row that the
token was sampled from (vLLM's default ``raw_logprobs``): the sampled token's plus the top k.
Rows that need none of the above (greedy, no penalties, no logprobs) keep the batched argmax
on the device.
"""

from __future__ import annotations

import math

import torch

from pdd.types import FinishReason, SamplingParams

_MASK64 = (1 << 64) - 1
GREEDY_EPS = 1e-5  # temperatures below this are greedy (as in vLLM)
MAX_LOGPROBS = 20


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, position: int) -> float:
    """Deterministic draw in [0, 1) for (seed, position); same on every machine."""
    h = _splitmix64((_splitmix64(seed & _MASK64) ^ (position & _MASK64)) & _MASK64)
    return (h >> 11) * (1.0 / (1 << 53))


def is_greedy(p: SamplingParams) -> bool:
    return p.temperature < GREEDY_EPS


def _has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _has_mask(p: SamplingParams) -> bool:
    return p.allowed_token_ids is not None or bool(p.bad_words_token_ids) or p.grammar is not None


def unpack_masks(bits: list[bytes], vocab: int, device=None) -> torch.Tensor:
    """Structured-output guides' bitmasks (``pdd.structured.Guide.allowed``, one per row, all of
    one width: little-endian 32-bit words, bit ``i % 32`` of word ``i // 32`` for id ``i``) as a
    bool tensor [rows, vocab] on ``device`` (None: the CPU); ids past a mask's width are False."""
    words = torch.frombuffer(bytearray(b"".join(bits)), dtype=torch.int32).view(len(bits), -1).to(device)
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    flat = ((words.unsqueeze(2) >> shifts) & 1).flatten(1)[:, :vocab].bool()
    if flat.shape[1] < vocab:
        flat = torch.cat([flat, flat.new_zeros(len(bits), vocab - flat.shape[1])], dim=1)
    return flat


def grammar_mask(bits: bytes, vocab: int) -> torch.Tensor:
    """One guide's bitmask as a bool tensor [vocab] (:func:`unpack_masks` of one row)."""
    return unpack_masks([bits], vocab)[0]


def _grammar_only(p: SamplingParams, position: int) -> bool:
    """A greedy row whose grammar is its only processing (the batched masked argmax)."""
    return (p.grammar is not None and is_greedy(p) and not _has_penalties(p) and position >= p.min_tokens
            and not p.logit_bias and p.logprobs is None and p.allowed_token_ids is None
            and not p.bad_words_token_ids)


def needs_processing(p: SamplingParams, position: int) -> bool:
    """False when the row is a plain argmax (batched on the device). A request without
    ``allowed_token_ids`` / ``bad_words`` pays two attribute tests for them, nothing more."""
    return (not is_greedy(p) or _has_penalties(p) or position < p.min_tokens or bool(p.logit_bias)
            or p.logprobs is not None or _has_mask(p))


def banned_ids(bad_words_token_ids: list[list[int]], history: list[int] | None, prompt_len: int = 0) -> list[int]:
    """Token ids ``bad_words`` bans at the next position (vLLM's bad-words processor): the last id
    of each sequence in ``bad_words_token_ids`` whose other ids are the last outputs (a one-id
    sequence: always). ``history``: the sequence's tokens so far, of which the first ``prompt_len``
    are the prompt (only outputs count; None: no outputs). Cost: O(sum of the sequences' lengths)."""
    n_out = len(history) - prompt_len if history is not None else 0
    out = []
    for w in bad_words_token_ids:
        k = len(w) - 1
        if k < 0 or k > n_out:
            continue
        if k == 0 or history[len(history) - k:] == w[:-1]:
            out.append(int(w[-1]))
    return out


def process_logits(row: torch.Tensor, p: SamplingParams, position: int, history: list[int] | None = None,
                   prompt_len: int = 0, eos_ids=(), allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Float64 CPU copy of ``row`` with the masks (structured outputs' ``allowed``,
    ``allowed_token_ids``, ``bad_words``, ``min_tokens``), logit bias and penalties applied.

    ``history`` = the sequence's tokens so far (prompt + outputs before ``position``), of which
    the first ``prompt_len`` are the prompt. ``allowed``: bool [vocab], the ids a structured
    output's grammar allows here (:func:`grammar_mask`; None: no grammar). With both it and
    ``allowed_token_ids``, the ids both allow; when they share none, the grammar's (a grammar's
    output is never broken).

    Never a row without a finite logit (its argmax is id 0, whatever ``allowed_token_ids`` says,
    and its softmax NaN): when the masks leave none of the ids ``allowed_token_ids`` allows (the
    whole vocabulary without it), the multi-token ``bad_words`` endings banned at this position
    are dropped; if that still leaves none, the single-token ``bad_words`` and the ``min_tokens``
    mask are dropped too (the allowed ids with bias and penalties); and if the logits themselves
    leave none finite, the allowed ids are equally likely. A row with any of these masks pays one
    ``isfinite`` pass over the vocabulary for the check; a row with none pays nothing."""
    x = row.detach().to("cpu", torch.float64).clone()
    vocab = x.shape[0]
    keep = None
    if p.allowed_token_ids is not None:
        keep = torch.tensor([t for t in p.allowed_token_ids if 0 <= t < vocab], dtype=torch.long)
    if allowed is not None:
        ids = torch.nonzero(allowed[:vocab]).flatten()
        if ids.numel():  # (a guide always allows some id: EOS at least)
            both = keep[allowed[keep]] if keep is not None else ids
            keep = both if both.numel() else ids
    if keep is not None:
        masked = torch.full_like(x, -math.inf)
        masked[keep] = x[keep]
        x = masked
    # bias and penalties leave -inf at -inf, so the bans are applied after them (same values)
    if p.logit_bias:
        for t, b in p.logit_bias.items():
            if 0 <= int(t) < vocab:
                x[int(t)] += float(b)
    if history is not None and _has_penalties(p):
        hist = torch.tensor([t for t in history if 0 <= t < vocab], dtype=torch.long)
        if p.repetition_penalty != 1.0 and hist.numel():
            seen = torch.unique(hist)
            v = x[seen]
            x[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            out = hist[prompt_len:] if prompt_len <= hist.numel() else hist[:0]
            if out.numel():
                counts = torch.bincount(out, minlength=vocab).to(torch.float64)
                x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(torch.float64)
    static: set[int] = set()  # single-token bad words and the min_tokens mask: known from the request
    dynamic: set[int] = set()  # multi-token bad-word endings: known from the outputs so far
    if p.bad_words_token_ids:
        static = {int(w[-1]) for w in p.bad_words_token_ids if len(w) == 1}
        multi = [w for w in p.bad_words_token_ids if len(w) > 1]
        dynamic = set(banned_ids(multi, history, prompt_len)) if multi else set()
    if position < p.min_tokens:
        static |= {int(t) for t in p.stop_token_ids} | {int(t) for t in eos_ids}
    static = sorted(t for t in static if 0 <= t < vocab)
    dynamic = sorted(t for t in dynamic if 0 <= t < vocab)
    if not static and not dynamic and keep is None:
        return x
    s_idx = torch.tensor(static, dtype=torch.long)
    s_old = x[s_idx].clone()
    x[s_idx] = -math.inf
    d_idx = torch.tensor(dynamic, dtype=torch.long)
    d_old = x[d_idx].clone()
    x[d_idx] = -math.inf
    if bool(torch.isfinite(x).any()):
        return x
    x[d_idx] = d_old  # nothing left: the dynamic bans go first
    if bool(torch.isfinite(x).any()):
        return x
    x[s_idx] = s_old  # then the static ones: the allowed ids with bias and penalties
    if not bool(torch.isfinite(x).any()):
        if keep is None:
            x.zero_()
        else:
            x[keep] = 0.0
    return x


def _nucleus(x: torch.Tensor, p: SamplingParams):
    """Sorted kept (probs, ids) after temperature, min_p, top_k, top_p; plus the sorted
    probabilities before any cut (for :func:`decision_margin`)."""
    vals, idx = torch.sort(x / p.temperature, descending=True)
    full = torch.softmax(vals, dim=0)
    keep = int(full.shape[0])
    if _has_mask(p):  # masked ids (-inf, probability 0) are never kept, whatever top_k says
        keep = max(1, int(torch.isfinite(vals).sum().item()))
    if p.min_p > 0.0:
        keep = min(keep, max(1, int((full >= p.min_p * full[0]).sum().item())))
    if p.top_k and p.top_k > 0:
        keep = min(keep, p.top_k)
    probs = full[:keep] / full[:keep].sum()
    if p.top_p < 1.0:
        cum = torch.cumsum(probs, dim=0)
        k = int(torch.searchsorted(cum, torch.tensor([p.top_p], dtype=torch.float64)).item()) + 1
        k = min(k, keep)
        probs = probs[:k] / probs[:k].sum()
        keep = k
    return probs, idx[:keep], full


def _draw(probs: torch.Tensor, idx: torch.Tensor, seed: int | None, position: int) -> int:
    u = uniform(seed if seed is not None else 0, position)
    cum = torch.cumsum(probs, dim=0)
    j = int(torch.searchsorted(cum, torch.tensor([u], dtype=torch.float64), right=True).item())
    return int(idx[min(j, len(idx) - 1)].item())


def logprob_info(row: torch.Tensor, token_id: int, k: int) -> dict:
    """``{"lp": logprob of token_id, "top": [[id, logprob], ...] (k most likely)}`` from the raw row."""
    lsm = torch.log_softmax(row.detach().to("cpu", torch.float64), dim=0)
    out = {"lp": float(lsm[token_id].item()), "top": []}
    if k > 0:
        v, i = torch.topk(lsm, min(k, lsm.shape[0]))
        out["top"] = [[int(a), float(b)] for a, b in zip(i.tolist(), v.tolist())]
    return out


def sample_row(logits: torch.Tensor, params: SamplingParams, position: int, history: list[int] | None = None,
               prompt_len: int = 0, eos_ids=(), allowed: torch.Tensor | None = None) -> tuple[int, dict | None]:
    """One row: (token id, logprob info or None); ``allowed`` as :func:`process_logits`."""
    x = process_logits(logits, params, position, history, prompt_len, eos_ids, allowed)
    if is_greedy(params):
        tok = int(torch.argmax(x).item())
    else:
        probs, idx, _ = _nucleus(x, params)
        tok = _draw(probs, idx, params.seed, position)
    lp = logprob_info(logits, tok, int(params.logprobs)) if params.logprobs is not None else None
    return tok, lp


def sample_one(logits: torch.Tensor, params: SamplingParams, position: int, history: list[int] | None = None,
               prompt_len: int = 0, eos_ids=(), allowed: torch.Tensor | None = None) -> int:
    """logits: [vocab] (any device/dtype) -> token id; ``position`` = output index (0-based)."""
    if not needs_processing(params, position):
        return int(torch.argmax(logits).item())
    return sample_row(logits, params, position, history, prompt_len, eos_ids, allowed)[0]


def decision_margin(logits: torch.Tensor, params: SamplingParams, position: int, history: list[int] | None = None,
                    prompt_len: int = 0, eos_ids=(), allowed: torch.Tensor | None = None) -> tuple[str, float]:
    """How close the choice at this position was to going another way (for excusing numerical
    divergences): greedy -> ``("logit_gap", top1 - top2)`` of the processed logits; sampled ->
    ``("prob", d)`` with d the smallest distance, in probability, between the draw and a
    cumulative-probability boundary of the kept tokens, or between ``top_p`` and the nucleus
    boundary, or between a probability and the ``min_p`` threshold, or between the k-th and
    (k+1)-th probabilities at the ``top_k`` cut. ``allowed`` as :func:`process_logits`."""
    x = process_logits(logits, params, position, history, prompt_len, eos_ids, allowed)
    if is_greedy(params):
        v = torch.topk(x, 2).values
        return "logit_gap", float(v[0] - v[1])
    probs, idx, full = _nucleus(x, params)
    u = uniform(params.seed if params.seed is not None else 0, position)
    cum = torch.cumsum(probs, dim=0)
    d = float(torch.min(torch.abs(cum[:-1] - u)).item()) if cum.numel() > 1 else 1.0
    n = full.shape[0]
    if params.min_p > 0.0:
        d = min(d, float(torch.min(torch.abs(full - params.min_p * full[0])).item()))
    if params.top_k and 0 < params.top_k < n:
        d = min(d, float(full[params.top_k - 1] - full[params.top_k]))
    if params.top_p < 1.0:
        keep = int(full.shape[0])
        if params.min_p > 0.0:
            keep = min(keep, max(1, int((full >= params.min_p * full[0]).sum().item())))
        if params.top_k and params.top_k > 0:
            keep = min(keep, params.top_k)
        pre = torch.cumsum(full[:keep] / full[:keep].sum(), dim=0)
        d = min(d, float(torch.min(torch.abs(pre - params.top_p)).item()))
    return "prob", d


class Sampler:
    """Turns logits rows into token ids and decides when a sequence stops."""

    def __init__(self, eos_token_ids: list[int] | None = None):
        self.eos_token_ids = set(eos_token_ids or [])
        self.last_logprobs: list[dict | None] = []  # per row of the last sample() call

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
               histories: list[tuple[list[int], int]] | None = None, guides: list | None = None) -> list[int]:
        """logits: [N, vocab] float32; params/positions: one per row (position = output index
        of the token being sampled); histories: per row ``(token_ids so far, prompt_len)`` for
        penalties (None: no history, penalties see no tokens); guides: per row the structured
        output's ``pdd.structured.Guide`` or None, advanced here over the row's outputs (the
        history past ``prompt_len``). Returns N token ids; the rows' logprob info (or None) is
        left in ``last_logprobs``. Raises ValueError for a row with a grammar and no guide."""
        n = len(params)
        self.last_logprobs = [None] * n
        slow = [i for i, p in enumerate(params) if needs_processing(p, positions[i])]
        if not slow:
            return torch.argmax(logits, dim=-1).tolist()
        out = torch.argmax(logits, dim=-1).tolist() if len(slow) < n else [0] * n
        vocab = logits.shape[-1]

        def _bits(i):
            guide = guides[i] if guides is not None else None
            if guide is None:
                raise ValueError("a row with a grammar needs its guide (Sampler.sample guides=)")
            hist, plen = histories[i] if histories is not None else (None, 0)
            return guide.allowed(hist[plen:] if hist is not None else [])

        # greedy rows whose only processing is their grammar: one masked argmax over them all,
        # on the logits' device (what process_logits + argmax give, without a float64 row each)
        masked = [i for i in slow if _grammar_only(params[i], positions[i])]
        if masked:
            idx = torch.tensor(masked, dtype=torch.long, device=logits.device)
            allow = unpack_masks([_bits(i) for i in masked], vocab, logits.device)
            rows = logits[idx].masked_fill(~allow, -math.inf)
            for i, t in zip(masked, torch.argmax(rows, dim=-1).tolist()):
                out[i] = t
            slow = [i for i in slow if not _grammar_only(params[i], positions[i])]
            if not slow:
                return out
        rows = logits[torch.tensor(slow, dtype=torch.long, device=logits.device)].detach().to("cpu", torch.float64)
        for r, i in enumerate(slow):
            hist, plen = histories[i] if histories is not None else (None, 0)
            allowed = grammar_mask(_bits(i), vocab) if params[i].grammar is not None else None
            out[i], self.last_logprobs[i] = sample_row(rows[r], params[i], positions[i], hist, plen,
                                                       self.eos_token_ids, allowed)
        return out

    def check_stop(self, token_id: int, num_outputs: int, params: SamplingParams) -> FinishReason | None:
        """After appending ``token_id`` as output number ``num_outputs`` (1-based count)."""
        if token_id in params.stop_token_ids:
            return FinishReason.STOP
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return FinishReason.STOP
        if num_outputs >= params.max_tokens:
            return FinishReason.LENGTH
        return None
