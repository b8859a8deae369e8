"""``kvtier check`` and the serve-line pre-flight probe a configured shared tier: connect + PING within
a short deadline, never a write, and one line saying reachable / unreachable / auth failed (issue 24
item 3).  Against real redis-server processes started here (tests/redis_servers.py) and a closed port."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.core.config import KVTierConfig
from kvtier.core.purge import probe_tier
from kvtier.integrations.vllm.plugin import warn_unreachable_shared_tier
from kvtier.integrations.vllm.preflight import probe_shared_tiers
from tests.redis_servers import free_port

PASSWORD = "probe-password-0123456789"


def transfer(extra: dict[str, object]) -> dict[str, object]:
    return {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"cpu_gib": 0.5, "tiers": ["cpu", "redis"], **extra}}


def check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtier.cli.main", "check", *args], capture_output=True,
                          text=True, check=False, timeout=60, env={"COLUMNS": "300", "PATH": "/usr/bin:/bin",
                                                                    "PYTHONPATH": ":".join(sys.path)})


def lines_about(stdout: str, key: str = "kv_connector_extra_config.redis_url") -> list[str]:
    return [ln for ln in stdout.splitlines() if f"{key}:" in ln]


def test_a_closed_port_is_unreachable_in_one_line_and_offline_skips_the_probe():
    url = f"redis://127.0.0.1:{free_port()}/0"
    run = check(json.dumps(transfer({"redis_url": url})))
    assert run.returncode == 0, run.stdout + run.stderr  # vLLM would start: the tier may come up later
    assert lines_about(run.stdout) == [(
        f"warning: kv_connector_extra_config.redis_url: shared tier {url} is unreachable (connection refused: "
        "nothing listens on that port); vLLM would start, but every shared-tier lookup would be a miss until it "
        "answers: start it, fix redis_url, or open the network path")], run.stdout
    assert run.stdout.splitlines()[-1] == "ok: vLLM would start with this KVTierConnector config (1 warning(s))."
    offline = check("--offline", json.dumps(transfer({"redis_url": url})))
    assert offline.returncode == 0 and lines_about(offline.stdout) == [], offline.stdout
    assert [ln for ln in offline.stdout.splitlines() if not ln.startswith("info: kvtier supports vLLM")] == [
        "ok: vLLM would start with this KVTierConnector config."], offline.stdout
    data = json.loads(check("--json", json.dumps(transfer({"redis_url": url}))).stdout)
    assert [(t["state"], t["url"]) for t in data["shared_tier"]] == [("unreachable", url)]


def test_a_host_that_does_not_resolve_is_unreachable_within_the_deadline():
    result = probe_tier("redis", KVTierConfig.from_dict({"redis_url": "redis://kvtier-no-such-host.invalid:6379/0"}))
    assert (result.state, result.detail) == ("unreachable", "the host name does not resolve"), result
    assert result.elapsed_s < 2.5


def test_a_live_server_is_reachable_and_the_probe_writes_nothing(redis_factory):
    server = redis_factory()
    run = check(json.dumps(transfer({"redis_url": server.url})))
    assert run.returncode == 0, run.stdout + run.stderr
    (line,) = lines_about(run.stdout)
    assert line.startswith(f"ok: kv_connector_extra_config.redis_url: shared tier {server.url} is reachable "
                           "(PING answered in "), line
    client = server.client()
    assert client.dbsize() == 0
    called = {name.removeprefix("cmdstat_").split("|")[0] for name in client.info("commandstats")}
    assert "ping" in called and called <= {"ping", "hello", "auth", "client", "info", "dbsize"}, called


def test_a_password_the_server_refuses_or_none_given_is_auth_failed(redis_factory, tmp_path: Path):
    server = redis_factory(extra=("--requirepass", PASSWORD))
    none_given = check(json.dumps(transfer({"redis_url": server.url})))
    assert lines_about(none_given.stdout) == [(
        f"warning: kv_connector_extra_config.redis_url: shared tier {server.url}: auth failed (the server requires "
        "a password and none is configured); vLLM would start, but every shared-tier lookup would be a miss: fix "
        "redis_password_env, redis_password_file or the password in redis_url (or the server's requirepass/ACL)")], \
        none_given.stdout
    (tmp_path / "pw").write_text("not-the-password\n")
    wrong = probe_shared_tiers(transfer({"redis_url": server.url, "redis_password_file": str(tmp_path / "pw")}))
    assert [p.result.state for p in wrong] == ["auth failed"]
    assert wrong[0].result.detail.startswith("the server refused the password: "), wrong[0].result
    in_url = check(json.dumps(transfer({"redis_url": server.url.replace("//", "//:not-the-password@")})))
    (line,) = lines_about(in_url.stdout)  # a wrong password in the URL is refused, not "none is configured"
    assert "auth failed (the server refused the password in redis_url: invalid username-password pair" in line, line
    assert "not-the-password" not in in_url.stdout and "none is configured" not in line
    (tmp_path / "pw").write_text(PASSWORD + "\n")
    right = probe_shared_tiers(transfer({"redis_url": server.url, "redis_password_file": str(tmp_path / "pw")}))
    assert [(p.result.state, p.problem) for p in right] == [("reachable", None)]


def test_no_probe_without_a_redis_tier_or_with_an_unreadable_password(tmp_path: Path):
    url = f"redis://127.0.0.1:{free_port()}/0"
    assert probe_shared_tiers(transfer({"redis_url": url, "tiers": ["cpu"]})) == []  # tier left out: not used
    assert probe_shared_tiers(transfer({})) == []
    # an unreadable password file is check_transfer_config's error, not a probe result
    assert probe_shared_tiers(transfer({"redis_url": url, "redis_password_file": str(tmp_path / "none")})) == []


def test_the_serve_line_preflight_warns_and_does_not_refuse(redis_factory, capsys: pytest.CaptureFixture[str]):
    """The vLLM plugin's hook (run while vLLM parses --kv-transfer-config, before the model loads)
    prints one WARNING line for an unreachable tier and nothing for a live one; it never exits."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    lines = warn_unreachable_shared_tier(transfer({"redis_url": url}))
    assert lines == [(f"WARNING kvtier: shared tier {url} is unreachable (connection refused: nothing listens on "
                     "that port); vLLM would start, but every shared-tier lookup would be a miss until it answers: "
                     "start it, fix redis_url, or open the network path")]
    assert capsys.readouterr().err.splitlines() == lines
    assert warn_unreachable_shared_tier(transfer({"redis_url": url})) == []  # once per URL and process
    live = redis_factory()
    assert warn_unreachable_shared_tier(transfer({"redis_url": live.url})) == []
    assert capsys.readouterr().err == ""


