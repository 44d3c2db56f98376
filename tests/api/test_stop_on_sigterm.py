"""``pdd demo``, ``pdd bench`` and ``pdd serve`` stopped with SIGTERM exit only once their instances have
(``pdd.cli_args.stop_on_sigterm``, ``Topology.stop``): they exited at once, and the instances,
each in a session of its own, held their ports ~2 s more, so a demo started right away was
refused "port ... already in use"; ``pdd serve`` exited 0 and silent. The topology here is a :class:`~pdd.launch.Topology` whose
one instance is a small process that takes its time to stop (or never does); the test waits on
its output and on exits, never on a clock."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.api.test_launch_orphans import _alive, _kill_all

# an instance: says when its SIGTERM handler is in place and when SIGTERM came (on stderr, the
# owner's, which the test reads); "slow" then exits 0.3 s later, "stuck" never does
CHILD = r"""
import signal, sys, time
mode = sys.argv[1]
def term(*_):
    print("instance got SIGTERM", file=sys.stderr, flush=True)
    if mode == "slow":
        time.sleep(0.3)
        sys.exit(0)
signal.signal(signal.SIGTERM, term)
print("ready", flush=True)
while True:
    time.sleep(1)
"""

OWNER = r"""
import subprocess, sys, time
import pdd.bench.bench, pdd.bench.demo, pdd.cli
from pdd.launch import Topology

cmd, mode, child = sys.argv[1:4]
name = sys.argv[5] if len(sys.argv) > 5 else "md0"  # the instance's name in the layout (gateway: stopped first)

class OneInstance(Topology):
    def start(self):
        p = subprocess.Popen([sys.executable, "-c", child, mode], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
        self.procs[name] = p
        assert p.stdout.readline().strip() == "ready"

def run(out, modes, requests, scale, cfg, *a, **kw):
    with OneInstance(cfg, log_dir=out) as topo:
        print("topology up", topo.procs[name].pid, flush=True)
        time.sleep(300)

pdd.bench.demo.run_demo = pdd.bench.bench.run_bench = run
if cmd == "serve":  # its own Topology (one slow instance), no checkpoint made, ports of a free block
    import pdd.launch
    from pdd.topology import free_port_block

    class Served(OneInstance):
        def start(self):  # as Topology.start, what it started is stopped when it is interrupted
            try:
                super().start()
                print("topology up", self.procs[name].pid, flush=True)
            except BaseException:
                self.stop()
                raise

    pdd.launch.Topology = Served
    pdd.cli.ensure_model = lambda cfg: None
    base = free_port_block()  # not the default ports: a pdd serve or make demo may hold them
    sys.exit(pdd.cli.main([cmd, "--port", str(base + 95), "--base-port", str(base), "--log-dir", sys.argv[4]]))
from pdd.topology import free_port_block
base = free_port_block()  # not the default ports: a pdd serve or make demo may hold them
port = ["--port" if cmd == "demo" else "--gateway-port", str(base + 95), "--base-port", str(base)]
sys.exit(pdd.cli.main([cmd, "--modes", "pdd", "--requests", "5", "--out", sys.argv[4], *port]))
"""


def _sighup_default() -> None:
    """In the child before exec: SIGHUP at its default, whatever this test run inherited (a
    suite started under ``nohup`` ignores it, and an ignored SIGHUP stays ignored in pdd)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _sigint_ignored() -> None:
    """In the child before exec: SIGINT ignored, as a non-interactive shell starts a background
    job (``pdd serve ... &`` in a script), SIGHUP at its default."""
    _sighup_default()
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _owner(cmd: str, mode: str, tmp_path: Path, name: str = "md0",
           preexec=_sighup_default) -> tuple[subprocess.Popen, int]:
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=f"{root / 'src'}{os.pathsep}{root}")
    owner = subprocess.Popen([sys.executable, "-c", OWNER, cmd, mode, CHILD, str(tmp_path / "out"), name],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0, env=env,
                             preexec_fn=preexec)
    line = owner.stdout.readline().decode()
    assert line.startswith("topology up "), (line, owner.stderr.read() if owner.poll() is not None else "")
    return owner, int(line.split()[2])


def _wait_for(owner: subprocess.Popen, text: bytes, bound_s: float = 60.0) -> None:
    """Read the owner's stderr (which its instance shares) until ``text`` appears; fails as soon
    as the owner has exited without it (its instance, alive, keeps the pipe open: a plain read
    would block)."""
    seen, deadline = b"", time.monotonic() + bound_s
    while text not in seen:
        assert owner.poll() is None, f"the owner exited ({owner.returncode}) before its instance got SIGTERM"
        assert time.monotonic() < deadline, seen
        if select.select([owner.stderr], [], [], 0.2)[0]:
            seen += os.read(owner.stderr.fileno(), 65536)


