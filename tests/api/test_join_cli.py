"""`pdd launch --join URL`: only an engine instance joins (a usage error otherwise, nothing
started); the join asks the gateway for exactly that slot, with the config's API key; a config's
`standby` names must be engine instances of its layout, keeping one of each tier started."""

import contextlib
import json

import pytest

from pdd import launch
from pdd.cli import main
from pdd.config import ClusterConfig
from pdd.gateway.join import api_key, join_body
from pdd.topology import free_port_block, layout


@contextlib.contextmanager
def _gateway_stand_in(handler):
    """A stand-in gateway (``handler``, a BaseHTTPRequestHandler) on a free port of 127.0.0.1,
    serving in a thread: yields ``(cfg, port)`` for :mod:`pdd.gateway.join` (the instance
    "listening" is the stand-in's own server)."""
    import threading
    from http.server import ThreadingHTTPServer
    from types import SimpleNamespace

    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield SimpleNamespace(host="127.0.0.1", security=SimpleNamespace(api_keys=[])), srv.server_address[1]
    finally:
        srv.shutdown()
        srv.server_close()


def _config_that_must_not_run(tmp_path, monkeypatch, model=None):
    """A config file for ``pdd launch`` whose instance fails the test if it is started (the
    usage error must come first). ``model``: a real checkpoint, for a launch that gets past
    launch's checkpoint check."""
    monkeypatch.setattr(launch, "run_instance", lambda cfg, name: (_ for _ in ()).throw(AssertionError("ran")))
    if model is None:
        (tmp_path / "model").mkdir()
        (tmp_path / "model" / "config.json").write_text("{}")
        model = str(tmp_path / "model")
    cfg = tmp_path / "c.json"
    base = free_port_block()  # launch refuses an instance whose (default) ports another process holds first
    cfg.write_text(json.dumps({"model_path": model, "base_port": base, "gateway_port": base + 95,
                               "security": {"tls": False, "fast_path": "plain"}}))
    return cfg


def test_join_of_the_link_is_a_usage_error(tmp_path, capsys, monkeypatch):
    cfg = _config_that_must_not_run(tmp_path, monkeypatch)
    with pytest.raises(SystemExit) as ex:
        main(["launch", "--role", "link", "--config", str(cfg), "--join", "http://127.0.0.1:1"])
    assert ex.value.code == 2
    err = capsys.readouterr().err
    assert "--join: only an engine instance" in err and "Traceback" not in err


def test_join_body_and_key(monkeypatch):
    cfg = ClusterConfig.model_validate({"base_port": 18000, "instances": {"main_decode": 2}, "standby": ["md1"],
                                        "security": {"api_keys": ["k1", "k2"]}})
    assert join_body(layout(cfg).get("md1"), cfg.host) == {"role": "main_decode", "name": "md1",
                                                           "address": "127.0.0.1:18071"}
    monkeypatch.delenv("PDD_API_KEY", raising=False)
    assert api_key(cfg) == "k1"
    monkeypatch.setenv("PDD_API_KEY", "env")
    assert api_key(cfg) == "env"


@pytest.mark.parametrize("standby,msg", [
    (["md7"], "standby: 'md7' is not an instance of the pdd topology"),
    (["link"], "standby: 'link' is not an instance of the pdd topology"),
    (["md0", "md1"], "standby: every main_decode instance is in standby; keep at least one started"),
])
def test_bad_standby(standby, msg):
    with pytest.raises(Exception) as ei:
        ClusterConfig.model_validate({"instances": {"main_decode": 2}, "standby": standby})
    assert msg in str(ei.value)


@pytest.mark.parametrize("url,why", [
    ("127.0.0.1:8000", "is not an http:// or https:// URL"),
    ("http://127.0.0.1:80x0", "has a bad port"),
    ("http://127.0.0.1:70000", "has a bad port"),
    ("http://:8000", "names no host"),
    ("ftp://gw:8000", "is not an http:// or https:// URL"),
    # used as given: urlsplit accepted these, the HTTP client then failed late (JOIN FAILED)
    (" http://127.0.0.1:8000", "has whitespace or a control character"),
    ("http://127.0.0.1:8000/ ", "has whitespace or a control character"),
    ("http://127.0.0.1\n:8000", "has whitespace or a control character"),
    ("http://[::1:8000", "has a malformed IPv6 host"),
])
def test_malformed_join_url_is_a_one_line_usage_error(tmp_path, capsys, monkeypatch, url, why):
    cfg = _config_that_must_not_run(tmp_path, monkeypatch)
    with pytest.raises(SystemExit) as ex:
        main(["launch", "--role", "main_decode", "--config", str(cfg), "--join", url])
    assert ex.value.code == 2
    err = capsys.readouterr().err
    line = [ln for ln in err.splitlines() if "--join" in ln and why in ln]
    assert line and "Traceback" not in err, err


