"""A tier is a plug-in (issue 20 item 1): a tier from outside kvtier (tests/dict_tier.py) is
registered by a module named in ``tier_modules``, configured through ``tier_settings``, and
then built, ordered, counted and reported by the store like a built-in one."""

from __future__ import annotations

import re
import sys

import pytest

from kvtier.core.config import KVTierConfig
from kvtier.core.errors import ConfigError
from kvtier.core.mover import directions
from kvtier.core.tiers import factory, registry
from tests.dict_tier import SPEC, DictTier

from .helpers import CHUNK_BYTES, CHUNK_TOKENS, NS, chain_of, payload

PLUGIN = "tests.dict_tier_plugin"


@pytest.fixture
def plugin():
    """The dict tier registered through ``tier_modules`` for one test, then forgotten."""
    sys.modules.pop(PLUGIN, None)  # imported afresh: the import is what registers
    yield
    registry.unregister(SPEC.name)
    sys.modules.pop(PLUGIN, None)


def test_a_module_named_in_tier_modules_registers_its_tier(plugin):
    import dataclasses

    from kvtier.core.mover import StoreCounters
    from kvtier.integrations.vllm.stats import store_counters

    assert SPEC.name not in registry.available_tiers()
    # what the hot paths derive from the records once (directions, the per-step stats table) is
    # derived again after a registration (registry.generation)
    assert "cpu_to_dict" not in directions()
    tokens = dataclasses.replace(StoreCounters().snapshot(CHUNK_BYTES, CHUNK_TOKENS, {}, 0, 0), loaded_tokens={"dict": 5})
    assert "loaded_tokens_dict" not in store_counters(tokens, None)
    config = KVTierConfig.from_dict({"tier_modules": [PLUGIN], "tiers": ["cpu", "dict"], "dict_capacity_mib": 1})
    assert registry.available_tiers() == ["cpu", "disk", "dict", "node", "redis", "s3"]  # by the record's order
    assert factory.configured("dict", config) and config.settings_of("dict").dict_capacity_mib == 1
    assert registry.hit_source("dict") == "external_unspecified"
    assert registry.slowest(["dict", "cpu", "disk"]) == "dict"
    assert {"cpu_to_dict", "dict_to_cpu"} <= set(directions())
    assert store_counters(tokens, None)["loaded_tokens_dict"] == 5


def test_the_store_builds_evicts_into_and_loads_from_a_plugin_tier(plugin, tmp_path):
    from kvtier.core.store import TieredStore

    config = KVTierConfig.from_dict({"tier_modules": [PLUGIN], "tiers": ["cpu", "dict"], "chunk_tokens": CHUNK_TOKENS,
                                     "cpu_gib": 2 * CHUNK_BYTES / (1 << 30), "write_mode": "write-back",
                                     "tier_settings": {"dict": {"dict_capacity_mib": 16 * CHUNK_BYTES / (1 << 20)}}})
    store = TieredStore(config, NS, CHUNK_BYTES)
    try:
        assert [lt.name for lt in store.index.lower] == ["dict"] and isinstance(store.tier("dict"), DictTier)
        chain = chain_of(3, 6)
        for i in range(0, 6, 2):  # two cpu pages: each pair pushes the one before into the dict tier
            assert store.put(chain[:i + 2], [payload(k) for k in chain[:i + 2]]) == 2
            store.flush()
        assert store.lookup(chain) == 6
        got = store.get(chain)
        assert got == [payload(k) for k in chain]
        s = store.stats()
        assert s.tier("dict").num_chunks >= 4 and s.transfer_bytes["dict_to_cpu"] > 0
        store.flush()  # the load's promotions spill cpu pages into the dict tier on the writer thread
        store.check_integrity()
    finally:
        store.close()


