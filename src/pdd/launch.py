"""Start instances as OS processes: one (``pdd launch``) or a whole topology (:class:`Topology`).

Each instance is ``python -m pdd.cli launch --role ROLE --name NAME --config FILE``; it prints
``READY NAME`` (or ``LINK READY``) on stdout once it serves. :class:`Topology` launches the
engines and the link side by side (none connects to another while it starts: KV senders connect
on first use), in dependency order (link and MD first), waits until each is ready, then starts the
gateway (it connects to every engine at start), and stops them all on exit: the gateway first (it
drains its requests in flight: ``shutdown_timeout_s``), then the others (SIGTERM, then SIGKILL
after a grace period). Logs go to ``<log_dir>/<name>.log``; a restart (:meth:`Topology.restart`)
continues its instance's log after a ``--- restart N ...`` line.

No orphans: each instance runs in a session of its own (so a signal to the owner's terminal does
not reach it twice), and so would outlive an owner killed with SIGKILL (which runs no clean-up).
The owner passes its pid in ``PDD_PARENT_PID``; the instance watches its parent
(:func:`watch_parent`) and stops itself once it has been re-parented.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx

from pdd.config import ClusterConfig
from pdd.spawn import PARENT_ENV, spawn_instance, start_failure_cause
from pdd.topology import (ROLE_COLOCATED, ROLE_GATEWAY, ROLE_LINK, ROLE_MAIN, ROLE_PREFILL, ROLE_RELAY,
                          InstanceSpec, Layout, http_url, layout)


PARENT_POLL_S = 0.25  # how often an instance checks that its owner is still alive
ORPHAN_GRACE_S = 5.0  # an orphaned instance's clean shutdown (SIGTERM) before it exits hard
# what the gateway may take past its shutdown_timeout_s before Topology.stop kills it: ending the
# requests still running (pdd.gateway.shutdown.END_WAIT_S, 12 s) and closing its HTTP server (3 s)
GATEWAY_EXIT_S = 20.0


class LaunchError(RuntimeError):
    """An instance did not come up; the message names it and quotes its log's tail."""


def link_config(cfg: ClusterConfig, lay: Layout) -> dict:
    """Config of the WAN emulator: one listen port per instance in datacenter B."""
    routes = [{"listen_port": s.wan_port, "target_host": cfg.host, "target_port": s.port}
              for s in lay.instances if s.dc == "B"]
    return {"host": cfg.host, "control_port": lay.link_control_port, "gbps": cfg.link.wan_gbps,
            "rtt_ms": cfg.link.wan_rtt_ms, "jitter_ms": cfg.link.wan_jitter_ms, "routes": routes,
            "loss_rate": cfg.link.wan_loss_rate, "mss_bytes": cfg.link.wan_mss_bytes,
            "cross_traffic": [list(p) for p in cfg.link.wan_cross_traffic]}


def _parent_alive(parent: int) -> bool:
    """Whether ``parent`` is still this process's parent (a dead parent's children are
    re-parented to init or a subreaper, so ``getppid`` changes)."""
    return os.getppid() == parent


def watch_parent(parent: int | None = None, poll_s: float = PARENT_POLL_S, grace_s: float = ORPHAN_GRACE_S,
                 _exit=os._exit) -> threading.Thread | None:
    """Stop this process when its owner dies (however: SIGKILL included).

    ``parent``: the owner's pid (default: ``$PDD_PARENT_PID``; None and unset: no watch, as for a
    ``pdd launch`` typed by hand). A daemon thread checks every ``poll_s`` seconds; once the
    parent is gone it sends this process SIGTERM (the instance's own clean shutdown) and exits
    hard (status 1) if it is still running ``grace_s`` later.

    Not ``prctl(PR_SET_PDEATHSIG)``: Linux sends that signal when the parent *thread* that forked
    the child exits, so an instance (re)started from a worker thread (fault injection, a thread
    pool) would be killed with that thread while its owner lives on. Polling ``getppid`` follows
    the owner process, on any POSIX system.
    """
    if parent is None:
        env = os.environ.get(PARENT_ENV, "")
        if not env.isdigit():
            return None
        parent = int(env)
    if not _parent_alive(parent):  # died before we looked
        _exit(1)
        return None

    def loop():
        while _parent_alive(parent):
            time.sleep(poll_s)
        try:
            os.kill(os.getpid(), signal.SIGTERM)
        except OSError:
            pass
        time.sleep(grace_s)
        _exit(1)

    t = threading.Thread(target=loop, name="parent-watch", daemon=True)
    t.start()
    return t


