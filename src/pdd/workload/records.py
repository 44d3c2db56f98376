"""Workload records in Mooncake JSONL format: read, write, cap, retime; an agentic generator, fixed-shape load.

A record is ``{"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [...]}`` with one hash id per 512-token prompt block; equal ids mean a shareable
prefix (the last, partial block gets its own id). Generators return lists of such dicts.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

BLOCK = 512
REPO_ROOT = Path(__file__).resolve().parents[3]
MOONCAKE_TRACE = REPO_ROOT / "data" / "traces" / "mooncake_conversation_trace.jsonl"
HIT_BINS = [(0, 90), (90, 95), (95, 97), (97, 98), (98, 99), (99, 99.5), (99.5, 100.0001)]


TRACE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
# most tokens a record's input_length / output_length may give: 8,000 x the shared trace's longest
# prompt (126,195). Past ~1e308 the scaling arithmetic overflowed float ("integer division result
# too large for a float", a traceback); nothing real comes near either.
MAX_TRACE_TOKENS = 10 ** 9
MAX_TRACE_BYTES = 1 << 30  # a trace file's size (the bundled Mooncake trace is 3 MB)
# one line's characters: a record of MAX_TRACE_TOKENS tokens has ~2M hash ids of up to 20 digits
MAX_TRACE_LINE_CHARS = 64 << 20


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _finite(v: int | float) -> bool:
    """``math.isfinite``, False for an integer past float's range (10**400 raised OverflowError)."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _bad_field(rec: dict) -> str | None:
    """Why a record's values are unusable (None when they are fine): ``timestamp`` a finite
    number of ms >= 0 (since the trace's start; their order is not checked), ``input_length``
    an integer 1..:data:`MAX_TRACE_TOKENS`, ``output_length`` an integer 0..MAX_TRACE_TOKENS,
    ``hash_ids`` a list of integers >= 0, at most one per ``BLOCK``-token block of the prompt
    (``ceil(input_length / 512)``: the format's one id per block; with fewer, or none, the
    blocks past them are the record's own, shared with no other prompt). Replay represents every id of a record by at least one token of its block
    (:meth:`pdd.workload.replay.Scale.input_tokens`), so extra ids made the prompt silently longer
    than ``input_length`` (5 ids on a 100-token record: 65 tokens instead of 3 at 16 tokens a block).
    Without this check a bad value failed later, in whatever used it, with a message naming
    neither the file, the line nor the field (``pdd bench``: "could not convert string to float:
    'x'")."""
    ts = rec["timestamp"]
    if not ((_is_int(ts) or isinstance(ts, float)) and _finite(ts)):
        return f"'timestamp' must be a number of ms, got {ts!r}"[:200]
    if ts < 0:  # an arrival before the trace's start (it was accepted silently)
        return f"'timestamp' must be >= 0 (ms since the trace's start), got {ts!r}"
    for k, lo in (("input_length", 1), ("output_length", 0)):
        if not (_is_int(rec[k]) and lo <= rec[k] <= MAX_TRACE_TOKENS):
            return f"{k!r} must be an integer {lo}..{MAX_TRACE_TOKENS:,}, got {rec[k]!r}"[:200]
    h = rec["hash_ids"]
    if not (isinstance(h, list) and all(_is_int(x) and x >= 0 for x in h)):
        # a negative id seeded its token block through numpy, whose "expected non-negative
        # integer" was all `pdd bench` said (no file, line or field)
        return f"'hash_ids' must be a list of integers >= 0, got {h!r}"[:200]
    blocks = -(-rec["input_length"] // BLOCK)
    if len(h) > blocks:
        return (f"'hash_ids' has {len(h)} ids, more than the {blocks} {BLOCK}-token block(s) of its 'input_length' "
                f"{rec['input_length']} (one id per block)")
    return None


def read_trace(path: str | Path, start: int = 0, stop: int | None = None) -> Iterator[dict]:
    """The Mooncake JSONL records ``[start, stop)`` of ``path`` (blank lines skipped; records
    before ``start`` are skipped unparsed). ValueError naming the file and line when a record read
    is not a JSON object with the four fields (``README.md`` given as a trace, a truncated file),
    a field's value is unusable (:func:`_bad_field`), the file is not UTF-8 text, a line is longer
    than :data:`MAX_TRACE_LINE_CHARS`, or ``path`` is not a regular file or is larger than
    :data:`MAX_TRACE_BYTES` (:func:`pdd.files.open_regular`: ``/dev/zero`` was read without end, a
    FIFO waited for a writer); OSError when it cannot be read (IsADirectoryError, FileNotFoundError)."""
    import io

    from pdd.files import open_regular

    with io.TextIOWrapper(open_regular(path, MAX_TRACE_BYTES, "give a Mooncake-format JSONL trace"),
                          encoding="utf-8") as f:
        i = lineno = 0
        while stop is None or i < stop:
            try:
                line = f.readline(MAX_TRACE_LINE_CHARS)
            except UnicodeDecodeError:
                raise ValueError(f"{path}: not UTF-8 text (a binary file?)") from None
            if not line:
                return
            lineno += 1
            if len(line) >= MAX_TRACE_LINE_CHARS and not line.endswith("\n"):
                raise ValueError(f"{path}, line {lineno}: longer than {MAX_TRACE_LINE_CHARS:,} characters; "
                                 "not a trace record")
            if not line.strip():
                continue
            if i >= start:
                try:
                    rec = json.loads(line)
                except ValueError as e:  # JSONDecodeError
                    raise ValueError(f"{path}, line {lineno}: not a JSON record ({e})") from None
                if not isinstance(rec, dict):
                    raise ValueError(f"{path}, line {lineno}: not a JSON object with {', '.join(TRACE_FIELDS)}")
                missing = [k for k in TRACE_FIELDS if k not in rec]
                if missing:
                    raise ValueError(f"{path}, line {lineno}: record lacks {', '.join(map(repr, missing))}")
                bad = _bad_field(rec)
                if bad:
                    raise ValueError(f"{path}, line {lineno}: {bad}")
                yield rec
            i += 1


def load_trace(path: str | Path = MOONCAKE_TRACE, limit: int | None = None) -> list[dict]:
    """The first ``limit`` (None: all) records of a Mooncake JSONL file (:func:`read_trace`)."""
    return list(read_trace(path, 0, limit or None))


def write_trace(records: Iterable[dict], path: str | Path) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps({k: r[k] for k in ("timestamp", "input_length", "output_length", "hash_ids")}) + "\n")


