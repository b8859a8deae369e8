"""``kvtier bench-store`` beyond the cpu and disk tiers: every registered tier whose settings model
marks a field for the ``bench-store`` tool (:mod:`kvtier.core.toolflags`) is measured when that
field, the tier's target (``redis_url``, ``s3_bucket``), is given.

The redis and s3 tiers have their own benchmarks with a raw client of the same server as the
reference (:mod:`kvtier.bench.redisbench`, :mod:`kvtier.bench.s3bench`); any other tier, a plug-in
from outside kvtier included, gets :func:`bench_tier`: its plug-in's tier built from the flags
given, ``put_many``/``get_many`` of the same chunks against a ``numpy.copyto`` of the same bytes.
A new tier needs no edit here or in :mod:`kvtier.cli` to be measured.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.core.errors import ConfigError, UserError
from kvtier.core.tiers.node.settings import TIER as NODE
from kvtier.core.tiers.redis.settings import TIER as REDIS
from kvtier.core.tiers.s3.settings import TIER as S3
from kvtier.core.toolflags import ToolFlag

if TYPE_CHECKING:  # imported by the runs: the CLI reads this module to build its options
    from kvtier.bench.storebench import StoreBenchResult

Rows = tuple[list["StoreBenchResult"], list[str]]
"""A tier's rows and its notes (one line each, printed under the table and kept in the JSON)."""


@dataclass(frozen=True)
class TierBench:
    """How ``kvtier bench-store`` measures one tier.

    Attributes:
        extras: the benchmark's own knobs for the tier (not settings of the tier: ``--s3-in-flight``),
            refused without the tier's target as its settings flags are.
        reference: the line naming the reference, printed under the table.
        parse: the extras' values (key -> value) checked and parsed before any measurement.
            Raises UserError: one sentence naming the flag.
        run: ``(settings, parsed extras, chunk MiBs, MiB per round, repeats) -> (rows, notes)``.
            Raises UserError: the tier could not be measured, one sentence (configuration keys may
            be named as keys: the CLI writes them as its flags).
    """

    extras: tuple[ToolFlag, ...]
    reference: str
    parse: Callable[[dict[str, Any]], Any]
    run: Callable[[dict[str, Any], Any, list[float], float, int], Rows]


def _no_extras(values: dict[str, Any]) -> None:
    return None


def _redis(settings: dict[str, Any], _extras: Any, chunk_mibs: list[float], total_mib: float, repeats: int) -> Rows:
    from kvtier.bench.redisbench import bench_redis
    from kvtier.core.config import KVTierConfig, redact_url

    url = str(settings["redis_url"])
    refuse_unreachable(REDIS, KVTierConfig.from_dict(settings), lambda: None)
    rows: list[StoreBenchResult] = []
    try:
        for mib in chunk_mibs:
            rows += bench_redis(url, mib, total_mib, repeats, cluster=bool(settings.get("redis_cluster")),
                                auth={k: v for k, v in settings.items() if k not in ("redis_url", "redis_cluster")})
    except RuntimeError as exc:
        raise UserError(f"the redis benchmark on {redact_url(url)} failed: {exc}; check --redis-url, that the "
                        "server is up and its maxmemory") from None
    return rows, []


S3_IN_FLIGHT = ToolFlag(S3, "s3_in_flight", str, "s3 requests in flight (tier and reference alike), "
                        "comma-separated, e.g. 1,4,16.", default="1,4,16")
S3_ASSUME_CONDITIONAL_PUT = ToolFlag(
    S3, "s3_assume_conditional_put", bool,
    "Time s3 puts as on a server that honours If-None-Match: * (one PUT per chunk, no HEAD) even where the server "
    "ignores it, as rclone serve s3 does; every key the benchmark writes is new, so the requests are the same ones.",
    default=False)


def _s3_extras(values: dict[str, Any]) -> tuple[list[int], bool]:
    text = values.get("s3_in_flight") or S3_IN_FLIGHT.default
    try:
        counts = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        counts = []
    if not counts or not all(1 <= t <= 256 for t in counts):
        raise UserError(f"--s3-in-flight {text!r} must be a comma-separated list of counts from 1 to 256; e.g. 1,4,16")
    return counts, bool(values.get("s3_assume_conditional_put"))


