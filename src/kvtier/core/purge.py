"""The operator verbs, written once for every tier over its blob store
(:mod:`kvtier.core.tiers.blobs`, a plug-in's :meth:`~kvtier.core.tiers.plugin.TierPlugin.blobs`):

- :func:`purge`: remove stored chunks by namespace, tenant or age, from outside any engine
  (``kvtier purge``, issue 22 item 3; docs/purge.md).  Each tier whose storage the configuration
  names (the disk tier's ``disk_path``, the redis tier's ``redis_url``, the s3 tier's
  ``s3_bucket``) is listed; what the :class:`PurgeSelector` matches is counted and, unless
  ``dry_run``, removed; either way the numbers are the same, so a dry run says exactly what a purge
  of an unchanged store removes.
- :func:`reset_outside`: drop one namespace from a tier's storage from outside the stores that
  hold it (vLLM's scheduler acknowledging a reset).
- :func:`probe_tier`: whether a tier's storage answers (``kvtier check``, the serve-line pre-flight).

A live engine reads a purged chunk as a miss (a file removed under it, a key gone from the server);
how soon it stops *reporting* the chunk as a hit is in docs/purge.md.
"""

from __future__ import annotations

import re
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.core import envelope, tenant
from kvtier.core.errors import KVTierError, UserError
from kvtier.core.tiers.probe import PROBE_DEADLINE_S, within_deadline

if TYPE_CHECKING:
    from kvtier.core.config import KVTierConfig
    from kvtier.core.tiers.base import ClearResult
    from kvtier.core.tiers.blobs import BlobRef, BlobStat, BlobStore
    from kvtier.core.tiers.probe import ProbeResult, ProbeState

class PurgeFailed(KVTierError):
    """A purge target that was named correctly could not be purged (a server that does not
    answer: the store's :class:`~kvtier.core.tiers.blobs.StorageFailed`); the message is one
    sentence naming it."""


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*$")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def parse_duration(text: str) -> float:
    """Seconds in ``text``: a number with a unit ``s``, ``m``, ``h``, ``d`` or ``w`` (``90s``, ``12h``,
    ``7d``), required: a bare ``7`` meant a week to its user and purged nearly everything as seconds.

    Raises:
        UserError: anything else (a bare number included), or a negative or zero duration.
    """
    match = _DURATION.match(text.lower())
    if match is None:
        raise UserError(f"--older-than {text!r} is not a duration; give a number with s, m, h, d or w, e.g. 12h or 7d")
    seconds = float(match.group(1)) * _UNIT_S[match.group(2)]
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


def parse_key_id(text: str) -> bytes:
    """A master key id written as 8 hex digits (``kvtier check`` prints it); raises UserError otherwise."""
    value = text.strip().lower()
    if not re.fullmatch(r"[0-9a-f]{8}", value):
        raise UserError(f"--key-id {text!r} is not 8 hex digits; copy a master key id from kvtier check")
    return bytes.fromhex(value)