def cap_input(records: Iterable[dict], max_tokens: int, block: int = BLOCK) -> list[dict]:
    """``records`` with every prompt at most ``max_tokens`` tokens, as ``pdd bench --max-input``
    (:meth:`pdd.workload.replay.Scale.input_tokens`) clips, counted in trace tokens: whole trailing
    ``block``-token blocks are dropped until the prompt fits (with their hash ids), and a prompt
    still longer than the cap after keeping one block is cut to the cap. No record is dropped;
    records that fit are returned unchanged. ValueError when ``max_tokens`` < 1."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    out = []
    for r in records:
        if r["input_length"] > max_tokens:
            n = capped_prompt_tokens(max_tokens, block)
            r = dict(r, input_length=n, hash_ids=list(r["hash_ids"][: -(-n // block)]))
        out.append(r)
    return out


def capped_prompt_tokens(max_tokens: int, block: int) -> int:
    """Length (tokens) of a prompt longer than ``max_tokens`` once capped: its whole ``block``-token
    blocks that fit (the trailing ones dropped), or ``max_tokens`` itself when not one block does.
    The rule of ``pdd bench --max-input`` (:meth:`pdd.workload.replay.Scale.input_tokens`) and of
    ``pdd sim run --max-input`` (:func:`cap_input`)."""
    keep = max_tokens // block
    return keep * block if keep else max_tokens


def from_earliest(records: Sequence[dict]) -> list[dict]:
    """``records`` with their timestamps counted from the earliest one (ms), the one rule of
    ``pdd bench`` (:func:`pdd.workload.replay.build_requests`) and ``pdd sim run``: a trace of
    absolute times (epoch milliseconds) starts at once rather than after that many idle seconds.
    Records whose earliest timestamp is 0 are returned unchanged."""
    t0 = min((r["timestamp"] for r in records), default=0)
    return list(records) if t0 == 0 else [dict(r, timestamp=r["timestamp"] - t0) for r in records]


def scale_rate(records: Sequence[dict], factor: float) -> list[dict]:
    """Replay ``factor`` times faster (timestamps divided by factor)."""
    return [dict(r, timestamp=r["timestamp"] / factor) for r in records]


def poisson_times(n: int, rate: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.cumsum(rng.exponential(1.0 / rate, n)) * 1000.0


def retime(records: Sequence[dict], rate: float, seed: int = 0) -> list[dict]:
    """Same requests in the same order, Poisson arrivals at ``rate`` req/s."""
    ts = poisson_times(len(records), rate, seed)
    return [dict(r, timestamp=float(t)) for r, t in zip(records, ts)]


class _Ids:
    def __init__(self):
        self.n = 0

    def take(self, k: int) -> list[int]:
        out = list(range(self.n, self.n + k))
        self.n += k
        return out


def _blocks(n_tokens: int) -> int:
    return max(1, math.ceil(n_tokens / BLOCK))


def generate_fixed(n_requests: int, rate: float, input_len: int, output_len: int, hit: float,
                   n_prefixes: int = 64, seed: int = 0, zipf_a: float = 0.0,
                   warm_s: float = 0.0, warm_gap_s: float = 30.0) -> list[dict]:
    """Fixed-shape load: every prompt is ``input_len`` tokens whose first ``hit`` fraction
    (rounded down to whole blocks) is one of ``n_prefixes`` shared prefixes (uniform, or Zipf
    with exponent ``zipf_a`` > 0) and the rest is unique; Poisson arrivals at ``rate``.

    ``warm_s`` > 0 first sends one request per prefix spread over ``warm_s`` seconds (steady
    state: the caches already hold the working set), then the measured load starts
    ``warm_gap_s`` later; such warm-up records carry ``"warmup": True`` (exclude them with
    ``SimConfig.measure_from_s = warm_start(records)``)."""
    rng = np.random.default_rng(seed)
    ids = _Ids()
    shared_blocks = int(hit * input_len) // BLOCK
    prefixes = [ids.take(shared_blocks) for _ in range(n_prefixes)]
    if zipf_a > 0:
        w = 1.0 / np.arange(1, n_prefixes + 1) ** zipf_a
        w /= w.sum()
        pick = rng.choice(n_prefixes, n_requests, p=w)
    else:
        pick = rng.integers(0, n_prefixes, n_requests)
    total_blocks = _blocks(input_len)
    out = []
    t0 = 0.0
    if warm_s > 0:
        for j in range(n_prefixes):
            h = prefixes[j] + ids.take(total_blocks - shared_blocks)
            out.append({"timestamp": warm_s * 1000.0 * j / n_prefixes, "input_length": int(input_len),
                        "output_length": int(output_len), "hash_ids": h, "warmup": True})
        t0 = (warm_s + warm_gap_s) * 1000.0
    ts = poisson_times(n_requests, rate, seed + 1) + t0
    for i in range(n_requests):
        h = prefixes[pick[i]] + ids.take(total_blocks - shared_blocks)
        out.append({"timestamp": float(ts[i]), "input_length": int(input_len),
                    "output_length": int(output_len), "hash_ids": h})
    return out


def warm_start(records: Sequence[dict]) -> float:
    """Seconds at which the measured (non warm-up) load starts."""
    t = [r["timestamp"] for r in records if not r.get("warmup")]
    return min(t) / 1000.0 if t else 0.0


def generate_agentic(n_requests: int, seed: int = 0, rate: float = 2.0, *,
                     n_system_prompts: int = 8, system_tokens: tuple[int, int] = (2000, 12000),
                     first_user_tokens: tuple[int, int] = (500, 6000),
                     mean_turns: float = 40.0, tool_median: int = 150, tool_sigma: float = 1.3,
                     big_tool_prob: float = 0.01, big_tool_tokens: tuple[int, int] = (4000, 20000),
                     out_median: int = 120, out_sigma: float = 0.9, out_cap: int = 4096,
                     anomaly_frac: float = 0.035, anomaly_input: tuple[int, int] = (16000, 100000),
                     anomaly_output: tuple[int, int] = (1, 24), max_context: int = 120000,
                     think_mean_s: float = 4.0, decode_s_per_token: float = 0.03) -> list[dict]:
    """Agentic multi-turn sessions in Mooncake format, calibrated to the PDD report's figures
    (token-weighted hit ~90%, 70-80% of requests > 95% hit, outputs mostly < 500 tokens,
    3-4% long-input/short-output requests; check with :func:`hit_histogram`).

    A session starts from one of ``n_system_prompts`` shared system prompts plus a first user
    message; each later turn's prompt is the previous prompt + the previous output + a tool
    result (log-normal, occasionally a big one) so consecutive prompts share all full blocks.
    Sessions arrive as a Poisson process; a turn follows the previous one after its estimated
    decode time plus an exponential think/tool time; finally time is scaled so the overall
    request rate is ``rate`` req/s.
    ``anomaly_frac`` of requests are standalone long-input/short-output ones (unique input).
    """
    rng = np.random.default_rng(seed)
    ids = _Ids()
    sys_prompts = []
    for _ in range(n_system_prompts):
        n = int(rng.integers(*system_tokens)) // BLOCK * BLOCK
        sys_prompts.append((n, ids.take(n // BLOCK)))
    n_anom = int(round(anomaly_frac * n_requests))
    n_sess_req = n_requests - n_anom
    session_rate = rate * (n_sess_req / max(1, n_requests)) / mean_turns
    records: list[dict] = []
    t_sess = 0.0
    made = 0
    while made < n_sess_req:
        t_sess += rng.exponential(1.0 / session_rate)
        turns = min(n_sess_req - made, max(1, int(rng.geometric(1.0 / mean_turns))))
        sys_len, sys_ids = sys_prompts[int(rng.integers(0, n_system_prompts))]
        stream_blocks = list(sys_ids)  # full-block ids of this session's token stream
        length = sys_len + int(rng.integers(*first_user_tokens))
        t = t_sess
        for k in range(turns):
            full = length // BLOCK
            while len(stream_blocks) < full:
                stream_blocks.extend(ids.take(full - len(stream_blocks)))
            h = stream_blocks[:full] + (ids.take(1) if length % BLOCK else [])
            out = int(min(out_cap, max(1, rng.lognormal(math.log(out_median), out_sigma))))
            records.append({"timestamp": t * 1000.0, "input_length": int(length),
                            "output_length": out, "hash_ids": h})
            made += 1
            if big_tool_prob > 0 and rng.random() < big_tool_prob:
                tool = int(rng.integers(*big_tool_tokens))
            else:
                tool = int(rng.lognormal(math.log(tool_median), tool_sigma)) + 20
            new_len = length + out + tool
            if new_len > max_context:
                break
            length = new_len
            t += 1.0 + out * decode_s_per_token + rng.exponential(think_mean_s)
    span = max(r["timestamp"] for r in records) / 1000.0 if records else 1.0
    for _ in range(n_anom):
        n_in = int(rng.integers(*anomaly_input))
        records.append({"timestamp": float(rng.uniform(0, span) * 1000.0), "input_length": n_in,
                        "output_length": int(rng.integers(*anomaly_output)), "hash_ids": ids.take(_blocks(n_in))})
    records.sort(key=lambda r: r["timestamp"])
    # sessions end early at max_context, so scale time to hit the requested overall rate
    span_ms = records[-1]["timestamp"] - records[0]["timestamp"] if len(records) > 1 else 0.0
    if span_ms > 0:
        f = (len(records) - 1) / rate * 1000.0 / span_ms
        t0 = records[0]["timestamp"]
        for r in records:
            r["timestamp"] = (r["timestamp"] - t0) * f
    return records


def prefix_hits(records: Sequence[dict]) -> np.ndarray:
    """Per-request hit fraction against an infinite prefix cache of all earlier prompts
    (whole 512-token blocks, capped at input - 1 tokens)."""
    seen: set[int] = set()
    out = np.empty(len(records))
    for i, r in enumerate(records):
        k = 0
        for h in r["hash_ids"]:
            if h in seen:
                k += 1
            else:
                break
        n = r["input_length"]
        out[i] = min(k * BLOCK, n - 1) / n if n > 0 else 0.0
        seen.update(r["hash_ids"][: n // BLOCK])
    return out


def hit_histogram(records: Sequence[dict]) -> dict:
    """Seven-bin hit-rate histogram (the report's bins) plus the summary figures."""
    hits = prefix_hits(records) * 100.0
    inp = np.array([r["input_length"] for r in records], dtype=float)
    out = np.array([r["output_length"] for r in records], dtype=float)
    bins = []
    for lo, hi in HIT_BINS:
        m = (hits >= lo) & (hits < hi)
        bins.append({"bin": f"{lo}-{min(hi, 100):g}%", "requests": int(m.sum()), "frac": float(m.mean())})
    long_short = (inp >= 16000) & (out <= 32) & (hits < 50)
    return {
        "requests": len(records),
        "token_weighted_hit": float((hits / 100 * inp).sum() / inp.sum()),
        "mean_hit": float(hits.mean() / 100),
        "frac_over_95": float((hits > 95).mean()),
        "frac_output_lt_500": float((out < 500).mean()),
        "frac_long_in_short_out": float(long_short.mean()),
        "mean_input": float(inp.mean()),
        "mean_output": float(out.mean()),
        "bins": bins,
    }


def print_hit_histogram(records: Sequence[dict], file=None) -> dict:
    h = hit_histogram(records)
    p = lambda *a: print(*a, file=file)
    p(f"requests {h['requests']}  token-weighted hit {h['token_weighted_hit']:.1%}  "
      f">95% hit {h['frac_over_95']:.1%}  output<500 {h['frac_output_lt_500']:.1%}  "
      f"long-in/short-out {h['frac_long_in_short_out']:.1%}")
    for b in h["bins"]:
        p(f"  {b['bin']:>10}  {b['requests']:6d}  {b['frac']:6.1%}  " + "#" * int(b["frac"] * 60))
    return h