def _s3(settings: dict[str, Any], extras: tuple[list[int], bool], chunk_mibs: list[float], total_mib: float,
        repeats: int) -> Rows:
    from kvtier.bench.s3bench import bench_s3
    from kvtier.core.config import KVTierConfig

    in_flights, assume_conditional_put = extras
    refuse_unreachable(S3, KVTierConfig.from_dict(settings), lambda: None)
    rows: list[StoreBenchResult] = []
    path = ""
    bucket = settings["s3_bucket"]
    try:
        for mib in chunk_mibs:
            for n in in_flights:
                got, path = bench_s3(settings, mib, total_mib, repeats, n, assume_conditional_put=assume_conditional_put)
                rows += got
    except ConfigError:
        raise
    except RuntimeError as exc:
        raise UserError(f"the s3 benchmark on bucket {bucket} failed: {exc}; check the server and credentials") \
            from None
    except Exception as exc:  # noqa: BLE001 - obstore's errors (unreachable, 403, no such bucket): one sentence
        from kvtier.core.tiers.s3.client import describe_failure
        from kvtier.core.tiers.s3.settings import S3Settings

        state, detail = describe_failure(exc, S3Settings(**settings), 1.0)
        raise UserError(f"the s3 benchmark on bucket {bucket} failed: {state}: {detail}; check s3_endpoint_url, "
                        "that the server is up and the credentials") from None
    return rows, [f"s3 put: {path}"]


BENCHES: dict[str, TierBench] = {
    REDIS: TierBench((), "reference: redis = raw redis-py pipelined SET/GET of the same bytes to the same server",
                       _no_extras, _redis),
    S3: TierBench((S3_IN_FLIGHT, S3_ASSUME_CONDITIONAL_PUT),
                    "reference: s3 = raw obstore put/get of the same bytes to the same bucket, same requests in flight",
                    _s3_extras, _s3),
}
"""The tiers with a benchmark of their own (a raw client of the same server as the reference)."""


def tier_bench(tier: str) -> TierBench:
    """The benchmark of ``tier``: its own (:data:`BENCHES`) or :func:`bench_tier`'s."""
    found = BENCHES.get(tier)
    if found is not None:
        return found

    def run(settings: dict[str, Any], _extras: Any, chunk_mibs: list[float], total_mib: float, repeats: int) -> Rows:
        return [row for mib in chunk_mibs for row in bench_tier(tier, settings, mib, total_mib, repeats)], []

    return TierBench((), f"reference: {tier} = numpy.copyto of the same bytes (the tier's plug-in has no raw client "
                         "to compare with)", _no_extras, run)


START_HINTS = {NODE: "start its owner, kvtier node serve --socket {url}"}
"""How to bring up a tier kvtier itself serves, by tier (any other: start its server)."""


def refuse_unreachable(tier: str, config: Any, close: Callable[[], None]) -> None:
    """Probe ``tier``'s storage (:func:`~kvtier.core.purge.probe_tier`, one harmless request within
    2 s) before any chunk is timed, so a server that is down is said as such, not as a tier short of room.

    Raises:
        UserError: it does not answer, refuses the credentials or is not the kind of server the
            settings say (a Redis Cluster node without ``redis_cluster``): one sentence; ``close`` called first.
    """
    from kvtier.core.purge import probe_tier

    probed = probe_tier(tier, config)
    if probed is None or probed.state == "reachable":
        return
    close()
    if probed.state == "auth failed":
        raise UserError(f"the {tier} tier at {probed.url} refused the credentials ({probed.detail}); nothing was "
                        f"measured: {probed.auth_fix}")
    if probed.state == "wrong mode":
        raise UserError(f"the {tier} tier at {probed.url} answers, but {probed.detail}; nothing was measured")
    hint = START_HINTS.get(tier, "start its server").format(url=probed.url)
    raise UserError(f"nothing answers for the {tier} tier at {probed.url} ({probed.state}: {probed.detail}); "
                    f"nothing was measured: {hint}, or fix {probed.address_key}")


