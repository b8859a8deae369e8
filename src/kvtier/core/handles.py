"""Result types of the store's two-phase operations."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvtier.core.keys import ChunkKey


@dataclass
class LoadHandle:
    """Chunks pinned for one load, from :meth:`TieredStore.prepare_load`.

    Attributes:
        keys: the loaded prefix of the chain, ``num_chunks`` keys.
        buffers: uint8 arrays ``[chunk_bytes]`` holding each chunk's verified bytes; zero-copy
            views into the cpu tier where possible.  Valid until :meth:`TieredStore.complete_load`.
        tiers: ``"cpu"`` or ``"disk"`` per chunk: where the chunk was found.
    """

    keys: list[ChunkKey]
    buffers: list[np.ndarray]
    tiers: list[str]
    pinned: list[ChunkKey] = field(default_factory=list, repr=False)
    done: bool = False

    @property
    def num_chunks(self) -> int:
        """Chunks in the loaded prefix."""
        return len(self.keys)


@dataclass
class StoreHandle:
    """Pages reserved for one save, from :meth:`TieredStore.prepare_store`.

    Attributes:
        keys: chunks to be written, in chain order.
        indices: position of each key in the chain passed to ``prepare_store``.
        parents: the previous key in the chain for each key (``None`` for chunk 0).
        buffers: writable uint8 arrays ``[chunk_bytes]``; fill them, then call ``complete_store``.
    """

    keys: list[ChunkKey]
    indices: list[int]
    parents: list[ChunkKey | None]
    buffers: list[np.ndarray]
    done: bool = False

    @property
    def num_chunks(self) -> int:
        """Chunks reserved."""
        return len(self.keys)
