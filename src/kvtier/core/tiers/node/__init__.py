"""The node tier: one DRAM pool per host in shared memory, used by every kvtier engine on the host
that names the same pool (issue 38).

Design (docs/node.md has the operator's side):

- **One owner per host** (``kvtier node serve``, :mod:`~kvtier.core.tiers.node.server`) creates
  the pool file (under ``/dev/shm`` or a hugetlbfs mount, ``node_gib`` bytes) and keeps the whole
  pool's placement state in one place (:mod:`~kvtier.core.tiers.node.index`: which value lives in
  which pages, LRU eviction, leases).  Engines talk to it over a UNIX socket in msgspec messages
  (:mod:`~kvtier.core.tiers.node.protocol`, never pickle) that carry keys, page numbers and lease
  ids only: **no payload byte crosses the socket**.
- **Every payload byte moves directly** between an engine's memory and the mapped pages
  (:mod:`~kvtier.core.tiers.node.pool`): a write is granted pages (``alloc``), copies the value
  envelope (:mod:`kvtier.core.envelope`) into them and publishes it (``commit``); a read pins the
  value (``pin``), verifies its digest straight from the pages while copying the payload into the
  caller's buffer, and releases the pin (piggybacked on the next message).  A value this engine
  wrote or pinned before is copied while its pin is in flight, and served only where the pin's
  answer names the same pages and generation (:mod:`~kvtier.core.tiers.node.early`).
- **Leases** are owned by the connection that took them: an engine that dies (SIGKILL) closes its
  socket, and the owner drops every lease of it at once; a stalled engine's leases expire after
  ``--lease-s``.  No page leaks.
- **Generation numbers**: each page carries the generation of the allocation that last granted
  it, written by the owner into the pool before it hands the page out.  A reader checks after its
  copy that its pages still carry the generation its pin named; if not (its lease expired, or the
  owner restarted and reused the page) the read is a miss, never a served byte.  A restarted owner
  continues from the pool's highest generation and takes the committed values back into its index
  (the pool stays warm across owner and engine restarts).
- **Presence** without a message: the owner keeps a table of the committed values' fingerprints in
  the pool and a heartbeat (:mod:`~kvtier.core.tiers.node.presence`); an engine's scheduler answers
  lookups by reading it on its own thread while the heartbeat is fresh (over the socket, a lookup
  waited for five wake-ups, each late by up to hundreds of milliseconds on a busy host).
- **Isolation**: values are indexed by (namespace, pool name) and carry the envelope's namespace,
  key (the pool name), tenant record and digest (a keyed MAC under ``shared_secret``), checked on
  every read.  Each secret has its own key space (:mod:`~kvtier.core.tiers.node.names`): engines
  with another secret, or none, never see each other's values; engines with one share them all.

The engine side is :class:`~kvtier.core.tiers.node.tier.NodeTier`, a shared tier behind
:class:`~kvtier.core.tiers.guarded.GuardedTier` (deadlines and a breaker, as the redis and s3
tiers): an owner that is dead or stalled is a run of misses within ``shared_transfer_deadline_s``
and the engine re-attaches (a new connection, the pool mapped again if it was recreated) once it
answers.  Its plug-in object is :data:`kvtier.core.tiers.builtin.NODE`.
"""