def test_tier_settings_are_checked_by_the_tiers_own_model(plugin):
    # a key given flat reads like any other key; one given nested is named by its path
    with pytest.raises(ConfigError, match=r"^kvtier config field 'dict_capacity_mib': Input should be greater than 0 "
                                          r"\(got 0\); fix the value of 'dict_capacity_mib'$"):
        KVTierConfig.from_dict({"tier_modules": [PLUGIN], "dict_capacity_mib": 0})
    with pytest.raises(ConfigError, match=r"^kvtier config field 'tier_settings\.dict\.dict_capacity_mib': Input should "
                                          r"be greater than 0 \(got 0\)"):
        KVTierConfig.from_dict({"tier_modules": [PLUGIN], "tier_settings": {"dict": {"dict_capacity_mib": 0}}})
    with pytest.raises(ConfigError, match="'dict_capacity_mib' is given both at the top level and in tier_settings"):
        KVTierConfig.from_dict({"tier_modules": [PLUGIN], "dict_capacity_mib": 1,
                                "tier_settings": {"dict": {"dict_capacity_mib": 2}}})
    with pytest.raises(ConfigError, match="tier_settings names 'nosuch': unknown tier 'nosuch'"):
        KVTierConfig.from_dict({"tier_settings": {"nosuch": {}}})


def test_an_unimportable_tier_module_is_one_sentence():
    with pytest.raises(ConfigError, match="tier_modules names 'no.such.tiers', which cannot be imported"):
        KVTierConfig.from_dict({"tier_modules": ["no.such.tiers"]})


def test_an_unregistered_tier_name_says_how_to_register_one():
    with pytest.raises(ConfigError, match="unknown tier 'dict'; choose from cpu, disk, node, redis, s3"):
        KVTierConfig.from_dict({"tiers": ["cpu", "dict"]})
    with pytest.raises(ConfigError, match="unknown kvtier config key 'dict_capacity_mib'"):
        KVTierConfig.from_dict({"dict_capacity_mib": 1})  # without the module that registers the tier


def test_a_bad_record_is_refused():
    with pytest.raises(ValueError, match="unknown hit source 'gpu'"):
        registry.register(registry.TierSpec("x", 5, False, "gpu", "m:f"))
    with pytest.raises(ValueError, match="already"):
        registry.register(registry.TierSpec("disk", 5, False, "disk", "m:f"))
    with pytest.raises(ValueError, match="lower-case"):
        registry.register(registry.TierSpec("My-Tier", 5, False, "disk", "m:f"))
    with pytest.raises(ValueError, match="unknown capabilities"):
        registry.register(registry.TierSpec("x", 5, False, "disk", "m:f", capabilities=frozenset({"teleports"})))


def test_a_record_may_declare_every_capability_protocol_and_the_builtins_declare_only_those():
    """The registry's names are the base module's protocols (a plug-in tier that registers memory
    or answers lookups without I/O must be accepted, not only the built-ins written in place)."""
    from kvtier.core.tiers.base import CAPABILITY_PROTOCOLS

    assert registry.CAPABILITIES == frozenset(CAPABILITY_PROTOCOLS)
    assert all(s.capabilities <= registry.CAPABILITIES for s in registry.BUILTIN)


NOT_A_PLUGIN = object()
"""What a record may name by mistake: an object without the plug-in's hooks."""


def test_a_record_naming_something_that_is_not_a_plugin_is_refused_in_one_sentence():
    """The plug-in is checked against the TierPlugin protocol when it is imported; after that every
    hook is a typed call (no "module:function" strings cast unchecked)."""
    from kvtier.core.tiers.plugin import TierPlugin
    from tests.dict_tier import PLUGIN as DICT_PLUGIN

    assert isinstance(DICT_PLUGIN, TierPlugin)
    for target, phrase in ((f"{__name__}:NOT_A_PLUGIN", "is not a tier plug-in (it lacks settings, build, "),
                           (f"{__name__}:NO_SUCH_NAME", "names nothing")):
        registry.register(registry.TierSpec("bogus", 40, False, "external_unspecified", target))
        try:
            with pytest.raises(ConfigError, match=re.escape(phrase)):
                factory.plugin("bogus")
        finally:
            registry.unregister("bogus")
    assert "bogus" not in registry.available_tiers()
    assert isinstance(factory.plugin("redis"), TierPlugin)
    assert factory.plugin("redis").settings is registry.settings_model("redis")