@pytest.mark.parametrize("cmd", ["demo", "bench", "serve"])
def test_sigterm_stops_the_instances_before_the_command_exits(cmd, tmp_path):
    owner, pid = _owner(cmd, "slow", tmp_path)
    try:
        owner.send_signal(signal.SIGTERM)
        assert owner.wait(timeout=60) == 128 + signal.SIGTERM
        assert not _alive(pid)  # gone before its owner exited (reaped by it), not 0.3 s later
        err = owner.stderr.read().decode()
        assert err.splitlines()[-1] == f"pdd {cmd}: stopped by SIGTERM; its instances have exited", err
    finally:
        _kill_all([pid])
        owner.kill()
        owner.wait()


def test_a_second_sigterm_while_the_instances_stop_kills_them_and_still_waits_for_them(tmp_path):
    """An instance that does not stop on SIGTERM is killed after the grace (5 s); a second
    SIGTERM (or Ctrl-C) meanwhile kills it at once, and the command still exits after it."""
    owner, pid = _owner("demo", "stuck", tmp_path)
    try:
        owner.send_signal(signal.SIGTERM)
        _wait_for(owner, b"instance got SIGTERM")  # Topology.stop is waiting for it
        owner.send_signal(signal.SIGTERM)
        assert owner.wait(timeout=60) == 128 + signal.SIGTERM
        assert not _alive(pid)
    finally:
        _kill_all([pid])
        owner.kill()
        owner.wait()


def test_a_second_sigterm_during_the_gateway_drain_stops_serve_at_once(tmp_path):
    """``pdd serve`` stops its gateway first and waits for its drain (up to shutdown_timeout_s, 30 s,
    and more); a gateway that does not exit is killed at once by a second SIGTERM (or Ctrl-C), and
    serve says it stopped, with SIGTERM's status (the second interrupt ended it with a traceback)."""
    owner, pid = _owner("serve", "stuck", tmp_path, name="gateway")
    try:
        owner.send_signal(signal.SIGTERM)
        _wait_for(owner, b"instance got SIGTERM")  # Topology.stop is waiting for the gateway's drain
        owner.send_signal(signal.SIGTERM)
        assert owner.wait(timeout=60) == 128 + signal.SIGTERM
        assert not _alive(pid)
        err = owner.stderr.read().decode()
        assert "Traceback" not in err, err
        assert err.splitlines()[-1] == "pdd serve: stopped by SIGTERM; its instances have exited", err
    finally:
        _kill_all([pid])
        owner.kill()
        owner.wait()


def _serving_then_stopped(owner, pid: int, sig: int) -> str:
    """Once ``pdd serve`` (``owner``) says it serves (the drain's path), send it ``sig``: it exits
    128 + ``sig``, its gateway (``pid``) gone, with no traceback. Returns its stderr."""
    assert owner.stdout.readline().decode().startswith("pdd (pdd) serving at ")
    owner.send_signal(sig)
    assert owner.wait(timeout=60) == 128 + sig
    assert not _alive(pid)
    err = owner.stderr.read().decode()
    assert "Traceback" not in err, err
    return err


def test_sighup_stops_serve_with_the_gateways_drain_as_sigterm_does(tmp_path):
    """SIGHUP (the terminal ``pdd serve`` runs in closed) stops it in SIGTERM's order: the gateway
    is sent SIGTERM (its drain) and waited for, then serve exits 129 with one line. Before,
    Python's default for SIGHUP ended serve at once: no drain, the instances left to their
    parent watch."""
    owner, pid = _owner("serve", "slow", tmp_path, name="gateway")
    try:
        err = _serving_then_stopped(owner, pid, signal.SIGHUP)
        assert err.splitlines()[0] == ("pdd serve: stopping: requests in flight may finish for up to 30 s "
                                       "(--shutdown-timeout), new ones are refused; SIGTERM (or a second SIGHUP) "
                                       "stops at once"), err
        assert "instance got SIGTERM" in err.splitlines()  # the gateway's drain was asked for
        assert err.splitlines()[-1] == "pdd serve: stopped by SIGHUP; its instances have exited", err
    finally:
        _kill_all([pid])
        owner.kill()
        owner.wait()


def test_a_terminal_hang_up_stops_serve_with_the_drain(tmp_path):
    """The real thing: ``pdd serve`` on a terminal (a pty it controls) that hangs up. The kernel
    sends it SIGHUP, and every later write to the terminal fails (EIO): serve still stops its
    gateway first and waits for it, and exits 129 (its lines to the dead terminal are dropped,
    not a traceback and exit 1)."""
    import fcntl
    import pty
    import termios

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=f"{root / 'src'}{os.pathsep}{root}")
    master, slave = pty.openpty()

    def controlling_terminal():  # a session of its own whose controlling terminal is the pty
        _sighup_default()
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    owner = subprocess.Popen([sys.executable, "-c", OWNER, "serve", "slow", CHILD, str(tmp_path / "out"), "gateway"],
                             stdin=slave, stdout=slave, stderr=slave, env=env, preexec_fn=controlling_terminal)
    os.close(slave)
    pid = None
    try:
        seen, deadline = b"", time.monotonic() + 60
        while b"topology up " not in seen or not seen.split(b"topology up ", 1)[1].count(b"\n"):
            assert owner.poll() is None and time.monotonic() < deadline, seen
            if select.select([master], [], [], 0.2)[0]:
                seen += os.read(master, 65536)
        pid = int(seen.split(b"topology up ", 1)[1].split()[0])
        os.close(master)  # the terminal hangs up
        master = None
        assert owner.wait(timeout=60) == 128 + signal.SIGHUP
        assert not _alive(pid)  # stopped and reaped by serve before it exited
    finally:
        if master is not None:
            os.close(master)
        _kill_all([pid] if pid else [])
        owner.kill()
        owner.wait()


