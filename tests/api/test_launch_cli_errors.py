"""`pdd launch` / `pdd serve`: a bad --config, --name, security.cert_dir or model_path is a usage
error naming the flag or field (exit 2), never a traceback. Found by a new user; nothing is started."""

import json

import pytest

from pdd import launch
from pdd.cli import main
from pdd.security import CERT_DIR_UNSET, SecurityError
from tests.cli_usage import usage_error


@pytest.fixture
def no_instance(monkeypatch):
    """An argument that gets past the checks would run an instance: fail loudly instead."""
    def run_instance(cfg, name):
        raise AssertionError("run_instance was reached")

    monkeypatch.setattr(launch, "run_instance", run_instance)


def _model(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return str(d)


def _config(tmp_path, **fields):
    p = tmp_path / "c.json"
    p.write_text(json.dumps(fields))
    return str(p)


def _refused(capsys, argv, message):
    err = usage_error(capsys, main, argv)
    assert err.endswith(f"pdd {argv[0]}: error: {message}\n"), err


@pytest.mark.parametrize("cmd", [["launch", "--role", "prefill"], ["serve"], ["certs", "--out", "x"]])
def test_a_config_that_is_a_directory_names_config(capsys, tmp_path, cmd, no_instance):
    _refused(capsys, cmd + ["--config", str(tmp_path)],
             f"--config {tmp_path}: is a directory, not a config file (YAML or JSON)")


@pytest.mark.parametrize("cmd", [["launch", "--role", "prefill"], ["serve"], ["certs", "--out", "x"]])
def test_a_config_that_is_not_an_object_names_config(capsys, tmp_path, cmd, no_instance):
    """A config file holding a JSON list was `pdd: invalid config: ...` with exit 1; now a usage
    error naming --config, the file and what it must hold."""
    cfg = tmp_path / "c.json"
    cfg.write_text('[{"mode": "pdd"}]')
    _refused(capsys, cmd + ["--config", str(cfg)],
             f"--config {cfg}: expected a JSON object (a YAML mapping) of config fields, got a list")


def test_launch_refuses_an_instance_not_in_the_config(capsys, tmp_path, no_instance):
    cfg = _config(tmp_path, mode="colocated", model_path=_model(tmp_path), security={"cert_dir": str(tmp_path)})
    _refused(capsys, ["launch", "--role", "prefill", "--name", "p7", "--config", cfg],
             "--name p7: no instance of that name in the colocated topology of the config; its instances: c0, gateway")
    _refused(capsys, ["launch", "--role", "prefill", "--config", cfg],  # the role's default name, p0
             "--name p0: no instance of that name in the colocated topology of the config; its instances: c0, gateway")


def test_launch_refuses_tls_without_a_cert_dir(capsys, tmp_path, no_instance):
    cfg = _config(tmp_path, model_path=_model(tmp_path))  # security.tls is on by default
    _refused(capsys, ["launch", "--role", "prefill", "--config", cfg], CERT_DIR_UNSET)


def test_launch_refuses_a_missing_model_path(capsys, tmp_path, no_instance):
    missing = str(tmp_path / "nope")
    cfg = _config(tmp_path, model_path=missing, security={"cert_dir": str(tmp_path)})
    _refused(capsys, ["launch", "--role", "prefill", "--config", cfg],
             f"model_path {missing}: no checkpoint there (config.json missing); make one with: "
             f"pdd make-model --out {missing}")


def test_launch_turns_a_security_error_into_a_usage_error(capsys, tmp_path, monkeypatch, tiny_model):
    def run_instance(cfg, name):
        raise SecurityError(f"{tmp_path}/ca.pem is missing")

    from pdd.topology import free_port_block

    monkeypatch.setattr(launch, "run_instance", run_instance)
    base = free_port_block()  # launch refuses an instance whose (default) ports another process holds first
    cfg = _config(tmp_path, model_path=tiny_model, security={"cert_dir": str(tmp_path)}, base_port=base,
                  gateway_port=base + 95)
    _refused(capsys, ["launch", "--role", "prefill", "--config", cfg], f"{tmp_path}/ca.pem is missing")


def test_serve_turns_a_security_error_into_a_usage_error(capsys, tmp_path, monkeypatch):
    import signal

    from pdd import cli, topology

    class Topology:
        def __init__(self, cfg, log_dir=None):
            raise SecurityError(f"{tmp_path}: no certificate for 'p0' and no ca.key to issue one")

    monkeypatch.setattr(launch, "Topology", Topology)
    monkeypatch.setattr(topology, "ports_in_use", lambda lay: [])
    monkeypatch.setattr(cli, "ensure_model", lambda cfg: None)
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # serve's SIGTERM handler stays out of pytest
    _refused(capsys, ["serve"], f"{tmp_path}: no certificate for 'p0' and no ca.key to issue one")


@pytest.mark.parametrize("cmd", [["make-model", "--preset", "tiny"], ["certs"]])
@pytest.mark.parametrize("out,message", [
    ("FILE", "--out FILE: cannot create the output directory: a file of that name exists"),
    ("FILE/x", "--out FILE/x: cannot create the output directory: FILE is a file, not a directory"),
    ("/proc/pdd-test/x", "--out /proc/pdd-test/x: cannot create the output directory: No such file or directory"),
    ("", "--out '': empty; give the output directory"),  # wrote into the current directory
])
def test_make_model_and_certs_refuse_an_out_they_cannot_write(capsys, tmp_path, monkeypatch, cmd, out, message):
    """Found by a new user: make-model --out an existing file and certs --out an unwritable place
    were FileExistsError / PermissionError tracebacks."""
    import pdd.modelgen

    monkeypatch.chdir(tmp_path)

    monkeypatch.setattr(pdd.modelgen, "make_model", lambda *a, **k: pytest.fail("make_model was reached"))
    (tmp_path / "FILE").write_text("x")
    out = out.replace("FILE", str(tmp_path / "FILE"))
    _refused(capsys, cmd + ["--out", out], message.replace("FILE", str(tmp_path / "FILE")))


def test_launch_refuses_a_name_of_another_role(capsys, tmp_path, no_instance):
    """``--role prefill --name md0`` ran md0 as whatever its spec said, whatever --role claimed."""
    cfg = _config(tmp_path, mode="pdd", model_path=_model(tmp_path), security={"cert_dir": str(tmp_path)})
    _refused(capsys, ["launch", "--role", "prefill", "--name", "md0", "--config", cfg],
             "--name md0 is a main_decode instance, not prefill (--role)")


def test_a_start_failure_is_one_line_naming_the_config_field(tmp_path):
    """Found by a new user: an instance dying at start (device: cuda on a CPU-only torch, a KV
    pool larger than memory) printed its 30-line traceback; the error is its last line, with the
    config field behind it, and where the whole log is."""
    from pdd.config import ClusterConfig
    from pdd.launch import Topology

    topo = Topology(ClusterConfig(), log_dir=tmp_path)
    (tmp_path / "md0.log").write_text("starting\nTraceback (most recent call last):\n  File \"x.py\", line 1\n"
                                      "    boom()\nAssertionError: Torch not compiled with CUDA enabled\n")
    assert topo._cause("md0") == ("engine.device: cuda, but this torch has no CUDA (use device: cpu, or a CUDA "
                                  "build of torch): AssertionError: Torch not compiled with CUDA enabled "
                                  f"(whole log: {tmp_path / 'md0.log'})")
    (tmp_path / "p0.log").write_text("Traceback (most recent call last):\nValueError: something else\n")
    assert topo._cause("p0") == f"ValueError: something else (whole log: {tmp_path / 'p0.log'})"
    (tmp_path / "rld0.log").write_text("plain line\n")
    assert topo._cause("rld0") == f"\nplain line\n(whole log: {tmp_path / 'rld0.log'})"


def test_serve_refuses_a_model_path_with_no_checkpoint_naming_the_field(capsys, tmp_path):
    """As pdd launch, pdd bench and pdd demo say it: a usage error naming model_path (it was exit 1
    with "pdd: no checkpoint at ..."); only the default models/<preset> is made."""
    from pdd.cli import ensure_model
    from pdd.config import ClusterConfig

    model = tmp_path / "no" / "model"
    err = usage_error(capsys, ensure_model, ClusterConfig(model_path=str(model)))
    assert err == (f"pdd serve: error: model_path {model}: no checkpoint there (config.json missing); make one with: "
                   f"pdd make-model --out {model}\n")
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("role,name,offset,listens", [
    ("prefill", "p0", 10, "{b10} and {b20}"),  # its RPC port taken; it listens on its metrics port too
    ("link", "link", 1, "{b0} and {b1}"),  # md0's WAN port, which the link binds
])
def test_launch_refuses_an_instance_whose_port_is_taken(capsys, tmp_path, no_instance, role, name, offset, listens):
    """Found by a new user: `pdd launch` of an instance already running (or beside another
    topology on its ports) got past every check and died in the bind with asyncio's 20-line
    OSError traceback ("[Errno 98] ... address already in use")."""
    import socket

    from pdd.topology import free_port_block

    base = free_port_block()
    cfg = _config(tmp_path, mode="cross_dc_pd", model_path=_model(tmp_path), base_port=base,
                  security={"cert_dir": str(tmp_path)})
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", base + offset))
        s.listen()
        who = f"{name}: base_port + {offset}" if role != "link" else f"md0 wan: base_port + {offset}"
        ports = listens.format(b0=base, b1=base + 1, b10=base + 10, b20=base + 20)
        _refused(capsys, ["launch", "--role", role, "--config", cfg],
                 f"port {base + offset} ({who}) already in use (is {name} already running, or another pdd serve, "
                 f"make demo or pdd bench?): {name} listens on {ports}; move base_port / gateway_port in the "
                 f"config to run another topology beside it")


@pytest.mark.parametrize("cert_dir,why", [
    ("FILE", "a file of that name exists"),
    ("FILE/x", "Not a directory"),
    ("/proc/pdd-test/x", "No such file or directory"),
])
def test_serve_refuses_a_cert_dir_it_cannot_make_naming_the_field(capsys, tmp_path, monkeypatch, cert_dir, why):
    """Found by a new user: `security.cert_dir` naming a file (or a path that cannot be made) was a
    FileExistsError / NotADirectoryError traceback from `pdd serve` (and `pdd bench` said only
    "FileExistsError: [Errno 17] File exists"); nothing is started."""
    import signal

    from pdd import cli, topology

    (tmp_path / "FILE").write_text("x")
    cert_dir = cert_dir.replace("FILE", str(tmp_path / "FILE"))
    monkeypatch.setattr(topology, "ports_in_use", lambda lay: [])
    monkeypatch.setattr(cli, "ensure_model", lambda cfg: None)
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # serve's SIGTERM handler stays out of pytest
    monkeypatch.setattr(launch, "spawn_instance", lambda *a, **k: pytest.fail("an instance was started"))
    cfg = _config(tmp_path, mode="pdd", model_path=_model(tmp_path), security={"cert_dir": cert_dir})
    _refused(capsys, ["serve", "--config", cfg, "--log-dir", str(tmp_path / "logs")],
             f"security.cert_dir {cert_dir}: cannot create or write the topology's certificates there: {why}")


@pytest.mark.parametrize("cmd", [["launch", "--role", "prefill"], ["serve"]])
def test_a_model_path_that_is_a_file_is_named_as_one(capsys, tmp_path, monkeypatch, cmd, no_instance):
    """Found by a new user: `model_path: models/small/config.json` (or any file) was "no checkpoint
    there (config.json missing); make one with: pdd make-model --out models/small/config.json", a
    command that refuses a file."""
    from pdd import topology

    monkeypatch.setattr(topology, "ports_in_use", lambda lay: [])
    model = _model(tmp_path)
    for path, hint in ((f"{model}/config.json", f" (did you mean {model}?)"), (str(tmp_path / "c.json"), "")):
        cfg = _config(tmp_path, model_path=path, security={"cert_dir": str(tmp_path)})
        _refused(capsys, cmd + ["--config", cfg],
                 f"model_path {path}: is a file; give the checkpoint's directory (the one holding config.json){hint}")