def pin_cpus(cfg: ClusterConfig, role: str) -> list[int] | None:
    """Restrict this process to ``cfg.cpu_affinity[role]`` (Linux ``sched_setaffinity``); returns
    the cores, or None when the role is not pinned (or the platform cannot pin). Raises OSError
    if the kernel refuses the mask (the config validator checked the cores exist)."""
    cpus = cfg.cpu_affinity.get(role)
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return None
    os.sched_setaffinity(0, cpus)
    return sorted(cpus)


def set_nice(nice: int | None) -> int | None:
    """Run this process at niceness ``nice`` (``ClusterConfig.process_nice``; None: leave it);
    returns the niceness now in force, or None when unchanged. A value the kernel refuses (below
    the inherited one without CAP_SYS_NICE) is logged, not raised: the process runs on as it was."""
    if nice is None or not hasattr(os, "setpriority"):
        return None
    try:
        os.setpriority(os.PRIO_PROCESS, 0, int(nice))
    except OSError as e:
        logging.getLogger(__name__).warning("process_nice %d refused (%s): running at nice %d", nice, e,
                                            os.getpriority(os.PRIO_PROCESS, 0))
        return None
    return os.getpriority(os.PRIO_PROCESS, 0)


def run_instance(cfg: ClusterConfig, name: str) -> int | None:
    """Run one instance of ``cfg``'s topology in this process until SIGTERM (or until its owner
    dies, when started by :class:`Topology`: :func:`watch_parent`). Every role stops cleanly on
    SIGTERM, SIGINT or SIGHUP (one not ignored at start) and returns the signal's number."""
    if os.environ.get(PARENT_ENV, "").isdigit():
        watch_parent()
    lay = layout(cfg)
    spec = lay.get(name)
    pin_cpus(cfg, spec.role)  # before torch starts its threads, which inherit the mask
    set_nice(cfg.process_nice)  # likewise inherited by them
    if spec.role == ROLE_LINK:
        from pdd.transfer.link import run_link

        return run_link(link_config(cfg, lay))
    os.environ.setdefault("OMP_NUM_THREADS", str(cfg.engine_for(name).torch_threads))
    if spec.role == ROLE_GATEWAY:
        from pdd.gateway.api import serve_gateway

        return asyncio.run(serve_gateway(cfg, lay))
    from pdd.roles.base import serve_instance

    if spec.role == ROLE_PREFILL:
        from pdd.roles.prefill import PrefillInstance as cls
    elif spec.role == ROLE_RELAY:
        from pdd.roles.relay_decode import RelayDecodeInstance as cls
    elif spec.role == ROLE_MAIN and cfg.vllm.main_decode:  # MD on vLLM (docs/VLLM_TIER.md)
        from pdd.vllm_tier.md import VllmMainDecodeInstance as cls
    elif spec.role in (ROLE_MAIN, ROLE_COLOCATED):
        from pdd.roles.main_decode import MainDecodeInstance as cls
    else:
        raise ValueError(f"unknown role {spec.role!r}")
    return asyncio.run(serve_instance(cls(cfg, spec, lay)))


def prepare_security(cfg: ClusterConfig, log_dir: str | Path) -> ClusterConfig:
    """Make the topology's CA, certificates and fast-path key (``pdd.security``) when its security
    needs them: into ``security.cert_dir`` when set (what exists there is kept), else into
    ``<log_dir>/certs``. Returns ``cfg`` with an absolute ``security.cert_dir``. Raises
    SecurityError naming the field when that directory cannot be made or written
    (``security.cert_dir: /etc/passwd`` was a FileExistsError traceback from ``pdd serve``)."""
    from pdd.security import SecurityError, ensure_topology_certs, needs_material

    sec = cfg.security
    if not needs_material(sec):
        return cfg
    cert_dir = Path(sec.cert_dir) if sec.cert_dir else Path(log_dir) / "certs"
    try:
        ensure_topology_certs(cfg, cert_dir)
    except OSError as e:
        why = ("a file of that name exists" if isinstance(e, FileExistsError) and not cert_dir.is_dir()
               else e.strerror or str(e))
        where = f"security.cert_dir {sec.cert_dir}" if sec.cert_dir else f"certificate directory {cert_dir}"
        raise SecurityError(f"{where}: cannot create or write the topology's certificates there: {why}") from None
    return cfg.model_copy(update={"security": sec.model_copy(update={"cert_dir": str(cert_dir.resolve())})})


def _start_order(lay: Layout) -> list[InstanceSpec]:
    rank = {ROLE_LINK: 0, ROLE_MAIN: 1, ROLE_COLOCATED: 1, ROLE_RELAY: 2, ROLE_PREFILL: 3, ROLE_GATEWAY: 4}
    return sorted(lay.instances, key=lambda s: rank[s.role])


