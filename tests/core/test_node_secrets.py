"""Engines with different ``shared_secret`` settings on one node pool (docs/node.md, "Isolation").

The redis and s3 tiers keep each secret's values in its own key space, so such engines share
nothing.  The node pool indexes values by (namespace, chunk key) alone: an engine with another
secret, or none, finds the others' values, fails their digest and deletes them (probe
/tmp/st57/node.py: 4 found, 0 served, 2 counted corrupt, and the writer then finds 0).  Until the
pool has key spaces (a keyed chunk key in the owner's name and the envelope, namespace and tenant
record unchanged, so that owner recovery and ``kvtier purge`` keep working), docs/node.md tells
operators to give every engine of a pool the same secret, and this test is an expected failure:
it passes, and then fails as strict, the day the pool keeps them apart.
"""

from __future__ import annotations

import pytest

from .helpers import chain_of, make_store, payload, shared_prefix

SECRETS = {"s1": "node-secret-one-0123456789abcdef", "s2": "node-secret-two-0123456789abcdef"}


def _store(node_server, secret: str | None):
    extra = {"shared_secret": SECRETS[secret]} if secret else {}
    return make_store(None, cpu_chunks=8, write_mode="write-through", node_socket=node_server.socket,
                      shared_deadline_s=5.0, shared_transfer_deadline_s=5.0, tiers=["cpu", "node"], **extra)


@pytest.mark.xfail(strict=True, reason="the node pool has no key spaces: another secret's engine deletes the "
                                       "values (docs/node.md, Isolation)")
@pytest.mark.parametrize("reader", ["s2", None])
def test_an_engine_with_another_secret_neither_finds_nor_deletes_the_values(node_server, reader) -> None:
    chain = chain_of(31, 4)
    writer = _store(node_server, "s1")
    try:
        writer.put(chain, [payload(k) for k in chain])
        assert writer.flush(10)
    finally:
        writer.close()
    other = _store(node_server, reader)
    try:
        found = shared_prefix(other, chain)
        handle = other.mover.prepare_load(chain, max_chunks=found)
        other.mover.complete_load(handle, True)
        corrupt = other.stats().tiers["node"].corrupt_chunks
    finally:
        other.close()
    again = _store(node_server, "s1")
    try:
        kept = shared_prefix(again, chain)
    finally:
        again.close()
    assert (found, corrupt, kept) == (0, 0, 4)
