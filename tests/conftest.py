"""Every test runs the gateway's phase machine strict: an illegal request phase transition
raises (pdd.gateway.phase), here and in the topologies the slow tests start (they inherit the
environment).

The generated checkpoints the tests share, each built once per session (``pdd.modelgen``,
seed 0): ``tiny_model`` (unit tests) and ``small_model`` (topologies, vLLM). Both are read-only
for the tests: a test that changes a checkpoint's files copies it first, and a test that needs
another seed, family or preset builds its own."""

import os

import pytest

os.environ["PDD_STRICT_PHASES"] = "1"

import pdd.gateway.phase  # noqa: E402

pdd.gateway.phase.STRICT = True


@pytest.fixture(autouse=True)
def _no_pdd_log_handler_left():
    """A test that runs ``pdd.cli.main`` in this process configures pdd's logging
    (``pdd.logs.configure_logging``): undone after it, so later tests see Python's defaults."""
    yield
    import logging

    root = logging.getLogger()
    for h in [h for h in root.handlers if getattr(h, "_pdd", False)]:
        root.removeHandler(h)
    logging.getLogger("pdd").setLevel(logging.NOTSET)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """Directory of the ``tiny`` checkpoint, seed 0 (weights, config, tokenizer, chat template)."""
    from pdd.modelgen import make_model

    return make_model(str(tmp_path_factory.mktemp("models") / "tiny"), preset="tiny", seed=0)


@pytest.fixture(scope="session")
def small_model(tmp_path_factory) -> str:
    """Directory of the ``small`` checkpoint, seed 0 (the demo's; the smallest vLLM's CPU
    attention takes)."""
    from pdd.modelgen import make_model

    return make_model(str(tmp_path_factory.mktemp("models") / "small"), preset="small", seed=0)
