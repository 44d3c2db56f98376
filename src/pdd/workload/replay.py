"""Mooncake trace replay: JSONL records -> scaled requests of deterministic token ids.

A Mooncake record is ``{"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [id, ...]}`` with one hash id per 512-token prompt block; equal ids (at equal
positions after equal prefixes) mean a shareable prefix. Replay turns each hash id into a
deterministic block of ``Scale.block_tokens`` token ids (seeded hash of the id), so two requests
that share their first ``k`` hash ids share exactly their first ``k * block_tokens`` token ids.
Requests that part at a block differ at that block's first token: a block whose first token
equals a sibling's (same preceding hash id) is re-drawn with a salt, so the shared prefix is
exactly the trace's (unless a block has more distinct successors than there are token ids). The
salt depends on which blocks the slice met first, so the same hash id may get other tokens in
another slice; within one built workload every occurrence is identical.

How a record is scaled (all of it in :class:`Scale`):

- input: ``round(input_length * block_tokens / 512)`` tokens, at least 1, and at least one
  token of the record's last block (so every hash id of the record is represented; this adds at
  most one token). Every block is ``block_tokens`` long except the last, which is cut. If
  ``max_input_tokens`` is set, whole trailing blocks are dropped until the prompt fits (a
  prompt still longer than the cap after keeping one block is cut to the cap).
- output: ``round(output_length * output_scale)`` clamped to ``[min_output_tokens,
  max_output_tokens]``.
- time: ``arrival_s = (timestamp - earliest_timestamp_in_slice) / 1000 / time_scale``
  (:func:`pdd.workload.records.from_earliest`, as ``pdd sim run``: the earliest, not the first,
  so a record whose timestamp is below the first's arrives at 0, not before the replay starts;
  ``ReplayRequest.trace_record`` keeps the record's own timestamp);
  with ``target_rate_rps`` set, ``time_scale`` is chosen so the slice's mean arrival rate
  (``(n - 1) / span``) equals it.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np

from pdd.workload.records import capped_prompt_tokens, from_earliest

if TYPE_CHECKING:
    from pdd.config import ClusterConfig

TRACE_BLOCK_TOKENS = 512  # tokens per hash block in Mooncake traces
DEFAULT_TRACE = Path(__file__).resolve().parents[3] / "data" / "traces" / "mooncake_conversation_trace.jsonl"


@dataclass(frozen=True)
class Scale:
    """How a trace slice is shrunk for a small model on a few cores.

    ``block_tokens``: tokens each 512-token hash block becomes (16 = lengths / 32).
    ``output_scale``: factor on ``output_length``; result clamped to
    ``[min_output_tokens, max_output_tokens]`` (tokens).
    ``max_input_tokens``: prompt cap in tokens (whole trailing blocks dropped); None = no cap.
    ``time_scale``: speed-up of arrivals (2.0 = twice as fast); ignored when ``target_rate_rps``
    (requests/s, mean over the slice) is set.
    ``start``, ``count``: the slice (count None = to the end), taken after session sampling.
    ``session_sample``: keep 1 in N conversations (all their turns), chosen by a hash of the
    conversation key with ``session_seed``; a short run then keeps the trace's multi-turn reuse
    (a contiguous 48-request slice of the conversation trace has ~4% ideal prefix hits, the whole
    hour 37%; 1 in 100 conversations gives 100-150 requests over the hour with 29-40%, and
    their first 48 19-41%, depending on ``session_seed``). The key is ``hash_ids[1]``
    (``hash_ids[0]`` is the system prompt every request of the conversation trace shares); a
    one-block record is its own conversation.
    """

    block_tokens: int = 16
    output_scale: float = 1 / 8
    min_output_tokens: int = 8
    max_output_tokens: int = 96
    max_input_tokens: int | None = None
    time_scale: float = 1.0
    target_rate_rps: float | None = None
    start: int = 0
    count: int | None = None
    session_sample: int = 1
    session_seed: int = 0

    def __post_init__(self) -> None:
        if self.block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        if self.min_output_tokens < 1 or self.max_output_tokens < self.min_output_tokens:
            raise ValueError("need 1 <= min_output_tokens <= max_output_tokens")
        if self.max_input_tokens is not None and self.max_input_tokens < 1:
            raise ValueError("max_input_tokens must be >= 1")
        if self.time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        if self.target_rate_rps is not None and self.target_rate_rps <= 0:
            raise ValueError("target_rate_rps must be > 0")
        if self.start < 0 or (self.count is not None and self.count < 0):
            raise ValueError("start and count must be >= 0")
        if self.session_sample < 1:
            raise ValueError("session_sample must be >= 1")

    def keeps_session(self, record: dict, idx: int) -> bool:
        """Whether session sampling keeps this record (``idx``: its index in the trace file)."""
        if self.session_sample == 1:
            return True
        key = f"{self.session_seed}:{session_key(record, idx)}"
        return zlib.crc32(key.encode()) % self.session_sample == 0

    def to_dict(self) -> dict:
        return asdict(self)

    # ---- per-record math (pure, exposed for tests and the simulator) ----

    def input_tokens(self, input_length: int, n_blocks: int) -> int:
        """Scaled prompt length in tokens for a record of ``input_length`` tokens and ``n_blocks``
        hash ids: ``input_length`` x ``block_tokens`` / 512, rounded, at least one token of each
        id's block (so every id is represented). Fewer ids than the prompt's 512-token blocks do
        not shorten it: the blocks past them are the record's own (:func:`build_requests`)."""
        bt = self.block_tokens
        n = max(1, round(input_length * bt / TRACE_BLOCK_TOKENS))
        if n_blocks > 0:
            n = max(n, (n_blocks - 1) * bt + 1)
        if self.max_input_tokens is not None and n > self.max_input_tokens:
            n = capped_prompt_tokens(self.max_input_tokens, bt)
        return n

    def output_tokens(self, output_length: int) -> int:
        """Scaled ``max_tokens`` for a record whose output was ``output_length`` tokens."""
        # clamped before rounding: --output-scale 1e308 made it inf, which round() refused
        n = min(max(output_length * self.output_scale, self.min_output_tokens), self.max_output_tokens)
        return int(round(n))

    def effective_time_scale(self, timestamps_ms: Sequence[float]) -> float:
        """Speed-up actually applied to a slice with these arrival timestamps (ms)."""
        if self.target_rate_rps is None:
            return self.time_scale
        if len(timestamps_ms) < 2:
            return 1.0
        span_s = (max(timestamps_ms) - min(timestamps_ms)) / 1000.0
        if span_s <= 0:
            return 1.0  # all arrive at once whatever the scale
        return self.target_rate_rps * span_s / (len(timestamps_ms) - 1)