@dataclass(frozen=True)
class PurgeSelector:
    """Which chunks a purge removes: those matching every given field.

    Attributes:
        namespaces: namespace digests (16 bytes each); empty: every namespace.
        older_than_s: only chunks written more than this many seconds before ``now``; ``None``: any age.
        cache_salt: only chunks whose tenant record names this ``cache_salt``; ``None``: any.
        lora_name: only chunks whose tenant record names this LoRA adapter; ``None``: any.
        key_id: only values encrypted under this master key id (:mod:`kvtier.core.keyids`); ``None``: any.
        now: the reference time (seconds since the epoch) for ``older_than_s``.
    """

    namespaces: frozenset[bytes] = frozenset()
    older_than_s: float | None = None
    cache_salt: str | None = None
    lora_name: str | None = None
    key_id: bytes | None = None
    now: float = field(default_factory=time.time)

    @property
    def needs_tenant(self) -> bool:  # whether matching reads a chunk's tenant record
        return self.cache_salt is not None or self.lora_name is not None

    @property
    def selects_anything(self) -> bool:
        """Whether any field narrows the purge (otherwise it removes every chunk: ``--all``)."""
        return bool(self.namespaces) or self.older_than_s is not None or self.needs_tenant or self.key_id is not None

    def wants_namespace(self, namespace: bytes) -> bool:  # whether chunks of ``namespace`` may match
        return not self.namespaces or namespace in self.namespaces

    def old_enough(self, written_s: float) -> bool:
        """Whether a chunk written at ``written_s`` (seconds since the epoch) matches the age filter."""
        return self.older_than_s is None or written_s <= self.now - self.older_than_s

    def tenant_admits(self, result: NamespacePurge, namespace: bytes, raw_record: bytes | memoryview | None,
                      where: str) -> bool:
        """Whether a chunk of ``namespace`` with tenant record ``raw_record`` (``None``: a value
        format with no room for one) goes, counting in ``result`` why one stays: an absent record
        is an unknown tenant (:attr:`NamespacePurge.unknown_tenant`); a record that fails its check
        (:class:`~kvtier.core.envelope.DamagedRecord`) is never trusted: kept, counted in
        :attr:`NamespacePurge.damaged_tenant` and named as a problem (``where``: the chunk's
        file, key or object).  ``True`` when the selector names no tenant."""
        if not self.needs_tenant:
            return True
        try:
            rec = None if raw_record is None else envelope.read_record(raw_record)
        except envelope.DamagedRecord as exc:
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
    note: str = ""  # with no namespace: a shared tier's storage holds no kvtier value at all (what was searched)

    def problem(self, text: str) -> None:
        """Count a problem; keep the first 5."""
        self.problem_count += 1
        if len(self.problems) < 5:
            self.problems.append(text)


def purge(config: KVTierConfig, selector: PurgeSelector, dry_run: bool,
          keys: Collection[str] | None = None) -> list[NamespacePurge]:
    """Purge every registered tier's storage that ``config`` names (:func:`purge_tier`), in tier
    order; with ``keys``, only the tiers one of whose configuration keys
    (:attr:`~kvtier.core.tiers.registry.TierSpec.keys`) is among them.

    Raises:
        UserError: a target named wrongly (not a directory, a bad password file), one sentence.

    A target that does not answer (an unreachable server: :class:`PurgeFailed`) is reported as a
    result of that tier with no namespace and the sentence as its problem, after the targets
    before it were purged; the caller reports every result and exits non-zero.
    """
    from kvtier.core.tiers.registry import specs

    out: list[NamespacePurge] = []
    for record in specs():
        if keys is not None and not set(record.keys) & set(keys):
            continue
        try:
            result = purge_tier(record.name, config, selector, dry_run)
        except PurgeFailed as exc:  # the other targets' results are still reported (and were carried out)
            failed = NamespacePurge(record.name, b"")
            failed.problem(str(exc))
            out.append(failed)
            continue
        if result is not None:
            out.extend(result)
    return out


