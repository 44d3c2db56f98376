"""Network facts of the machine the tests run on."""

import socket


def ipv6_loopback() -> bool:
    """Whether a TCP socket can bind the IPv6 loopback ``::1`` here (tests of an IPv6 ``host``
    skip without it)."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False
