"""The store's convenience verbs, whole chains in and out as bytes (tests, tools, drills).

:class:`StoreConvenience` is a base of :class:`~kvtier.core.store.TieredStore`: ``put`` and ``get``
run the two-phase verbs (``prepare_store``/``complete_store``, ``prepare_load``/``complete_load``)
exactly as the vLLM connector does, with a copy each way.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvtier.core.handles import EngineSave

if TYPE_CHECKING:
    from kvtier.core.context import OpContext
    from kvtier.core.handles import StoreHandle
    from kvtier.core.keys import ChunkKey
    from kvtier.core.mover import Mover
    from kvtier.core.tenant import TenantId

READ_AHEAD_WAIT_S = 60.0
"""How long :meth:`StoreConvenience.get` waits for chunks read ahead before calling the load failed."""


class StoreConvenience:
    """``put``/``get`` over the store's two-phase verbs (see the module docstring)."""

    chunk_bytes: int

    if TYPE_CHECKING:  # provided by TieredStore (its load verbs are its mover's: TieredStore.__init__)
        mover: Mover
        def prepare_store(self, chain: Sequence[ChunkKey], start: int = 0, tenant: TenantId | None = None,
                          ctx: OpContext | None = None) -> StoreHandle: ...
        def complete_store(self, handle: StoreHandle, success: bool, engine: EngineSave | None = None) -> None: ...

    def put(self, chain: Sequence[ChunkKey], datas: Sequence[bytes | memoryview | np.ndarray],
            tenant: TenantId | None = None, ctx: OpContext | None = None) -> int:
        """Store ``datas[i]`` (``chunk_bytes`` each) under ``chain[i]`` for ``ctx`` (or ``tenant``, as
        :meth:`prepare_store`); returns chunks newly stored."""
        handle = self.prepare_store(chain, tenant=tenant, ctx=ctx)
        ok = False
        t0 = time.perf_counter()
        try:
            for idx, buf in zip(handle.indices, handle.buffers):
                np.copyto(buf, np.frombuffer(datas[idx], dtype=np.uint8))
            ok = True
        finally:  # the copy is counted (engine_to_cpu) only when it succeeded
            self.complete_store(handle, ok, EngineSave(0, handle.num_chunks * self.chunk_bytes, time.perf_counter() - t0))
        return handle.num_chunks

    def get(self, chain: Sequence[ChunkKey], ctx: OpContext | None = None) -> list[bytes]:
        """Bytes of the longest available prefix of ``chain`` (copies)."""
        handle = self.mover.prepare_load(chain, read_ahead=True, ctx=ctx)
        try:
            out = [buf.tobytes() for buf in handle.buffers[:handle.ready_chunks()]]
            if not handle.wait(READ_AHEAD_WAIT_S):
                raise TimeoutError(f"chunks read ahead from disk did not arrive within {READ_AHEAD_WAIT_S} s")
            out += [buf.tobytes() for buf in handle.buffers[len(out):]]
        except BaseException:
            self.mover.complete_load(handle, False)
            raise
        self.mover.complete_load(handle, True)
        return out
