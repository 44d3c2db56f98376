"""``HEAD`` on the gateway (``pdd.gateway.head``): the status and headers of the GET it stands
for, no body. Found by a new user: ``curl -I /health`` (and a load balancer's HEAD probe) got
405 Method Not Allowed."""

from __future__ import annotations

import pytest

from pdd.config import ClusterConfig


def _same_but_body(client, path: str, **kw) -> int:
    """HEAD ``path`` answers as GET does, without a body; returns the status."""
    get, head = client.get(path, **kw), client.head(path, **kw)
    assert head.content == b""
    assert (head.status_code, dict(head.headers)) == (get.status_code, dict(get.headers))
    assert int(head.headers["content-length"]) == len(get.content) > 0
    return head.status_code


@pytest.mark.parametrize("path, status", [
    ("/health", 200), ("/v1/models", 200), ("/v1/models/pdd-tiny", 200), ("/version", 200),
    ("/v1/models/other", 404),  # an unknown model: the GET's 404 error
    ("/v1/completions", 405),  # POST only: the GET's 405 (Allow: POST)
    ("/nowhere", 404),
])
def test_head_answers_as_get_without_a_body(api, path, status):
    client, _ = api
    assert _same_but_body(client, path) == status


def test_head_health_is_503_while_the_gateway_shuts_down(api):
    client, _ = api
    client.app.state.drain.begin()
    assert _same_but_body(client, "/health") == 503
    assert client.get("/health").json()["status"] == "shutting_down"
    assert _same_but_body(client, "/v1/models") == 200  # (the other endpoints keep answering)


def test_head_with_api_keys_is_refused_as_get_and_health_stays_open(tiny_model):
    from fastapi.testclient import TestClient
    from tokenizers import Tokenizer

    from pdd.engine.engine import Engine
    from pdd.gateway.api import create_app
    from tests.api.conftest import EngineOrch

    cfg = ClusterConfig.model_validate({"model_path": tiny_model, "served_model_name": "pdd-tiny",
                                        "security": {"api_keys": ["k1"]},
                                        "engine": {"max_model_len": 512, "max_input_len": 400}})
    orch = EngineOrch(Engine.from_pretrained(tiny_model, num_pages=16, page_size=8))
    with TestClient(create_app(cfg, orch, Tokenizer.from_file(f"{tiny_model}/tokenizer.json"))) as client:
        assert _same_but_body(client, "/v1/models") == 401
        assert _same_but_body(client, "/v1/models", headers={"Authorization": "Bearer k1"}) == 200
        assert _same_but_body(client, "/health") == 200
