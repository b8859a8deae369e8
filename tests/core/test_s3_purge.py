"""``kvtier purge`` over an S3 bucket (core/purge.py over the s3 tier's blob store, core/tiers/s3/blobs.py) against the
real ``rclone serve s3`` the tests start (tests/s3_servers.py): chunks written by the real tier in
two namespaces (one under a shared secret), a foreign object whose name looks like a chunk, and
the selectors (namespace, age, tenant), dry run first."""

from __future__ import annotations

import json
import time

import obstore
import pytest
from typer.testing import CliRunner

from kvtier.cli.main import app
from kvtier.core.config import KVTierConfig
from kvtier.core.purge import PurgeFailed, PurgeSelector, probe_tier, purge, purge_tier
from kvtier.core.tiers.s3.client import brief
from kvtier.core.tiers.sharedvalue import HEADER_BYTES

from .test_s3_tier import data, key, objects
from .tier_harness import CHUNK, NS, OTHER_NS, make_s3_tier, s3_credentials_file

SECRET = "0123456789abcdef-purge-secret"


@pytest.fixture
def filled(s3_server, tmp_path):
    """A bucket with 3 chunks of NS, 2 of OTHER_NS under a shared secret, and a foreign object."""
    bucket = s3_server.make_bucket()
    creds = s3_credentials_file(tmp_path, s3_server)
    plain = make_s3_tier(s3_server, bucket, NS, creds)
    keyed = make_s3_tier(s3_server, bucket, OTHER_NS, creds, shared_secret=SECRET)
    try:
        plain.put_many([key(i) for i in range(3)], [data(i) for i in range(3)])
        keyed.put_many([key(i) for i in range(10, 12)], [data(i) for i in range(10, 12)])
    finally:
        plain.close()
        keyed.close()
    foreign = f"kvtier/{NS.hex()}/{'ab' * 16}"  # a chunk's name, but not a kvtier value
    obstore.put(s3_server.client(bucket), foreign, b"not a kvtier value" * 8)
    obstore.put(s3_server.client(bucket), "other-app/file.txt", b"left alone")
    config = KVTierConfig.from_dict({"s3_endpoint_url": s3_server.url, "s3_bucket": bucket, "s3_allow_http": True,
                                     "s3_credentials_file": str(creds)})
    return bucket, config, foreign, creds


def test_dry_run_says_what_the_purge_removes_and_a_foreign_object_is_kept(s3_server, filled):
    bucket, config, foreign, _creds = filled
    before = objects(s3_server, bucket)
    everything = PurgeSelector()
    planned = purge(config, everything, dry_run=True, keys={"s3_bucket"})
    assert objects(s3_server, bucket) == before  # a dry run removes nothing
    by_ns = {r.namespace: r for r in planned}
    assert {ns: (r.chunks, r.bytes) for ns, r in by_ns.items()} == {NS: (3, 3 * (CHUNK + HEADER_BYTES)),
                                                                    OTHER_NS: (2, 2 * (CHUNK + HEADER_BYTES))}
    assert all(r.tier == "s3" for r in planned)
    assert any(foreign in p and "kept" in p for p in by_ns[NS].problems)
    done = purge(config, everything, dry_run=False, keys={"s3_bucket"})
    assert [(r.namespace, r.chunks, r.bytes) for r in done] == [(r.namespace, r.chunks, r.bytes) for r in planned]
    assert objects(s3_server, bucket) == sorted([foreign, "other-app/file.txt"])