@dataclass(frozen=True)
class TokenSpace:
    """Token ids a synthetic prompt may use: ``[first_normal_id, vocab_size)`` minus ``avoid_ids``."""

    vocab_size: int = 32000
    first_normal_id: int = 0
    avoid_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if len(self.allowed()) == 0:
            raise ValueError("token space is empty")

    def allowed(self) -> np.ndarray:
        return _allowed_ids(self.vocab_size, self.first_normal_id, tuple(sorted(self.avoid_ids)))

    @classmethod
    def from_model(cls, path: str | Path) -> "TokenSpace":
        """Read a HF model directory: ``config.json`` vocab size and ``tokenizer.json`` special tokens.

        The upper bound is the smaller of the embedding size and the tokenizer's vocabulary, so
        every id decodes. Special / added tokens and bos/eos/pad ids are avoided; the first
        normal id is one past the run of special ids starting at 0.
        """
        path = Path(path)
        cfg = json.loads((path / "config.json").read_text())
        vocab = int(cfg["vocab_size"])
        special: set[int] = set()
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            v = cfg.get(key)
            if isinstance(v, int):
                special.add(v)
            elif isinstance(v, list):
                special.update(int(x) for x in v)
        tok_path = path / "tokenizer.json"
        if tok_path.exists():
            tok = json.loads(tok_path.read_text())
            special.update(int(t["id"]) for t in tok.get("added_tokens", []))
            model_vocab = (tok.get("model") or {}).get("vocab")
            if isinstance(model_vocab, dict) and model_vocab:
                n_tok = max(max(model_vocab.values()) + 1, max(special, default=-1) + 1)
                vocab = min(vocab, n_tok)
        first = 0
        while first in special:
            first += 1
        return cls(vocab_size=vocab, first_normal_id=first, avoid_ids=frozenset(i for i in special if i >= first))


