"""``PddConnector`` against vLLM's real classes (``connector_checks.py``, run by vLLM's Python:
the CPU attention backend's KV write, ``vllm.v1.request.Request``, ``KVTransferConfig``).
Skipped where ``.venv-vllm`` is absent (CI does not install vLLM: ``make vllm``)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from pdd.bench import vllm_mode as vm
from pdd.vllm_tier import venv

CHECKS = Path(__file__).with_name("connector_checks.py")


@pytest.fixture(scope="module")
def results():
    try:
        python = venv.vllm_python()
    except venv.VllmMissing as ex:
        pytest.skip(f"vLLM's CPU build is not installed here ({ex})")
    env = vm.vllm_env(type("C", (), {"host": "127.0.0.1", "engine": type("E", (), {"torch_threads": 1})})())
    p = subprocess.run([str(python), str(CHECKS)], capture_output=True, text=True, timeout=600, env=env)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("PDD_CHECKS ")), None)
    assert line is not None, f"connector_checks.py printed no result (rc {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    return json.loads(line[len("PDD_CHECKS "):])


@pytest.mark.parametrize("name", ["load_lands_in_blocks", "scheduler_side"])
def test_connector_against_vllm(results, name):
    assert results.get(name) == "ok", results.get(name, f"check {name} did not run")
