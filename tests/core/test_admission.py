"""Admission per lower tier: ``{"disk": "reused"}`` writes to disk only chunks the cpu tier served;
config errors name the tier or the policy."""

import pytest

from kvtier.core.config import KVTierConfig
from kvtier.core.errors import ConfigError
from kvtier.core.policies.admission import AdmitAll, AdmitReused, available_admissions, make_admission
from tests.core.helpers import chain_of, make_store
from tests.core.test_store import assert_served, put_chain


def test_disk_admits_only_what_the_cpu_tier_served(tmp_path):
    store = make_store(tmp_path, cpu_chunks=4, disk_chunks=32, admission={"disk": "reused"}, write_mode="write-back")
    try:
        a, b, c = chain_of(1, 2), chain_of(2, 2), chain_of(3, 4)
        put_chain(store, a)
        put_chain(store, b)
        handle = store.prepare_load(b)  # b is served from cpu once; a never is
        store.complete_load(handle, True)
        put_chain(store, c)  # evicts a and b from cpu
        store.flush()
        assert store.stats().tier("cpu").evictions == 4
        assert all(store.tier("disk").contains(k) for k in b) and not any(store.tier("disk").contains(k) for k in a)
        assert store.lookup(a) == 0 and store.lookup(b) == 2
        assert_served(store, b, 2)
        store.check_integrity()
    finally:
        store.close()


def test_default_admits_everything(tmp_path):
    store = make_store(tmp_path, cpu_chunks=2, disk_chunks=32)
    try:
        assert all(isinstance(lt.admission, AdmitAll) for lt in store.index.lower)
        a = chain_of(1, 2)
        put_chain(store, a)
        put_chain(store, chain_of(2, 2))
        store.flush()
        assert all(store.tier("disk").contains(k) for k in a)
    finally:
        store.close()


def test_judge_and_names():
    assert AdmitReused().judge(b"k", 1) and not AdmitReused().judge(b"k", 0) and AdmitAll().judge(b"k", 0)
    assert available_admissions() == ["all", "reused"]
    with pytest.raises(ValueError, match="unknown admission policy 'tinylfu'"):
        make_admission("tinylfu")


@pytest.mark.parametrize("values, message", [
    ({"admission": {"cpu": "reused"}}, "lower tier"),
    ({"admission": {"disk": "often"}}, "'often'"),
    ({"admission": {"disk": "reused"}, "write_mode": "write-through"}, "needs write_mode write-back"),
    ({"admission": {"redis": "reused"}, "write_mode": "write-back"}, "local tier"),
])
def test_config_errors_name_the_tier_or_policy(values, message):
    with pytest.raises(ConfigError, match=message):
        KVTierConfig.from_dict(values)
