"""``Topology.stop`` stops the gateway first and the instances only once it has exited, so the
requests it drains finish on live instances (it sent SIGTERM to all of them at once). The
topology here is two small processes named as the layout's gateway and md0; md0, told to stop,
exits 0 only if the gateway is gone by then (exited and reaped), else 3. No clock."""

from __future__ import annotations

import subprocess
import sys

from pdd.config import ClusterConfig
from pdd.launch import Topology

GATEWAY = r"""
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
print("ready", flush=True)
while True:
    time.sleep(1)
"""

INSTANCE = r"""
import os, signal, sys, time
gateway = int(sys.argv[1])
def term(*_):
    try:
        os.kill(gateway, 0)  # a zombie not reaped yet counts as there: the owner had not seen it exit
    except ProcessLookupError:
        sys.exit(0)
    sys.exit(3)
signal.signal(signal.SIGTERM, term)
print("ready", flush=True)
while True:
    time.sleep(1)
"""


class TwoProcesses(Topology):
    def start(self):
        gw = subprocess.Popen([sys.executable, "-c", GATEWAY], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
        md = subprocess.Popen([sys.executable, "-c", INSTANCE, str(gw.pid)], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
        self.procs["md0"], self.procs["gateway"] = md, gw  # in start order: the gateway last
        for p in (gw, md):
            assert p.stdout.readline().strip() == "ready"


def test_stop_waits_for_the_gateway_before_it_stops_the_instances(tmp_path):
    topo = TwoProcesses(ClusterConfig.model_validate({"mode": "pdd"}), log_dir=tmp_path)
    topo.start()
    procs = dict(topo.procs)
    try:
        topo.stop()
        assert {n: p.returncode for n, p in procs.items()} == {"gateway": 0, "md0": 0}
        assert topo.procs == {}
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
