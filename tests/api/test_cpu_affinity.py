"""cpu_affinity: each role's processes pinned to the cores the config names (pdd.launch.pin_cpus)."""
import os
import subprocess
import sys

import pytest
from pydantic import ValidationError

from pdd.config import ClusterConfig

HAVE = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no sched_setaffinity here")


def test_config_accepts_roles_and_existing_cores():
    cfg = ClusterConfig.model_validate({"cpu_affinity": {"prefill": [HAVE[0]], "main_decode": [HAVE[-1]]}})
    assert cfg.cpu_affinity == {"prefill": [HAVE[0]], "main_decode": [HAVE[-1]]}
    assert ClusterConfig().cpu_affinity == {}


@pytest.mark.parametrize("aff, words", [
    ({"prefill": [max(HAVE or [0]) + 1]}, ["cpu_affinity", "prefill: cores", "not available", str(max(HAVE or [0]) + 1)]),
    ({"prefill": []}, ["cpu_affinity", "prefill: name at least one core"]),
    ({"prefil": [0]}, ["cpu_affinity", "prefil", "relay_decode"]),
])
def test_config_refuses_bad_affinity_naming_it(aff, words):
    with pytest.raises(ValidationError) as e:
        ClusterConfig.model_validate({"cpu_affinity": aff})
    for w in words:
        assert w in str(e.value)


def test_pin_cpus_sets_this_process_mask():
    """In a child process (the test process keeps its own mask): the pinned role gets exactly the
    named core, a role not named keeps every core."""
    code = (
        "import os, json; from pdd.config import ClusterConfig; from pdd.launch import pin_cpus\n"
        f"cfg = ClusterConfig.model_validate({{'cpu_affinity': {{'prefill': [{HAVE[-1]}]}}}})\n"
        "a = pin_cpus(cfg, 'relay_decode'); b = sorted(os.sched_getaffinity(0))\n"
        "c = pin_cpus(cfg, 'prefill'); d = sorted(os.sched_getaffinity(0))\n"
        "print(json.dumps([a, b, c, d]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    import json

    a, b, c, d = json.loads(out)
    assert a is None and b == HAVE
    assert c == [HAVE[-1]] and d == [HAVE[-1]]
