"""The disk tier: one verified chunk file per chunk under ``disk_path`` on a local filesystem,
shared by the processes of one host and kept across restarts.

Modules:

- :mod:`~kvtier.core.tiers.disk.tier`: :class:`~kvtier.core.tiers.disk.tier.DiskTier` on a request's
  path: the index's membership test, the verified whole-file reads of the expected length and their
  buffered I/O, and the serial-or-split :class:`~kvtier.core.tiers.disk.tier.ReadChooser` (the node tier's too);
- :mod:`~kvtier.core.tiers.disk.files`: its set-up, index, crash-safe writes, deletes and accounting;
- :mod:`~kvtier.core.tiers.disk.reads`: its reads off a hit's path: of any length, recoded, and ranged
  reads at the payload's offset (the header checked, the bytes not);
- :mod:`~kvtier.core.tiers.disk.factory`: the tier from a configuration, its preflight check and
  state directory;
- :mod:`~kvtier.core.tiers.disk.directory`: the index kept in step with the directory (the rescan of
  files other processes wrote or removed, ``clear``, a vanished directory made again);
- :mod:`~kvtier.core.tiers.disk.chunkfile`: the chunk file format (the value envelope with its
  header padded to a 4096-byte block);
- :mod:`~kvtier.core.tiers.disk.chunkio`: the I/O settings, aligned buffers, writes and ``O_DIRECT`` reads;
- :mod:`~kvtier.core.tiers.disk.iomode`: whether ``O_DIRECT`` works here, the ``disk_io: auto`` rule;
- :mod:`~kvtier.core.tiers.disk.scan`: listing shards, header checks and writer locks for the rescan;
- :mod:`~kvtier.core.tiers.disk.reset`: removing one namespace's files, and the reset marker;
- :mod:`~kvtier.core.tiers.disk.check`: filesystem checks of ``disk_path``;
- :mod:`~kvtier.core.tiers.disk.blobs`: the directory as a blob store (purge, reset, probe).

Its plug-in object is :data:`kvtier.core.tiers.builtin.DISK`.  Nothing is imported here: a
submodule is loaded only by the code that names it.
"""
