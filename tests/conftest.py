"""Every test runs the gateway's phase machine strict: an illegal request phase transition
raises (pdd.gateway.phase), here and in the topologies the slow tests start (they inherit the
environment)."""

import os

os.environ["PDD_STRICT_PHASES"] = "1"

import pdd.gateway.phase  # noqa: E402

pdd.gateway.phase.STRICT = True
