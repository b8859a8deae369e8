"""Fixtures of the bench tests: ``server`` is a real local HTTP server (tests/bench/sse_server.py)
streaming completions in vLLM's format; parametrize it indirectly with its command-line options."""

import pytest

from tests.bench.sse_server import launch


@pytest.fixture()
def server(request):
    """``(process, url)`` of a fresh sse_server.py (options: ``request.param``), killed afterwards."""
    proc, url = launch(*getattr(request, "param", []))
    yield proc, url
    proc.kill()
    proc.wait()
