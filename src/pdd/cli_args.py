"""What every ``pdd`` sub-command (``pdd.cli``, ``pdd.sim.cli``) does with a bad config or flag:
one line naming the field or flag, never a traceback."""

from __future__ import annotations

import argparse
import sys


class ShortUsageParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors (argparse's own and ``ap.error`` calls alike) print
    one usage line pointing at ``--help``, then ``PROG: error: MESSAGE``, on stderr, and exit
    with status 2. argparse printed the whole usage first: 24 lines for ``pdd bench``, 37 for
    ``pdd sim run``, which pushed the message naming the flag off the screen. ``pdd``'s parser
    is one (``pdd.cli``), so every sub-command's parser is one too (argparse makes them of the
    parent's class)."""

    def error(self, message: str):
        self.exit(2, f"usage: {self.prog} [-h] [options]  (see {self.prog} --help)\n{self.prog}: error: {message}\n")


def config_or_exit(args, **over):
    """``ClusterConfig.load(args.config, **over)``, or a usage error (:func:`usage_error`: one
    line ``PROG: error: ...`` on stderr, SystemExit(2)) naming the field, the file or the flag,
    never a traceback. Every bad input is exit 2, as argparse's: a --config path that is no
    config file, a file that is not YAML/JSON, a field out of range in it (``--config F: invalid
    config: gateway_port: ...``; this was exit 1) and a flag's value out of range
    (``invalid config: gateway_port (--port): ...``)."""
    from pydantic import ValidationError

    from pdd.config import ClusterConfig, ConfigFileError, validation_summary

    try:
        return ClusterConfig.load(getattr(args, "config", None), **over)
    except ValidationError as e:
        by_flag = {str(err["loc"][0]) for err in e.errors() if _by_flag(err, over)}
        msg = f"invalid config: {_flagged(validation_summary(e), by_flag)}"
        if by_flag:  # a flag's value out of range (--port 0)
            usage_error(args, msg)
        flags = [f for k, f in _OVERRIDE_FLAGS.items() if over.get(k) is not None]
        if flags and _loads(args, {k: v for k, v in over.items() if k not in _OVERRIDE_FLAGS}):
            # valid without the flags: their values made it invalid (--port inside --base-port's block,
            # "ports collide"), as in pdd demo and pdd bench
            usage_error(args, f"{' / '.join(flags)}: {msg}")
        usage_error(args, config_value_problem(getattr(args, "config", None), msg))
    except (OSError, ConfigFileError) as e:  # the only file load reads is --config itself
        usage_error(args, config_file_problem(args.config, e))
    except ValueError as e:
        usage_error(args, config_value_problem(getattr(args, "config", None), f"invalid config: {e}"))


def config_value_problem(path, msg: str) -> str:
    """``msg`` (``invalid config: FIELD: ...``) with the ``--config PATH`` it came from in front,
    as every command names a refused field of a config file (``pdd bench`` did first); ``msg``
    as it is when no file was given (the embedded defaults with a flag's value)."""
    return f"--config {path}: {msg}" if path else msg


def config_file_problem(path, ex: Exception) -> str | None:
    """The one line naming ``--config PATH`` for a config file ``ClusterConfig.load`` could not
    read (``ex``), as every command says it (``--config /x.yaml: no such file``; ``pdd demo`` said
    "--config: [Errno 2] No such file or directory: '/x.yaml'"); None for another exception."""
    from pdd.config import ConfigFileError

    if isinstance(ex, FileNotFoundError):
        return f"--config {path}: no such file"
    if isinstance(ex, IsADirectoryError):
        return f"--config {path}: is a directory, not a config file (YAML or JSON)"
    if isinstance(ex, OSError):  # unreadable (permissions)
        return f"--config {path}: cannot read it: {ex.strerror or ex}"
    if isinstance(ex, ConfigFileError):  # not YAML / JSON, or not a mapping of fields: the message names the file
        return f"--config {ex}"
    return None


_OVERRIDE_FLAGS = {"gateway_port": "--port", "base_port": "--base-port", "mode": "--mode",
                   "shutdown_timeout_s": "--shutdown-timeout"}


def _loads(args, over: dict) -> bool:
    """Whether ``--config`` with ``over`` (and none of the flags' overrides) is a valid config."""
    from pdd.config import ClusterConfig

    try:
        ClusterConfig.load(getattr(args, "config", None), **over)
    except Exception:
        return False
    return True


def _by_flag(err: dict, over: dict) -> bool:
    """Whether pydantic error ``err`` is about a value a flag gave (``over``), not the one the
    config file has for that field (``ClusterConfig.load`` checks that one too: ``gateway_port:
    70000`` under ``--port 9300``)."""
    field = str(err["loc"][0]) if err.get("loc") else None
    given = over.get(field)  # (the same object: a NaN equals nothing, itself included)
    return field in _OVERRIDE_FLAGS and given is not None and (err.get("input") is given or err.get("input") == given)


def _flagged(summary: str, by_flag: set[str]) -> str:
    """``validation_summary`` with the flag named beside a field a flag set (``gateway_port (--port):
    ...``): the user typed ``--port 99999``, not ``gateway_port``. ``by_flag``: those fields."""
    parts = []
    for part in summary.split("; "):
        field = part.split(":", 1)[0]
        if field in by_flag:
            part = f"{field} ({_OVERRIDE_FLAGS[field]}){part[len(field):]}"
        parts.append(part)
    return "; ".join(parts)


CORS_FLAGS = {"allowed_origins": "--allowed-origins", "allowed_methods": "--allowed-methods",
              "allowed_headers": "--allowed-headers"}  # cors.<field>: pdd serve's flag (vLLM's names)


def with_cors_flags(args, cfg):
    """``cfg`` with ``pdd serve``'s CORS flags over its ``cors`` block: ``--allowed-origins``,
    ``--allowed-methods``, ``--allowed-headers`` (each a JSON list of strings, as vLLM takes them)
    and ``--allow-credentials``. A value that is not such a list, or that the ``cors`` block refuses
    (:class:`pdd.config.CorsConfig`), is a usage error naming the flag and the field (one line,
    exit 2)."""
    import json

    from pydantic import ValidationError

    from pdd.config import CorsConfig, validation_summary

    given: dict = {}
    for field, flag in CORS_FLAGS.items():
        text = getattr(args, field, None)
        if text is None:
            continue
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            usage_error(args, f"{flag} {text!r}: expected a JSON list of strings, e.g. "
                              f"'[\"https://app.example.com\"]' (as vLLM takes it)")
        given[field] = value
    if getattr(args, "allow_credentials", False):
        given["allow_credentials"] = True
    if not given:
        return cfg
    try:
        # the cors block alone: re-validating the whole config from its dump would mark every field
        # as given (unused_settings and the derived engine limits read which ones the user set)
        cors = CorsConfig.model_validate({**cfg.cors.model_dump(), **given})
    except ValidationError as e:
        msg = "; ".join(f"cors.{part}" for part in validation_summary(e).split("; "))
        for field, flag in CORS_FLAGS.items():
            msg = msg.replace(f"cors.{field}:", f"cors.{field} ({flag}):")
        usage_error(args, f"invalid config: {msg}")
    return cfg.model_copy(update={"cors": cors})


def seconds_flag(args, flag: str, text: str | None) -> float | None:
    """The number of seconds ``text`` given to ``flag`` (``pdd serve --shutdown-timeout``) says,
    or None when the flag was not given; a usage error naming the flag (one line, exit 2) when it
    is not a number. Its range is the config field's, checked with the config (the flag named
    there too: a negative, NaN or infinite value)."""
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        usage_error(args, f"{flag} {text!r}: not a number; give seconds >= 0")


def missing_model_problem(cfg) -> str | None:
    """Why the checkpoint ``cfg.model_path`` names cannot be used or made: None when it holds a
    ``config.json`` or is the embedded default ``models/<model_preset>`` (which ``pdd serve``,
    ``pdd bench`` and ``pdd demo`` write with random weights when missing); else the one line
    naming ``model_path`` and the command that makes one. A path the user named is never
    filled with random weights behind their back. Raises nothing."""
    from pathlib import Path

    path = Path(cfg.model_path)
    if (path / "config.json").exists() or (path == Path("models") / cfg.model_preset and not path.is_file()):
        return None
    return no_checkpoint_message(cfg.model_path)


def no_checkpoint_message(model_path: str) -> str:
    """The one line naming ``model_path`` when no checkpoint is there: a file (``config.json``
    itself, a weights file) is named as such, since ``pdd make-model --out FILE`` cannot make one
    there; else the command that makes one."""
    from pathlib import Path

    if Path(model_path).is_file():
        parent = Path(model_path).parent
        hint = f" (did you mean {parent}?)" if (parent / "config.json").is_file() else ""
        return (f"model_path {model_path}: is a file; give the checkpoint's directory (the one holding "
                f"config.json){hint}")
    return (f"model_path {model_path}: no checkpoint there (config.json missing); make one with: "
            f"pdd make-model --out {model_path}")


def gateway_root(url: str) -> str:
    """``url`` without a trailing ``/v1`` or ``/v1/``: the OpenAI ``base_url`` form users copy
    (``pdd serve`` prints "serving at http://127.0.0.1:8000/v1") taken as the gateway's root,
    which ``pdd bench --url`` and ``pdd launch --join`` want (they add ``/v1/models``,
    ``/pdd/stats``, ``/pdd/instances`` themselves). Anything else is returned as given."""
    for tail in ("/v1/", "/v1"):
        if url.endswith(tail):
            return url[:-len(tail)]
    return url


def openai_endpoint(url: str) -> str | None:
    """The OpenAI endpoint path ``url`` names (``/v1/completions``, ``/v1/chat/completions``, any
    ``/v1/<something>``), or None: given to a flag that wants the gateway's root, where the
    command adds the endpoints itself (``pdd bench --url``), it would be requested as
    ``.../v1/completions/v1/models``. A root behind a path prefix (``http://host/pdd``) is not one."""
    from urllib.parse import urlsplit

    path = urlsplit(url or "").path
    i = path.find("/v1/")
    return path[i:] if i >= 0 and path[i + 4:].strip("/") else None


def usage_error(args, msg: str):
    """A usage error naming the flag or config field: one line ``PROG: error: MSG`` on stderr (the
    sub-command's prog, else ``pdd``), then SystemExit(2). Not argparse's ``error``, whose usage
    block (37 lines for ``pdd sim run``) came first and buried the line naming the flag, as
    ``pdd.sim.cli.run_command`` prints a refused value."""
    p = getattr(args, "parser", None)
    refuse(p.prog if p is not None else "pdd", msg)


def refuse(prog: str, msg: str):
    """One line ``PROG: error: MSG`` on stderr, then SystemExit(2): :func:`usage_error` for a
    command that has its parser's prog at hand (``pdd demo``, ``pdd bench``) rather than in
    ``args``."""
    print(f"{prog}: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def file_in_the_way(path):
    """The nearest existing ancestor of ``path`` (str or Path) when it is a file (or anything but
    a directory), so that nothing can be made under it: ``/etc/passwd`` for ``/etc/passwd/a/x.json``;
    None when that ancestor is a directory. Out-path checks name it ("/etc/passwd is a file, not
    a directory") rather than saying "no such directory" of a path that exists."""
    import os
    from pathlib import Path

    for p in Path(os.path.abspath(path)).parents:
        if os.path.lexists(p):
            return None if p.is_dir() else _as_given(path, p)
    return None


def _as_given(path, ancestor):
    """``ancestor`` (absolute) spelled as ``path`` spells its parents: relative when it is."""
    import os
    from pathlib import Path

    given = Path(path)
    for p in given.parents:
        if Path(os.path.abspath(p)) == ancestor:
            return p
    return ancestor


def out_dir_problem(path, keep: bool, flag: str = "--out") -> str | None:
    """None when ``path`` (str or Path) is, or can be made, a writable directory (parents too);
    else the one line naming ``flag`` that says why not, e.g. ``--out F: cannot create the output
    directory: a file of that name exists``. An empty ``path`` is refused (``Path("")`` is the
    current directory: the run's files would land there).

    ``keep=True`` leaves the directory made (``pdd make-model``, ``pdd certs``, ``pdd sim ...``
    write into it next); ``keep=False`` makes it only to find out and then removes what this call
    made, down to what existed before (``pdd bench`` / ``pdd demo``: a run refused after this
    check, e.g. for a taken port, leaves nothing behind; the run makes it once it starts).
    Raises nothing."""
    import os
    from pathlib import Path

    if not str(path).strip():
        return f"{flag} {str(path)!r}: empty; give the output directory"
    out = Path(os.path.abspath(path))  # no '..' in it: only what this call made is removed
    made = [] if keep else [p for p in (out, *out.parents) if not p.exists()]  # deepest first
    try:
        out.mkdir(parents=True, exist_ok=True)
        if not os.access(out, os.W_OK):
            return f"{flag} {path}: the output directory is not writable"
    except FileExistsError:
        return f"{flag} {path}: cannot create the output directory: a file of that name exists"
    except NotADirectoryError as ex:
        if (f := file_in_the_way(path)) is not None:
            return f"{flag} {path}: cannot create the output directory: {f} is a file, not a directory"
        return f"{flag} {path}: cannot create the output directory: {ex.strerror or ex}"
    except OSError as ex:
        return f"{flag} {path}: cannot create the output directory: {ex.strerror or ex}"
    finally:
        for p in made:
            try:
                p.rmdir()
            except OSError:
                break  # not empty (another process wrote there meanwhile): kept
    return None


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP received by a command that :func:`stop_on_sigterm` set up: raised in its
    main thread like Ctrl-C's KeyboardInterrupt, so its clean-up runs; ``signum`` the signal."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


def stop_on_sigterm() -> None:
    """Make SIGTERM (``kill``, systemd, docker, k8s) stop this command as Ctrl-C does: it raises
    :class:`Stopped` (a KeyboardInterrupt) in the main thread, so the ``with Topology(...)``
    blocks and ``finally`` clauses run and its instances are stopped and waited for
    (``Topology.stop``: SIGTERM, then SIGKILL after a grace) before it exits. Python's default
    for SIGTERM ends the process at once: ``pdd demo`` exited while its instances, each in a
    session of its own, still held their ports for ~2 s (until their parent watch saw it), and a
    demo started right away was refused "port ... already in use". SIGHUP (the terminal it runs
    in closed: an ssh session ended, a terminal window shut) does the same: Python's default
    for it ends the process at once too, so ``pdd serve`` stopped without its gateway's drain and
    its instances were left to their parent watch. A SIGHUP already ignored (``nohup``, a
    service manager that ignores it) stays ignored, so the command outlives its terminal as
    asked (docs/SERVE.md "Stop it"). A SIGINT ignored at start is taken back (Python's own
    KeyboardInterrupt): a non-interactive shell ignores it in every background job (``pdd serve
    ... &`` in a script), so ``kill -INT`` did nothing, and that is the shell's habit, not a
    request as nohup's is. Call from the main thread."""
    import signal

    def _term(signum, frame):
        raise Stopped(signum)

    signal.signal(signal.SIGTERM, _term)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, _term)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def stopping_message(prog: str, ex: KeyboardInterrupt, shutdown_timeout_s: float) -> str:
    """The line a command prints when its first Ctrl-C or SIGTERM (``ex``: a :class:`Stopped`
    carries the signal, a plain KeyboardInterrupt is SIGINT) begins the graceful stop: how long
    requests in flight may still take, and that the same signal again (either signal, in fact)
    stops at once. After a SIGTERM (systemd, docker, k8s: no terminal) it said "Ctrl-C again"."""
    import signal

    signum = getattr(ex, "signum", signal.SIGINT)
    if signum == signal.SIGINT:
        again = "Ctrl-C again"
    elif signum == signal.SIGHUP:  # its terminal is gone: no Ctrl-C to press there
        again = "SIGTERM (or a second SIGHUP)"
    else:
        again = f"a second {signal.Signals(signum).name} (or Ctrl-C)"
    return (f"{prog}: stopping: requests in flight may finish for up to {shutdown_timeout_s:g} s "
            f"(--shutdown-timeout), new ones are refused; {again} stops at once")


def stopped_status(prog: str, ex: KeyboardInterrupt) -> int:
    """For a command stopped by Ctrl-C, SIGTERM or SIGHUP once its clean-up ran: one line on
    stderr saying so (:func:`say`), and the shell's status for the signal (130 for SIGINT, 143
    for SIGTERM, 129 for SIGHUP)."""
    import signal

    signum = getattr(ex, "signum", signal.SIGINT)
    say(f"{prog}: stopped by {signal.Signals(signum).name}; its instances have exited")
    return 128 + signum


def say(line: str) -> None:
    """Print ``line`` on stderr if it can be written: after SIGHUP the terminal may be gone, and
    a write to a hung-up terminal fails (EIO), which must not cut the stop short with a
    traceback nor change its exit status."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # EIO, EPIPE; a closed stream
        pass
