"""``pdd.cli.exit_now``: a process a topology starts ends without the interpreter's teardown, its
buffered output and log lines written first, with the status it was given."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import logging, sys
from pdd.logs import configure_logging
from pdd.cli import exit_now
configure_logging("INFO")
print("stdout line", end="")                   # buffered: a pipe
sys.stderr.write("stderr line\\n")
logging.getLogger("pdd.test").warning("a log line")
exit_now(129)
"""


def test_exit_now_flushes_output_and_logs_and_keeps_the_status():
    p = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert p.returncode == 129
    assert p.stdout == "stdout line"
    assert p.stderr.startswith("stderr line\n") and "WARNING" in p.stderr and "[pdd.test] a log line" in p.stderr
