"""OpenAI-compatible HTTP API of the gateway (FastAPI): completions (SSE or not), models,
health, and pdd's own ``/pdd/stats`` and ``/pdd/flush``.

Every streamed chunk carries one token; besides the OpenAI fields it has ``"pdd": {"tier",
"pos", "token_id"}`` (which decoder produced it). With ``stream_options.include_usage`` a last
chunk carries ``usage`` (``prompt_tokens_details.cached_tokens`` = P's prefix-cache hits, the
figure billing uses) and ``"pdd": {"pipeline", "wan_bytes", "wan_bytes_expected", ...}``.
Bad input gets HTTP 400 with an OpenAI-style error body before any tier does work.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from pdd.config import ClusterConfig
from pdd.gateway.orchestrator import Orchestrator, RequestFailed, ReqState
from pdd.types import SamplingParams

log = logging.getLogger(__name__)


class StreamOptions(BaseModel):
    include_usage: bool = False


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(16, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # OpenAI's and vLLM's default
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    seed: int | None = None
    n: int = Field(1, ge=1, le=1)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    user: str | None = None


def error_body(message: str, param: str | None = None, code: str | None = None, etype: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": etype, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, status: int = 400, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, param, code), status_code=status)


class Detokenizer:
    """Incremental text for a growing list of ids; holds back a trailing partial UTF-8 char."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.sent = ""

    def add(self, token_id: int, final: bool) -> str:
        self.ids.append(token_id)
        full = self.tok.decode(self.ids, skip_special_tokens=True)
        if full.endswith("\ufffd") and not final:
            return ""
        if not full.startswith(self.sent):  # tokenizer re-segmented: emit the difference safely
            out = full[len(self.sent):] if len(full) > len(self.sent) else ""
        else:
            out = full[len(self.sent):]
        self.sent = full
        return out


def create_app(cfg: ClusterConfig, orch: Orchestrator, tokenizer) -> FastAPI:
    app = FastAPI(title="pdd gateway", version="0.1.0")
    vocab = int(tokenizer.get_vocab_size(with_added_tokens=True))
    model_vocab = _model_vocab(cfg) or vocab

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", []) if x != "body"]
        param = ".".join(loc) or None
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            return bad_request(f"request body is not valid JSON: {msg}", None)
        return bad_request(f"{param}: {msg}" if param else msg, param)

    @app.get("/health")
    async def health():
        return {"status": "ok", "mode": cfg.mode}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": cfg.served_model_name, "object": "model", "created": 0, "owned_by": "pdd"}]}

    @app.get("/pdd/stats")
    async def stats():
        return await orch.stats()

    @app.post("/pdd/flush")
    async def flush():
        return await orch.flush()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        if body.model is not None and body.model != cfg.served_model_name:
            return bad_request(f"model {body.model!r} does not exist; this server serves {cfg.served_model_name!r}",
                               "model", status=404, code="model_not_found")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                return bad_request("prompt: only one prompt per request is supported", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = tokenizer.encode(prompt, add_special_tokens=False).ids
        else:
            ids = list(prompt)
            bad = [t for t in ids if not (0 <= t < model_vocab)]
            if bad:
                return bad_request(f"prompt: token id {bad[0]} is outside the vocabulary [0, {model_vocab})", "prompt")
        if not ids:
            return bad_request("prompt: must not be empty", "prompt")
        e = cfg.engine
        max_tokens = body.max_tokens if body.max_tokens is not None else 16
        if len(ids) > e.max_input_len:
            return bad_request(f"prompt: {len(ids)} tokens is longer than the maximum input length {e.max_input_len}",
                               "prompt", code="context_length_exceeded")
        if len(ids) + max_tokens > e.max_model_len:
            return bad_request(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the context window "
                               f"of {e.max_model_len} tokens", "max_tokens", code="context_length_exceeded")
        # an unseeded sampled request still gets one seed, shared by every tier that decodes it,
        # so RLD and MD draw identically for each position
        seed = body.seed if body.seed is not None else secrets.randbits(63)
        sp = SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                            seed=seed, ignore_eos=body.ignore_eos, stop_token_ids=list(body.stop_token_ids or []))
        try:
            st = await orch.start_request(ids, sp)
        except RequestFailed as ex:
            return JSONResponse(error_body(str(ex), etype="server_error"), status_code=503)
        created = int(time.time())
        cid = f"cmpl-{st.rid}"
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_sse(orch, st, tokenizer, cid, created, cfg.served_model_name, include_usage),
                                     media_type="text/event-stream")
        detok = Detokenizer(tokenizer)
        text, fin, ntok = [], None, 0
        try:
            async for t in orch.stream(st):
                ntok += 1
                text.append(detok.add(t.token_id, t.fin is not None))
                fin = t.fin
        except RequestFailed as ex:
            return JSONResponse(error_body(str(ex), etype="server_error"), status_code=503)
        return {"id": cid, "object": "text_completion", "created": created, "model": cfg.served_model_name,
                "choices": [{"index": 0, "text": "".join(text), "logprobs": None, "finish_reason": fin}],
                "usage": _usage(st, ntok), "pdd": _pdd_summary(st)}

    return app


