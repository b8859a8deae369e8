"""The operator verbs are written once (issue 33 item 6): the toy dict tier from outside kvtier
(tests/dict_tier.py), whose plug-in offers only the blob-store verbs ``list``, ``stat`` and
``delete``, gets ``kvtier purge`` (by salt, namespace and age), a reset from outside the stores and
the reachability probe from kvtier.core.purge, with no purge, reset or probe code of its own.
Values are written by a real store through the tier's data path, with real tenant records."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import uuid

import pytest
import typer
from typer.testing import CliRunner

from kvtier.core.config import KVTierConfig
from kvtier.core.envelope import FIXED_BYTES
from kvtier.core.purge import PurgeSelector, probe_tier, purge, purge_tier, reset_outside
from kvtier.core.store import TieredStore
from kvtier.core.tenant import TenantId
from kvtier.core.tiers import registry

from .helpers import CHUNK_BYTES, CHUNK_TOKENS, NS, chain_of, payload

PLUGIN = "tests.dict_tier_plugin"
OTHER_NS = dataclasses.replace(NS, model="other-model")


@pytest.fixture
def area():
    """The dict tier registered through ``tier_modules``, a fresh storage area, and its configuration."""
    sys.modules.pop(PLUGIN, None)
    name = f"blob-verbs-{uuid.uuid4().hex[:8]}"
    config = KVTierConfig.from_dict({"tier_modules": [PLUGIN], "tiers": ["cpu", "dict"], "chunk_tokens": CHUNK_TOKENS,
                                     "cpu_gib": 64 * CHUNK_BYTES / (1 << 30), "write_mode": "write-through",
                                     "dict_capacity_mib": 64 * CHUNK_BYTES / (1 << 20), "dict_storage": name})
    yield name, config
    from tests import dict_tier

    dict_tier._AREAS.pop(name, None)
    registry.unregister("dict")
    sys.modules.pop(PLUGIN, None)


def stored(name: str) -> dict[bytes, set[bytes]]:
    """Namespace digest -> chunk keys the area holds."""
    from tests.dict_tier import _AREAS

    return {ns: {bytes(k) for k in keys} for ns, keys in _AREAS.get(name, {}).items() if keys}


def write(store: TieredStore, chain, tenant: TenantId | None) -> set[bytes]:
    assert store.put(chain, [payload(k) for k in chain], tenant=tenant) == len(chain)
    assert store.flush(10)
    return {bytes(k) for k in chain}


def test_the_toy_tier_has_no_purge_reset_or_probe_code_of_its_own():
    import tests.dict_tier as module

    own = {n.lower() for n, v in vars(module).items() if getattr(v, "__module__", None) == module.__name__}
    names = own | {n.lower() for n in vars(module.DictPlugin)} | {n.lower() for n in vars(module.DictBlobs)}
    assert {n for n in names if any(verb in n for verb in ("purge", "reset", "probe"))} == {"before_reset"}
    assert {"list", "stat", "delete"} <= set(vars(module.DictBlobs))


def test_purge_by_salt_removes_exactly_that_tenants_values_and_the_dry_run_said_so(area):
    name, config = area
    store = TieredStore(config, NS, CHUNK_BYTES)
    try:
        salt_a = write(store, chain_of(1, 3, "A"), TenantId.of("A", None))
        salt_b = write(store, chain_of(2, 2, "B"), TenantId.of("B", None))
        unknown = write(store, chain_of(3, 2, "A"), None)  # a store that did not say: never matched by --salt
        ns = store.namespace.digest()
        assert stored(name) == {ns: salt_a | salt_b | unknown}

        dry = purge_tier("dict", config, PurgeSelector(cache_salt="A"), dry_run=True)
        assert dry is not None and [(r.tier, r.namespace, r.chunks, r.bytes, r.unknown_tenant) for r in dry] == \
            [("dict", ns, 3, 3 * (CHUNK_BYTES + FIXED_BYTES), 2)]  # the values are envelopes: 128-byte headers
        assert stored(name) == {ns: salt_a | salt_b | unknown}  # a dry run removes nothing

        done = purge(config, PurgeSelector(cache_salt="A"), dry_run=False, keys={"dict_storage"})
        assert [(r.namespace, r.chunks, r.bytes, r.unknown_tenant) for r in done] == \
            [(r.namespace, r.chunks, r.bytes, r.unknown_tenant) for r in dry]
        assert stored(name) == {ns: salt_b | unknown}
        assert store.lookup(chain_of(2, 2, "B")) == 2
    finally:
        store.close()


def test_purge_by_namespace_and_by_age_removes_exactly_the_matching_values(area):
    name, config = area
    mine, other = TieredStore(config, NS, CHUNK_BYTES), TieredStore(config, OTHER_NS, CHUNK_BYTES)
    try:
        old = write(mine, chain_of(1, 3), None)
        cut = time.time()
        time.sleep(0.05)
        young = write(mine, chain_of(2, 2), None)
        theirs = write(other, chain_of(3, 4), None)
        ns, other_ns = mine.namespace.digest(), other.namespace.digest()

        aged = purge_tier("dict", config, PurgeSelector(older_than_s=1.0, now=cut + 1.0), dry_run=False)
        assert aged is not None and {r.namespace: r.chunks for r in aged} == {ns: 3, other_ns: 0}
        assert stored(name) == {ns: young, other_ns: theirs}
        assert not old & stored(name)[ns]

        one = purge_tier("dict", config, PurgeSelector(namespaces=frozenset({other_ns})), dry_run=False)
        assert one is not None and [(r.namespace, r.chunks) for r in one] == [(other_ns, 4)]
        assert stored(name) == {ns: young}
    finally:
        mine.close()
        other.close()


def test_reset_of_one_namespace_from_outside_the_stores_leaves_another(area):
    name, config = area
    mine, other = TieredStore(config, NS, CHUNK_BYTES), TieredStore(config, OTHER_NS, CHUNK_BYTES)
    try:
        gone = write(mine, chain_of(1, 3), TenantId.of("A", None))
        kept = write(other, chain_of(1, 3), TenantId.of("A", None))
        result = reset_outside("dict", config, mine.namespace.digest())
        assert result is not None and result.ok and {bytes(k) for k in result.keys} == gone
        assert stored(name) == {other.namespace.digest(): kept}
        assert other.lookup(chain_of(1, 3)) == 3
    finally:
        mine.close()
        other.close()


def test_probe_reports_the_area_reachable_and_a_tier_without_storage_is_not_probed(area):
    name, config = area
    result = probe_tier("dict", config, 2.0)
    assert result is not None and result.state == "reachable" and result.url == f"dict:{name}"
    assert result.message.startswith(f"shared tier dict:{name} is reachable (LIST answered in ")
    private = KVTierConfig.from_dict({"tier_modules": [PLUGIN], "tiers": ["cpu", "dict"], "dict_capacity_mib": 1})
    assert probe_tier("dict", private) is None and purge_tier("dict", private, PurgeSelector(), True) is None
    assert reset_outside("dict", private, NS.digest()) is None


def test_kvtier_purge_takes_the_toy_tiers_flags_from_its_settings_model(area):
    """``kvtier purge`` builds each tier's flags from its settings model (kvtier.core.toolflags): the
    toy tier's ``dict_storage`` (marked for purge in tests/dict_tier.py) is ``--dict-storage`` with no
    edit in kvtier.cli, refused without its target like a built-in tier's flags, and purges."""
    from kvtier.cli.stored import register

    name, config = area
    app = typer.Typer()
    app.callback()(lambda: None)
    register(app)  # built now, with the dict tier registered
    store = TieredStore(config, NS, CHUNK_BYTES)
    try:
        salted = write(store, chain_of(1, 3, "A"), TenantId.of("A", None))
        rest = write(store, chain_of(2, 2, "B"), TenantId.of("B", None))
        runner = CliRunner(env={"COLUMNS": "200"})
        assert "--dict-storage" in runner.invoke(app, ["purge", "--help"]).output
        given = runner.invoke(app, ["purge", "--dict-storage", name, "--salt", "A", "--json"])
        assert given.exit_code == 0, given.output
        assert [(r["tier"], r["chunks"]) for r in json.loads(given.stdout)["namespaces"]] == [("dict", 3)]
        assert stored(name) == {store.namespace.digest(): rest} and not salted & rest
        nothing = runner.invoke(app, ["purge", "--all"])
        assert nothing.exit_code == 2 and nothing.output == (
            "error: give a target to purge: --disk-path DIR (the disk tier's directory), --dict-storage NAME, "
            "--node-socket PATH, --redis-url URL and/or --s3-bucket BUCKET.\n")
        empty = runner.invoke(app, ["purge", "--dict-storage", " ", "--all"])
        assert empty.exit_code == 2 and "--dict-storage is empty; give the area the engines use" in empty.output
    finally:
        store.close()
