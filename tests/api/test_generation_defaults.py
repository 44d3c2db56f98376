"""A checkpoint's generation_config.json sampling values are the defaults of a request that leaves
them out, as vLLM (``--generation-config auto``) and SGLang serve them (found by a compatibility
pass: pdd sampled such a request at temperature 1.0, top_p 1.0 where vLLM takes the model's, e.g.
Llama 3.2 Instruct's 0.6, 0.9)."""

from __future__ import annotations

import json
import shutil

import pytest

from pdd.config import ClusterConfig

from tests.api.conftest import EngineOrch

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": [5, 6, 7], "max_tokens": 2}


def _checkpoint(tiny_model, tmp_path, **gen) -> str:
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_model, path)
    g = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**g, **gen}))
    return str(path)


@pytest.fixture
def served(tiny_model, tmp_path):
    """(TestClient, EngineOrch) on a copy of the tiny checkpoint whose generation_config.json
    recommends sampling values (an instruct model's, e.g. Llama 3.2's 0.6 / 0.9)."""
    from fastapi.testclient import TestClient
    from tokenizers import Tokenizer

    from pdd.engine.engine import Engine
    from pdd.gateway.api import create_app

    path = _checkpoint(tiny_model, tmp_path, do_sample=True, temperature=0.6, top_p=0.9, top_k=20, min_p=0.05,
                       repetition_penalty=1.05)
    orch = EngineOrch(Engine.from_pretrained(path, num_pages=64, page_size=8))
    cfg = ClusterConfig.model_validate({"model_path": path, "engine": {"max_model_len": 256, "max_input_len": 200}})
    with TestClient(create_app(cfg, orch, Tokenizer.from_file(f"{path}/tokenizer.json"))) as client:
        yield client, orch


def _sampling(sp) -> tuple:
    return sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.repetition_penalty


@pytest.mark.parametrize("path,body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_a_request_leaving_sampling_out_gets_the_checkpoints_values_its_own_win(served, path, body):
    client, orch = served
    assert client.post(path, json=body).status_code == 200
    assert _sampling(orch.started[-1][1]) == (0.6, 0.9, 20, 0.05, 1.05)
    nulls = {k: None for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
    assert client.post(path, json={**body, **nulls}).status_code == 200  # null is left out too
    assert _sampling(orch.started[-1][1]) == (0.6, 0.9, 20, 0.05, 1.05)
    own = {"temperature": 0, "top_p": 1, "top_k": -1, "min_p": 0, "repetition_penalty": 1}
    assert client.post(path, json={**body, **own}).status_code == 200
    assert _sampling(orch.started[-1][1]) == (0.0, 1.0, -1, 0.0, 1.0)


def test_generation_defaults_take_what_vllm_takes(tiny_model, tmp_path):
    from pdd.gateway.openai_defaults import generation_defaults

    # transformers' own defaults are no recommendation (vLLM reads GenerationConfig.to_diff_dict)
    path = _checkpoint(tiny_model, tmp_path, temperature=1.0, top_p=1.0, top_k=50, repetition_penalty=1.0,
                       max_new_tokens=64, min_p=0.1)
    assert generation_defaults(path) == {"min_p": 0.1}
    bad = _checkpoint(tiny_model, tmp_path / "bad", temperature=-1, top_p="0.9", top_k=2.5, min_p=0.2)
    assert generation_defaults(bad) == {"min_p": 0.2}  # what the API would refuse is skipped (logged)
    assert generation_defaults(tiny_model) == {}  # pdd make-model's: EOS ids and do_sample only
    assert generation_defaults(str(tmp_path / "none")) == {}
