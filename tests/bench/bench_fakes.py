"""Fake OpenAI-style SSE server and fake topology for the bench tests (imported by conftest.py)."""

import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

# prompt[0] selects the behaviour of the fake server (anything >= 10 is OK)
OK, HTTP_500, MID_ERROR, HANG, NO_DONE, ODD_CHUNKS = 1, 2, 3, 4, 5, 6


def fake_app(hang_every: int = 0, vocab: int | None = None) -> FastAPI:
    """``hang_every`` N > 0: every N-th request (1-based, in arrival order) stalls after its first
    token as HANG does, whatever its prompt (a mode whose requests time out). ``vocab``: a prompt
    holding an id at or past it is refused with HTTP 400, as pdd's gateway words it."""
    app = FastAPI()
    arrivals = [0]

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        prompt, n = body["prompt"], body["max_tokens"]
        if vocab is not None and isinstance(prompt, list) and max(prompt) >= vocab:
            return JSONResponse({"error": {"message": f"prompt: token id {max(prompt)} is outside the vocabulary "
                                                      f"[0, {vocab})", "type": "invalid_request_error",
                                           "param": "prompt", "code": None}}, status_code=400)
        kind = prompt[0] if isinstance(prompt, list) and prompt[0] < 10 else OK
        arrivals[0] += 1
        if hang_every and arrivals[0] % hang_every == 0:
            kind = HANG
        assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["ignore_eos"]
        if kind == HTTP_500:
            return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, status_code=500)

        async def gen():
            for pos in range(n):
                if kind == HANG and pos == 1:
                    await asyncio.sleep(30)
                if kind == MID_ERROR and pos == 2:
                    yield f"data: {json.dumps({'error': {'message': 'MD lost', 'type': 'server_error'}})}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                if kind == ODD_CHUNKS and pos == 1:  # JSON, but no completion chunk's shape
                    for odd in ('{"choices": {"a": 1}}', "5", "[]", '{"choices": ["t"]}', '{"choices": [{"text": 7}]}'):
                        yield f"data: {odd}\n\n"
                await asyncio.sleep(0.005)
                chunk = {"id": "c", "object": "text_completion", "created": 0, "model": body["model"],
                         "choices": [{"index": 0, "text": f"t{pos} ", "logprobs": None,
                                      "finish_reason": "length" if pos == n - 1 else None}],
                         "pdd": {"tier": "rld" if pos < 2 else "md", "pos": pos, "token_id": 100 + pos}}
                yield f"data: {json.dumps(chunk)}\n\n"
            if kind == NO_DONE:
                return
            usage = {"id": "c", "object": "text_completion", "created": 0, "model": body["model"], "choices": [],
                     "usage": {"prompt_tokens": len(prompt), "completion_tokens": n,
                               "total_tokens": len(prompt) + n, "prompt_tokens_details": {"cached_tokens": 0}},
                     "pdd": {"pipeline": "p_rld_md", "wan_bytes": 10 * len(prompt),
                             "wan_bytes_expected": 10 * len(prompt), "md_cached_tokens": 0, "p_cached_tokens": 0,
                             "handoff_pos": 2}}
            yield f"data: {json.dumps(usage)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


def serve_in_thread(app):
    """Serve ``app`` with uvicorn on a free local port in a daemon thread; returns ``(url, stop)``."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)

    def stop():
        server.should_exit = True
        th.join(5)
        sock.close()
    return f"http://127.0.0.1:{sock.getsockname()[1]}", stop


@pytest.fixture(scope="session")
def server_url():
    url, stop = serve_in_thread(fake_app())
    yield url
    stop()


class FakeTopology:
    """Stands in for pdd.launch.Topology: the fake server plus counters for stats/flush."""

    started: list = []
    events: list = []  # ("flush", mode) / ("stats", mode), across instances, in order

    def __init__(self, url, cfg, log_dir=None):
        self.url, self.cfg, self.calls, self.cpu_calls = url, cfg, 0, 0

    def __enter__(self):
        FakeTopology.started.append(self.cfg.mode)
        return self

    def __exit__(self, *exc):
        return None

    def stats(self):
        self.calls += 1
        FakeTopology.events.append(("stats", self.cfg.mode))
        return {"mode": self.cfg.mode, "wan_line_bytes": 1000 * self.calls,
                "instances": {"p": {"role": "prefill", "pages_total": 64, "pages_free": 64, "cpu_seconds": 0.5 * self.calls}}}

    def flush(self):
        FakeTopology.events.append(("flush", self.cfg.mode))
        return {"instances": {"p": {"pages_total": 64, "pages_free": 64}}, "leaked_pages": 0}

    def cpu_seconds(self):
        self.cpu_calls += 1
        return {"gateway": 0.25 * self.cpu_calls, "p": 1.0 * self.cpu_calls}