@lru_cache(maxsize=16)
def _allowed_ids(vocab_size: int, first: int, avoid: tuple[int, ...]) -> np.ndarray:
    ids = np.arange(max(first, 0), vocab_size, dtype=np.int64)
    if avoid:
        ids = np.setdiff1d(ids, np.asarray(avoid, dtype=np.int64))
    return ids


def block_token_ids(hash_id: int, n_tokens: int, tokens: TokenSpace, seed: int = 0, salt: int = 0) -> list[int]:
    """The deterministic token block for ``hash_id`` (its first ``n_tokens`` ids).

    Depends only on (seed, hash_id, salt, token space); a shorter block is a prefix of a longer one.
    """
    allowed = tokens.allowed()
    rng = np.random.default_rng([int(seed), int(hash_id), int(salt)])
    return allowed[rng.integers(0, len(allowed), size=n_tokens)].tolist()


@dataclass
class ReplayRequest:
    """One request to replay.

    ``idx``: record index in the trace file. ``arrival_s``: send time relative to the replay
    start (s). ``prompt_ids``: token ids. ``max_tokens``: output tokens to generate.
    ``hash_ids``: the trace hash ids the prompt uses (after truncation), ``block_tokens`` each.
    """

    idx: int
    arrival_s: float
    prompt_ids: list[int]
    max_tokens: int
    trace_record: dict
    hash_ids: tuple[int, ...] = ()
    block_tokens: int = 16
    meta: dict = field(default_factory=dict)

    @property
    def input_tokens(self) -> int:
        return len(self.prompt_ids)

    def block_lengths(self) -> list[int]:
        """Tokens of each used hash block (all ``block_tokens`` but the last)."""
        n, bt = len(self.prompt_ids), self.block_tokens
        return [min(bt, n - i * bt) for i in range(len(self.hash_ids))]


def session_key(record: dict, idx: int) -> str:
    """The conversation a Mooncake-format record belongs to: ``"h<hash_ids[1]>"``
    (``hash_ids[0]`` is the system prompt every conversation of the shared trace shares), or
    ``"r<idx>"`` for a one-block record, which is its own conversation (``idx``: its index
    in the trace file). In a trace whose system prompts span several blocks (``pdd workload
    agentic``: 8 prompts of 2K-12K tokens) the key names the system prompt, so a "conversation"
    is the group of sessions sharing it, which still keeps their prefix reuse together."""
    h = record.get("hash_ids") or []
    return f"h{h[1]}" if len(h) > 1 else f"r{idx}"


def load_trace(path: str | Path = DEFAULT_TRACE, start: int = 0, count: int | None = None) -> list[dict]:
    """Read Mooncake JSONL records ``[start, start + count)`` (blank lines skipped;
    :func:`pdd.workload.records.read_trace`).

    ValueError naming the file and line when a line read is not a JSON object with the four
    fields (e.g. ``--trace README.md``)."""
    from pdd.workload.records import read_trace

    return list(read_trace(path, start, None if count is None else start + count))


def past_the_end(records: Iterable[dict] | str | Path, scale: Scale) -> str | None:
    """Why ``scale.start`` selects nothing from ``records`` (a trace path or loaded records),
    naming ``--start`` and the trace's request count, e.g. ``--start 99: past the end of t.jsonl,
    which has 3 requests``; with ``--session-sample`` above 1 also how many it keeps (``--start``
    counts those). None when ``start`` is inside the kept requests, or is 0 (an empty or all
    sampled-out trace is not --start's doing). Reads the whole trace: meant for a refused run."""
    if scale.start <= 0:
        return None
    allrecs = load_trace(records) if isinstance(records, (str, Path)) else list(records)
    kept = sum(1 for i, r in enumerate(allrecs) if scale.keeps_session(r, i))
    if scale.start < kept:
        return None
    where = str(records) if isinstance(records, (str, Path)) else "the trace"
    msg = f"--start {scale.start}: past the end of {where}, which has {len(allrecs)} requests"
    if scale.session_sample > 1:
        msg += (f", {kept} of them kept by --session-sample {scale.session_sample} (--start counts kept requests; "
                f"give --start below {kept})" if kept else
                f", none of them kept by --session-sample {scale.session_sample}")
    else:
        msg += f" (give --start below {kept})"
    return msg


