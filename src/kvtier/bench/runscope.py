"""What one run of one arm of ``bench compare`` gets of its own, made before its servers start and
removed after they stop, so no run starts warm and no run touches another's data:

* a fresh, empty storage directory ``<path>/run-<k>`` for an arm whose connector writes files
  (kvtier's ``disk_path``, ExampleConnector's ``shared_storage_path``), removed after the run;
* a key prefix of its own on the shared Redis (:func:`kvtier.bench.shared_redis.with_run_prefix`)
  and in the shared bucket (:func:`kvtier.bench.shared_s3.with_run_prefix`), deleted after the run;
* a fresh node pool owner for the ``kvtier-node`` arm (:func:`kvtier.bench.shared_node.run_owner`),
  stopped and its pool deleted after the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
from collections.abc import Iterator
from pathlib import Path

from kvtier.bench import shared_s3
from kvtier.bench.arms import ArmSpec
from kvtier.bench.shared_node import NodePool, run_owner
from kvtier.bench.shared_redis import delete_prefix, with_run_prefix
from kvtier.bench.shared_s3 import S3Target


def fresh_storage(arm: ArmSpec, repeat: int) -> tuple[ArmSpec, Path | None]:
    """The arm with its storage directory (if any) moved to ``<path>/run-<repeat>``, emptied, and
    that directory (``None`` when the arm writes no files)."""
    base = arm.disk_path
    if base is None or arm.kv_transfer_config is None:
        return arm, None
    run_dir = Path(base) / f"run-{repeat}"
    shutil.rmtree(run_dir, ignore_errors=True)
    extra = dict(arm.kv_transfer_config["kv_connector_extra_config"])
    key = "disk_path" if "disk_path" in extra else "shared_storage_path"
    extra[key] = str(run_dir)
    config = {**arm.kv_transfer_config, "kv_connector_extra_config": extra}
    return dataclasses.replace(arm, kv_transfer_config=config), run_dir


@contextlib.contextmanager
def run_scope(arm: ArmSpec, repeat: int, tag: str, *, s3_target: S3Target | None = None,
              node_pool: NodePool | None = None, node_log: Path | None = None) -> Iterator[ArmSpec]:
    """The arm as run ``repeat`` of the comparison ``tag`` runs it (see the module docstring); what
    it made is removed on exit (best effort: a Redis key left expires at ``redis_ttl_s``).

    Raises:
        ServerStartError: the run's node pool owner did not start (nothing is left behind).
    """
    run_spec, run_dir = fresh_storage(arm, repeat)
    run_spec, key_prefix, redis_url = with_run_prefix(run_spec, tag, repeat)
    run_spec, object_prefix = shared_s3.with_run_prefix(run_spec, tag, repeat)
    try:
        with run_owner(run_spec, node_pool, node_log or Path(f"{arm.name}-run{repeat}.node.log")):
            yield run_spec
    finally:
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)
        if key_prefix is not None and redis_url is not None:
            with contextlib.suppress(Exception):  # best effort: the keys expire at redis_ttl_s anyway
                delete_prefix(redis_url, key_prefix)
        if object_prefix is not None and s3_target is not None:
            with contextlib.suppress(Exception):  # best effort: the server and its files go at the end
                shared_s3.delete_prefix(s3_target, object_prefix)
