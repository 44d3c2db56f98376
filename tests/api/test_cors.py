"""Browser access to the gateway (CORS) as vLLM's server gives it: ``cors`` in the config and
``pdd serve --allowed-origins / --allow-credentials / --allowed-methods / --allowed-headers``
(vLLM's flags, JSON lists), vLLM's defaults (no origin: no cross-origin access). pdd had no CORS:
a browser's preflight got 405 and no page could call it. In-process app; ports 9270..9369, 9382."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pdd.config import ClusterConfig, validation_summary
from tests.cli_usage import usage_error

APP = "https://app.example.com"
PREFLIGHT = {"Origin": APP, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type, x-request-id"}


def _client(tiny_model, **cfg):
    from fastapi.testclient import TestClient
    from tokenizers import Tokenizer

    from pdd.engine.engine import Engine
    from pdd.gateway.api import create_app
    from tests.api.conftest import EngineOrch

    conf = ClusterConfig.model_validate({"model_path": tiny_model, "served_model_name": "pdd-tiny",
                                         "engine": {"max_model_len": 512, "max_input_len": 400}, **cfg})
    orch = EngineOrch(Engine.from_pretrained(tiny_model, num_pages=64, page_size=8))
    return TestClient(create_app(conf, orch, Tokenizer.from_file(f"{tiny_model}/tokenizer.json")))


def _refusal(message: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}


def test_an_allowed_origin_gets_its_preflight_and_its_response_headers(tiny_model):
    """The preflight is answered before the API key (a browser sends none with it); the request
    itself, refused or served, carries the headers the page needs to read the answer."""
    with _client(tiny_model, cors={"allowed_origins": [APP]}, security={"api_keys": ["k1"]}) as client:
        r = client.options("/v1/chat/completions", headers=PREFLIGHT)
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == APP
        assert {"GET", "POST", "OPTIONS"} <= set(r.headers["access-control-allow-methods"].split(", "))  # '*': all
        assert r.headers["access-control-allow-headers"] == "authorization, content-type, x-request-id"
        assert "access-control-allow-credentials" not in r.headers  # vLLM's default: off
        body = {"prompt": "Hello", "max_tokens": 2}
        r = client.post("/v1/completions", json=body, headers={"Origin": APP, "X-Request-Id": "page-1"})
        assert r.status_code == 401  # no key: refused, and the page can read why
        assert (r.headers["access-control-allow-origin"], r.headers["access-control-expose-headers"]) == (
            APP, "X-Request-Id")
        r = client.post("/v1/completions", json=body, headers={"Origin": APP, "Authorization": "Bearer k1",
                                                                "X-Request-Id": "page-2"})
        assert r.status_code == 200, r.text
        assert (r.headers["access-control-allow-origin"], r.headers["x-request-id"]) == (APP, "page-2")
        assert r.headers["vary"] == "Origin"
        r = client.options("/v1/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"})
        # an OpenAI-style body (it was Starlette's plain text), Starlette's 400 kept
        assert (r.status_code, r.headers["content-type"], r.json()) == (400, "application/json", _refusal(
            "Disallowed CORS origin: 'https://evil.example' is not in cors.allowed_origins (the gateway's "
            "config; pdd serve --allowed-origins)"))
        assert "access-control-allow-origin" not in r.headers


def test_the_default_allows_no_origin_as_vllm(tiny_model):
    with _client(tiny_model) as client:
        r = client.options("/v1/completions", headers=PREFLIGHT)
        assert (r.status_code, r.json()) == (400, _refusal(
            "Disallowed CORS origin: 'https://app.example.com' is not in cors.allowed_origins (the gateway's "
            "config; pdd serve --allowed-origins)"))
        r = client.get("/v1/models", headers={"Origin": APP})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_credentials_methods_and_headers_narrow_the_preflight(tiny_model):
    cors = {"allowed_origins": ["*"], "allow_credentials": True, "allowed_methods": ["GET", "POST"],
            "allowed_headers": ["Content-Type"]}
    with _client(tiny_model, cors=cors) as client:
        r = client.options("/v1/completions", headers={**PREFLIGHT, "Access-Control-Request-Headers": "content-type"})
        assert r.status_code == 200, r.text
        assert (r.headers["access-control-allow-origin"], r.headers["access-control-allow-credentials"],
                r.headers["access-control-allow-methods"]) == (APP, "true", "GET, POST")
        r = client.options("/v1/completions", headers=PREFLIGHT)  # authorization is not allowed
        assert (r.status_code, r.json()) == (400, _refusal(
            "Disallowed CORS headers: 'authorization, content-type, x-request-id' are not all in "
            "cors.allowed_headers (the gateway's config; pdd serve --allowed-headers)"))
        r = client.options("/v1/completions", headers={**PREFLIGHT, "Access-Control-Request-Method": "PUT",
                                                       "Access-Control-Request-Headers": "content-type"})
        assert (r.status_code, r.json()) == (400, _refusal(
            "Disallowed CORS method: 'PUT' is not in cors.allowed_methods (the gateway's config; pdd serve "
            "--allowed-methods)"))


@pytest.mark.parametrize("cors,message", [
    ({"allowed_origins": ["http://localhost:3000/"]},
     "cors.allowed_origins: entry 1 'http://localhost:3000/' is not an origin as a browser sends it: "
     "scheme://host[:port] in lower case, without a path or trailing slash (e.g. 'https://app.example.com'), "
     "or '*' for any"),
    ({"allowed_origins": ["*", "App.example.com"]},
     "cors.allowed_origins: entry 2 'App.example.com' is not an origin as a browser sends it: "
     "scheme://host[:port] in lower case, without a path or trailing slash (e.g. 'https://app.example.com'), "
     "or '*' for any"),
    ({"allowed_methods": ["get"]},
     "cors.allowed_methods: entry 1 'get' is not an HTTP method in upper case (GET, POST, OPTIONS, ...) nor '*'"),
    ({"allowed_headers": ["Content-Type, Authorization"]},
     "cors.allowed_headers: entry 1 'Content-Type, Authorization' is not a header name (letters, digits and "
     "!#$%&'*+.^_`|~-) nor '*'"),
    ({"allow_credentials": "yes"},
     "cors.allow_credentials: must be true or false (YAML's yes/no and on/off unquoted too), got the string 'yes'"),
    ({"allowed_origins": "*"}, "cors.allowed_origins: Input should be a valid list"),
])
def test_a_bad_cors_value_is_named(cors, message):
    with pytest.raises(ValidationError) as ei:
        ClusterConfig.model_validate({"cors": cors})
    assert validation_summary(ei.value) == message


@pytest.mark.parametrize("argv,message", [
    (["--allowed-origins", "https://app.example.com"],
     "pdd serve: error: --allowed-origins 'https://app.example.com': expected a JSON list of strings, e.g. "
     "'[\"https://app.example.com\"]' (as vLLM takes it)\n"),
    (["--allowed-headers", "[1]"],
     "pdd serve: error: --allowed-headers '[1]': expected a JSON list of strings, e.g. "
     "'[\"https://app.example.com\"]' (as vLLM takes it)\n"),
    (["--allowed-origins", '["https://app.example.com/"]'],
     "pdd serve: error: invalid config: cors.allowed_origins (--allowed-origins): entry 1 "
     "'https://app.example.com/' is not an origin as a browser sends it: scheme://host[:port] in lower case, "
     "without a path or trailing slash (e.g. 'https://app.example.com'), or '*' for any\n"),
])
def test_serve_names_the_flag_of_a_bad_cors_value(argv, message, capsys):
    from pdd.cli import main

    assert usage_error(capsys, main, ["serve", "--port", "9382", "--base-port", "9270", *argv]) == message


def test_serve_flags_replace_the_config_fields_they_name(tmp_path):
    from pdd.cli import build_parser
    from pdd.cli_args import with_cors_flags

    (tmp_path / "c.yaml").write_text("cors: {allowed_origins: ['https://a.example'], "
                                     "allowed_headers: [Authorization]}\n")
    cfg = ClusterConfig.load(tmp_path / "c.yaml")
    args = build_parser().parse_args(["serve", "--allowed-origins", '["https://b.example", "http://localhost:3000"]',
                                      "--allow-credentials"])
    assert with_cors_flags(args, cfg).cors.model_dump() == {
        "allowed_origins": ["https://b.example", "http://localhost:3000"], "allow_credentials": True,
        "allowed_methods": ["*"], "allowed_headers": ["Authorization"]}
    assert with_cors_flags(build_parser().parse_args(["serve"]), cfg) is cfg


def test_serve_flags_leave_the_rest_of_the_config_as_the_user_gave_it():
    """Found in review: the flags re-validated the whole config from its dump, which marks every
    field as given, so `pdd serve --mode colocated --allowed-origins ...` printed a note that the
    config sets all nine pdd-only policy settings (it sets none), and the engine's derived limits
    read as given. Only the cors block changes."""
    from pdd.cli import build_parser
    from pdd.cli_args import with_cors_flags

    cfg = ClusterConfig.model_validate({"mode": "colocated"})
    args = build_parser().parse_args(["serve", "--allowed-origins", '["https://a.example.com"]'])
    out = with_cors_flags(args, cfg)
    assert out.cors.allowed_origins == ["https://a.example.com"]
    assert out.unused_settings() == []
    assert out.model_fields_set == {"mode", "cors"}
    assert out.policy.model_fields_set == cfg.policy.model_fields_set == set()
    assert out.engine.model_fields_set == cfg.engine.model_fields_set
