"""Open-loop async replay against an OpenAI-compatible ``/v1/completions`` endpoint (SSE streaming).

Every request is sent at its ``arrival_s`` (seconds after the replay starts) whatever happened to
earlier ones, over one ``httpx.AsyncClient`` with as many connections as requests. Each streamed
chunk is one token; its client receive time, and the ``"pdd"`` fields the gateway adds (tier,
pos, token_id), are recorded. The final usage chunk's ``usage`` and ``"pdd"`` fields are kept.
Nothing a server does (HTTP error, broken stream, error event, hang) crashes a run: the request
is recorded as failed with a one-line ``error`` ("HTTP 503: ...", "Timeout: ...",
"server error: ...", "<ExceptionType>: ...").

All times in a record are seconds on ``time.perf_counter`` relative to the replay start.
Also works against vLLM/SGLang (no ``"pdd"`` fields: a chunk with text counts as a token; a chunk
with vLLM's ``token_ids`` (asked for with ``return_token_ids``) counts as its ids, recorded).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import httpx

from pdd.workload.replay import ReplayRequest


@dataclass
class RequestRecord:
    """What the client saw of one request (one line of requests.jsonl).

    Times are seconds relative to the replay start: ``arrival_s`` scheduled send, ``send_s``
    actual send, ``end_s`` stream end (or failure), ``token_times_s`` receive time of each token.
    ``tiers``, ``pos``, ``token_ids`` are per token (None where the server did not say).
    ``usage`` is the OpenAI usage object; ``pdd`` the usage chunk's pdd fields (pipeline,
    wan_bytes, wan_bytes_expected, md_cached_tokens, p_cached_tokens, handoff_pos).
    ``ok``: the stream ended with ``[DONE]`` and no error.
    """

    idx: int
    mode: str = ""
    arrival_s: float = 0.0
    send_s: float | None = None
    end_s: float | None = None
    prompt_tokens: int = 0
    max_tokens: int = 0
    ok: bool = False
    error: str | None = None
    http_status: int | None = None
    token_times_s: list[float] = field(default_factory=list)
    token_ids: list[int | None] = field(default_factory=list)
    tiers: list[str | None] = field(default_factory=list)
    pos: list[int | None] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    usage: dict | None = None
    pdd: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RequestRecord":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    @property
    def num_tokens(self) -> int:
        return len(self.token_times_s)

    @property
    def ttft_ms(self) -> float | None:
        """Time to first token (ms), None without tokens."""
        if not self.token_times_s or self.send_s is None:
            return None
        return (self.token_times_s[0] - self.send_s) * 1000.0


def completion_body(
    prompt: str | list[int], max_tokens: int, model: str, extra: dict | None = None
) -> dict:
    """The JSON body of a greedy, ignore-EOS streaming completion with usage."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "ignore_eos": True,
    }
    body.update(extra or {})
    return body


def _short(s: str, n: int = 300) -> str:
    s = " ".join(s.split())
    return s if len(s) <= n else s[: n - 3] + "..."


async def _stream_one(
    client: httpx.AsyncClient,
    url: str,
    body: dict,
    rec: RequestRecord,
    clock: Callable[[], float],
    timeout_s: float,
) -> None:
    """Send one streaming request and fill ``rec``; never raises except on cancellation."""
    rec.send_s = clock()
    done = False
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", url.rstrip("/") + "/v1/completions", json=body) as resp:
                rec.http_status = resp.status_code
                if resp.status_code != 200:
                    raw = (await resp.aread()).decode("utf-8", errors="replace")
                    try:
                        msg = json.loads(raw)["error"]["message"]
                    except (ValueError, KeyError, TypeError):
                        msg = raw
                    rec.error = f"HTTP {resp.status_code}: {_short(str(msg))}"
                    return
                async for line in resp.aiter_lines():
                    now = clock()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    try:
                        obj = json.loads(data)
                        _absorb(rec, obj, now)
                    except (ValueError, TypeError, AttributeError):
                        # not JSON, or not the shape of a completion chunk (`data: 5`, a choice that
                        # is no object, a number as text): it was "TypeError: argument of type
                        # 'int' is not iterable", naming nothing the server sent
                        rec.error = rec.error or f"bad chunk: {_short(data, 120)}"
                        continue
                if not done and rec.error is None:
                    rec.error = "incomplete stream: closed before [DONE]"
    except TimeoutError:
        rec.error = f"Timeout: no end after {timeout_s:g} s ({len(rec.token_times_s)} tokens)"
    except httpx.HTTPError as ex:
        rec.error = f"{type(ex).__name__}: {_short(str(ex)) or 'transport error'}"
    except asyncio.CancelledError:
        rec.error = "cancelled"
        rec.end_s = clock()
        raise
    except Exception as ex:  # noqa: BLE001 - a benchmark run must survive anything one request does
        rec.error = f"{type(ex).__name__}: {_short(str(ex))}"
    finally:
        if rec.end_s is None:
            rec.end_s = clock()
        rec.ok = done and rec.error is None


