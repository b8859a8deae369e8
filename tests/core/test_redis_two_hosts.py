"""Two hosts, one cache (store level): Redis in one network namespace, a store in each of two
others, joined by veth pairs.  A prefix saved on host A is a hit on host B with identical bytes.

Only the namespaces' own addresses (10.211.1.0/24, 10.211.2.0/24, which exist only inside them)
are contacted (tests/netns.py); skipped only where the machine cannot create a namespace.  The
engine-level version: tests/integrations/test_vllm_two_hosts.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from ..netns import cannot_create
from ..netns import netns_hosts as hosts
from ..redis_servers import redis_binaries, wait_until

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def netns_hosts():
    reason = cannot_create()
    if reason:
        pytest.skip(reason)
    with hosts() as names:
        yield names


def run_host(ns: str, *args: str) -> dict:
    env = {"PATH": os.environ.get("PATH", "/usr/bin"), "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
    proc = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-m", "tests.core.netns_host", *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_prefix_saved_on_host_a_is_a_hit_on_host_b(netns_hosts, tmp_path):
    server_bin, cli_bin = redis_binaries()
    redis = subprocess.Popen(["ip", "netns", "exec", netns_hosts["r"], server_bin, "--bind", "10.211.1.1",
                              "10.211.2.1", "--port", "6379", "--save", "", "--appendonly", "no",
                              "--protected-mode", "no", "--dir", str(tmp_path)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def up() -> bool:
            ping = subprocess.run(["ip", "netns", "exec", netns_hosts["a"], cli_bin, "-h", "10.211.1.1", "ping"],
                                  capture_output=True, text=True, timeout=10, check=False)
            return "PONG" in ping.stdout
        assert wait_until(up, timeout_s=20)
        prefix = f"twohost-{uuid.uuid4().hex[:8]}:"
        saved = run_host(netns_hosts["a"], "save", "redis://10.211.1.1:6379/0", prefix, "11", "4")
        assert saved == {"role": "save", "stored": 4, "flushed": True, "skipped_writes": 0}
        loaded = run_host(netns_hosts["b"], "load", "redis://10.211.2.1:6379/0", prefix, "11", "4")
        assert loaded == {"role": "load", "local": 0, "found": 4, "tiers": ["redis"] * 4, "exact": True}
        other = run_host(netns_hosts["b"], "load", "redis://10.211.2.1:6379/0", prefix, "12", "4")
        assert other["found"] == 0 and other["tiers"] == []  # a prompt nobody saved is a miss
    finally:
        redis.terminate()
        redis.wait(timeout=10)
