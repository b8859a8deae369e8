"""The node pool's placement state, kept by its owner alone (:mod:`kvtier.core.tiers.node.server`):
which value lives in which pages, eviction (least recently used first), and leases.  No I/O, no
threads: the owner's one event loop calls it.

- **Values** are indexed by (namespace, pool name) and belong to one key space
  (:mod:`~kvtier.core.tiers.node.names`: ``keys``, ``clear`` and ``listing`` name it).  A value occupies consecutive pages; an
  allocation that finds no run of free pages evicts unpinned values, least recently used first,
  until one appears (none: ``NO_ROOM``).
- **Leases** belong to one connection: a write lease (pages granted, not yet published) and a
  read lease (a pin: the value's pages are not reused while it is held).  :meth:`PoolIndex.drop`
  ends every lease of a connection (the engine closed it or died); :meth:`PoolIndex.expire` ends
  those older than ``lease_s`` (a stalled engine).  A value deleted or evicted while pinned keeps
  its pages until its last pin ends.
- **Generations**: every allocation takes a new generation and writes it into each of its pages
  (``gens``) before the pages are handed out; a reader compares after its copy (see the package
  docstring).  ``heads`` marks where committed values start (:func:`head_word`: their bytes and
  key space), so a restarted owner rebuilds this index from the pool (:meth:`PoolIndex.recover`).
- **Presence**: each committed value's fingerprint is in the pool's presence table
  (:mod:`~kvtier.core.tiers.node.presence`) from its commit until it is deleted or evicted, so
  engines answer lookups without a message.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvtier.core.tiers.node import protocol
from kvtier.core.tiers.node.presence import PresenceTable, fingerprint

Name = tuple[bytes, bytes]
"""(namespace, pool name: the chunk key in its key space, :mod:`~kvtier.core.tiers.node.names`)."""
SPACE_SHIFT = 32
MAX_VALUE_BYTES = (1 << SPACE_SHIFT) - 2
"""Largest value the pool takes, bytes (its head keeps value bytes + 1 in 32 bits)."""


def head_word(nbytes: int, space: int) -> int:
    """A committed value's head: value bytes + 1 in the low 32 bits, its key space in the high 32
    (an owner before key spaces wrote bytes + 1 alone: space 0, the space of no secret)."""
    return (space << SPACE_SHIFT) | (nbytes + 1)


def read_head(word: int) -> tuple[int, int]:
    """``(value bytes, key space)`` of a nonzero head (:func:`head_word` undone)."""
    return (word & ((1 << SPACE_SHIFT) - 1)) - 1, word >> SPACE_SHIFT


@dataclass(eq=False)
class Value:
    name: Name
    page: int
    npages: int
    nbytes: int
    gen: int
    writer: int
    pins: int = 0
    written_s: float = 0.0  # wall clock at commit (0: unknown, a value taken back after a restart)
    committed: bool = False
    gone: bool = False  # deleted or evicted while pinned: pages freed at the last unpin
    slot: int = -1  # its presence table slot while committed
    space: int = 0  # its key space (names.space_of)


@dataclass(eq=False)
class Lease:
    value: Value
    conn: int
    write: bool
    expires: float


@dataclass
class Client:
    name: str
    since: float
    leases: set[int] = field(default_factory=set)


class PoolIndex:
    """See the module docstring.  ``gens`` / ``heads``: the pool's arrays, ``table``: its presence
    table (:class:`~kvtier.core.tiers.node.pool.Pool`)."""

    def __init__(self, gens: np.ndarray, heads: np.ndarray, table: PresenceTable, page_bytes: int,
                 lease_s: float) -> None:
        self.gens, self.heads, self.table = gens, heads, table
        self.page_bytes = page_bytes
        self.num_pages = len(gens)
        self.lease_s = lease_s
        self.used = np.zeros(self.num_pages, dtype=bool)
        self.free_pages = self.num_pages
        self._cursor = 0  # where the next allocation is first searched: the last's end, or a freed value's page
        self.values: OrderedDict[Name, Value] = OrderedDict()  # committed values, least recently used first
        self.pending: dict[Name, Value] = {}  # granted, not yet committed
        self.leases: dict[int, Lease] = {}
        self.clients: dict[int, Client] = {}
        self.next_gen = int(gens.max()) + 1 if self.num_pages else 1
        self._next_lease = 1
        self.evictions = 0
        # live engine connection (one that pinned or allocated) -> [bytes, values] of the values it wrote
        self.written: dict[int, list[int]] = {}
        self.total = [0, 0]  # [bytes, values] of every committed value

    # ---- connections ----------------------------------------------------------------------
    def attach(self, conn: int, name: str, now: float) -> None:
        self.clients[conn] = Client(name, now)

    def drop(self, conn: int) -> None:
        """End every lease of ``conn`` (closed or dead) and forget it."""
        client = self.clients.pop(conn, None)
        for lease_id in list(client.leases if client else ()):
            self._end(lease_id)
        self.written.pop(conn, None)  # its values are now counted by the oldest live writer

    def expire(self, now: float) -> int:
        """End the leases older than ``lease_s``; how many."""
        old = [i for i, lease in self.leases.items() if lease.expires <= now]
        for lease_id in old:
            self._end(lease_id)
        return len(old)

    # ---- verbs ------------------------------------------------------------------------------
    def lookup(self, ns: bytes, keys: list[bytes]) -> list[bool]:
        return [(ns, k) in self.values for k in keys]

    def pin(self, conn: int, ns: bytes, keys: list[bytes], now: float) -> list[tuple[int, int, int, int] | None]:
        self.written.setdefault(conn, [0, 0])  # an engine's: it may inherit the values whose writer is gone
        out: list[tuple[int, int, int, int] | None] = []
        for k in keys:
            value = self.values.get((ns, k))
            if value is None:
                out.append(None)
                continue
            self.values.move_to_end(value.name)
            value.pins += 1
            out.append((self._lease(conn, value, False, now), value.page, value.nbytes, value.gen))
        return out

    def release(self, conn: int, lease_ids: list[int]) -> None:
        for lease_id in lease_ids:
            lease = self.leases.get(lease_id)
            if lease is not None and lease.conn == conn:  # another connection's id: not this one's to end
                self._end(lease_id)

    def alloc(self, conn: int, ns: bytes, keys: list[bytes], sizes: list[int], now: float,
              space: int = 0) -> list[tuple[int, int, int] | int]:
        self.written.setdefault(conn, [0, 0])
        out: list[tuple[int, int, int] | int] = []
        for k, nbytes in zip(keys, sizes, strict=True):
            name = (ns, k)
            if name in self.values or name in self.pending:
                out.append(protocol.PRESENT)
                continue
            npages = max(1, -(-nbytes // self.page_bytes))
            page = self._room(npages) if 0 <= nbytes <= MAX_VALUE_BYTES else -1
            if page < 0:
                out.append(protocol.NO_ROOM)
                continue
            gen = self.next_gen
            self.next_gen += 1
            self.gens[page:page + npages] = gen  # before the pages are handed out (package docstring)
            self.heads[page:page + npages] = 0
            self.used[page:page + npages] = True
            self.free_pages -= npages
            self._cursor = page + npages
            value = Value(name, page, npages, nbytes, gen, conn, space=space)
            self.pending[name] = value
            out.append((self._lease(conn, value, True, now), page, gen))
        return out

    def commit(self, conn: int, lease_ids: list[int]) -> list[bool]:
        out = []
        for lease_id in lease_ids:
            lease = self.leases.get(lease_id)
            if lease is None or lease.conn != conn or not lease.write:
                out.append(False)  # expired (its pages may be another value's now): never published
                continue
            value = lease.value
            del self.leases[lease_id]
            self.clients[conn].leases.discard(lease_id)
            del self.pending[value.name]
            value.committed = True
            value.written_s = time.time()
            self.values[value.name] = value
            self._count(value, 1)
            self.heads[value.page] = head_word(value.nbytes, value.space)
            value.slot = self.table.insert(fingerprint(*value.name))
            out.append(True)
        if self.table.full():
            self._rebuild_table()
        return out

    def delete(self, ns: bytes, keys: list[bytes]) -> list[bool]:
        out = []
        for k in keys:
            value = self.values.pop((ns, k), None)
            out.append(value is not None)
            if value is not None:
                self._unpublish(value)
        return out

    def clear(self, ns: bytes, space: int) -> list[bytes]:
        keys = self.keys(ns, space)
        self.delete(ns, keys)
        return keys

    def listing(self, namespaces: list[bytes], start: int,
                limit: int) -> tuple[list[tuple[bytes, bytes, int, float, int]], bool]:
        """``limit`` values of ``namespaces`` (all: empty) from position ``start`` (as
        :class:`~kvtier.core.tiers.node.protocol.Listed` names them), and whether more follow."""
        wanted = set(namespaces)
        found = [v for v in self.values.values() if not wanted or v.name[0] in wanted]
        page = found[start:start + limit]
        return [(v.name[0], v.name[1], v.nbytes, v.written_s, v.space) for v in page], start + limit < len(found)

    def keys(self, ns: bytes, space: int) -> list[bytes]:
        return [v.name[1] for v in self.values.values() if v.name[0] == ns and v.space == space]

    def usage_of(self, conn: int) -> tuple[int, int]:
        """(bytes, values) ``conn`` is counted for (:class:`~kvtier.core.tiers.node.protocol.UsageReply`):
        the values it wrote, and for the oldest live engine connection (one that pinned or allocated: a
        reader too, so that values a restarted owner took back are counted while engines only read
        them) also those whose writer is gone."""
        own = self.written.get(conn, [0, 0])
        heir = min(self.written, key=lambda c: (self.clients[c].since, c)) if self.written else None
        if conn != heir:
            return own[0], own[1]
        return (self.total[0] - sum(w[0] for c, w in self.written.items() if c != conn),
                self.total[1] - sum(w[1] for c, w in self.written.items() if c != conn))

    def used_bytes(self) -> int:
        return int(self.used.sum()) * self.page_bytes

    # ---- recovery and checks -----------------------------------------------------------------
    def recover(self, name_at: Callable[[int, int, int], Name | None]) -> int:
        """Index the committed values the pool's heads mark (an owner restarting on a warm pool);
        ``name_at(page, nbytes, space)`` reads a value's namespace and pool name from its envelope
        header (``None``: unreadable, or not to be taken back: the head is cleared).  Returns how
        many were taken back."""
        for page in np.flatnonzero(self.heads).tolist():
            nbytes, space = read_head(int(self.heads[page]))
            npages = max(1, -(-nbytes // self.page_bytes))
            gen = int(self.gens[page])
            name = name_at(page, nbytes, space)
            if (name is None or name in self.values or page + npages > self.num_pages
                    or self.used[page:page + npages].any() or not (self.gens[page:page + npages] == gen).all()):
                self.heads[page] = 0
                continue
            self.used[page:page + npages] = True
            self.free_pages -= npages
            self.values[name] = Value(name, page, npages, nbytes, gen, 0, committed=True, space=space)
            self._count(self.values[name], 1)
        self._rebuild_table()
        return len(self.values)

    def problem(self) -> str:
        """The first broken invariant, or ``""`` (the conformance suite's ``check``)."""
        held = np.zeros(self.num_pages, dtype=np.int64)
        owners = [*self.values.values(), *self.pending.values(),
                  *{id(lease.value): lease.value for lease in self.leases.values() if lease.value.gone}.values()]
        for v in owners:
            held[v.page:v.page + v.npages] += 1
        if (held > 1).any():
            return "a page is held by two values"
        if not np.array_equal(held > 0, self.used) or self.free_pages != self.num_pages - int(self.used.sum()):
            return "the used-page map differs from the values and leases"
        pins: dict[int, int] = {}
        for lease in self.leases.values():
            if not lease.write:
                pins[id(lease.value)] = pins.get(id(lease.value), 0) + 1
        if any(v.pins != pins.get(id(v), 0) for v in self.values.values()):
            return "a value's pin count differs from its read leases"
        if self.total != [sum(v.npages for v in self.values.values()) * self.page_bytes, len(self.values)]:
            return "the usage count differs from the values"
        if sum(len(c.leases) for c in self.clients.values()) != len(self.leases):
            return "a lease is not owned by exactly one connection"
        return self.table.problem({v.slot: fingerprint(*v.name) for v in self.values.values()})

    # ---- internals -------------------------------------------------------------------------------
    def _lease(self, conn: int, value: Value, write: bool, now: float) -> int:
        lease_id = self._next_lease
        self._next_lease += 1
        self.leases[lease_id] = Lease(value, conn, write, now + self.lease_s)
        self.clients[conn].leases.add(lease_id)
        return lease_id

    def _end(self, lease_id: int) -> None:
        lease = self.leases.pop(lease_id)
        client = self.clients.get(lease.conn)
        if client is not None:
            client.leases.discard(lease_id)
        value = lease.value
        if lease.write:  # abandoned or expired before its commit
            self.pending.pop(value.name, None)
            self._free(value)
            return
        value.pins -= 1
        if value.gone and value.pins == 0:
            self._free(value)

    def _count(self, value: Value, sign: int) -> None:
        nbytes = sign * value.npages * self.page_bytes
        self.total[0] += nbytes
        self.total[1] += sign
        if value.writer in self.clients:
            mine = self.written.setdefault(value.writer, [0, 0])
            mine[0] += nbytes
            mine[1] += sign

    def _rebuild_table(self) -> None:
        for value, slot in zip(self.values.values(), self.table.rebuild(fingerprint(*n) for n in self.values),
                               strict=True):
            value.slot = slot

    def _unpublish(self, value: Value) -> None:
        self.table.remove(value.slot)
        self._count(value, -1)
        self.heads[value.page] = 0
        if value.pins:
            value.gone = True
        else:
            self._free(value)

    def _free(self, value: Value) -> None:
        self.used[value.page:value.page + value.npages] = False
        self.free_pages += value.npages
        self._cursor = min(self._cursor, value.page)  # freed pages are searched first

    def _room(self, npages: int) -> int:
        """First page of a free run of ``npages``, evicting unpinned values (least recently used
        first) until one appears; ``-1`` if none can.  The whole pool is searched only when enough
        pages are free in all (a full pool: never); after an eviction, first around the evicted
        value (values of one size: always there), so a full pool's allocation costs O(``npages``),
        not O(pages): 5 ms per value on a 262,144-page pool before; a pool with room is searched
        first from the lowest page freed since, else from where the last allocation ended."""
        if npages > self.num_pages:
            return -1
        if self.free_pages >= npages:  # from where the last allocation ended first (a filling pool: there)
            near = self._free_run(npages, self._cursor, min(self.num_pages, self._cursor + 64 * npages))
            if (page := near if near >= 0 else self._free_run(npages, 0, self.num_pages)) >= 0:
                return page
        while True:
            victim = next((v for v in self.values.values() if v.pins == 0), None)
            if victim is None:
                return -1
            del self.values[victim.name]
            self.evictions += 1
            self._unpublish(victim)
            page = self._free_run(npages, max(0, victim.page - npages + 1),
                                  min(self.num_pages, victim.page + victim.npages + npages - 1))
            if page < 0 and self.free_pages >= npages:
                page = self._free_run(npages, 0, self.num_pages)
            if page >= 0:
                return page

    def _free_run(self, npages: int, lo: int, hi: int) -> int:
        """First page of a run of ``npages`` free pages within pages ``lo`` to ``hi`` (excluded); -1: none."""
        free = ~self.used[lo:hi]
        if npages == 1:
            hit = int(free.argmax()) if len(free) else 0
            return lo + hit if len(free) and free[hit] else -1
        total = np.concatenate(([0], np.cumsum(free, dtype=np.int64)))
        found = np.flatnonzero(total[npages:] - total[:-npages] == npages)
        return lo + int(found[0]) if len(found) else -1
