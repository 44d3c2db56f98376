"""Fixtures: the gateway's FastAPI app over an in-process engine (no process topology), so the
API layer (parameters, stop strings, n, logprobs, chat) is tested in milliseconds.

``EngineOrch`` has the orchestrator's request interface (``start_request``, ``stream``,
``abort``, ``stats``, ``flush``) and runs every request on one local :class:`Engine`.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from pdd.config import ClusterConfig
from pdd.gateway.orchestrator import ABORT_CLIENT, ABORT_FAILED, ABORT_OUTCOMES, RequestFailed, ReqState, TokenOut

torch.set_num_threads(1)


class EngineOrch:
    def __init__(self, engine):
        self.engine = engine
        self.seqs: dict = {}
        self.states: dict = {}
        self.started: list[tuple[list[int], object]] = []
        self.aborted: list[str] = []
        self.abort_reasons: list[str] = []
        self.steps = 0
        self._n = 0
        self._runner: asyncio.Task | None = None
        self.fail_next = False

    async def start_request(self, prompt_ids, sp, rid=None, sibling_of=None, siblings=0) -> ReqState:
        if self.fail_next:
            err, self.fail_next = self.fail_next, False
            if isinstance(err, BaseException):  # as the orchestrator: wrapped, the cause kept
                raise RequestFailed(f"request failed while starting: {err}") from err
            raise RequestFailed("injected start failure")
        self._n += 1
        rid = rid or f"t{self._n}"
        st = ReqState(rid, len(prompt_ids), sp)
        try:
            seq = self.engine.new_sequence(rid, list(prompt_ids), sp, use_cache=True)
        except Exception as e:  # as the orchestrator: a tier's refusal fails the start
            raise RequestFailed(f"request {rid} failed while starting: {type(e).__name__}: {e}") from e
        st.p_cached_tokens = seq.num_cached_tokens
        self.engine.add(seq)
        self.seqs[rid], self.states[rid] = seq, st
        self.started.append((list(prompt_ids), sp))
        if self._runner is None or self._runner.done():
            self._runner = asyncio.get_running_loop().create_task(self._run())
        # like P: the call returns once the prompt is prefilled, its whole pages cached
        while seq.num_computed < seq.prompt_len and rid in self.seqs:
            await asyncio.sleep(0)
        ps = self.engine.page_size
        n = len(prompt_ids) // ps
        if n and rid in self.seqs:
            self.engine.radix.insert(list(prompt_ids)[:n * ps], seq.page_table[:n])
        return st

    async def _run(self) -> None:
        while self.engine.has_work():
            for ev in self.engine.step():
                st = self.states.get(ev.seq_id)
                fin = ev.finish_reason.value if ev.finished else None
                if st is not None:
                    st.queue.put_nowait(TokenOut(ev.position, ev.token_id, "local", fin, ev.logprobs))
                if ev.finished:
                    self.engine.release(self.seqs.pop(ev.seq_id))
            self.steps += 1
            await asyncio.sleep(0)

    async def stream(self, st: ReqState):
        try:
            while not st.finished:
                t = await asyncio.wait_for(st.queue.get(), 60)
                if t.fin is not None:
                    st.finished = True
                yield t
        except BaseException as e:
            if not st.finished:
                await self.abort(st, ABORT_CLIENT if isinstance(e, (asyncio.CancelledError, GeneratorExit))
                                 else ABORT_FAILED)
            raise

    async def abort(self, st: ReqState, reason: str) -> None:
        assert reason in ABORT_OUTCOMES, reason
        st.finished = True
        self.aborted.append(st.rid)
        self.abort_reasons.append(reason)
        seq = self.seqs.pop(st.rid, None)
        if seq is not None:
            self.engine.release(seq, cache=False)

    async def stats(self) -> dict:
        return {"steps": self.steps}

    async def flush(self) -> dict:
        return {}


@pytest.fixture
def api(tiny_model):
    """(TestClient, EngineOrch) for a fresh engine on the tiny checkpoint."""
    from fastapi.testclient import TestClient
    from tokenizers import Tokenizer

    from pdd.engine.engine import Engine
    from pdd.gateway.api import create_app

    eng = Engine.from_pretrained(tiny_model, num_pages=256, page_size=8)
    orch = EngineOrch(eng)
    cfg = ClusterConfig.model_validate({"model_path": tiny_model, "served_model_name": "pdd-tiny",
                                        "engine": {"max_model_len": 512, "max_input_len": 400}})
    tok = Tokenizer.from_file(f"{tiny_model}/tokenizer.json")
    app = create_app(cfg, orch, tok)
    with TestClient(app) as client:
        yield client, orch
