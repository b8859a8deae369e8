"""Which URL hosts stay on this machine (one rule for the s3 tier's advice and the audit's rules)."""

import pytest

from kvtier.core.hosts import is_loopback_host


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST", "localhost.", "127.0.0.1", "127.3.2.1", "::1", "[::1]"])
def test_loopback_hosts(host):
    assert is_loopback_host(host)


@pytest.mark.parametrize("host", ["10.0.0.1", "s3.amazonaws.com", "localhost.example.com", "128.0.0.1", "", "::2"])
def test_other_hosts(host):
    assert not is_loopback_host(host)