def bench_tier(tier: str, settings: dict[str, Any], chunk_mib: float, total_mib: float,
               repeats: int) -> list[StoreBenchResult]:
    """Tier ``tier`` built by its plug-in from ``settings`` (its configuration keys): ``put_many`` /
    ``get_many`` of ``total_mib`` MiB of ``chunk_mib`` MiB chunks per round against ``numpy.copyto``
    of the same bytes, tier and reference alternating who goes first; the chunks are deleted after
    each round.

    Returns:
        the ``put`` and ``get`` rows (``io`` ``"tier"``, one thread).

    Raises:
        ConfigError: ``settings`` are refused by the tier's settings model (the key named).
        UserError: the plug-in builds no tier from them, or the tier did not store or return every chunk.
    """
    import numpy as np
    from prometheus_client import CollectorRegistry

    from kvtier.bench.storebench import MiB, StoreBenchResult, _chunks, _rate, _timed
    from kvtier.core.config import KVTierConfig
    from kvtier.core.tiers.factory import TierContext, make_tier

    chunk_bytes = int(chunk_mib * MiB)
    num = max(2, int(total_mib / chunk_mib))
    config = KVTierConfig.from_dict(settings)
    tier_obj = make_tier(tier, TierContext(config, os.urandom(16), chunk_bytes, 1, CollectorRegistry()))
    if tier_obj is None:
        raise UserError(f"the {tier} tier's plug-in built no tier from {', '.join(settings)}; give the settings the "
                        "engines use")
    refuse_unreachable(tier, config, tier_obj.close)
    from kvtier.core.keys import ChunkKey
    from kvtier.core.tiers.base import GetResult, PutResult

    datas = _chunks(num, chunk_bytes, seed=4)
    dsts = [np.empty(chunk_bytes, dtype=np.uint8) for _ in range(num)]
    refs = [np.empty(chunk_bytes, dtype=np.uint8) for _ in range(num)]
    for dst, ref_dst, src in zip(dsts, refs, datas):  # fault the destination pages in before any timing
        np.copyto(dst, src)
        np.copyto(ref_dst, src)
    times: dict[str, list[float]] = {"tier_put": [], "ref_put": [], "tier_get": [], "ref_get": []}
    try:
        for r in range(repeats):
            keys = [ChunkKey(os.urandom(16)) for _ in range(num)]

            def tier_put(keys: list[ChunkKey] = keys) -> None:
                results = tier_obj.put_many(keys, [d.data for d in datas])
                if results != [PutResult.STORED] * num:
                    stored = sum(result.stored for result in results)
                    raise UserError(f"the {tier} tier stored {stored} of the {num} chunks of {chunk_mib:g} MiB of a "
                                    f"round ({num * chunk_mib:g} MiB; a round holds at least two chunks); give it "
                                    f"room for {num * chunk_mib:g} MiB or lower --total-mib")

            def tier_get(keys: list[ChunkKey] = keys) -> None:
                if tier_obj.get_many(keys, [d.data for d in dsts]) != [GetResult.HIT] * num:
                    raise UserError(f"the {tier} tier lost a chunk during the benchmark")

            def ref_copy() -> None:
                for dst, src in zip(refs, datas):
                    np.copyto(dst, src)

            pairs = [("ref_put", ref_copy), ("tier_put", tier_put), ("ref_get", ref_copy), ("tier_get", tier_get)]
            if r % 2:
                pairs = [pairs[1], pairs[0], pairs[3], pairs[2]]
            for name, fn in pairs:
                times[name].append(_timed(fn))
            if not np.array_equal(dsts[-1], datas[-1]):
                raise UserError(f"the {tier} tier returned wrong bytes")
            tier_obj.delete_many(keys)
    finally:
        tier_obj.close()
    nbytes = num * chunk_bytes
    rows = []
    for op in ("put", "get"):
        rate = _rate(nbytes, statistics.median(times[f"tier_{op}"]))
        ref = _rate(nbytes, statistics.median(times[f"ref_{op}"]))
        rounds = [ref_s / tier_s for tier_s, ref_s in zip(times[f"tier_{op}"], times[f"ref_{op}"])]
        rows.append(StoreBenchResult(tier, op, chunk_mib, rate, ref, rate / ref, io="tier", threads=1,
                                     ratio_min=min(rounds), ratio_max=max(rounds)))
    return rows
