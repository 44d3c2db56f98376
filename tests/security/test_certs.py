"""`pdd certs`, the launcher's certificate set-up, and the gateway's API key middleware."""

from __future__ import annotations

import json
import stat

import httpx
import pytest

from pdd.cli import main
from pdd.config import ClusterConfig
from pdd.launch import prepare_security
from pdd.security import ApiKeyMiddleware, SecurityError, make_certs


def test_pdd_certs_makes_a_ca_and_per_instance_certificates(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("mode: pdd\nhost: 127.0.0.1\n")
    out = tmp_path / "certs"
    assert main(["certs", "--config", str(cfg), "--out", str(out)]) == 0
    assert "issued p0, rld0, md0, gateway" in capsys.readouterr().out
    names = {p.name for p in out.iterdir()}
    assert names == {"ca.pem", "ca.key", "fastpath.key"} | {f"{n}.{e}" for n in ("p0", "rld0", "md0", "gateway")
                                                           for e in ("pem", "key")}
    for n in ("ca.key", "p0.key", "fastpath.key"):
        assert stat.S_IMODE((out / n).stat().st_mode) == 0o600
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((out / "md0.pem").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "md0" in san.get_values_for_type(x509.DNSName)
    assert [str(i) for i in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    ca = x509.load_pem_x509_certificate((out / "ca.pem").read_bytes())
    cert.verify_directly_issued_by(ca)

    # idempotent: a second run keeps everything; another mode only adds what it lacks
    before = (out / "p0.pem").read_bytes()
    assert main(["certs", "--config", str(cfg), "--out", str(out), "--mode", "same_dc_pd"]) == 0
    assert "CA kept, issued d0, kept p0, gateway" in capsys.readouterr().out
    assert (out / "p0.pem").read_bytes() == before


def test_certs_without_the_ca_key_cannot_be_issued(tmp_path):
    make_certs(tmp_path, ["a"])
    (tmp_path / "ca.key").unlink()
    assert make_certs(tmp_path, ["a"])["kept"] == ["a"]
    with pytest.raises(SecurityError, match="no ca.key"):
        make_certs(tmp_path, ["b"])


def test_launcher_makes_certs_into_the_log_dir_unless_the_config_points_to_them(tmp_path):
    cfg = prepare_security(ClusterConfig(), tmp_path / "logs")
    assert cfg.security.cert_dir == str((tmp_path / "logs" / "certs").resolve())
    assert (tmp_path / "logs" / "certs" / "gateway.pem").exists()

    mine = tmp_path / "mine"
    make_certs(mine, ["p0", "rld0", "md0", "gateway"])
    ca = (mine / "ca.pem").read_bytes()
    cfg = prepare_security(ClusterConfig.model_validate({"security": {"cert_dir": str(mine)}}), tmp_path / "l2")
    assert cfg.security.cert_dir == str(mine.resolve()) and (mine / "ca.pem").read_bytes() == ca
    assert not (tmp_path / "l2" / "certs").exists()

    off = ClusterConfig.model_validate({"security": {"tls": False, "fast_path": "plain"}})
    assert prepare_security(off, tmp_path / "l3").security.cert_dir is None


def test_security_config_defaults_and_validation():
    sec = ClusterConfig().security
    assert sec.tls is True and sec.fast_path == "mac" and sec.cert_dir is None and sec.api_keys == []
    with pytest.raises(Exception):
        ClusterConfig.model_validate({"security": {"fast_path": "rdma"}})
    with pytest.raises(Exception):
        ClusterConfig.model_validate({"security": {"tsl": False}})  # typos are refused


async def test_api_key_middleware():
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    guarded = ApiKeyMiddleware(app, keys=["k1", "k2"])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guarded), base_url="http://t") as c:
        r = await c.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert (await c.get("/v1/models", headers={"Authorization": "Bearer nope"})).status_code == 401
        assert (await c.get("/v1/models", headers={"Authorization": "Bearer k2"})).text == "ok"
        assert (await c.get("/v1/models", headers={"x-api-key": "k1"})).text == "ok"
        assert (await c.get("/health")).text == "ok"  # health checks need no key
    open_app = ApiKeyMiddleware(app, keys=[])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=open_app), base_url="http://t") as c:
        assert (await c.get("/v1/models")).text == "ok"
    assert json.loads(json.dumps(ClusterConfig.model_validate({"security": {"api_keys": ["x"]}}).model_dump()))


@pytest.mark.parametrize("headers,message", [
    # the second of two was taken silently (a dict of the headers kept the last)
    ([("Authorization", "Bearer nope"), ("Authorization", "Bearer k1")],
     "ambiguous credentials: the request has 2 Authorization headers; send one"),
    ([("Authorization", "Bearer k1"), ("Authorization", "Bearer k1")],
     "ambiguous credentials: the request has 2 Authorization headers; send one"),
    ([("x-api-key", "k1"), ("X-Api-Key", "nope")],
     "ambiguous credentials: the request has 2 x-api-key headers; send one"),
])
async def test_two_credentials_are_a_401_saying_so(headers, message):
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    guarded = ApiKeyMiddleware(app, keys=["k1", "k2"])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guarded), base_url="http://t") as c:
        r = await c.get("/v1/models", headers=headers)
        assert (r.status_code, r.json()) == (401, {"error": {"message": message, "type": "invalid_request_error",
                                                             "param": None, "code": "invalid_api_key"}})
        assert r.headers["www-authenticate"] == "Bearer"
        # one of each header is no ambiguity: the Bearer key decides (docs/SECURITY.md)
        assert (await c.get("/v1/models", headers=[("Authorization", "Bearer k1"), ("x-api-key", "nope")])).text == "ok"