def test_the_plugin_hook_probes_a_valid_config_and_not_a_refused_one(capsys: pytest.CaptureFixture[str]):
    """plugin.preflight (what vLLM's KVTransferConfig.__post_init__ calls) warns for a valid config's
    unreachable tier; a config it refuses is not probed (its error is what the operator must see)."""
    from types import SimpleNamespace

    from kvtier.core.errors import ConfigError
    from kvtier.integrations.vllm.plugin import preflight

    url = f"redis://127.0.0.1:{free_port()}/0"
    preflight(SimpleNamespace(**transfer({"redis_url": url})))  # the fields vLLM's config carries
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"WARNING kvtier: shared tier {url} is unreachable (connection refused"), line
    other = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(ConfigError, match="cpu_gib"):
        preflight(SimpleNamespace(**transfer({"redis_url": other, "cpu_gib": -1})))
    assert capsys.readouterr().err == ""


def test_a_certificate_for_another_host_names_the_mismatch(redis_factory, tmp_path: Path):
    """The server's certificate names 127.0.0.1 only: reached as localhost, the handshake fails, and the
    line says the certificate must name the URL's host (deploy/kubernetes/shared-tier: kvtier-redis)."""
    from tests.redis_servers import TlsFiles

    tls = TlsFiles.make(tmp_path / "tls")
    server = redis_factory(tls=tls)
    url = f"rediss://localhost:{server.port}/0"
    result = probe_tier("redis", KVTierConfig.from_dict({"redis_url": url, "redis_tls_ca_file": str(tls.ca)}))
    assert result.state == "unreachable", result
    assert "mismatch" in result.detail and "must name the host of redis_url" in result.detail, \
        result.detail
    assert probe_tier("redis", KVTierConfig.from_dict({"redis_url": server.url, "redis_tls_ca_file": str(tls.ca)})).state \
        == "reachable"