class _Served:
    """A Topology for ``pdd serve`` that starts nothing (the test's port range: 9270..9369, 9380)."""

    def __init__(self, cfg, log_dir=None):
        self.log_dir, self.url = Path(log_dir), "http://127.0.0.1:9380"

    def start(self):
        pass

    def stop(self):
        pass


@pytest.mark.parametrize("signum,again", [(signal.SIGTERM, "a second SIGTERM (or Ctrl-C) stops at once"),
                                          (signal.SIGINT, "Ctrl-C again stops at once")])
def test_serve_stopping_line_names_the_signal_it_got(signum, again, tmp_path, monkeypatch, capsys):
    """``pdd serve`` stopped while it serves says how to stop it at once: "Ctrl-C again" after a
    SIGTERM (systemd, docker, k8s: no terminal to press it in) was wrong."""
    import pdd.cli
    import pdd.cli_args
    import pdd.launch
    from pdd.cli_args import Stopped

    monkeypatch.setattr(pdd.launch, "Topology", _Served)
    monkeypatch.setattr(pdd.cli, "ensure_model", lambda cfg: None)
    monkeypatch.setattr(pdd.cli_args, "stop_on_sigterm", lambda: None)  # the test process keeps its handler

    def serving(topo):
        raise Stopped(signum) if signum == signal.SIGTERM else KeyboardInterrupt()

    monkeypatch.setattr(pdd.cli, "_supervise", serving)
    rc = pdd.cli.main(["serve", "--port", "9380", "--base-port", "9270", "--shutdown-timeout", "4",
                       "--log-dir", str(tmp_path / "logs")])
    assert rc == 128 + signum
    assert capsys.readouterr().err.splitlines()[0] == (
        f"pdd serve: stopping: requests in flight may finish for up to 4 s (--shutdown-timeout), new ones are "
        f"refused; {again}")


def test_a_sighup_ignored_at_start_stays_ignored_so_nohup_keeps_serve_running():
    """``nohup pdd serve`` (SIGHUP ignored when it starts) outlives its terminal, as docs/SERVE.md
    "Stop it" says: ``stop_on_sigterm`` leaves an ignored SIGHUP ignored (it replaced nohup's
    SIG_IGN with its stop, so a closed terminal stopped serve, exit 129) and still takes SIGTERM;
    with SIGHUP at its default it takes both."""
    probe = ("import signal, sys\n"
             "signal.signal(signal.SIGHUP, signal.SIG_IGN if sys.argv[1] == 'nohup' else signal.SIG_DFL)\n"
             "from pdd.cli_args import stop_on_sigterm\n"
             "stop_on_sigterm()\n"
             "print(signal.getsignal(signal.SIGHUP) is signal.SIG_IGN, callable(signal.getsignal(signal.SIGHUP)),\n"
             "      callable(signal.getsignal(signal.SIGTERM)))\n")
    for how, expect in (("nohup", "True False True"), ("terminal", "False True True")):
        out = subprocess.run([sys.executable, "-c", probe, how], capture_output=True, text=True, timeout=60)
        assert (out.returncode, out.stdout.strip()) == (0, expect), out.stderr


def test_sigint_ignored_at_start_still_stops_serve_with_the_drain(tmp_path):
    """``pdd serve ... &`` in a script starts with SIGINT ignored (a non-interactive shell does
    that to background jobs), and Python leaves an ignored SIGINT ignored, so ``kill -INT`` did
    nothing. That is not a user's request, as nohup's SIGHUP is: ``stop_on_sigterm`` takes SIGINT
    back, and serve stops as on Ctrl-C (the gateway's drain, then exit 130)."""
    owner, pid = _owner("serve", "slow", tmp_path, name="gateway", preexec=_sigint_ignored)
    try:
        err = _serving_then_stopped(owner, pid, signal.SIGINT)
        assert "instance got SIGTERM" in err.splitlines()  # the gateway's drain was asked for
        assert err.splitlines()[-1] == "pdd serve: stopped by SIGINT; its instances have exited", err
    finally:
        _kill_all([pid])
        owner.kill()
        owner.wait()


def test_stop_on_sigterm_takes_an_ignored_sigint_back():
    probe = ("import signal, sys\n"
             "signal.signal(signal.SIGINT, signal.SIG_IGN if sys.argv[1] == 'ignored' else signal.default_int_handler)\n"
             "from pdd.cli_args import stop_on_sigterm\n"
             "stop_on_sigterm()\n"
             "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)\n")
    for how in ("ignored", "default"):
        out = subprocess.run([sys.executable, "-c", probe, how], capture_output=True, text=True, timeout=60)
        assert (out.returncode, out.stdout.strip()) == (0, "True"), out.stderr
