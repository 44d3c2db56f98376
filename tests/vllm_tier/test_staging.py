"""The staged-KV file and the token / slot arithmetic the connector uses (torch only: runs
without vLLM)."""

from __future__ import annotations

import pytest
import torch

from pdd.vllm_tier.staging import KEY, Stage, layer_index, slot_mapping, token_rows, write_stage


def _pages(n_pages=3, layers=4, ps=16, heads=2, dim=8, dtype=torch.float32):
    return torch.randn(n_pages, layers, 2, ps, heads, dim).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stage_round_trip(tmp_path, dtype):
    pages = _pages(dtype=dtype)
    st = write_stage(str(tmp_path / "r1.kv"), pages, num_tokens=40)
    back = Stage.from_params(st.params())
    assert back == st and back.page_size == 16 and back.num_tokens == 40
    assert torch.equal(back.load(), pages)
    assert not (tmp_path / "r1.kv.part").exists()


def test_stage_params_checked():
    assert Stage.from_params(None) is None and Stage.from_params({"other": 1}) is None
    with pytest.raises(ValueError, match=KEY):
        Stage.from_params({KEY: {"path": "x"}})
    with pytest.raises(ValueError, match=KEY):  # more tokens than the pages hold
        Stage.from_params({KEY: {"path": "x", "num_tokens": 49, "shape": [3, 4, 2, 16, 2, 8], "dtype": "float32"}})
    with pytest.raises(ValueError, match=KEY):
        Stage.from_params({KEY: {"path": "x", "num_tokens": 4, "shape": [3, 4, 2, 16, 2, 8], "dtype": "int8"}})


def test_token_rows_follow_pdd_page_layout():
    pages = _pages()
    for t in (0, 15, 16, 33, 47):
        k, v = token_rows(pages, 2, t, t + 1)
        assert torch.equal(k[0], pages[t // 16, 2, 0, t % 16]) and torch.equal(v[0], pages[t // 16, 2, 1, t % 16])
    k, v = token_rows(pages, 1, 5, 40)
    assert k.shape == v.shape == (35, 2, 8)


def test_slot_mapping_and_layer_names():
    s = slot_mapping([7, 2, 9], 32, 30, 70)
    assert s[:2].tolist() == [7 * 32 + 30, 7 * 32 + 31] and s[2].item() == 2 * 32 and s[-1].item() == 9 * 32 + 5
    with pytest.raises(ValueError, match="blocks"):
        slot_mapping([7], 32, 0, 33)
    assert layer_index("model.layers.3.self_attn.attn") == 3 and layer_index("layers.12.attn") == 12
    with pytest.raises(ValueError):
        layer_index("lm_head")


def test_stage_root_removes_dead_endpoints_dirs(monkeypatch, tmp_path):
    import os
    import subprocess
    import tempfile

    from pdd.vllm_tier import staging

    monkeypatch.setattr(os.path, "isdir", lambda p: False if p == "/dev/shm" else os.path.lexists(p))
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / f"pdd-vllm-stage-{dead.pid}-md0-x").mkdir()
    (tmp_path / f"pdd-vllm-stage-{os.getpid()}-md1-y").mkdir()
    d = staging.stage_root("md0")
    assert os.path.dirname(d) == str(tmp_path) and os.path.basename(d).startswith(f"pdd-vllm-stage-{os.getpid()}-md0-")
    assert not (tmp_path / f"pdd-vllm-stage-{dead.pid}-md0-x").exists()
    assert (tmp_path / f"pdd-vllm-stage-{os.getpid()}-md1-y").exists()