def _kill_group(p: subprocess.Popen) -> None:
    """SIGKILL ``p``'s process group (an instance and what it started) unless it has exited."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Topology:
    """A running topology for ``cfg.mode``; use as a context manager.

    Attributes: ``url`` (gateway base URL), ``procs`` (name -> Popen), ``layout``.
    """

    def __init__(self, cfg: ClusterConfig, log_dir: str | Path | None = None, start_timeout_s: float = 120.0):
        self.cfg = cfg
        self.layout = layout(cfg)
        self.url = http_url(cfg.host, cfg.gateway_port)
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix=f"pdd-{cfg.mode}-"))
        self.start_timeout_s = start_timeout_s
        self.procs: dict[str, subprocess.Popen] = {}
        self.restarts: dict[str, int] = {}  # name -> times restarted (its log is continued, not replaced)
        self._ready: dict[str, threading.Event] = {}  # name -> set once its current run printed READY
        self._cfg_file: Path | None = None
        self.last_busy: list[str] = []  # busy_reasons at wait_idle's last poll (a timed-out wait's cause)

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "Topology":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.cfg = prepare_security(self.cfg, self.log_dir)
        self._cfg_file = self.log_dir / "cluster.json"
        self._cfg_file.write_text(self.cfg.model_dump_json(indent=1))
        try:
            specs = [s for s in _start_order(self.layout) if s.name not in self.cfg.standby]  # standby: added later
            engines = [s for s in specs if s.role != ROLE_GATEWAY]
            # side by side: each pays its imports and model load at once (one by one, a pdd topology
            # took ~12 s, most of it waiting); the first in start order that fails is the one named
            for spec in engines:
                self._launch(spec)
            for spec in engines:
                self._wait_ready(spec)
            for spec in specs:
                if spec.role == ROLE_GATEWAY:
                    self._spawn(spec)
            self._check_api_keys()
        except BaseException:
            self.stop()
            raise

    def _check_api_keys(self) -> None:
        """Fail closed: with ``security.api_keys`` set, a request without a key must be refused."""
        if not self.cfg.security.api_keys or ROLE_GATEWAY not in {s.role for s in self.layout.instances}:
            return
        try:
            code = httpx.get(f"{self.url}/v1/models", timeout=10, trust_env=False).status_code
        except httpx.HTTPError as e:
            raise LaunchError(f"gateway did not answer the API key check: {e!r}") from None
        if code != 401:
            raise LaunchError(f"security.api_keys is set but the gateway answered {code} to a request without "
                              "a key (expected 401): refusing to serve unprotected")

    def _spawn(self, spec: InstanceSpec, previous_exit: int | None = None) -> None:
        """Start ``spec``'s instance and wait until it is ready (:meth:`_wait_ready`)."""
        self._launch(spec, previous_exit)
        self._wait_ready(spec)

    def _launch(self, spec: InstanceSpec, previous_exit: int | None = None) -> None:
        """Start ``spec``'s instance (``pdd.spawn.spawn_instance``) without waiting for it."""
        p, ready = spawn_instance(self.cfg, spec.role, spec.name, self._cfg_file, self.log_dir / f"{spec.name}.log",
                                  restart=self.restarts.get(spec.name, 0), previous_exit=previous_exit)
        self.procs[spec.name] = p
        self._ready[spec.name] = ready

    def _wait_ready(self, spec: InstanceSpec) -> None:
        """Wait until launched ``spec`` printed READY: ``start_timeout_s`` seconds from now (plus
        ``vllm.start_timeout_s`` for an MD on vLLM); raises LaunchError naming it and its log's cause
        when it exits first or the time runs out."""
        p, ready = self.procs[spec.name], self._ready[spec.name]
        wait_s = self.start_timeout_s
        if spec.role == ROLE_MAIN and self.cfg.vllm.main_decode:  # it starts a vLLM server first
            wait_s += self.cfg.vllm.start_timeout_s
        deadline = time.monotonic() + wait_s
        while not ready.wait(0.05):
            if p.poll() is not None:
                raise LaunchError(f"{spec.name} ({spec.role}) exited with {p.returncode} before it was ready: "
                                  + self._cause(spec.name))
            if time.monotonic() > deadline:
                raise LaunchError(f"{spec.name} ({spec.role}) not ready after {wait_s:.0f} s: "
                                  + self._cause(spec.name))

    def _cause(self, name: str) -> str:
        """:func:`start_failure_cause` of ``name``'s log."""
        return start_failure_cause(self.log_dir / f"{name}.log")

    def _tail(self, name: str, n: int = 30) -> str:
        try:
            return "".join((self.log_dir / f"{name}.log").read_text().splitlines(True)[-n:])
        except OSError:
            return ""

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop every instance and return once each process has exited. The gateway first: its
        SIGTERM starts its drain (``pdd.gateway.shutdown``: new requests refused with 503, those
        in flight finish on the live instances within ``cfg.shutdown_timeout_s`` or end with an
        error and are aborted on every tier), and it is SIGKILLed if it has not exited
        ``GATEWAY_EXIT_S`` seconds after that timeout. Then the others: SIGTERM to each one's
        process group (its clean shutdown), SIGKILL to those still running ``grace_s`` seconds
        later. A KeyboardInterrupt meanwhile (a second Ctrl-C or SIGTERM) SIGKILLs the rest at
        once and waits for them before it goes on, so the owner never exits before its instances
        (whose ports a next topology needs)."""
        try:  # (the SIGTERMs too: a second signal can come as soon as an instance got its first)
            gw = [s.name for s in self.layout.instances if s.role == ROLE_GATEWAY and s.name in self.procs]
            self._terminate(gw, self.cfg.shutdown_timeout_s + GATEWAY_EXIT_S)  # its drain, on live instances
            self._terminate(list(reversed(list(self.procs))), grace_s)
        except KeyboardInterrupt:
            for p in self.procs.values():
                _kill_group(p)
            for p in self.procs.values():
                p.wait()
            self.procs.clear()
            raise
        self.procs.clear()

    def _terminate(self, names: list[str], timeout_s: float) -> None:
        """SIGTERM the process group of each of ``names`` still running (in that order), then
        SIGCONT (one stopped, SIGSTOP, runs its clean stop rather than sitting out the timeout), then wait
        for each to exit, all within ``timeout_s`` seconds; SIGKILL those still running then."""
        for name in names:
            p = self.procs[name]
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                    os.killpg(p.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout_s
        for name in names:
            p = self.procs[name]
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_group(p)
                p.wait()

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Fault injection: signal one instance's process (and wait for it to go)."""
        p = self.procs[name]
        os.killpg(p.pid, sig)
        p.wait(timeout=30)

    def restart(self, name: str) -> None:
        """Start one (stopped or killed) instance again, as ``pdd launch`` would; the others keep
        running and reconnect to it. Its log keeps what the run before wrote (its traceback):
        the new run's output follows a ``--- restart N at <time> ---`` line (``pdd.spawn``)."""
        p = self.procs.get(name)
        if p is not None and p.poll() is None:
            raise LaunchError(f"{name} is still running")
        self.restarts[name] = self.restarts.get(name, 0) + 1
        self._spawn(self.layout.get(name), previous_exit=p.returncode if p is not None else None)

    # ------------------------------------------------------------------ queries
    def stats(self) -> dict:
        return httpx.get(f"{self.url}/pdd/stats", timeout=30).json()

    def wait_idle(self, timeout_s: float = 30.0, poll_s: float = 0.1) -> bool:
        """Wait until the topology is settled (:func:`busy_reasons` of its stats is empty).
        Returns False on timeout or when the gateway cannot be reached."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                st = self.stats()
            except httpx.HTTPError:
                return False
            self.last_busy = busy_reasons(st)
            if not self.last_busy:
                return True
            time.sleep(poll_s)
        return False

    def flush(self) -> dict:
        return httpx.post(f"{self.url}/pdd/flush", timeout=60).json()

    def cpu_seconds(self) -> dict[str, float]:
        """User+system CPU seconds of each live instance process (from /proc)."""
        out = {}
        tck = os.sysconf("SC_CLK_TCK")
        for name, p in self.procs.items():
            try:
                fields = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
                out[name] = (int(fields[11]) + int(fields[12])) / tck
            except (OSError, IndexError, ValueError):
                out[name] = float("nan")
        return out


def busy_reasons(stats: dict) -> list[str]:
    """What keeps a topology from being settled, read from the gateway's ``/pdd/stats``: an
    instance holding a live request (P holds one until its KV streams have drained), the WAN
    emulator carrying bytes, a transfer whose outcome P has not reported (``transfers_pending``),
    or a relayed request that ended at the client while its KV still crosses to MD
    (``kv_awaited``: MD caches the prompt's pages when it lands, so a next request with that
    prefix would otherwise race it). Empty when settled; a server without these stats (e.g.
    vLLM) is settled. (The gateway's ``requests_live`` is not read: a request whose client has
    its last byte may still be leaving the gateway's table.)"""
    out = [f"{name} running {int(v.get('running', 0))}" for name, v in (stats.get("instances") or {}).items()
           if isinstance(v, dict) and int(v.get("running", 0) or 0)]
    link = stats.get("link") or {}
    out += [f"link {k} {int(link[k])}" for k in ("in_flight_a_to_b", "in_flight_b_to_a") if int(link.get(k, 0) or 0)]
    out += [f"{k} {int(stats[k])}" for k in ("transfers_pending", "kv_awaited") if int(stats.get(k, 0) or 0) > 0]
    return out


def config_from_args(config: str | None, **overrides) -> ClusterConfig:
    return ClusterConfig.load(config, **overrides)


def dump(obj) -> str:
    return json.dumps(obj, indent=1, sort_keys=True)
