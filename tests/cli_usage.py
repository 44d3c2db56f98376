"""The check every CLI usage-error test shares: the command exits 2 (argparse's usage error)
and prints no traceback."""

import pytest


def usage_error(capsys, entry, argv: list[str]) -> str:
    """Runs ``entry(argv)`` (a CLI ``main``), asserts it raises ``SystemExit(2)`` and that stderr
    holds no traceback; returns that stderr."""
    with pytest.raises(SystemExit) as ex:
        entry(argv)
    assert ex.value.code == 2, ex.value.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err
