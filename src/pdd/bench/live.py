"""Driving a running topology for one measured run: the model it serves, a warm-up, a replay
between two ``stats()`` snapshots, and WAN byte sampling (the workload is scaled to the engine's
limits by ``pdd.workload.replay.fit_scale``); :class:`RemoteTopology` stands in for a gateway that pdd did not start (``--url``)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

import httpx

from pdd.bench.client import replay_sync, run_one_sync
from pdd.launch import busy_reasons
from pdd.workload.replay import TokenSpace, block_token_ids
from pdd.config import ClusterConfig


def ensure_model(config: ClusterConfig, console=None) -> Path:
    """The model directory of ``config``; written with ``pdd.modelgen.make_model`` if missing and
    it is the default ``models/<model_preset>``, as ``pdd serve`` does. ValueError naming
    ``model_path`` and ``pdd make-model`` for any other path with no checkpoint (a config's
    ``model_path: /typo`` was filled with random weights and benchmarked)."""
    from pdd.cli_args import missing_model_problem

    path = Path(config.model_path)
    if not (path / "config.json").exists():
        missing = missing_model_problem(config)
        if missing:
            raise ValueError(missing)
        if console is not None:
            console.print(f"making model {config.model_preset!r} (seed {config.model_seed}) in {path} ...")
        from pdd.modelgen import make_model

        make_model(str(path), config.model_preset, config.model_seed)
    return path


def _default_topology(cfg: ClusterConfig, log_dir: Path):
    from pdd.launch import Topology

    return Topology(cfg, log_dir=log_dir)


def _proc_cpu(topo) -> dict | None:
    fn = getattr(topo, "cpu_seconds", None)
    if fn is None:
        return None
    try:
        return {k: (None if v != v else v) for k, v in fn().items()}  # NaN -> None (JSON)
    except Exception:  # noqa: BLE001 - CPU accounting is best effort
        return None


def _warmup(topo, cfg: ClusterConfig, tokens: TokenSpace, seed: int, timeout_s: float, console) -> None:
    """Run one short private prompt through the path (first-call costs), then flush the caches."""
    prompt = block_token_ids((1 << 65) + seed, 2 * cfg.engine.page_size + 3, tokens, seed)
    rec = run_one_sync(topo.url, prompt, 4, model=cfg.served_model_name, timeout_s=timeout_s)
    if not rec.ok:
        console.print(f"[yellow]warm-up request failed: {rec.error}")
    topo.flush()


def measured_replay(
    topo,
    requests: Sequence,
    *,
    model: str,
    mode: str,
    timeout_s: float,
    progress: bool = True,
    console=None,
    flush: bool = True,
    after_replay: Callable[[], None] | None = None,
    **replay_kw,
) -> tuple[list, dict]:
    """Replay ``requests`` on a running topology between two ``stats()`` snapshots.

    Returns ``(records, entry)``: the client's :class:`~pdd.bench.client.RequestRecord` list and the
    server_stats.json entry ``{"stats_before", "proc_cpu_seconds_before", "proc_cpu_seconds",
    "stats", "flush"}`` (see :func:`pdd.bench.report.server_summary`). ``flush``: flush the caches
    afterwards (the next replay on this topology starts empty; ``entry["flush"]`` reports leaked
    pages). ``after_replay``: called once the last request has ended, before the drain and the
    stats (``pdd bench --fault`` restarts killed instances there). ``replay_kw`` go to :func:`pdd.bench.client.replay` (``max_in_flight``, ``label``, ...).
    """
    if getattr(topo, "extra_body", None) is not None:  # a server's own request fields (vLLM's return_token_ids)
        replay_kw.setdefault("extra_body", topo.extra_body)
    wait_idle = getattr(topo, "wait_idle", None)
    if wait_idle is not None:  # what came before (a warm-up) must be settled before the snapshot
        wait_idle()
    entry: dict = {"stats_before": topo.stats(), "proc_cpu_seconds_before": _proc_cpu(topo)}
    records = replay_sync(topo.url, requests, model=model, mode=mode, timeout_s=timeout_s, progress=progress,
                          console=console, **replay_kw)
    if after_replay is not None:
        after_replay()
    if wait_idle is not None:  # let cut-off and finished transfers drain before counting bytes
        entry["idle"] = wait_idle()
        if not entry["idle"] and console is not None:
            console.print(f"[yellow]{mode}: the server was still busy (transfers pending, requests running or "
                          f"bytes on the WAN line) when the wait for it to settle ended: its WAN byte and CPU "
                          f"counts may miss what was still in flight", soft_wrap=True)
    entry["proc_cpu_seconds"] = _proc_cpu(topo)
    entry["stats"] = topo.stats()
    if flush:
        entry["flush"] = topo.flush()
    return records, entry


def _json_object(r: httpx.Response) -> dict:
    """The body of an HTTP 200 answer when it is a JSON object, else ``{}`` (a server that answers
    every path with a JSON array or string ended ``pdd bench --url`` with an AttributeError
    traceback when it read the mode). ValueError when the body is not JSON."""
    body = r.json() if r.status_code == 200 else {}
    return body if isinstance(body, dict) else {}


def check_remote_vocab(url: str, tokens: TokenSpace, model: str, source: str, timeout_s: float) -> None:
    """One request to the server at ``url`` with the largest id prompts may hold (``tokens``'s
    ``vocab_size - 1``, one output token). Raises ValueError naming the fix (``--config`` with the
    server's model) when the server refuses it with HTTP 400 as outside its vocabulary: every
    request of the run would fail so (a server on pdd's tiny model, 1,024 tokens, benchmarked with
    the demo's 4,096-token checkpoint ran its reference and main runs, 0 of 10 completed).
    ``source``: where the ids' vocabulary came from (for the message). Any other outcome passes:
    the run itself reports a server that fails otherwise."""
    rec = run_one_sync(url, [tokens.vocab_size - 1, 0, 1], 1, model=model, timeout_s=timeout_s)
    if rec.http_status == 400 and rec.error and "vocabular" in rec.error:
        raise ValueError(f"--url: the server refuses this run's prompt token ids ({rec.error}); they are drawn "
                         f"from [0, {tokens.vocab_size}) ({source}): give --config with the server's model_path "
                         f"(or model_preset)")


class RemoteTopology:
    """A running gateway at ``url`` used like a Topology (nothing started or stopped).

    ``stats()``: GET /pdd/stats (``{}`` when the server has none, e.g. vLLM, or answers with
    something other than a JSON object); ``flush()``: POST /pdd/flush, best effort (the same).
    """

    def __init__(self, url: str, timeout_s: float = 30.0):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def __enter__(self) -> "RemoteTopology":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def stats(self) -> dict:
        try:
            r = httpx.get(f"{self.url}/pdd/stats", timeout=self.timeout_s, trust_env=False)
            return _json_object(r)
        except (httpx.HTTPError, ValueError):
            return {}

    def wait_idle(self, timeout_s: float = 30.0, poll_s: float = 0.2) -> bool:
        """Poll /pdd/stats until the server is settled (``pdd.launch.busy_reasons``, as
        ``pdd.launch.Topology.wait_idle`` does for the topologies pdd starts). Read right after a
        replay, a transfer still crossing made the WAN columns disagree (1.49 MB sent vs 8.04
        expected). True when settled (or the server has no such stats, e.g. vLLM); False after
        ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not busy_reasons(self.stats()):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)

    def flush(self) -> dict:
        try:
            r = httpx.post(f"{self.url}/pdd/flush", timeout=60, trust_env=False)
            return _json_object(r)
        except (httpx.HTTPError, ValueError):
            return {}

    def reported_mode(self) -> str | None:
        """The mode the server says it runs: /pdd/stats ``mode``, else /health ``mode`` (pdd's
        gateway answers both; /health stays open behind API keys); None when neither says."""
        m = self.stats().get("mode")
        if not m:
            try:
                r = httpx.get(f"{self.url}/health", timeout=self.timeout_s, trust_env=False)
                body = r.json() if r.status_code in (200, 503) else {}
                m = body.get("mode") if isinstance(body, dict) else None
            except (httpx.HTTPError, ValueError):
                m = None
        return str(m) if m else None

    def mode(self) -> str:
        return self.reported_mode() or "external"


class WanSampler:
    """Samples the cumulative WAN line bytes (both directions) every ``interval_s`` in a thread.

    ``read() -> int | None`` returns the counter (None: skip this sample). ``t_s`` are seconds
    since :meth:`start`.
    """

    def __init__(self, read: Callable[[], int | None], interval_s: float = 0.5):
        self.read, self.interval_s = read, interval_s
        self.t_s: list[float] = []
        self.bytes: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def _sample(self) -> None:
        try:
            v = self.read()
        except Exception:  # noqa: BLE001 - sampling is best effort
            v = None
        if v is not None:
            self.t_s.append(round(time.perf_counter() - self._t0, 4))
            self.bytes.append(int(v))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def start(self) -> "WanSampler":
        self._t0 = time.perf_counter()
        self._sample()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self._sample()
        return {"interval_s": self.interval_s, "t_s": self.t_s, "bytes": self.bytes}


def wan_reader(topo) -> Callable[[], int | None] | None:
    """How to read ``topo``'s WAN line counter: the link's control port for a local topology
    with a link, GET /pdd/stats for a remote gateway; None when there is nothing to read."""
    lay = getattr(topo, "layout", None)
    if lay is not None and getattr(lay, "link_control_port", None) is not None:
        from pdd.transfer.link import query_stats

        host, port = topo.cfg.host, lay.link_control_port

        def read_link() -> int:
            s = asyncio.run(query_stats(host, port, timeout=2.0))
            return int(s.get("bytes_a_to_b", 0)) + int(s.get("bytes_b_to_a", 0))

        return read_link
    if isinstance(topo, RemoteTopology):
        def read_remote() -> int | None:
            s = topo.stats()
            return int(s["wan_line_bytes"]) if s.get("link") and s.get("wan_line_bytes") is not None else None

        return read_remote
    return None
