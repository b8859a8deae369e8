"""A key whose own value is refused is reported once: no derived problem about its absence
(fresh-user tester: s3_bucket "b" was "at least 3 characters" AND "s3_endpoint_url but no s3_bucket")."""

from __future__ import annotations

from kvtier.integrations.vllm.preflight import check_transfer_config


def transfer(**extra: object) -> dict[str, object]:
    return {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"cpu_gib": 0.5, "s3_allow_http": True, **extra}}


def messages(**extra: object) -> list[str]:
    return [f"{p.key}: {p.message}" for p in check_transfer_config(transfer(**extra))]


def test_a_refused_bucket_is_not_also_a_missing_bucket():
    said = messages(s3_bucket="b", s3_endpoint_url="http://127.0.0.1:1")
    assert any("s3_bucket" in m and "at least 3 characters" in m for m in said), said
    assert not any("but no s3_bucket" in m for m in said), said


def test_a_bucket_never_given_is_still_missing():
    said = messages(s3_endpoint_url="http://127.0.0.1:1")
    assert any("s3_endpoint_url but no s3_bucket" in m for m in said), said
