"""``kvtier node serve``: run this host's node pool owner (:mod:`kvtier.core.tiers.node.server`)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import typer

from kvtier.cli.errors import fail
from kvtier.core.errors import UserError

HELP = """Run this host's node pool: one DRAM pool in shared memory that every kvtier engine on the host uses as its node tier (engines name its --socket as node_socket; docs/node.md).

The owner keeps the pool's index, eviction (least recently used first) and the engines' leases; payload bytes move directly between the engines and the mapped pool, never through the socket. Restarting the owner keeps the pool warm (same --pool, --node-gib and --page-kib). An existing --pool that is not a kvtier pool, or --socket that is not a socket, is refused, never overwritten. Stops on SIGTERM or SIGINT.

Example:

  mkdir -p /dev/shm/kvtier-node

  kvtier node serve --pool /dev/shm/kvtier-node/pool --node-gib 64 --socket /dev/shm/kvtier-node/node.sock
"""

node_app = typer.Typer(help="The host's shared DRAM pool (the node tier): run its owner.", no_args_is_help=True)


def serve_command(
    pool: Path = typer.Option(..., "--pool", help="The pool file, under /dev/shm or a hugetlbfs mount.",
                              metavar="PATH"),
    node_gib: float = typer.Option(..., "--node-gib", help="The pool's size in GiB (memory reserved at start).",
                                   metavar="N"),
    socket: Path = typer.Option(..., "--socket", help="The UNIX socket the engines connect to (their node_socket).",
                                metavar="PATH"),
    page_kib: int = typer.Option(256, "--page-kib", help="One page in KiB; a chunk takes whole pages.",
                                 metavar="N"),
    lease_s: float = typer.Option(30.0, "--lease-s", help="Longest an engine's lease lives if it stalls, seconds.",
                                  metavar="S"),
    max_clients: int = typer.Option(256, "--max-clients", help="Engine connections served at once.", metavar="N"),
    verbose: bool = typer.Option(False, "--verbose", help="Log each connection and lease expiry."),
) -> None:
    from kvtier.core.tiers.node.server import ServeOptions, not_a_directory, serve

    if not 0 < node_gib <= 1 << 20:
        fail(f"--node-gib {node_gib:g} is out of range; give the pool's size in GiB, e.g. --node-gib 64")
    if not 4 <= page_kib <= 1 << 20 or page_kib & (page_kib - 1):
        fail(f"--page-kib {page_kib} must be a power of two from 4 to 1048576, e.g. --page-kib 256")
    if not 0 < lease_s <= 3600:
        fail(f"--lease-s {lease_s:g} must be above 0 and at most 3600 seconds, e.g. --lease-s 30")
    if max_clients < 1:
        fail(f"--max-clients {max_clients} must be at least 1")
    if not pool.parent.is_dir():
        fail(f"--pool {pool}: directory {pool.parent} {not_a_directory(pool.parent)}; give a file under /dev/shm "
             "or a hugetlbfs mount")
    if pool.is_dir():
        fail(f"--pool {pool} is a directory; give a file name in it, e.g. {pool / 'kvtier-node'}")
    if not socket.is_absolute():
        # the engines' own rule (kvtier.core.tiers.node.settings): they would refuse this node_socket
        fail(f"--socket must be an absolute path (engines refuse a relative node_socket), got {str(socket)!r}; "
             "e.g. --socket /dev/shm/kvtier-node/node.sock")
    from kvtier.core.tiers.node.settings import socket_path_problem

    if problem := socket_path_problem(str(socket), "--socket"):
        fail(problem)
    _warn_unless_memory_backed(pool)
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(asctime)s %(message)s")
    try:
        serve(ServeOptions(pool, node_gib, socket, page_kib, lease_s, max_clients))
    except UserError as exc:
        fail(str(exc).rstrip(".") + ".")


MEMORY_FILESYSTEMS = ("tmpfs", "hugetlbfs")
"""Filesystems a pool file belongs on (docs/node.md, ``--pool``): memory, mapped by every engine."""


def _warn_unless_memory_backed(pool: Path) -> None:
    """A warning on stderr when ``pool``'s directory is not on tmpfs or hugetlbfs (a disk-backed pool
    file is written back to the disk under the page cache): allowed, as docs/node.md only advises."""
    from kvtier.core.tiers.disk.check import mount_of

    mount = mount_of(pool.parent)
    if mount is not None and mount[0] not in MEMORY_FILESYSTEMS:
        print(f"warning: --pool {pool} is on the {mount[0]} filesystem mounted at {mount[1]}, not in memory; the "
              "kernel writes the pool back to that disk, so put it under /dev/shm or a hugetlbfs mount "
              "(docs/node.md)", file=sys.stderr)


def register(app: typer.Typer) -> None:
    """Add ``kvtier node`` to the CLI."""
    node_app.command("serve", help=HELP)(serve_command)
    app.add_typer(node_app, name="node")
