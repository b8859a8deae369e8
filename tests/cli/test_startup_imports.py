"""The ``kvtier`` command's start-up imports neither numpy nor prometheus_client: every command pays
its start-up (``kvtier check`` in a pre-flight hook, ``kvtier audit`` in CI, the suite's ~330 CLI
processes), and these two cost ~50 ms and ~20 ms of its ~450 (``python -X importtime``, EPYC-2,
2026-12-07).  A command that needs them (``bench``, ``doctor``'s scrape, a tier's I/O) imports
them when it runs.  Measured: ``kvtier check --offline``, ``kvtier audit`` and ``kvtier --help`` in a
row, 0.83x the CPU seconds of main 1557925 (farm-bench, 15 pairs)."""

from __future__ import annotations

import subprocess
import sys

PROBE = ("import sys; import kvtier.cli.main; "
         "print(sorted(m for m in ('numpy', 'prometheus_client', 'torch', 'vllm') if m in sys.modules))")


def test_the_cli_starts_without_numpy_prometheus_torch_or_vllm() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_numpy_array_of_token_ids_keys_as_the_same_list_does() -> None:
    """``chunk_keys`` takes a numpy array without importing numpy itself (it looks for the module the
    caller imported): the keys equal those of the same ids as a list."""
    import numpy as np

    from kvtier.core.keys import chunk_keys

    ids = list(range(1000, 1300))
    assert chunk_keys(b"r" * 16, np.array(ids, dtype=np.int32), 128) == chunk_keys(b"r" * 16, ids, 128)
