"""Other namespaces' files under one disk_path are not room a disk tier can evict.

Seen by an outside prober: an engine's model changed (or its tensor-parallel size, or chunk_tokens) and it
restarted on the same disk_path and disk_gib. The start-up check counted the old model's chunk files as room
("the tier's to evict"), so it started; but a tier evicts only its own namespace's files, so once the free
space was used every write failed with ENOSPC (22 of 30 chunks on an 8 MiB tmpfs, `kvtier_write_errors_total`)
while the tier reported two thirds of its size free. Now the tier's factory, which knows the engine's
namespaces, refuses the size in one sentence.

The old files here are sparse (a size on disk far beyond any free space, no blocks written), so the sizes
hold whatever else the host's filesystem does meanwhile.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest

from kvtier.core.config import GiB, KVTierConfig
from kvtier.core.errors import ConfigError
from kvtier.core.keys import Namespace
from kvtier.core.store import TieredStore
from tests.core.helpers import CHUNK_BYTES, CHUNK_TOKENS, NS, chain_of, payload

OLD_FILES_BYTES = 1 << 40  # 1 TiB of chunk files an earlier engine left (sparse)


def _store(root: Path, disk_gib: float, namespace: Namespace = NS) -> TieredStore:
    config = KVTierConfig.from_dict({"chunk_tokens": CHUNK_TOKENS, "cpu_gib": 4 * CHUNK_BYTES / GiB, "disk_path": str(root),
                                     "disk_gib": disk_gib, "disk_io": "buffered", "write_mode": "write-through"})
    return TieredStore(config, namespace, CHUNK_BYTES, tp_size=namespace.tp_size)


def _leave_files(namespace_dir: Path) -> None:
    (namespace_dir / "ff").mkdir(parents=True, exist_ok=True)
    with open(namespace_dir / "ff" / "left-by-an-earlier-engine", "wb") as f:
        f.truncate(OLD_FILES_BYTES)


def _disk_gib_past_the_free_space(root: Path) -> float:
    """A size the free space cannot hold, but the free space plus the old files can (by half of them)."""
    return (shutil.disk_usage(root).free + OLD_FILES_BYTES // 2) / GiB


def test_another_models_files_are_not_room_a_restarted_engine_can_evict(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    old_model = _store(root, disk_gib=1)
    chain = chain_of(1, 2)
    old_model.put(chain, [payload(k) for k in chain])
    old_model.close()
    _leave_files(root / NS.digest().hex())
    disk_gib = _disk_gib_past_the_free_space(root)

    new_model = dataclasses.replace(NS, model="the-model-it-was-replaced-by")
    with pytest.raises(ConfigError) as err:
        _store(root, disk_gib, new_model)
    assert "this engine's own chunk files hold there; the other 1024.0 GiB under it are not its own" in str(err.value)
    assert f"kvtier purge --disk-path {root} --all --dry-run" in str(err.value)
    assert not (root / new_model.digest().hex()).exists()  # refused before anything was made

    restarted = _store(root, disk_gib)  # the old model's own files are its room
    assert restarted.get(chain) == [payload(k) for k in chain]
    restarted.close()


def test_every_rank_of_the_engine_counts_its_siblings_files_as_room(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    rank0 = dataclasses.replace(NS, tp_size=2, tp_rank=0)
    _leave_files(root / dataclasses.replace(rank0, tp_rank=1).digest().hex())
    disk_gib = _disk_gib_past_the_free_space(root)
    store = _store(root, disk_gib, rank0)
    store.close()
    other_engine = dataclasses.replace(rank0, model="another-model")
    with pytest.raises(ConfigError, match="are not its own"):
        _store(root, disk_gib, other_engine)
    assert os.path.isdir(root / rank0.digest().hex())
