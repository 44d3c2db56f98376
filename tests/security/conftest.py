"""Fixtures of the security tests: certificate dirs (one topology CA, one foreign CA)."""

from __future__ import annotations

import pytest

from pdd.security import make_certs

NAMES = ["srv", "cli", "gateway", "p0", "rld0", "d0", "md0"]


@pytest.fixture(scope="session")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    make_certs(d, NAMES)
    return d


@pytest.fixture(scope="session")
def foreign_certs(tmp_path_factory):
    """Same instance names, another CA (a wrongly-certified peer)."""
    d = tmp_path_factory.mktemp("foreign-certs")
    make_certs(d, NAMES, ca_name="some other CA")
    return d
