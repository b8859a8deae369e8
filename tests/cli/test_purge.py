"""``kvtier purge`` through the real CLI on a real disk directory: the dry run's numbers (table and
--json) are what the purge then removes; bad input is one sentence and exit 2 (issue 22 item 3)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvtier.cli.main import app
from kvtier.core.tenant import TenantId

from ..core.helpers import chain_of, make_store, payload


def invoke(*args: str):
    return CliRunner(env={"COLUMNS": "200"}).invoke(app, ["purge", *args])


@pytest.fixture
def disk_dir(tmp_path):
    store = make_store(tmp_path, cpu_chunks=32, disk_chunks=32, write_mode="write-through")
    for prompt, salt, chunks in ((1, "A", 3), (2, "B", 4)):
        chain = chain_of(prompt, chunks, salt)
        store.put(chain, [payload(k) for k in chain], tenant=TenantId.of(salt, None))
    chain = chain_of(3, 2, "B")
    store.put(chain, [payload(k) for k in chain])  # an unknown tenant (as files written before records)
    store.flush()
    store.close()
    return tmp_path / "disk"


def test_dry_run_json_equals_what_the_purge_removes(disk_dir):
    dry = invoke("--disk-path", str(disk_dir), "--salt", "B", "--dry-run", "--json")
    assert dry.exit_code == 0, dry.output
    planned = json.loads(dry.output)
    assert planned["dry_run"] is True
    assert planned["total"]["chunks"] == 4 and planned["total"]["unknown_tenant"] == 2
    before = {p: p.stat().st_size for p in disk_dir.glob("*/*/*.kvc")}
    assert len(before) == 9

    done = invoke("--disk-path", str(disk_dir), "--salt", "B", "--json")
    assert done.exit_code == 0, done.output
    removed = json.loads(done.output)
    assert removed["total"] == planned["total"] and removed["dry_run"] is False
    gone = [p for p in before if not p.exists()]
    assert len(gone) == 4 and sum(before[p] for p in gone) == removed["total"]["bytes"]


def test_table_names_the_unknown_tenants(disk_dir):
    result = invoke("--disk-path", str(disk_dir), "--salt", "B", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "would remove" in result.output and "Would remove 4 chunks" in result.output
    assert "Kept 2 chunks whose tenant is unknown" in result.output
    assert len(list(disk_dir.glob("*/*/*.kvc"))) == 9


def test_all_removes_everything_and_no_selector_is_refused(disk_dir):
    refused = invoke("--disk-path", str(disk_dir))
    assert refused.exit_code == 2 and "pass --all" in refused.output
    assert len(list(disk_dir.glob("*/*/*.kvc"))) == 9
    result = invoke("--disk-path", str(disk_dir), "--all", "--json")
    assert result.exit_code == 0 and json.loads(result.output)["total"]["chunks"] == 9
    assert not list(disk_dir.glob("*/*/*.kvc"))


@pytest.mark.parametrize(("args", "phrase"), [
    ((), "give a target"),
    (("--disk-path", "/nonexistent/kvtier", "--salt", "B"), "--disk-path /nonexistent/kvtier does not exist; give"),
    (("--disk-path", "/etc/passwd", "--salt", "B"), "--disk-path /etc/passwd is not a directory"),
    (("--disk-path", "{tmp}", "--older-than", "a week"), "is not a duration"),
    (("--disk-path", "{tmp}", "--older-than", "7"), "give a number with s, m, h, d or w, e.g. 12h or 7d"),
    (("--disk-path", "{tmp}", "--namespace", "abc"), "32 hex digits"),
    (("--disk-path", "{tmp}", "--salt", ""), "--salt is empty"),
    (("--redis-url", "http://x:6379", "--all"), "error: --redis-url must start with redis://"),  # the flag typed, not the key
    (("--s3-bucket", "kv-cache", "--s3-endpoint-url", "ftp://x:9000", "--all"), "error: --s3-endpoint-url must start"),
])
def test_bad_input_is_one_sentence_and_exit_2(tmp_path, args, phrase):
    result = invoke(*(a.replace("{tmp}", str(tmp_path)) for a in args))
    assert result.exit_code == 2, result.output
    assert phrase in result.output and "Traceback" not in result.output
    assert result.output.count("\n") == 1  # one line


def test_a_neighbouring_directory_is_refused_not_reported_as_purged(disk_dir):
    """--disk-path one level too high (the tier's parent) or too low (one namespace directory)
    printed "Removed 0 chunks" and exit 0: a tenant looked purged that was not (tester3)."""
    namespace = next(p for p in disk_dir.iterdir() if p.is_dir())
    parent = invoke("--disk-path", str(disk_dir.parent), "--salt", "B")
    assert parent.exit_code == 2, parent.output
    assert parent.output == (f"error: --disk-path {disk_dir.parent} holds no namespace directory but {disk_dir} "
                             f"does; give the disk tier's directory, --disk-path {disk_dir}.\n")
    inside = invoke("--disk-path", str(namespace), "--all")
    assert inside.exit_code == 2, inside.output
    assert inside.output == (f"error: --disk-path {namespace} is one namespace directory, not the disk tier's "
                             f"directory; give --disk-path {disk_dir} --namespace {namespace.name}.\n")
    assert len(list(disk_dir.glob("*/*/*.kvc"))) == 9  # nothing removed
    empty = disk_dir.parent / "fresh"  # a disk_path no engine has written yet: nothing to remove, exit 0
    empty.mkdir()
    fresh = invoke("--disk-path", str(empty), "--all", "--json")
    assert fresh.exit_code == 0 and json.loads(fresh.output)["total"]["chunks"] == 0, fresh.output


def test_a_parent_of_two_disk_tiers_names_both(disk_dir):
    """``kvtier purge --disk-path .kvtier`` (the demo's and the quick start's disk tiers side by side) named only
    the first, as if it were the one (fresh-user tester): every sub-directory that is a disk tier's is named."""
    import shutil

    other = disk_dir.parent / "other-disk"
    shutil.copytree(disk_dir, other)
    result = invoke("--disk-path", str(disk_dir.parent), "--all", "--dry-run")
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert str(disk_dir) in result.output and str(other) in result.output, result.output
    assert len(list(disk_dir.glob("*/*/*.kvc"))) == 9 == len(list(other.glob("*/*/*.kvc")))


def test_a_namespace_found_nowhere_is_said(disk_dir):
    """A mistyped --namespace digest printed "Removed 0 chunks ... in 0 namespaces" and nothing else, as
    if the purge had been done (tester3)."""
    real = next(p.name for p in disk_dir.iterdir() if p.is_dir())
    typo = "0" * 32
    result = CliRunner(env={"COLUMNS": "200"}).invoke(
        app, ["purge", "--disk-path", str(disk_dir), "--namespace", typo, "--namespace", real, "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["total"]["chunks"] == 9  # the real namespace, whole
    assert result.stderr == (f"note: namespace {typo} holds nothing in the targets given; check the digest (a dry "
                             "run without --namespace lists the namespaces there).\n")
    found = CliRunner().invoke(app, ["purge", "--disk-path", str(disk_dir), "--namespace", real, "--dry-run", "--json"])
    assert found.exit_code == 0 and found.stderr == ""


def test_a_file_whose_header_cannot_be_checked_is_kept_and_named_exit_1(disk_dir):
    victim = min(disk_dir.glob("*/*/*.kvc"))
    raw = bytearray(victim.read_bytes())
    raw[4] ^= 0xFF  # the envelope's version (kvtier.core.envelope): not a chunk file this kvtier reads
    victim.write_bytes(bytes(raw))
    result = invoke("--disk-path", str(disk_dir), "--salt", "B", "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.output)
    assert any(victim.name in p and "unsupported chunk format" in p for r in report["namespaces"] for p in r["problems"])
    assert victim.exists()  # a purge by tenant never removes what it cannot attribute


@pytest.mark.parametrize("selectors", [["--salt", "a"], ["--namespace", "0" * 32, "--older-than", "1h"]])
def test_all_with_a_selector_is_refused_and_nothing_removed(disk_dir, selectors):
    """--all with --salt (or --namespace, --older-than) ran as one of them without comment (fresh-user tester)."""
    before = sorted(disk_dir.glob("*/*/*.kvc"))
    for dry in ([], ["--dry-run"]):
        result = invoke("--disk-path", str(disk_dir), "--all", *selectors, *dry)
        assert result.exit_code == 2, result.output
        named = ", ".join(s for s in selectors if s.startswith("--"))
        assert result.output.strip() == (f"error: --all removes every chunk, which contradicts {named}; drop --all to "
                                         "remove only the chunks the selectors name, or drop the selectors to "
                                         "remove everything.")
    assert sorted(disk_dir.glob("*/*/*.kvc")) == before and before


@pytest.mark.parametrize("options, message", [
    (["--redis-cluster", "--redis-key-prefix", "kv:"], "--redis-cluster, --redis-key-prefix need --redis-url URL"),
    (["--redis-ttl-s", "3600"], "--redis-ttl-s needs --redis-url URL"),
    (["--s3-allow-http"], "--s3-allow-http needs --s3-bucket BUCKET (the bucket the engines use)"),
    (["--s3-region", "eu-west-1", "--s3-credentials-file", "c"], "--s3-region, --s3-credentials-file need --s3-bucket"),
])
def test_a_shared_tier_option_without_its_target_is_refused_and_nothing_removed(disk_dir, options, message):
    """--redis-* without --redis-url (and --s3-allow-http without --s3-bucket) were ignored: the purge
    went on with the disk tier alone, as if the shared tier had been purged too (tester4)."""
    before = sorted(disk_dir.glob("*/*/*.kvc"))
    result = invoke("--disk-path", str(disk_dir), "--all", *options)
    assert result.exit_code == 2 and message in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1
    assert sorted(disk_dir.glob("*/*/*.kvc")) == before and before


def test_many_problems_print_the_first_few_and_one_count_line(disk_dir):
    """One problem per chunk (a read-only disk tier: hundreds) printed the first few, then their count."""
    files = sorted(disk_dir.glob("*/*/*.kvc"))
    assert len(files) == 9
    for victim in files:
        raw = bytearray(victim.read_bytes())
        raw[4] ^= 0xFF  # the envelope's version: each file kept and named as a problem
        victim.write_bytes(bytes(raw))
    result = invoke("--disk-path", str(disk_dir), "--salt", "B")
    assert result.exit_code == 1, result.output  # as before: any problem is exit 1
    lines = [line for line in result.output.splitlines() if line.startswith("problem ")]
    assert len(lines) == 5 + 1, result.output
    assert all("unsupported chunk format" in line for line in lines[:-1])
    assert lines[-1] == ("problem ... and 4 more (9 problems in all; --json names the first 5 of "
                         "each namespace).")
    assert all(f.exists() for f in files)


def test_a_directory_that_is_not_a_disk_tiers_is_refused_and_left_alone(tmp_path):
    """``--disk-path`` of a directory holding no namespace directory but other things (/etc, a home
    directory) said "Removed 0 chunks" and exit 0 (fresh-user tester): one sentence, exit 2, nothing touched.
    An empty directory, or one holding only kvtier's own dot files or lost+found (a fresh disk_path), is not
    refused."""
    other = tmp_path / "home"
    (other / "photos").mkdir(parents=True)
    (other / "notes.txt").write_text("keep me")
    (other / ".kvtier-kv-events-00.msgpack").write_bytes(b"")
    before = sorted(p.relative_to(other) for p in other.rglob("*"))
    for args in (("--all",), ("--all", "--dry-run"), ("--salt", "A")):
        result = invoke("--disk-path", str(other), *args)
        assert result.exit_code == 2 and result.output == (
            f"error: --disk-path {other} is not a kvtier disk tier's directory: it holds no namespace directory (32 "
            "hex digits) but other entries (notes.txt, photos); nothing was removed; give the directory the engines' "
            "disk tier uses.\n")
    assert sorted(p.relative_to(other) for p in other.rglob("*")) == before
    fresh = tmp_path / "fresh"
    (fresh / "lost+found").mkdir(parents=True)
    (fresh / ".kvtier-kv-events-00.msgpack").write_bytes(b"")
    result = invoke("--disk-path", str(fresh), "--all")
    assert result.exit_code == 0 and "Removed 0 chunks" in result.output


def test_a_redis_that_wants_a_password_is_authentication_failed_as_check_says(redis_factory, tmp_path, monkeypatch):
    """A server with requirepass: purge said "did not answer the purge (AuthenticationError: ...)" where
    check says "auth failed"; now one sentence saying authentication failed and how to give the password,
    and the right password purges."""
    password = "pw-purge-Zq81-secret"
    server = redis_factory(extra=("--requirepass", password))
    none_given = invoke("--redis-url", server.url, "--all", "--dry-run")
    assert none_given.exit_code == 2, none_given.output
    assert none_given.output.strip() == (
        f"error: authentication failed at the Redis server at {server.url} (the server requires a password and none "
        "is configured); give the password the engines use with --redis-password-env VAR or --redis-password-file "
        "FILE.")
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-password\n")
    refused = invoke("--redis-url", server.url, "--redis-password-file", str(wrong), "--all", "--dry-run")
    assert refused.exit_code == 2 and "authentication failed at the Redis server" in refused.output, refused.output
    assert "the server refused the password" in refused.output and password not in refused.output
    monkeypatch.setenv("KVTIER_TEST_REDIS_PW", password)
    given = invoke("--redis-url", server.url, "--redis-password-env", "KVTIER_TEST_REDIS_PW", "--all", "--dry-run")
    assert given.exit_code == 0, given.output


def test_a_wrong_redis_database_or_prefix_is_said_and_an_unreached_tier_has_no_summary(redis_factory):
    """`--redis-url .../5` or `--redis-key-prefix other:` printed "Would remove 0 chunks" and exit 0 with no
    word that nothing kvtier was there; an unreachable Redis printed "Would remove 0 chunks, 0 bytes" before
    its problem line (new user 5)."""
    from ..core.test_purge import put, redis_store

    server = redis_factory()
    store = redis_store(server.url, "kvtier:")
    put(store, chain_of(1, 2), None)
    store.close()
    base = server.url.rsplit("/", 1)[0]
    found = invoke("--redis-url", f"{base}/0", "--all", "--dry-run")
    assert found.exit_code == 0 and "Would remove 2 chunks" in found.output and "note:" not in found.output
    for args, searched in ((("--redis-url", f"{base}/5"), (f"database 5 of the Redis server at {base}/5 (keys "
                                                           "starting 'kvtier:')")),
                           (("--redis-url", f"{base}/0", "--redis-key-prefix", "other:"),
                            f"database 0 of the Redis server at {base}/0 (keys starting 'other:')")):
        empty = invoke(*args, "--all", "--dry-run")
        assert empty.exit_code == 0, empty.output
        assert (f"note: redis: {searched} holds no kvtier value at all; check that the engines' redis tier uses "
                "this address and prefix.") in " ".join(empty.output.split()), empty.output
        as_json = json.loads(CliRunner().invoke(app, ["purge", *args, "--all", "--dry-run", "--json"]).stdout)
        assert as_json["namespaces"] == [] and as_json["notes"][0].startswith(f"redis: {searched}")
    unreached = invoke("--redis-url", "redis://127.0.0.1:1/0", "--all", "--dry-run")
    assert unreached.exit_code == 1, unreached.output
    assert "Would remove" not in unreached.output and "not reached" in unreached.output
    assert "Connection refused" in unreached.output and "check --redis-url" in unreached.output
