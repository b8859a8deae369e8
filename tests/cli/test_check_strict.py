"""``kvtier check --strict`` fails (exit 1) on a configured tier it cannot reach, for CI; without it the
same probe is a warning and the exit code 0 (issue 34).  Against a port nobody listens on and a real
redis-server started here (tests/redis_servers.py)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.cli.test_check_shared_tier_probe import transfer
from tests.redis_servers import free_port


def check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtier.cli.main", "check", *args], capture_output=True,
                          text=True, check=False, timeout=60, env={"COLUMNS": "300", "PATH": "/usr/bin:/bin",
                                                                    "PYTHONPATH": ":".join(sys.path)})


def test_strict_fails_on_a_redis_url_nobody_listens_on():
    url = f"redis://127.0.0.1:{free_port()}/0"
    config = json.dumps(transfer({"redis_url": url}))
    lenient = check(config)
    assert lenient.returncode == 0, lenient.stdout + lenient.stderr
    strict = check("--strict", config)
    assert strict.returncode == 1, strict.stdout + strict.stderr
    lines = strict.stdout.splitlines()
    assert lines[0].startswith(f"error: kv_connector_extra_config.redis_url: shared tier {url} is unreachable "
                               "(connection refused"), lines
    assert lines[-1] == "error: --strict: 1 configured tier(s) cannot be reached.", lines
    assert not any(line.startswith("ok: vLLM would start") for line in lines), lines
    as_json = check("--strict", "--json", config)
    data = json.loads(as_json.stdout)
    assert as_json.returncode == 1 and data["ok"] is False
    assert [(p["severity"], p["key"]) for p in data["problems"]] == [("error", "kv_connector_extra_config.redis_url")]


def test_strict_passes_when_every_tier_answers(redis_factory):
    server = redis_factory()
    run = check("--strict", json.dumps(transfer({"redis_url": server.url})))
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines()[-1] == "ok: vLLM would start with this KVTierConnector config."


def test_strict_with_offline_is_a_usage_error():
    run = check("--strict", "--offline", json.dumps(transfer({"redis_url": "redis://127.0.0.1:1/0"})))
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.strip() == "error: --strict needs the shared-tier probes that --offline skips; give one of them."