def build_requests(
    records: Iterable[dict] | str | Path,
    scale: Scale = Scale(),
    tokens: TokenSpace = TokenSpace(),
    seed: int = 0,
) -> list[ReplayRequest]:
    """Scale a trace (a path or already-loaded records; sampled and sliced by ``scale``) into requests.

    ``ReplayRequest.idx`` is the record's index in the trace (in ``records``).
    """
    stop = None if scale.count is None else scale.start + scale.count
    if isinstance(records, (str, Path)) and scale.session_sample == 1:
        recs = load_trace(records, scale.start, scale.count)
        indices = list(range(scale.start, scale.start + len(recs)))
    else:
        allrecs = load_trace(records) if isinstance(records, (str, Path)) else list(records)
        kept = [(i, r) for i, r in enumerate(allrecs) if scale.keeps_session(r, i)][scale.start: stop]
        indices, recs = [i for i, _ in kept], [r for _, r in kept]
    if not recs:
        return []
    # counted from the slice's earliest timestamp, by pdd sim run's rule (ts[0] gave an unsorted
    # slice's earlier records negative arrivals); each request keeps its record as read
    ts = [float(r["timestamp"]) for r in from_earliest(recs)]
    tscale = scale.effective_time_scale(ts)
    bt = scale.block_tokens
    cache: dict[int, list[int]] = {}
    first_seen: dict[tuple[int | None, int], int] = {}  # (parent hash id, first token) -> hash id
    out: list[ReplayRequest] = []
    for i, rec in enumerate(recs):
        hids = [int(h) for h in rec["hash_ids"]]
        n_in = scale.input_tokens(int(rec["input_length"]), len(hids))
        used = hids[: -(-n_in // bt)] if hids else []
        prompt: list[int] = []
        parent: int | None = None
        for h in used:
            blk = cache.get(h)
            if blk is None:
                blk = _new_block(h, parent, bt, tokens, seed, first_seen)
                cache[h] = blk
            first_seen.setdefault((parent, blk[0]), h)
            prompt.extend(blk)
            parent = h
        if len(prompt) < n_in:  # no hash ids, or fewer than its blocks: the rest is its own, shared by none
            prompt.extend(block_token_ids((1 << 64) + indices[i], n_in - len(prompt), tokens, seed))
        del prompt[n_in:]
        out.append(
            ReplayRequest(
                idx=indices[i],
                arrival_s=ts[i] / 1000.0 / tscale,
                prompt_ids=prompt,
                max_tokens=scale.output_tokens(int(rec["output_length"])),
                trace_record=rec,
                hash_ids=tuple(used),
                block_tokens=bt,
            )
        )
    return out


def _new_block(
    h: int, parent: int | None, bt: int, tokens: TokenSpace, seed: int, first_seen: dict, max_salt: int = 64
) -> list[int]:
    """Block for a hash id first met after ``parent``: re-drawn (salted) while its first token equals
    a sibling block's, so prompts that part at a block differ at exactly that block's first token."""
    for salt in range(max_salt):
        blk = block_token_ids(h, bt, tokens, seed, salt)
        if first_seen.get((parent, blk[0]), h) == h:
            return blk
    return blk  # more siblings than token ids: a chance collision is unavoidable


def ideal_prefix_hits(requests: Sequence[ReplayRequest], page_size: int = 1, min_uncached: int = 0) -> list[int]:
    """Prompt tokens of each request an infinite prefix cache would already hold (in order).

    The cache starts empty and holds every earlier prompt of the sequence. ``page_size`` > 1
    counts only whole pages; ``min_uncached`` leaves that many tokens to compute (engines
    recompute at least the last prompt token to get logits: use 1).
    """
    # trie over hash-id paths: (parent node, hash id) -> [node id, longest block seen (tokens)]
    trie: dict[tuple[int, int], list[int]] = {}
    hits: list[int] = []
    for r in requests:
        lens = r.block_lengths()
        matched, parent = 0, 0
        for h, n in zip(r.hash_ids, lens):
            node = trie.get((parent, h))
            if node is None:
                break
            m = min(node[1], n)
            matched += m
            if m < n:
                break
            parent = node[0]
        matched = max(0, min(matched, len(r.prompt_ids) - min_uncached))
        hits.append(matched // page_size * page_size)
        parent = 0
        for h, n in zip(r.hash_ids, lens):
            node = trie.get((parent, h))
            if node is None:
                node = trie[(parent, h)] = [len(trie) + 1, n]
            elif n > node[1]:
                node[1] = n
            parent = node[0]
    return hits


def ideal_prefix_hit_rate(requests: Sequence[ReplayRequest], page_size: int = 1, min_uncached: int = 0) -> float:
    """Token-weighted prefix hit rate of the sequence with an infinite cache starting empty (0..1)."""
    total = sum(len(r.prompt_ids) for r in requests)
    return sum(ideal_prefix_hits(requests, page_size, min_uncached)) / total if total else 0.0


def workload_summary(
    requests: Sequence[ReplayRequest], scale: Scale, trace: str | Path = DEFAULT_TRACE, page_size: int = 1
) -> dict:
    """The ``workload`` section of report.json: trace, slice, scale and the slice's shape."""
    n = len(requests)
    ts = [float(r.trace_record["timestamp"]) for r in requests]
    ins = [len(r.prompt_ids) for r in requests]
    outs = [r.max_tokens for r in requests]
    span = max(r.arrival_s for r in requests) if requests else 0.0  # the last's: "0.0 s (all at once)" for
    # a slice whose latest record was not its last
    try:
        trace_name = str(Path(trace).resolve().relative_to(DEFAULT_TRACE.parents[2]))
    except ValueError:
        trace_name = str(trace)
    return {
        "trace": trace_name,
        "requests": n,
        "scale": scale.to_dict(),
        "effective_time_scale": scale.effective_time_scale(ts) if ts else scale.time_scale,
        "duration_s": span,
        "rate_rps": (n - 1) / span if n > 1 and span > 0 else None,
        "input_tokens_total": sum(ins),
        "input_tokens_mean": sum(ins) / n if n else 0.0,
        "input_tokens_max": max(ins, default=0),
        "output_tokens_total": sum(outs),
        "output_tokens_mean": sum(outs) / n if n else 0.0,
        "ideal_prefix_hit_rate": ideal_prefix_hit_rate(requests),
        "ideal_prefix_hit_rate_paged": ideal_prefix_hit_rate(requests, page_size, 1),
        "page_size": page_size,
    }


def fit_scale(scale: Scale, config: "ClusterConfig", n_requests: int | None, start: int | None) -> Scale:
    """``scale`` with the slice set and the prompt cap lowered to what the engine accepts
    (``max_input_len`` and ``max_model_len - max_output_tokens``).

    ValueError, naming the flag, when ``max_output_tokens`` (``--max-output``) leaves no prompt
    token within ``max_model_len`` (every prompt was cut to 1 token, silently), or when
    ``block_tokens`` (``--block-tokens``) exceeds the prompt cap: every prompt would then be its
    first block cut short, so requests sharing only their first hash id (every request of the
    shared conversation trace shares its system-prompt block) had identical prompts, and
    ``--block-tokens 1000000000`` drew 8 GB per block before anything ran."""
    eng = config.engine
    room = eng.max_model_len - scale.max_output_tokens
    if room < 1:
        raise ValueError(f"--max-output {scale.max_output_tokens} leaves no prompt token within the engine's "
                         f"max_model_len {eng.max_model_len} (prompt + output); give a smaller --max-output "
                         f"(or a --config whose engine.max_model_len is the server's)")
    cap = min(eng.max_input_len, room)
    if scale.max_input_tokens is not None:
        cap = min(cap, scale.max_input_tokens)
    if scale.block_tokens > cap:
        raise ValueError(f"--block-tokens {scale.block_tokens} exceeds the prompt cap of {cap} tokens (--max-input, "
                         f"the engine's max_input_len {eng.max_input_len} and max_model_len {eng.max_model_len} "
                         f"- --max-output {scale.max_output_tokens}): every prompt would be its first block cut "
                         f"short, so requests sharing only that block would have identical prompts")
    upd: dict = {"max_input_tokens": cap}
    if n_requests is not None:
        upd["count"] = n_requests
    if start is not None:
        upd["start"] = start
    return replace(scale, **upd)
