"""A tier that compresses loads blosc2 when its writer is built, not inside its first put's
shared-tier deadline (importing blosc2 takes ~0.9 s on an idle EPYC-2, past the 2 s deadline
under load); a tier that does not compress never loads it."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import sys
from kvtier.core.sealing import EnvelopeWriter
assert "blosc2" not in sys.modules, "imported before the writer was built"
EnvelopeWriter(bytes(16), chain={chain!r})
print("blosc2" in sys.modules)
"""


@pytest.mark.parametrize(("chain", "loaded"), [(("blosc2-zstd-shuffle2",), "True"), (("identity",), "False")])
def test_a_compressing_writer_loads_its_library_when_built(chain, loaded):
    out = subprocess.run([sys.executable, "-c", PROBE.format(chain=chain)], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == loaded