def purge_tier(name: str, config: KVTierConfig, selector: PurgeSelector, dry_run: bool) -> list[NamespacePurge] | None:
    """List what ``selector`` matches in tier ``name``'s storage (its plug-in's blob store,
    :meth:`~kvtier.core.tiers.plugin.TierPlugin.blobs`) and, unless ``dry_run``, remove it; the
    numbers are the same either way.  ``None`` when ``config`` names no storage of the tier.

    Per value, in order: gone meanwhile: skipped; unreadable: kept, a problem; older than
    ``--older-than`` asks, by its written time (an unknown time: kept, its reason said once);
    then, when a tenant is asked for or the store wants its values verified, its header: one
    that is not a kvtier value of this name is kept and a problem, a tenant record is judged by
    :meth:`PurgeSelector.tenant_admits`.

    Returns:
        one :class:`NamespacePurge` per namespace the storage holds that the selector admits
        (those with nothing matched included, so a dry run shows where it looked), by digest.

    Raises:
        UserError: the storage is named wrongly (one sentence).
        PurgeFailed: it does not answer (one sentence naming it).
    """
    from kvtier.core.tiers.blobs import StorageFailed
    from kvtier.core.tiers.factory import plugin
    from kvtier.core.tiers.registry import spec

    try:
        store = plugin(name).blobs(config)
        if store is None:
            return None
        try:
            results = {ns: NamespacePurge(name, ns) for ns in store.namespaces() if selector.wants_namespace(ns)}
            for batch in store.list(selector.namespaces):
                for ref in batch:
                    results.setdefault(ref.namespace, NamespacePurge(name, ref.namespace))
                _purge_batch(store, batch, selector, dry_run, results)
                _listing_problems(store, name, results)
            _listing_problems(store, name, results)
        finally:
            store.close()
    except StorageFailed as exc:
        raise PurgeFailed(str(exc)) from None
    if not results and spec(name).shared:  # a wrong database or key prefix read as "0 chunks" (new user 5)
        return [NamespacePurge(name, b"", note=f"{getattr(store, 'searched', store.where)} holds no kvtier value at "
                               f"all; check that the engines' {name} tier uses this address and prefix")]
    return [results[ns] for ns in sorted(results)]


def _listing_problems(store: BlobStore, name: str, results: dict[bytes, NamespacePurge]) -> None:
    for namespace, text in store.listing_problems():
        results.setdefault(namespace, NamespacePurge(name, namespace)).problem(text)


def _purge_batch(store: BlobStore, batch: list[BlobRef], selector: PurgeSelector, dry_run: bool,
                 results: dict[bytes, NamespacePurge]) -> None:
    """Judge (and unless ``dry_run`` remove) one listed batch (see :func:`purge_tier`).  Headers are
    read in the same ``stat`` as sizes when no age is asked (one round trip on a server), else only
    for the values old enough."""
    need_header = selector.needs_tenant or store.verifies_values or selector.key_id is not None
    chosen: list[tuple[BlobRef, int]] = []
    if need_header and selector.older_than_s is None:
        for ref, found in zip(batch, store.stat(batch, header=True), strict=True):
            if found is not None and _tenant_admits(selector, results[ref.namespace], ref, found):
                chosen.append((ref, found.size))
    else:
        aged: list[tuple[BlobRef, int]] = []
        for ref, found in zip(batch, store.stat(batch, header=False), strict=True):
            if found is None:
                continue
            result = results[ref.namespace]
            if found.problem is not None:
                result.problem(found.problem)
                continue
            if selector.older_than_s is not None:
                if found.written_s is None:
                    if found.age_problem is not None and found.age_problem not in result.problems:
                        result.problem(found.age_problem)
                    continue
                if not selector.old_enough(found.written_s):
                    continue
            aged.append((ref, found.size))
        chosen = aged
        if aged and need_header:
            chosen = [(ref, size) for (ref, size), head in
                      zip(aged, store.stat([ref for ref, _ in aged], header=True), strict=True)
                      if head is not None and _tenant_admits(selector, results[ref.namespace], ref, head)]
    if not chosen:
        return
    outcomes: list[bool | str] = [True] * len(chosen) if dry_run else store.delete([ref for ref, _ in chosen])
    for (ref, size), gone in zip(chosen, outcomes, strict=True):
        result = results[ref.namespace]
        if isinstance(gone, str):
            result.problem(gone)
        elif gone:
            result.chunks += 1
            result.bytes += size


def _tenant_admits(selector: PurgeSelector, result: NamespacePurge, ref: BlobRef, found: BlobStat) -> bool:
    """Whether a value whose header was read goes: one that cannot be read or is not a kvtier value
    of this name is kept and a problem; then its tenant record is judged."""
    if found.problem is not None:
        result.problem(found.problem)
        return False
    if selector.key_id is not None and (found.header is None or found.header.key_id != selector.key_id):
        return False  # not encrypted, or under another master key
    record = found.header.tenant if found.header is not None else None
    return selector.tenant_admits(result, ref.namespace, record, ref.name)


