"""Host names of URLs: which ones stay on this machine."""

from __future__ import annotations

import ipaddress


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (a URL's host name, any case, a trailing dot allowed) is this machine:
    ``localhost`` or a loopback address (all of 127.0.0.0/8, and ``::1``)."""
    host = host.lower().rstrip(".")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
