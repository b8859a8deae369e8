"""Admission: whether a chunk leaving the tier above may enter a lower tier (disk, shared).

Eviction orders what a tier holds; admission decides what it takes in.  They are separate so each
tier can have its own: a disk tier that takes every chunk the cpu tier evicts writes mostly KV that
is never read again (in chat traffic most chunks are used once), wearing the SSD and pushing out
what was reused.  One verb::

    judge(key, uses) -> bool     uses: times the chunk was used (served) while resident in the
                                 tier above, before it left it; True: write it to this tier.

Names (``make_admission``):

- ``all``: admit everything (the default; what kvtier always did).
- ``reused``: admit a chunk only if it was used at least once while in the tier above — Dynamo
  KVBM's and LMCache's "write to a lower tier only once reused" ask; a content-delivery classic
  ("cache on second hit", Maggs & Sitaraman, "Algorithmic nuggets in content delivery", SIGCOMM
  CCR 45(3), 2015).

The cpu (top) tier admits whatever the engine computed: the engine drops its own copy silently, so
a chunk not saved then is lost.  Configured per tier with ``admission`` in
:class:`kvtier.core.config.KVTierConfig` (e.g. ``{"disk": "reused"}``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from kvtier.core.keys import ChunkKey


class AdmissionPolicy(ABC):
    """Judges whether a chunk enters a tier (see the module docstring).  Stateless here; an
    implementation that keeps state must bound it."""

    name: ClassVar[str] = "abstract"

    @abstractmethod
    def judge(self, key: ChunkKey, uses: int) -> bool:
        """Whether ``key``, used ``uses`` times in the tier above, may enter this tier."""


class AdmitAll(AdmissionPolicy):
    name = "all"

    def judge(self, key: ChunkKey, uses: int) -> bool:
        return True


class AdmitReused(AdmissionPolicy):
    name = "reused"

    def judge(self, key: ChunkKey, uses: int) -> bool:
        return uses > 0


_ADMISSIONS: dict[str, type[AdmissionPolicy]] = {"all": AdmitAll, "reused": AdmitReused}


def available_admissions() -> list[str]:
    """Names accepted by :func:`make_admission`."""
    return list(_ADMISSIONS)


def make_admission(name: str) -> AdmissionPolicy:
    """A fresh admission policy by name.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    cls = _ADMISSIONS.get(name)
    if cls is None:
        raise ValueError(f"unknown admission policy {name!r}; choose one of {', '.join(_ADMISSIONS)}")
    return cls()