def test_a_missing_tls_ca_file_is_named_by_check_not_read_as_a_network_error(tmp_path: Path):
    """A ``rediss://`` tier whose ``redis_tls_ca_file`` does not exist: ``kvtier check`` says so in one
    line (it never looked; the tier then failed at its first connection, reported as unreachable),
    and the probe is not run on it."""
    url = f"rediss://127.0.0.1:{free_port()}/0"
    missing = tmp_path / "ca.pem"
    run = check(json.dumps(transfer({"redis_url": url, "redis_tls_ca_file": str(missing)})))
    assert run.returncode != 0, run.stdout + run.stderr
    found = lines_about(run.stdout, "kv_connector_extra_config.redis_tls_ca_file")
    assert found == [(f"error: kv_connector_extra_config.redis_tls_ca_file: cannot read redis_tls_ca_file "
                      f"{str(missing)!r} (No such file or directory); point it at the PEM file of the CA that "
                      "signed the Redis server's certificate")], run.stdout
    assert "unreachable" not in run.stdout


@pytest.mark.parametrize("scheme", ["redis", "rediss"])
def test_a_server_that_accepts_but_never_answers_is_said_as_such_not_as_a_connect_timeout(scheme):
    """A real listening socket that accepts and never replies was "unreachable (connect timed out)":
    the connect worked, the PING (or TLS handshake) got no answer; said so within the deadline."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    accepted: list[socket.socket] = []
    done = threading.Event()

    def accept_forever() -> None:
        listener.settimeout(0.2)
        while not done.is_set():
            try:
                accepted.append(listener.accept()[0])  # held open, never written to
            except OSError:
                continue

    thread = threading.Thread(target=accept_forever, daemon=True)
    thread.start()
    url = f"{scheme}://127.0.0.1:{listener.getsockname()[1]}/0"
    try:
        run = check(json.dumps(transfer({"redis_url": url})))
    finally:
        done.set()
        thread.join(5)
        for conn in accepted:
            conn.close()
        listener.close()
    assert run.returncode == 0, run.stdout + run.stderr
    what = "the TLS handshake or PING" if scheme == "rediss" else "PING"
    tail = " (a rediss:// URL to a port that speaks plain text looks the same)" if scheme == "rediss" else ""
    assert lines_about(run.stdout) == [(
        f"warning: kv_connector_extra_config.redis_url: shared tier {url} is unreachable (it accepted the connection "
        f"but did not answer {what} within 1 s: something listens on that port that is not a Redis server, or the "
        f"server is stalled{tail}); vLLM would start, but every shared-tier lookup would be a miss until it answers: "
        "start it, fix redis_url, or open the network path")], run.stdout


def test_a_cluster_node_named_without_redis_cluster_is_wrong_mode_and_strict_fails(redis_cluster):
    """A Cluster node's URL without ``redis_cluster: true`` answers PING, so the probe said
    "reachable" and check said ok, while the engine's writes and lookups of about two thirds of the
    keys were refused with MOVED (probe: /tmp/st57/clustermis.py).  ``INFO cluster`` tells; with
    ``redis_cluster`` the same node is reachable."""
    result = probe_tier("redis", KVTierConfig.from_dict({"redis_url": redis_cluster.url}))
    assert result is not None and result.state == "wrong mode", result
    assert "set redis_cluster: true" in result.message and "vLLM would start" in result.message
    run = check(json.dumps(transfer({"redis_url": redis_cluster.url})))
    assert run.returncode == 0 and len(lines_about(run.stdout)) == 1, run.stdout + run.stderr
    assert lines_about(run.stdout)[0].startswith("warning:") and "redis_cluster is not set" in run.stdout
    assert check("--strict", json.dumps(transfer({"redis_url": redis_cluster.url}))).returncode == 1
    ok = probe_tier("redis", KVTierConfig.from_dict({"redis_url": redis_cluster.url, "redis_cluster": True}))
    assert ok is not None and ok.state == "reachable", ok