def _absorb(rec: RequestRecord, obj: dict, now: float) -> None:
    """Fold one SSE JSON object into the record (token chunk, usage chunk or error event).
    TypeError / AttributeError, before the record changed, when ``obj`` is not shaped as one."""
    if "error" in obj and not obj.get("choices"):
        err = obj["error"]
        msg = err.get("message") if isinstance(err, dict) else err
        rec.error = f"server error: {_short(str(msg))}"
        return
    pd = obj.get("pdd") or {}
    choices = obj.get("choices") or []
    if not isinstance(pd, dict):
        raise TypeError("pdd is not an object")
    if not isinstance(choices, list):
        raise TypeError("choices is not a list")
    if choices:
        ch = choices[0]
        text = ch.get("text") or ""
        if not isinstance(text, str):
            raise TypeError("text is not a string")
        ids = ch.get("token_ids")
        if "token_id" not in pd and "pos" not in pd and isinstance(ids, list):
            # vLLM with return_token_ids: the chunk's token ids (one per token, text or not)
            for k, tid in enumerate(ids):
                rec.token_times_s.append(now)
                rec.token_ids.append(tid)
                rec.tiers.append(None)
                rec.pos.append(None)
                rec.text += text if k == 0 else ""
        elif "token_id" in pd or "pos" in pd or text:
            rec.token_times_s.append(now)
            rec.token_ids.append(pd.get("token_id"))
            rec.tiers.append(pd.get("tier"))
            rec.pos.append(pd.get("pos"))
            rec.text += text
        if ch.get("finish_reason"):
            rec.finish_reason = ch["finish_reason"]
    if obj.get("usage") is not None:
        rec.usage = obj["usage"]
        if not choices and pd:
            rec.pdd = dict(pd)


async def run_one(
    url: str,
    prompt: str | list[int],
    max_tokens: int,
    *,
    model: str = "pdd-small",
    timeout_s: float = 60.0,
    client: httpx.AsyncClient | None = None,
    extra_body: dict | None = None,
) -> RequestRecord:
    """Send one streaming completion now and return its record (times relative to the call, s)."""
    t0 = time.perf_counter()
    rec = RequestRecord(idx=0, prompt_tokens=len(prompt) if isinstance(prompt, list) else 0, max_tokens=max_tokens)
    body = completion_body(prompt, max_tokens, model, extra_body)
    own = client is None
    client = client or httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), trust_env=False)
    try:
        await _stream_one(client, url, body, rec, lambda: time.perf_counter() - t0, timeout_s)
    finally:
        if own:
            await client.aclose()
    return rec


def run_one_sync(url: str, prompt: str | list[int], max_tokens: int, **kw: Any) -> RequestRecord:
    """Blocking :func:`run_one` (for tests and scripts without an event loop)."""
    return asyncio.run(run_one(url, prompt, max_tokens, **kw))


async def replay(
    url: str,
    requests: Sequence[ReplayRequest],
    *,
    model: str = "pdd-small",
    mode: str = "",
    timeout_s: float = 300.0,
    max_connections: int | None = None,
    progress: bool = True,
    console=None,
    on_record: Callable[[RequestRecord], None] | None = None,
    extra_body: dict | None = None,
    max_in_flight: int | None = None,
    label: str | None = None,
) -> list[RequestRecord]:
    """Replay ``requests`` open-loop against ``url`` (gateway base URL); records in request order.

    ``timeout_s``: per request, from its send to its stream end. ``max_connections`` defaults to
    the number of requests (every request may be in flight at once). ``on_record`` is called as
    each request ends. ``progress`` shows a rich progress bar on ``console`` (titled ``label``,
    default ``mode``). ``max_in_flight``: at most this many requests in flight; requests are
    then sent in order, each at its ``arrival_s`` or when a slot frees, whichever is later
    (1 = one at a time, closed loop).
    """
    n = len(requests)
    if max_in_flight is not None and max_in_flight < 1:
        raise ValueError("max_in_flight must be >= 1")
    conns = max_connections or max(1, min(n, max_in_flight or n))
    limits = httpx.Limits(max_connections=conns, max_keepalive_connections=conns)
    timeout = httpx.Timeout(timeout_s, connect=min(30.0, timeout_s), pool=None)
    records = [
        RequestRecord(idx=r.idx, mode=mode, arrival_s=r.arrival_s, prompt_tokens=len(r.prompt_ids), max_tokens=r.max_tokens)
        for r in requests
    ]
    state = {"done": 0, "failed": 0, "tokens": 0}

    prog = task = None
    if progress:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        prog = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"), console=console, transient=False,
        )
        task = prog.add_task(label or mode or "replay", total=n, info="")
        prog.start()

    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        t0 = time.perf_counter()
        clock = lambda: time.perf_counter() - t0  # noqa: E731

        async def one(req: ReplayRequest, rec: RequestRecord) -> None:
            delay = req.arrival_s - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            body = completion_body(req.prompt_ids, req.max_tokens, model, extra_body)
            await _stream_one(client, url, body, rec, clock, timeout_s)
            state["done"] += 1
            state["failed"] += 0 if rec.ok else 1
            state["tokens"] += len(rec.token_times_s)
            if prog is not None:
                prog.update(task, advance=1, info=f"failed {state['failed']}  tokens {state['tokens']}")
            if on_record is not None:
                on_record(rec)

        async def worker(queue: asyncio.Queue) -> None:
            while not queue.empty():
                i = queue.get_nowait()
                await one(requests[i], records[i])

        try:
            if max_in_flight is None or max_in_flight >= n:
                await asyncio.gather(*(one(q, r) for q, r in zip(requests, records)))
            else:
                queue: asyncio.Queue = asyncio.Queue()
                for i in range(n):
                    queue.put_nowait(i)
                await asyncio.gather(*(worker(queue) for _ in range(max_in_flight)))
        finally:
            if prog is not None:
                prog.stop()
    return records


def replay_sync(url: str, requests: Sequence[ReplayRequest], **kw: Any) -> list[RequestRecord]:
    """Blocking :func:`replay`."""
    return asyncio.run(replay(url, requests, **kw))