def test_good_join_urls_pass():
    from pdd.gateway.join import gateway_url_problem

    assert gateway_url_problem("http://127.0.0.1:8000") is None
    assert gateway_url_problem("https://gw.example:443/") is None
    assert gateway_url_problem("http://127.0.0.1") is None  # port 80, as any HTTP client
    assert gateway_url_problem("http://[::1]:8000") is None


def test_a_join_url_with_a_path_or_query_is_refused():
    from pdd.gateway.join import gateway_url_problem

    for url in ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/?x=1", "http://127.0.0.1:8000#top"):
        assert "path, query or fragment" in gateway_url_problem(url), url


def test_a_join_answered_with_a_long_page_says_how_long_it_was():
    """A gateway (or a proxy before it) answering with a page, not JSON: the message cut the page
    at 200 characters without saying so; it is now cut by ``shown`` (120, then its length)."""
    from http.server import BaseHTTPRequestHandler
    from types import SimpleNamespace

    from pdd.gateway.join import join

    class Page(BaseHTTPRequestHandler):
        def do_POST(self):
            body = ("<p>" + "e" * 997).encode()
            self.send_response(502)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    with _gateway_stand_in(Page) as (cfg, port):
        spec = SimpleNamespace(name="md1", role="main_decode", port=port)
        rep = join(cfg, spec, f"http://127.0.0.1:{port}", timeout_s=10)
    assert rep == {"error": {"message": f"HTTP 502: '<p>{'e' * 116}... (1000 characters)"}}


@pytest.mark.parametrize("given", ["http://127.0.0.1:1/v1", "http://127.0.0.1:1/v1/"])
def test_join_takes_the_v1_url_pdd_serve_prints_as_the_gateways_root(tmp_path, monkeypatch, given, tiny_model):
    """``pdd serve`` prints "serving at http://127.0.0.1:8000/v1" (the OpenAI base_url form): that
    URL given to --join was refused as having a path; its root is joined."""
    import pdd.gateway.join as join_mod

    cfg = _config_that_must_not_run(tmp_path, monkeypatch, model=tiny_model)
    joined, ran = [], []
    monkeypatch.setattr(join_mod, "join_when_ready", lambda cfg, spec, url: joined.append((spec.name, url)))
    monkeypatch.setattr(launch, "run_instance", lambda cfg, name: ran.append(name))
    assert main(["launch", "--role", "main_decode", "--config", str(cfg), "--join", given]) == 0
    assert joined == [("md0", "http://127.0.0.1:1")] and ran == ["md0"]


@pytest.mark.parametrize("holder,printed", [
    # md0 was killed and relaunched by hand with --join: the gateway's watcher had reconnected it,
    # the add answered 409 and launch printed "JOIN FAILED md0: ... already a member's: md0 (active)"
    ({"name": "md0", "state": "active", "connected": True},
     ("JOINED md0 active (already a member: the gateway reconnected to this process)\n", "")),
    ({"name": "md0", "state": "active", "connected": False},
     ("JOINED md0 active (already a member: the gateway reconnects to this process)\n", "")),
    # another member at the address: still a failure
    ({"name": "md1", "state": "active", "connected": True},
     ("", "JOIN FAILED md0: address '127.0.0.1:{port}' is already a member's: md1 (active)\n")),
])
def test_a_relaunched_member_joins_as_already_a_member(capsys, holder, printed):
    from http.server import BaseHTTPRequestHandler
    from types import SimpleNamespace

    from pdd.gateway.join import join_when_ready

    port = None

    class Gateway(BaseHTTPRequestHandler):
        def _json(self, status, obj):
            body = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self._json(409, {"error": {"message": f"address '127.0.0.1:{port}' is already a member's: "
                                                  f"{holder['name']} ({holder['state']})",
                                       "type": "invalid_request_error", "param": "address",
                                       "code": "duplicate_address"}})

        def do_GET(self):
            assert self.path == "/pdd/instances"
            self._json(200, {"object": "list", "data": [{**holder, "address": f"127.0.0.1:{port}"}]})

        def log_message(self, *a):
            pass

    with _gateway_stand_in(Gateway) as (cfg, port):
        spec = SimpleNamespace(name="md0", role="main_decode", port=port)
        join_when_ready(cfg, spec, f"http://127.0.0.1:{port}").join(timeout=20)
    out, err = capsys.readouterr()
    assert (out, err) == (printed[0], printed[1].format(port=port))
