"""Fixtures of the bench tests: ``server`` is a real local HTTP server (tests/bench/sse_server.py)
streaming completions in vLLM's format; parametrize it indirectly with its command-line options."""

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvtier.integrations.vllm.serve import free_port


@pytest.fixture()
def server(request):
    """``(process, url)`` of a fresh sse_server.py (options: ``request.param``), killed afterwards."""
    port = free_port()
    args = getattr(request, "param", [])
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("sse_server.py")), str(port), *args])
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    yield proc, url
    proc.kill()
    proc.wait()