def reset_outside(name: str, config: KVTierConfig, namespace: bytes) -> ClearResult | None:
    """Drop namespace ``namespace``'s values from tier ``name``'s storage from outside the stores
    that hold them (vLLM's scheduler acknowledging a reset, :mod:`kvtier.integrations.vllm.scheduler.reset`):
    the store's :meth:`~kvtier.core.tiers.blobs.BlobStore.before_reset` (the disk tier's marker,
    so that a restart in between never serves what the reset dropped), then every value of the
    namespace under this configuration's key space, listed and deleted batch by batch.

    Returns:
        the chunk keys removed (``ok`` False, with the first reason, when some could not be);
        ``None`` when ``config`` does not ask for the tier or it has no storage outside the
        engines (the cpu tier).
    """
    from kvtier.core.keys import ChunkKey
    from kvtier.core.tiers.base import ClearResult
    from kvtier.core.tiers.blobs import StorageFailed
    from kvtier.core.tiers.factory import configured, plugin

    if not configured(name, config):
        return None
    try:
        store = plugin(name).blobs(config)
    except (UserError, StorageFailed) as exc:
        return ClearResult([], False, str(exc))
    if store is None:
        return None
    removed: list[ChunkKey] = []
    errors: list[str] = []
    try:
        if (why := store.before_reset(namespace)) is not None:
            return ClearResult([], False, why)
        space = store.space  # this configuration's key space: another secret's values are not its to reset
        for batch in store.list(frozenset({namespace})):
            mine = [ref for ref in batch if ref.space == space]
            for ref, gone in zip(mine, store.delete(mine) if mine else [], strict=True):
                if isinstance(gone, str):
                    errors.append(gone)
                elif gone:
                    removed.append(ChunkKey(ref.key))
        errors += [text for _namespace, text in store.listing_problems()]
    except StorageFailed as exc:
        errors.insert(0, f"{store.where} did not list and delete the namespace's values ({exc})")
    finally:
        store.close()
    return ClearResult(removed, not errors, errors[0] if errors else "")


def probe_tier(name: str, config: KVTierConfig, deadline_s: float = PROBE_DEADLINE_S) -> ProbeResult | None:
    """Whether tier ``name``'s storage answers: one harmless request
    (:meth:`~kvtier.core.tiers.blobs.BlobStore.ping`, never a write) within ``deadline_s`` seconds,
    name resolution included (:func:`~kvtier.core.tiers.probe.within_deadline`); ``kvtier check``
    and the serve-line pre-flight run it for every configured shared tier.

    Returns:
        the :class:`~kvtier.core.tiers.probe.ProbeResult`; ``None`` when ``config`` does not ask for
        the tier or it has no storage outside the engines.

    Raises:
        ConfigError: the probe cannot run (an unreadable password file, a missing package): the
            tier's preflight check reports it.
    """
    import time

    from kvtier.core.tiers.factory import configured, plugin
    from kvtier.core.tiers.probe import ProbeResult

    if not configured(name, config):
        return None
    store = plugin(name).blobs(config, deadline_s)
    if store is None:
        return None

    def result(state: ProbeState, detail: str, elapsed_s: float) -> ProbeResult:
        return ProbeResult(state, store.where, detail, elapsed_s, auth_fix=store.auth_fix,
                           address_key=store.address_key, kind=getattr(store, "kind", "shared tier"),
                           reach_fix=getattr(store, "reach_fix", "open the network path"))

    def attempt(start: float) -> ProbeResult:
        try:
            verb = store.ping()
        except Exception as exc:  # noqa: BLE001 - any failure is a state, said in a few words
            state, detail = store.failure(exc, deadline_s - (time.monotonic() - start))
            return result(state, detail, time.monotonic() - start)
        finally:
            store.close()
        elapsed = time.monotonic() - start
        return result("reachable", f"{verb} answered in {elapsed * 1000:.1f} ms", elapsed)

    return within_deadline(attempt, deadline_s, f"kvtier-{name}-probe",
                           lambda detail, elapsed_s: result("unreachable", detail, elapsed_s))
