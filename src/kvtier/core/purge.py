"""Removing stored chunks by namespace, tenant or age, from outside any engine (``kvtier purge``,
issue 22 item 3).

Each tier that can be purged names a hook in its registry record
(:attr:`~kvtier.core.tiers.registry.TierSpec.purge`,
``purge(config, selector, dry_run) -> list[NamespacePurge] | None``); :func:`purge` runs every
hook whose target the configuration names (the disk tier's ``disk_path``, the redis tier's
``redis_url``, the s3 tier's ``s3_bucket``).  A hook lists what the :class:`PurgeSelector` matches and, unless ``dry_run``,
removes it; either way it returns the same numbers, so a dry run says exactly what a purge of an
unchanged store removes.

A live engine sharing the store treats a purged chunk as a miss when it reads it (a chunk file
removed under it, a key gone from the server); how soon it stops *reporting* the chunk as a hit is
in docs/purge.md.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from kvtier.core import tenant
from kvtier.core.errors import KVTierError, UserError

if TYPE_CHECKING:
    from kvtier.core.config import KVTierConfig

class PurgeFailed(KVTierError):
    """A purge target that was named correctly could not be purged (a server that does not
    answer); the message is one sentence naming it."""


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)?\s*$")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def parse_duration(text: str) -> float:
    """Seconds in ``text``: a number with an optional unit ``s``, ``m``, ``h``, ``d`` or ``w``
    (``90``, ``30m``, ``12h``, ``7d``).

    Raises:
        UserError: anything else, or a negative or zero duration.
    """
    match = _DURATION.match(text.lower())
    if match is None:
        raise UserError(f"--older-than {text!r} is not a duration; give a number with s, m, h, d or w, e.g. 12h or 7d")
    seconds = float(match.group(1)) * _UNIT_S[match.group(2) or "s"]
    if seconds <= 0:
        raise UserError(f"--older-than {text!r} must be more than zero; e.g. 12h or 7d")
    return seconds


def parse_namespace(text: str) -> bytes:
    """The 16-byte namespace digest written as 32 hex digits (a disk tier's directory name).

    Raises:
        UserError: not 32 hex digits.
    """
    value = text.strip().lower()
    if not re.fullmatch(r"[0-9a-f]{32}", value):
        raise UserError(f"--namespace {text!r} is not 32 hex digits; copy a directory name under the disk tier's "
                        "disk_path (or a namespace from kvtier purge --dry-run)")
    return bytes.fromhex(value)


@dataclass(frozen=True)
class PurgeSelector:
    """Which chunks a purge removes: those matching every given field.

    Attributes:
        namespaces: namespace digests (16 bytes each); empty: every namespace.
        older_than_s: only chunks written more than this many seconds before ``now``; ``None``: any age.
        cache_salt: only chunks whose tenant record names this ``cache_salt``; ``None``: any.
        lora_name: only chunks whose tenant record names this LoRA adapter; ``None``: any.
        now: the reference time (seconds since the epoch) for ``older_than_s``.
    """

    namespaces: frozenset[bytes] = frozenset()
    older_than_s: float | None = None
    cache_salt: str | None = None
    lora_name: str | None = None
    now: float = field(default_factory=time.time)

    @property
    def needs_tenant(self) -> bool:
        """Whether matching reads a chunk's tenant record."""
        return self.cache_salt is not None or self.lora_name is not None

    @property
    def selects_anything(self) -> bool:
        """Whether any field narrows the purge (otherwise it removes every chunk: ``--all``)."""
        return bool(self.namespaces) or self.older_than_s is not None or self.needs_tenant

    def wants_namespace(self, namespace: bytes) -> bool:
        """Whether chunks of ``namespace`` may match."""
        return not self.namespaces or namespace in self.namespaces

    def old_enough(self, written_s: float) -> bool:
        """Whether a chunk written at ``written_s`` (seconds since the epoch) matches the age filter."""
        return self.older_than_s is None or written_s <= self.now - self.older_than_s

    def tenant_admits(self, result: NamespacePurge, namespace: bytes, raw_record: bytes | memoryview | None,
                      where: str) -> bool:
        """Whether a chunk of ``namespace`` with tenant record ``raw_record`` (``None``: a value
        format with no room for one) goes, counting in ``result`` why one stays: an absent record
        is an unknown tenant (:attr:`NamespacePurge.unknown_tenant`); a record that fails its check
        (:class:`~kvtier.core.tenant.DamagedRecord`) is never trusted: kept, counted in
        :attr:`NamespacePurge.damaged_tenant` and named as a problem (``where``: the chunk's
        file, key or object).  ``True`` when the selector names no tenant."""
        if not self.needs_tenant:
            return True
        try:
            rec = None if raw_record is None else tenant.read(raw_record)
        except tenant.DamagedRecord as exc:
            result.damaged_tenant += 1
            result.problem(f"{where}: {exc}; kept")
            return False
        if rec is None:
            result.unknown_tenant += 1
            return False
        return tenant.matches(rec, namespace, self.cache_salt, self.lora_name)


@dataclass
class NamespacePurge:
    """What a purge found (and, unless a dry run, removed) in one namespace of one tier.

    Attributes:
        tier: the tier's registry name.
        namespace: the namespace digest (16 bytes).
        chunks / bytes: chunks matched and their stored bytes (headers included).
        unknown_tenant: chunks a ``--salt``/``--lora`` selector left alone because their tenant
            record is unknown (saved before the record existed, or by a store that could not say).
        damaged_tenant: chunks a ``--salt``/``--lora`` selector left alone because their tenant
            record fails its check (each also a problem).
        problems: one phrase per chunk that could not be read or removed (first few only).
        problem_count: every such chunk, the ones past :attr:`problems`' first few included.
    """

    tier: str
    namespace: bytes
    chunks: int = 0
    bytes: int = 0
    unknown_tenant: int = 0
    damaged_tenant: int = 0
    problems: list[str] = field(default_factory=list)
    problem_count: int = 0

    def problem(self, text: str) -> None:
        """Count a problem; keep the first 5."""
        self.problem_count += 1
        if len(self.problems) < 5:
            self.problems.append(text)


PurgeHook = Callable[["KVTierConfig", PurgeSelector, bool], "list[NamespacePurge] | None"]


def purge(config: KVTierConfig, selector: PurgeSelector, dry_run: bool,
          keys: Collection[str] | None = None) -> list[NamespacePurge]:
    """Run every registered tier's purge hook over ``config`` (tiers whose target it does not name
    return nothing), in tier order; with ``keys``, only the tiers one of whose configuration keys
    (:attr:`~kvtier.core.tiers.registry.TierSpec.keys`) is among them.

    Raises:
        UserError: a target named wrongly (not a directory, a bad password file), one sentence.

    A target that does not answer (an unreachable server: the hook's ``PurgeFailed``) is reported
    as a result of that tier with no namespace and the sentence as its problem, after the targets
    before it were purged; the caller reports every result and exits non-zero.
    """
    from kvtier.core.tiers.registry import load, specs

    out: list[NamespacePurge] = []
    for record in specs():
        if record.purge is None or (keys is not None and not set(record.keys) & set(keys)):
            continue
        hook = cast(PurgeHook, load(record.purge, record.name))
        try:
            result = hook(config, selector, dry_run)
        except PurgeFailed as exc:  # the other targets' results are still reported (and were carried out)
            failed = NamespacePurge(record.name, b"")
            failed.problem(str(exc))
            out.append(failed)
            continue
        if result is not None:
            out.extend(result)
    return out
