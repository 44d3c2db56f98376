"""process_nice: every process of a topology runs at the niceness the config names
(pdd.launch.set_nice), and the demo gives its processes DEMO_NICE unless told otherwise."""
import json
import os
import subprocess
import sys

import pytest
from pydantic import ValidationError

from pdd.config import ClusterConfig

pytestmark = pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no setpriority here")


def test_config_range_and_default():
    assert ClusterConfig().process_nice is None
    assert ClusterConfig.model_validate({"process_nice": -10}).process_nice == -10
    for bad in (-21, 20):
        with pytest.raises(ValidationError) as e:
            ClusterConfig.model_validate({"process_nice": bad})
        assert "process_nice" in str(e.value)


def _child(code: str) -> list:
    out = subprocess.run([sys.executable, "-c", "import os, json; from pdd.launch import set_nice\n" + code],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_set_nice_in_a_child_process():
    """In a child (the test process keeps its own): None leaves the niceness, a value sets it,
    and one the kernel refuses (back below 0 without CAP_SYS_NICE) is kept out, not raised."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    a, b, c, d = _child("a = set_nice(None); b = os.getpriority(os.PRIO_PROCESS, 0)\n"
                        "c = set_nice(15); d = os.getpriority(os.PRIO_PROCESS, 0)\n"
                        "print(json.dumps([a, b, c, d]))\n")
    assert (a, b) == (None, base)
    assert (c, d) == (15, 15)
    if os.geteuid() != 0:
        e, f = _child("set_nice(15); e = set_nice(-5); print(json.dumps([e, os.getpriority(os.PRIO_PROCESS, 0)]))\n")
        assert (e, f) == (None, 15)


def test_demo_gives_its_config_demo_nice_unless_told(monkeypatch):
    from pdd.bench import demo
    from pdd.topology import free_port_block

    base = free_port_block()

    seen = []
    monkeypatch.setattr(demo, "run_demo", lambda out, modes, n, scale, cfg, seed, **kw: seen.append(cfg.process_nice)
                        or {"modes": {}})
    monkeypatch.setattr("pdd.bench.demo.bench_exit_status", lambda report, modes, prog: 0)
    for argv, want in (([], demo.DEMO_NICE), (["--nice", "3"], 3)):
        demo.main(["--modes", "pdd", "--base-port", str(base), "--port", str(base + 95), *argv])
        assert seen[-1] == want
