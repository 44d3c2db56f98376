"""MD on vLLM: pdd's MD wire endpoint in front of a vLLM server that loads KV with ``PddConnector``.

One process per MD instance (``vllm.main_decode: true`` in the config; ``pdd.launch`` picks this
class for role ``main_decode``). It speaks MD's messages unchanged (``pdd.roles.main_decode``:
``reserve``, ``kv``, ``kv_done``, ``extend``, ``finish``, ``kv_cancel`` / ``drop``, ``abort``), and
starts vLLM's OpenAI server as its child, with ``--kv-transfer-config`` naming
:class:`pdd.vllm_tier.connector.PddConnector`.

What is pdd's here and what is vLLM's:

- **DRC and staging are pdd's.** The endpoint holds pdd's paged KV pool and radix cache in host
  memory (the engine's pool and radix cache, the model loaded but never run: no forward pass
  happens in this process). ``reserve`` matches the prompt there (whole pdd pages), so only the
  missing pages cross the WAN; ``kv`` frames land in the pool as on pdd's MD; ``kv_done`` inserts
  the prompt's whole pages into the radix cache and reports ``kv_ready``. This pool is the
  connector's staging area: pages arrive while RLD decodes, before a vLLM request exists.
- **Extend and decode are vLLM's.** At the (final) handoff the prompt's pages are written to a
  staged file (:mod:`pdd.vllm_tier.staging`) and the endpoint POSTs a streaming
  ``/v1/completions`` with ``prompt`` = prompt ids + the handed-over ids, ``max_tokens`` = what is
  left, and ``kv_transfer_params`` naming the staged file. The connector loads the staged tokens
  beyond vLLM's own prefix hit into vLLM's paged KV before the step; vLLM's prefill computes the
  rest (the handed-over ids: the extend) and samples on. Its tokens go to the gateway as pdd's
  ``tok`` messages, at the positions pdd's MD would give them.
- **Catch-up** maps to nothing in vLLM's API (a running request takes no more prompt tokens): a
  non-final ``extend`` round is acknowledged without compute (``steps: 0``) and the final round's
  prefill covers every id. A P->MD request (no relay) is the same completion with the prompt +
  P's first token.
- Sampling: greedy equals pdd's engine; vLLM draws its own random numbers, so a seeded sampled
  request is not token-equal to pdd's counter-based draws; logprobs are not returned.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
from pathlib import Path

import httpx

from pdd.roles.base import first_token_finish
from pdd.roles.main_decode import MainDecodeInstance
from pdd.topology import http_url
from pdd.transfer.messages import Extend, ExtendOk, KvDone, KvReady, ReqError, WanSample
from pdd.types import FinishReason
from pdd.vllm_tier.staging import stage_root, write_stage

log = logging.getLogger(__name__)

CONNECTOR_MODULE = "pdd.vllm_tier.connector"
CONNECTOR_CLASS = "PddConnector"


def src_root() -> str:
    """The directory holding the ``pdd`` package (vLLM's processes import the connector from it)."""
    return str(Path(__file__).resolve().parents[2])


def kv_transfer_config() -> dict:
    return {"kv_connector": CONNECTOR_CLASS, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_consumer"}


def vllm_md_command(python, cfg, port: int, max_model_len: int, torch_dtype: str) -> list[str]:
    """vLLM's server for the MD tier: the checkpoint, dtype and limits of ``cfg``'s main-decode
    engine block, the connector, and ``cfg.vllm.extra_args``."""
    e = cfg.engine_for("main_decode")
    return [str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(Path(cfg.model_path).resolve()),
            "--served-model-name", cfg.served_model_name,
            "--host", cfg.host, "--port", str(int(port)),
            "--dtype", torch_dtype,
            "--max-model-len", str(int(max_model_len)),
            "--max-num-seqs", str(e.max_running),
            "--max-num-batched-tokens", str(max(e.max_batch_tokens, max_model_len)),
            "--seed", str(cfg.model_seed),
            "--kv-transfer-config", json.dumps(kv_transfer_config()),
            "--enable-prompt-tokens-details",  # usage says how many prompt tokens vLLM did not compute
            "--disable-uvicorn-access-log", *cfg.vllm.extra_args]


def vllm_md_env(cfg, threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.vllm.kvcache_gib))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    env["VLLM_SERVER_DEV_MODE"] = "1"  # serves /reset_prefix_cache (pdd's flush)
    env["PYTHONPATH"] = src_root()  # the connector only: vLLM's own packages come from its venv
    env["NO_PROXY"] = env["no_proxy"] = ",".join(x for x in (env.get("NO_PROXY"), cfg.host, "localhost") if x)
    return env


def md_vllm_python(cfg, name: str) -> Path:
    """The Python of vLLM's venv for MD instance ``name`` (:func:`pdd.vllm_tier.venv.vllm_python`
    on the config's ``vllm.python``). Raises ``VllmMissing`` naming the instance, ``make vllm`` and
    what ``pdd serve`` / ``pdd launch`` take instead: the config's ``vllm.python`` or
    ``$PDD_VLLM_PYTHON`` (they have no ``--vllm-python`` flag)."""
    from pdd.vllm_tier.venv import vllm_python

    return vllm_python(cfg.vllm.python, who=f"{name} (vllm.main_decode)", flag=None)


def sampling_body(sp, have: int) -> dict:
    """vLLM completion fields for pdd's ``SamplingParams`` after ``have`` outputs exist
    (``allowed_token_ids`` and ``bad_words`` as vLLM's own, into its SamplingParams). Raises
    ``ValueError`` for a structured output (``sp.grammar``): vLLM would start the constraint at
    its own first token, after the ``have`` outputs (the gateway refuses such requests first)."""
    if sp.grammar is not None:
        raise ValueError(f"a structured output ({', '.join(sp.structured or {})}) cannot continue on vLLM after "
                         f"{have} outputs: vLLM starts a constraint at its own first token")
    body = {"max_tokens": sp.max_tokens - have, "temperature": sp.temperature, "top_p": sp.top_p,
            "top_k": sp.top_k, "ignore_eos": sp.ignore_eos, "stop_token_ids": list(sp.stop_token_ids),
            "min_p": sp.min_p, "presence_penalty": sp.presence_penalty,
            "frequency_penalty": sp.frequency_penalty, "repetition_penalty": sp.repetition_penalty,
            "min_tokens": max(0, sp.min_tokens - have), "skip_special_tokens": False}
    if sp.seed is not None:
        body["seed"] = int(sp.seed) % (1 << 63)
    if sp.logit_bias:
        body["logit_bias"] = {str(k): float(v) for k, v in sp.logit_bias.items()}
    if sp.allowed_token_ids is not None:
        body["allowed_token_ids"] = [int(t) for t in sp.allowed_token_ids]
    if sp.bad_words:
        # vLLM tokenises them itself (the same tokenizer: the ids the gateway made). Its history for
        # a multi-token word is the outputs vLLM itself generated: the prompt it is sent holds the
        # ``have`` outputs before, so a word begun before the handoff and ended after is not seen.
        body["bad_words"] = list(sp.bad_words)
    return body


class VllmMainDecodeInstance(MainDecodeInstance):
    tier = "md"

    def __init__(self, cfg, spec, lay):
        super().__init__(cfg, spec, lay)
        self.tier = "md" if spec.dc == "B" else "d"
        self.proc = None
        self.vllm_url: str | None = None
        self.stage_dir: str | None = None
        self.http: httpx.AsyncClient | None = None
        self.vllm_ready_s: float | None = None
        self.vllm_log: str | None = None
        self.handoff_ms: list[float] = []  # extend received -> vLLM's first token, per request
        self.stage_ms: list[float] = []  # of which: writing the staged file
        self.vllm_cached_tokens = 0  # prompt tokens vLLM did not compute (loaded or its own cache hit)
        self.vllm_prompt_tokens = 0

    # ------------------------------------------------------------------ set-up
    async def start(self) -> None:
        await super().start()  # pdd's pool + radix cache (the DRC and staging) and the RPC server
        self.stage_dir = stage_root(self.spec.name)
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), trust_env=False)
        self._spawn_vllm()  # from this (the main) thread: the child's parent-death signal follows it
        await asyncio.to_thread(self._wait_vllm)

    def _spawn_vllm(self) -> None:
        import subprocess
        import tempfile

        from pdd.vllm_tier.venv import free_port, model_max_len

        python = md_vllm_python(self.cfg, self.spec.name)
        e = self.engine_cfg
        port = free_port(self.cfg.host)
        self.vllm_url = http_url(self.cfg.host, port)
        self.vllm_command = vllm_md_command(python, self.cfg, port,
                                            model_max_len(self.cfg.model_path, e.max_model_len), e.dtype)
        self.vllm_log = str(Path(tempfile.mkdtemp(prefix=f"pdd-vllm-{self.spec.name}-log-")) / "vllm.log")
        self._t_spawn = time.monotonic()
        with open(self.vllm_log, "w") as logf:
            self.proc = subprocess.Popen(self.vllm_command, stdout=logf, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=vllm_md_env(self.cfg, e.torch_threads),
                                         start_new_session=True, preexec_fn=_die_with_parent)
        print(f"{self.spec.name}: vLLM server starting on {self.vllm_url}, log {self.vllm_log}: "
              f"{' '.join(self.vllm_command)}", flush=True)

    def _wait_vllm(self) -> None:
        deadline = self._t_spawn + self.cfg.vllm.start_timeout_s
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise RuntimeError(f"{self.spec.name}: vLLM exited with {rc} before it was ready; log {self.vllm_log}:\n"
                                   + _tail(self.vllm_log))
            try:
                if httpx.get(f"{self.vllm_url}/health", timeout=5, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self._stop_vllm()
                raise RuntimeError(f"{self.spec.name}: vLLM not ready after {self.cfg.vllm.start_timeout_s:.0f} s; "
                                   f"log {self.vllm_log}:\n" + _tail(self.vllm_log))
            time.sleep(0.5)
        self.vllm_ready_s = round(time.monotonic() - self._t_spawn, 1)
        print(f"{self.spec.name}: vLLM ready after {self.vllm_ready_s} s", flush=True)

    def _stop_vllm(self) -> None:
        import signal

        p, self.proc = self.proc, None
        if p is None:
            return
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=15)
        except (ProcessLookupError, PermissionError):
            pass
        except Exception:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            p.wait()

    async def stop(self) -> None:
        if self.stage_dir:  # first: a supervisor may SIGKILL this process while vLLM stops
            shutil.rmtree(self.stage_dir, ignore_errors=True)
        if self.http is not None:
            await self.http.aclose()
        await asyncio.to_thread(self._stop_vllm)
        await super().stop()

    def extra_stats(self) -> dict:
        hm, sm = sorted(self.handoff_ms), sorted(self.stage_ms)
        return {**super().extra_stats(), "engine": "vllm", "vllm_url": self.vllm_url, "vllm_log": self.vllm_log,
                "vllm_ready_s": self.vllm_ready_s, "vllm_requests": len(self.handoff_ms),
                "vllm_prompt_tokens": self.vllm_prompt_tokens, "vllm_cached_tokens": self.vllm_cached_tokens,
                "vllm_first_token_ms_median": hm[len(hm) // 2] if hm else None,
                "stage_write_ms_median": sm[len(sm) // 2] if sm else None,
                "staged_files": sum(1 for f in os.listdir(self.stage_dir) if f.endswith(".kv")) if self.stage_dir else 0}

    async def on_flush(self, peer, h, payload):
        """pdd's staging DRC is flushed as pdd's MD's; vLLM's own prefix cache is reset too."""
        try:
            await self.http.post(f"{self.vllm_url}/reset_prefix_cache", timeout=60)
        except httpx.HTTPError as e:
            log.warning("%s: vLLM's prefix cache reset failed: %s", self.spec.name, e)
        return await super().on_flush(peer, h, payload)

    def handlers(self) -> dict:
        hs = super().handlers()
        hs.pop("generate", None)  # colocated on vLLM is `pdd bench --modes vllm_colocated`
        return hs

    # ------------------------------------------------------------------ KV in
    async def on_kv_done(self, peer, h, payload):
        """As pdd's MD, except that nothing joins a pdd batch: the prompt's whole pages enter
        the DRC, then ``kv_ready`` (relayed) or, for a P->MD request, P's first token goes out and
        vLLM decodes from prompt + that token."""
        m = KvDone.decode(h)
        ctx = self.reqs.get(m.rid)
        if ctx is None:
            self.early.hold(m.rid, "kv_done", h, b"", time.monotonic())
            return None
        parts = int(ctx.extra.get("kv_parts", 1)) - 1
        ctx.extra["kv_parts"] = parts
        if parts > 0:
            return None
        t0, fin, relay = m.first_token, m.fin or None, bool(m.relay)
        if await self.first_token_refused(ctx, h, t0):  # as pdd's MD: an id outside the vocabulary
            return None
        seq = ctx.seq

        def _imported(e):
            e.kv_imported(seq, None, add=False)  # the prompt's KV only: outputs are vLLM's
            n = seq.prompt_len // e.page_size
            if n and e.radix is not None:
                e.radix.insert(seq.token_ids[: n * e.page_size], seq.page_table[:n])

        ctx.extra["kv_complete"] = True
        ctx.extra["first_token"] = t0
        if not relay:
            self.emit(ctx, 0, t0, fin)
        else:  # the pages are in the pool already (imported as they came): the handoff may stage them
            ctx.sink.put(KvReady(ctx.rid).wire())
        await self.worker.call(_imported, overlap=True)
        ctx.extra["kv_imported"] = True
        self._kv_settled(ctx.rid)
        rate = self.kv_rate_sample_gbps(ctx)
        if rate is not None:
            ctx.sink.put(WanSample(rate).wire())
        if not relay:
            if fin is not None:
                await self.release(ctx, cache=True)
            else:
                self._start_decode(ctx, [int(t0)])
        return None

    # ------------------------------------------------------------------ handoff
    async def on_extend(self, peer, h, payload):
        m = Extend.decode(h)
        ctx = self.reqs.get(m.rid)
        if ctx is None:
            return ExtendOk(False).wire()
        if not m.final:  # catch-up round: nothing to compute ahead in vLLM (module docs)
            self.counters["catchup_rounds_deferred"] = self.counters.get("catchup_rounds_deferred", 0) + 1
            return ExtendOk(True, steps=0, extend_step_ms=0.0, extra_step_ms=0.0).wire()
        ctx = await self._with_kv(ctx)
        if ctx is None:
            return ExtendOk(False).wire()
        if "decode_task" in ctx.extra:  # a repeated final round: the stream already runs
            return ExtendOk(True).wire()
        self.counters["extends"] = self.counters.get("extends", 0) + 1
        self._start_decode(ctx, [int(t) for t in m.token_ids])
        return ExtendOk(True).wire()

    def _start_decode(self, ctx, outputs: list[int]) -> None:
        ctx.in_engine = True
        ctx.extra["decode_task"] = asyncio.get_running_loop().create_task(self._decode(ctx, outputs))

    def _stage(self, ctx):
        """Write the prompt's pages (pdd's layout, this pool's dtype) to the request's staged file."""
        import torch

        pool = self.engine.pool
        seq = ctx.seq
        n = -(-seq.prompt_len // pool.page_size)
        idx = torch.tensor([int(p) for p in seq.page_table[:n]], dtype=torch.long, device=pool.buffer.device)
        pages = pool.buffer[idx]
        return write_stage(os.path.join(self.stage_dir, f"{ctx.rid}.kv"), pages, seq.prompt_len)

    async def _decode(self, ctx, outputs: list[int]) -> None:
        """Prefill prompt + ``outputs`` on vLLM over the staged prompt KV and stream its tokens
        (positions ``len(outputs)`` on); release the request at the end, caching its prompt pages."""
        rid, seq, sp = ctx.rid, ctx.seq, ctx.sampling
        pos = len(outputs)
        stage = None
        fin_sent = False
        t_extend = time.perf_counter()
        try:
            if sp.max_tokens - pos <= 0:
                raise RuntimeError(f"nothing left to decode ({pos} of max_tokens {sp.max_tokens} already out)")
            # on the loop, not a thread: a cancel (abort) must not leave a file being written (a few ms per MB)
            stage = self._stage(ctx)
            self.stage_ms.append(round((time.perf_counter() - t_extend) * 1000, 3))
            body = {"model": self.cfg.served_model_name, "prompt": list(seq.prompt_ids) + outputs, "stream": True,
                    "stream_options": {"include_usage": True}, "return_token_ids": True,
                    "kv_transfer_params": {**stage.params(), "pdd_rid": rid}, **sampling_body(sp, pos)}
            async with self.http.stream("POST", f"{self.vllm_url}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"vLLM answered {r.status_code}: {(await r.aread())[:500]!r}")
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    usage = chunk.get("usage")
                    if usage:  # the last chunk: prompt tokens vLLM had (its prefix cache + the connector's load)
                        det = usage.get("prompt_tokens_details") or {}
                        self.vllm_cached_tokens += int(det.get("cached_tokens") or 0)
                        self.vllm_prompt_tokens += int(usage.get("prompt_tokens") or 0)
                    for ch in chunk.get("choices", []):
                        ids = [int(t) for t in ch.get("token_ids") or []]
                        fin = ch.get("finish_reason")
                        if ids and pos == len(outputs):
                            self.handoff_ms.append(round((time.perf_counter() - t_extend) * 1000, 3))
                        for t in ids:
                            if fin_sent:
                                raise RuntimeError(f"vLLM sent token {t} after the finish pdd gave position {pos - 1}")
                            # the finish is known from the token itself, so no token waits for the next chunk
                            reason = first_token_finish(t, sp, self.eos_ids) if pos + 1 < sp.max_tokens else \
                                FinishReason.LENGTH.value
                            if reason is None and fin is not None and t == ids[-1]:
                                reason = _finish(fin)  # a finish pdd's rules do not predict (vLLM's own)
                            self.emit(ctx, pos, t, reason)
                            pos += 1
                            fin_sent = reason is not None
                        if fin is not None and not fin_sent:
                            raise RuntimeError(f"vLLM finished ({fin}) at position {pos} without a token to carry it")
            if not fin_sent:
                raise RuntimeError("vLLM's stream ended without a finish reason")
            self.counters["finished"] += 1
        except asyncio.CancelledError:  # aborted (the gateway) or finished elsewhere: the HTTP stream closes
            raise
        except Exception as e:
            log.warning("%s: vLLM decode of %s failed: %s", self.spec.name, rid, e)
            self.counters["failed"] = self.counters.get("failed", 0) + 1
            if not fin_sent:
                ctx.sink.put(ReqError(rid, f"{self.spec.name} (vLLM): {e}").wire())
        finally:
            if stage is not None:
                try:
                    os.unlink(stage.path)
                except OSError:
                    pass
            ctx.extra.pop("decode_task", None)
            ctx.in_engine = False
            if not ctx.released:
                await self.release(ctx, cache=True)

    async def release(self, ctx, cache: bool) -> None:
        task = ctx.extra.get("decode_task")
        if task is not None and task is not asyncio.current_task():
            task.cancel()  # closes the HTTP stream: vLLM aborts the request
        ctx.in_engine = False
        await super().release(ctx, cache)


def _finish(reason: str | None) -> str:
    if reason == "length":
        return FinishReason.LENGTH.value
    if reason == "abort":
        return FinishReason.ABORT.value
    return FinishReason.STOP.value


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    """Linux: the vLLM server gets SIGTERM when the MD endpoint dies (SIGKILL included)."""
    import signal

    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _tail(path, n: int = 30) -> str:
    try:
        return "".join(Path(path).read_text(errors="replace").splitlines(True)[-n:])
    except OSError:
        return ""