def _model_vocab(cfg: ClusterConfig) -> int | None:
    try:
        with open(f"{cfg.model_path}/config.json") as f:
            return int(json.load(f)["vocab_size"])
    except Exception:
        return None


def _usage(st: ReqState, ntok: int) -> dict:
    return {"prompt_tokens": st.prompt_len, "completion_tokens": ntok, "total_tokens": st.prompt_len + ntok,
            "prompt_tokens_details": {"cached_tokens": st.p_cached_tokens}}


def _pdd_summary(st: ReqState) -> dict[str, Any]:
    return {"pipeline": st.pipeline.value, "wan_bytes": st.wan_bytes, "wan_bytes_expected": st.wan_bytes_expected,
            "md_cached_tokens": st.md_cached_tokens, "p_cached_tokens": st.p_cached_tokens,
            "handoff_pos": st.handoff_pos, "rld_finished_first": st.rld_finished_first,
            "events_ms": {k: round((v - st.t_arrival) * 1000, 2) for k, v in st.events.items()}}


async def _sse(orch: Orchestrator, st: ReqState, tokenizer, cid: str, created: int, model: str, include_usage: bool):
    detok = Detokenizer(tokenizer)
    ntok = 0
    try:
        async for t in orch.stream(st):
            ntok += 1
            chunk = {"id": cid, "object": "text_completion", "created": created, "model": model,
                     "choices": [{"index": 0, "text": detok.add(t.token_id, t.fin is not None), "logprobs": None,
                                  "finish_reason": t.fin}],
                     "pdd": {"tier": t.tier, "pos": t.pos, "token_id": t.token_id}}
            yield f"data: {json.dumps(chunk)}\n\n"
    except RequestFailed as ex:
        yield f"data: {json.dumps(error_body(str(ex), etype='server_error'))}\n\n"
        yield "data: [DONE]\n\n"
        return
    if include_usage:
        chunk = {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": [],
                 "usage": _usage(st, ntok), "pdd": _pdd_summary(st)}
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"


async def serve_gateway(cfg: ClusterConfig, lay) -> None:
    """Run the gateway process: connect to every tier, then serve HTTP; print ``READY gateway``."""
    import asyncio
    import signal

    import uvicorn
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(f"{cfg.model_path}/tokenizer.json")
    orch = Orchestrator(cfg, lay)
    await orch.start()
    app = create_app(cfg, orch, tokenizer)
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.gateway_port, log_level="warning",
                                           timeout_keep_alive=30, limit_concurrency=1024))
    loop = asyncio.get_running_loop()
    task = loop.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("gateway HTTP server did not start")
        await asyncio.sleep(0.05)
    print("READY gateway", flush=True)

    def _stop():
        server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, _stop)
        except NotImplementedError:
            pass
    await task
    await orch.close()