def test_namespace_age_and_tenant_selectors(s3_server, filled):
    bucket, config, _foreign, _creds = filled
    young = purge(config, PurgeSelector(older_than_s=3600), dry_run=False, keys={"s3_bucket"})
    assert sum(r.chunks for r in young) == 0  # everything was written seconds ago
    tenant = purge(config, PurgeSelector(cache_salt="tenant-b"), dry_run=False, keys={"s3_bucket"})
    # written by the bare tier, which was not told a tenant: unknown (tests/core/test_shared_tenant_purge.py
    # writes with one); the foreign object is a problem, never an unknown tenant
    assert sum(r.chunks for r in tenant) == 0 and sum(r.unknown_tenant for r in tenant) == 5
    one = purge(config, PurgeSelector(namespaces=frozenset({OTHER_NS}), older_than_s=60, now=time.time() + 3600),
                dry_run=False, keys={"s3_bucket"})
    assert [(r.namespace, r.chunks) for r in one] == [(OTHER_NS, 2)]
    left = objects(s3_server, bucket)
    assert not any(OTHER_NS.hex() in p for p in left) and sum(NS.hex() in p for p in left) == 4


def test_cli_purge_of_a_bucket_json_dry_run_then_purge(s3_server, filled):
    bucket, _config, _foreign, creds = filled
    args = ["purge", "--s3-bucket", bucket, "--s3-endpoint-url", s3_server.url, "--s3-allow-http",
            "--s3-credentials-file", str(creds), "--namespace", NS.hex(), "--json"]
    dry = CliRunner().invoke(app, [*args, "--dry-run"])
    assert dry.exit_code == 1, dry.output  # the foreign object is named as a problem: exit 1
    report = json.loads(dry.stdout)
    assert report["total"]["chunks"] == 3 and report["namespaces"][0]["tier"] == "s3"
    done = CliRunner().invoke(app, args)
    assert json.loads(done.stdout)["total"] == report["total"]
    assert sum(NS.hex() in p for p in objects(s3_server, bucket)) == 1  # the foreign object only


def test_unreachable_server_is_said_unreachable_with_or_without_credentials(s3_factory, monkeypatch, tmp_path):
    """A dead endpoint is "could not be reached", never "refused the credentials", even when no
    credentials are set (obstore then asks the instance metadata endpoint first)."""
    server = s3_factory()
    url = server.url
    server.kill9()
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for creds in (None, s3_credentials_file(tmp_path, server)):
        values = {"s3_endpoint_url": url, "s3_bucket": "kv-gone", "s3_allow_http": True, "s3_connect_timeout_s": 1.0,
                  "s3_max_retries": 0, **({"s3_credentials_file": str(creds)} if creds else {})}
        (failed,) = purge(KVTierConfig.from_dict(values), PurgeSelector(), dry_run=True, keys={"s3_bucket"})
        (problem,) = failed.problems  # reported as the tier's result (core/purge.py), not raised
        assert problem.startswith(f"the S3 server at {url}/kv-gone/kvtier/ could not be reached"), problem
        assert "refused the" not in problem and "credentials (403)" not in problem
        with pytest.raises(PurgeFailed, match="could not be reached"):
            purge_tier("s3", KVTierConfig.from_dict(values), PurgeSelector(), dry_run=True)
        assert probe_tier("s3", KVTierConfig.from_dict(values), 2.0).state == "unreachable"


def test_cli_purge_errors_name_the_flags_the_user_typed():
    result = CliRunner().invoke(app, ["purge", "--s3-bucket", "kv-cache", "--s3-endpoint-url", "ftp://x:9000", "--all"])
    assert result.exit_code == 2 and "--s3-endpoint-url must start with" in result.output
    assert "s3_endpoint_url" not in result.output and "kvtier config field" not in result.output
    alone = CliRunner().invoke(app, ["purge", "--s3-endpoint-url", "https://minio:9000", "--all"])
    assert alone.exit_code == 2 and "--s3-endpoint-url needs --s3-bucket BUCKET" in alone.output


def test_brief_never_cuts_a_word():
    text = ("Generic S3 error: Error performing list request: Error performing GET http://127.0.0.1:1/kvv?list-type=2"
            " in 287.119µs - HTTP error: error sending request\n\nDebug source: ... kind: Connect ... "
            "Connection refused (os error 111)")
    short = brief(text)
    assert short.startswith("Error performing list request") and "µs" not in short
    assert "(connection refused)" in short
    cut = brief("word " * 60, limit=40)
    assert cut.endswith(" ...") and all(w == "word" for w in cut[:-4].split())
