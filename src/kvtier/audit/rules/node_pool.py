"""The node tier (one shared DRAM pool per host, docs/node.md): a pool too small to be worth
sharing, and a ``/dev/shm`` in the manifest too small for the pool.

Both read the engine's kvtier settings (``node_socket`` asks for the tier, ``node_gib`` says the
pool's size as its owner was started with ``kvtier node serve --node-gib``); without ``node_gib``
they say nothing.
"""

from __future__ import annotations

import posixpath

from kvtier.audit.model import ServeConfig
from kvtier.audit.rules.base import rule
from kvtier.audit.rules.settings import kvtier_settings, left_out, number, refused, under
from kvtier.integrations.vllm.preflight_tiers import node_pool_below_cpu_tier

_DOCS = "kvtier docs/node.md"


def _node_gib(c: ServeConfig) -> float | None:
    """``node_gib`` when the node tier is on (a socket, a size, its tier in ``tiers`` if given)."""
    extra = kvtier_settings(c)
    if extra is None or not extra.get("node_socket") or left_out(extra, "node_socket"):
        return None
    gib = number(extra.get("node_gib"), 0.0)
    return gib if gib > 0 else None


@rule("kvtier-node-pool-below-working-set", "warning", "node pool smaller than one engine's own cpu tier",
      "Lower cpu_gib to node_gib, or start the node pool larger (kvtier node serve --node-gib, and node_gib here): "
      "both come out of the host's RAM, so cpu_gib ≤ node_gib ≤ host RAM − reserves − cpu_gib; kvtier size "
      "--node-socket PATH --node-gib N --host-ram-gib H prints a cpu_gib that keeps both (docs/node.md § Sizing).",
      f"{_DOCS} § Sizing", locate="node_gib")
def kvtier_node_pool_below_working_set(c: ServeConfig) -> str | None:
    node_gib = _node_gib(c)
    extra = kvtier_settings(c)
    if node_gib is None or extra is None or refused(extra, "cpu_gib") or refused(extra, "node_socket", "node_gib"):
        return None  # a refused size (kvtier-config-invalid) is not judged as its default
    said = node_pool_below_cpu_tier(node_gib, number(extra.get("cpu_gib"), 4.0))  # 4: KVTierConfig's default
    return f"{said}." if said else None


@rule("kvtier-node-shm-below-pool", "error", "the shared-memory volume of the node pool smaller than node_gib",
      "Give the volume holding the pool (beside node_socket: an emptyDir with medium Memory, /dev/shm, or a "
      "hugetlbfs mount) a sizeLimit of at least node_gib, or mount the host's /dev/shm directory as the deploy files "
      "do (deploy/kubernetes/node-tier/).",
      f"Kubernetes volumes (kubernetes.io/docs/concepts/storage/volumes/#emptydir); {_DOCS} § Memory",
      locate="node_gib")
def kvtier_node_shm_below_pool(c: ServeConfig) -> str | None:
    """The pool lives beside its owner's socket (``kvtier node serve --pool DIR/pool --socket
    DIR/node.sock``, docs/node.md): the memory-backed volume holding ``node_socket`` must hold
    ``node_gib``."""
    node_gib = _node_gib(c)
    extra = kvtier_settings(c)
    if node_gib is None or extra is None or c.pod is None:
        return None
    where = posixpath.dirname(posixpath.normpath(str(extra["node_socket"])))
    holding = [m for m in c.pod.mounts if under(where, m.path)]
    if not holding:
        return None
    mount = max(holding, key=lambda m: len(posixpath.normpath(m.path)))
    in_ram = (mount.medium or "").lower() == "memory" or posixpath.normpath(mount.path) == "/dev/shm"
    if not in_ram or mount.size_gib is None or mount.size_gib >= node_gib - 1e-9:
        return None
    return (f"the memory volume at {mount.path}, which holds the node pool beside node_socket, holds "
            f"{mount.size_gib:,.4g} GiB ({mount.size_source}), less than node_gib {node_gib:g} GiB: the pool's memory "
            "cannot be reserved there (its owner refuses to start, or the emptyDir past its sizeLimit gets the pod "
            "evicted).")
