"""The gateway's constraint compiles (``pdd.structured.compiler``, a
``pdd.compile_queue.CompileQueue``): a small constraint overtakes a large one queued before it,
and a client that disconnects while its compile waits drops the compile (it never runs) and its
request never starts. The real HTTP app on a real uvicorn server over the held orchestrator of
``test_disconnect_start``; the queue's clock is the test's, so the order is exact, and its one thread
is held by a job of the test's while requests queue."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from pdd import structured
from pdd.compile_queue import CompileQueue
from pdd.gateway.orchestrator import OUTCOMES
from tests.api.test_disconnect_start import PROMPT_LONG, _post, _until, held  # noqa: F401 - the fixture

BIG = "root ::= " + " | ".join(f'"w{i}"' for i in range(400))  # a GBNF grammar of 4,179 characters


@pytest.fixture
def queue(monkeypatch):
    """The gateway's compiler replaced by a queue on a frozen clock, its thread held until ``go``;
    the constraints compiled (the guided field's value, in order)."""
    import pdd.gateway.api as gapi

    clock = [0.0]
    q = CompileQueue(threads=1, stack_bytes=structured.COMPILER_STACK_BYTES, clock=lambda: clock[0],
                     name="grammar-compile")
    monkeypatch.setattr(structured, "_COMPILER", q)
    compiled: list[str] = []
    real = gapi.structured_constraint

    def spy(body, lltok=None):
        compiled.append(body.guided_regex or body.guided_grammar)
        return real(body, lltok)

    monkeypatch.setattr(gapi, "structured_constraint", spy)
    go, started = threading.Event(), threading.Event()
    busy = q.submit(lambda: (started.set(), go.wait(60)))
    assert started.wait(60)
    yield q, go, compiled, clock
    go.set()
    busy.result(60)
    q.shutdown()


async def _status(reader) -> str:
    return (await asyncio.wait_for(reader.readline(), 30)).decode()


async def test_a_small_constraint_overtakes_a_large_one_queued_before_it(held, queue):
    orch, app, port = held
    q, go, compiled, clock = queue
    orch.go.set()  # every request that starts streams its tokens
    big = await _post(port, {"prompt": PROMPT_LONG, "max_tokens": 2, "guided_grammar": BIG})
    await _until(lambda: q.pending() == 1, "the large compile to queue")
    small = await _post(port, {"prompt": PROMPT_LONG, "max_tokens": 2, "guided_regex": "w[0-9]"})
    await _until(lambda: q.pending() == 2, "the small compile to queue")
    clock[0] = 1.0  # both have waited 1 s: the small one's ratio is the higher
    go.set()
    for reader, writer in (small, big):
        assert (await _status(reader)).startswith("HTTP/1.1 200")
        writer.close()
    assert compiled == ["w[0-9]", BIG]


async def test_a_client_gone_while_its_compile_waits_drops_the_compile(held, queue):
    orch, app, port = held
    q, go, compiled, clock = queue
    reader, writer = await _post(port, {"prompt": PROMPT_LONG, "max_tokens": 2, "guided_regex": "gone"})
    await _until(lambda: q.pending() == 1, "the compile to queue")
    writer.close()
    await writer.wait_closed()
    await _until(lambda: q.pending() == 0, "the queued compile to be cancelled")
    go.set()
    orch.go.set()
    reader, writer = await _post(port, {"prompt": PROMPT_LONG, "max_tokens": 2, "guided_regex": "kept"})
    assert (await _status(reader)).startswith("HTTP/1.1 200")
    writer.close()
    await _until(lambda: not orch.reqs, "the kept request to end")
    assert compiled == ["kept"]  # the gone client's constraint was never compiled
    assert {k: orch.totals[k] for k in OUTCOMES} == {"completed": 1, "failed": 0, "cancelled": 0, "rejected": 0}


async def test_a_constraint_compiled_before_queues_as_a_small_one(held, queue):
    """Sent again, a large constraint compiles from pdd.structured's cache in milliseconds: it
    queues at the least cost, ahead of a new large one queued before it."""
    orch, app, port = held
    q, go, compiled, clock = queue
    orch.go.set()
    go.set()  # the first BIG compiles at once
    reader, writer = await _post(port, {"prompt": PROMPT_LONG, "max_tokens": 2, "guided_grammar": BIG})
    assert (await _status(reader)).startswith("HTTP/1.1 200")
    writer.close()
    go.clear()
    started = threading.Event()
    busy = q.submit(lambda: (started.set(), go.wait(60)))
    assert started.wait(60)
    other = BIG.replace('"w0"', '"v0"')  # as large, never compiled
    new = await _post(port, {"prompt": PROMPT_LONG, "max_tokens": 2, "guided_grammar": other})
    await _until(lambda: q.pending() == 1, "the new large compile to queue")
    again = await _post(port, {"prompt": PROMPT_LONG, "max_tokens": 2, "guided_grammar": BIG})
    await _until(lambda: q.pending() == 2, "the cached one to queue")
    clock[0] += 1.0
    go.set()
    busy.result(60)
    for reader, writer in (again, new):
        assert (await _status(reader)).startswith("HTTP/1.1 200")
        writer.close()
    assert compiled == [BIG, BIG, other]


async def _answer(reader) -> tuple[str, dict]:
    """The status line and JSON body of one HTTP/1.1 response."""
    status = await _status(reader)
    length = 0
    while (line := (await asyncio.wait_for(reader.readline(), 30)).decode()) != "\r\n":
        name, _, value = line.partition(":")
        if name.lower() == "content-length":
            length = int(value)
    return status, json.loads(await asyncio.wait_for(reader.readexactly(length), 30))


OVER = "root ::= " + " | ".join(f'"x{i}"' for i in range(6000))  # a GBNF grammar of 58,896 characters


WS_KIND = ("guided_whitespace_pattern: a whitespace pattern lays out JSON output, and guided_regex gives a regex "
           "constraint")


def _too_large(where: str, n: int) -> str:
    return f"{where}: the constraint is {n:,} characters; at most 32,768 are compiled"


@pytest.mark.parametrize("field,param,message", [
    ({"guided_grammar": OVER}, "guided_grammar", _too_large("guided_grammar", len(OVER))),
    ({"structured_outputs": {"grammar": OVER}}, "structured_outputs", _too_large("structured_outputs.grammar", len(OVER))),
    ({"guided_regex": "a" * 40_000}, "guided_regex", _too_large("guided_regex", 40_000)),
    ({"guided_choice": ["c" * 20_000, "d" * 20_000]}, "guided_choice", _too_large("guided_choice", 40_008)),
    ({"guided_json": {"enum": ["e" * 40_000]}}, "guided_json", _too_large("guided_json", 40_014)),
    # with a whitespace pattern within the limit (it compiles after what is refused without compiling)
    ({"guided_json": {"enum": ["e" * 40_000]}, "guided_whitespace_pattern": "[ ]{0,2}"}, "guided_json",
     _too_large("guided_json", 40_014 + len("[ ]{0,2}"))),
    ({"guided_regex": "a" * 40_000, "guided_whitespace_pattern": " "}, "guided_whitespace_pattern", WS_KIND),
    ({"guided_regex": "w", "guided_whitespace_pattern": " " * 40_000}, "guided_whitespace_pattern",
     _too_large("guided_whitespace_pattern", 40_000)),
])
async def test_a_constraint_over_the_size_limit_is_refused_before_it_queues(held, queue, field, param, message):
    """Refused only when its compile ran, a constraint over pdd.structured.MAX_CONSTRAINT_CHARS
    waited behind every compile queued before it (4-5 s behind large grammars) for its 400; the
    size is known without compiling, with a whitespace pattern too (whose regex compiled before
    the size was read: it queued). The compiler's thread is held throughout."""
    orch, app, port = held
    q, go, compiled, clock = queue
    reader, writer = await _post(port, {"prompt": PROMPT_LONG, "max_tokens": 2, **field})
    status, body = await _answer(reader)
    writer.close()
    assert status.startswith("HTTP/1.1 400"), (status, body)
    assert body["error"] == {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    assert q.pending() == 0 and compiled == [] and not orch.reqs
