"""vLLM general plugin: a bad kvtier config stops ``vllm serve`` before the model loads, in one line.

Registered in pyproject.toml under the entry-point group ``vllm.general_plugins``, which vLLM
loads early in every vLLM process (vllm/plugins/__init__.py ``load_general_plugins``; in the API
server it runs while the command-line parser is built, before ``--kv-transfer-config`` is
parsed).  :func:`register` wraps ``KVTransferConfig.__post_init__`` (vllm/config/kv_transfer.py)
so that, whenever vLLM builds a transfer config that names KVTierConnector, the pre-flight of
:mod:`kvtier.integrations.vllm.preflight` runs on it.  vLLM itself is not modified; a config
without KVTierConnector is not touched.

On an error:

* built from the command line (vLLM's argparse ``parse_dataclass``): print
  ``ERROR kvtier: <one sentence>`` to stderr and exit with status 2, before any engine process
  starts or any weight is read;
* built in Python (``LLM(kv_transfer_config=...)``): raise :class:`~kvtier.core.errors.ConfigError`
  (pydantic reports it as a ``ValidationError`` naming the same sentence).

On the command line ``chunk_tokens`` is also checked against the block sizes the CPU backend may
choose (``--block-size``, else 128; see :func:`~kvtier.integrations.vllm.preflight.cpu_block_divisor`);
the exact block size is known only once the engine has chosen it, after the model loaded, where
the connector checks it again.

Warnings (e.g. ``kv_load_failure_policy``) are left to the connector's own log line, except one:
a configured shared tier (``redis_url``) is probed (connect + PING within 2 s, never a write) and,
when it is unreachable or refuses the password, ``WARNING kvtier: <one sentence>`` is printed to
stderr before the model loads; the server starts anyway (the tier may come up later).

A valid config on the command line (the API server) also gets vLLM PR #49000 backported
(:mod:`kvtier.integrations.vllm.shutdown_log`): a graceful stop logs no spurious
``AsyncLLM output_handler failed … EngineDeadError``.
"""

from __future__ import annotations

import sys
from typing import Any

from kvtier.core.errors import ConfigError
from kvtier.core.tiers.probe import PROBE_DEADLINE_S
from kvtier.integrations.vllm.engine_config import cpu_block_divisor
from kvtier.integrations.vllm.preflight import (
    check_transfer_config,
    kvtier_entries,
    probe_shared_tiers,
    uses_kvtier,
)
from kvtier.integrations.vllm.preflight_tiers import node_pool_size_problems
from kvtier.integrations.vllm.shutdown_log import install as install_shutdown_race_fix

_MARK = "_kvtier_preflight_installed"
NODE_ADDRESS_KEY = "node_socket"  # a probe of the node pool (kvtier.core.tiers.node.blobs.NodeBlobs.address_key)


def register() -> None:
    """Install the pre-flight on vLLM's ``KVTransferConfig`` and register KVTierConnector by
    name (idempotent; a no-op without vLLM)."""
    try:
        from vllm.config.kv_transfer import KVTransferConfig
    except ImportError:
        return
    register_connector()
    if getattr(KVTransferConfig, _MARK, False):
        return
    original = KVTransferConfig.__post_init__

    def __post_init__(self: Any) -> None:
        original(self)
        preflight(self)

    KVTransferConfig.__post_init__ = __post_init__  # type: ignore[method-assign]
    setattr(KVTransferConfig, _MARK, True)


def register_connector() -> None:
    """Name KVTierConnector in vLLM's ``KVConnectorFactory`` (lazily imported), so vLLM can find
    it by name where no ``kv_connector_module_path`` is at hand: ``MultiConnector`` builds its
    children's metrics in the API process that way
    (vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py ``build_kv_connector_stats``),
    and without it a MultiConnector holding kvtier fails at its first stats log."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:
        return
    if "KVTierConnector" not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector("KVTierConnector", "kvtier.integrations.vllm.connector",
                                              "KVTierConnector")


def preflight(config: Any) -> None:
    """Check a vLLM ``KVTransferConfig`` that names KVTierConnector.

    Raises:
        SystemExit: status 2, when it came from the command line and has an error.
        ConfigError: when it was built in Python and has an error.
    """
    transfer = {name: getattr(config, name, None) for name in
                ("kv_connector", "kv_role", "kv_connector_module_path", "kv_load_failure_policy",
                 "kv_connector_extra_config")}
    if not uses_kvtier(transfer):
        return
    command_line = _from_command_line()
    divisor = _block_divisor(sys.argv) if command_line else None
    errors = [p for p in check_transfer_config(transfer, block_divisor=divisor) if p.severity == "error"]
    if not errors:
        warn_unreachable_shared_tier(transfer)
        if command_line:  # the API server: its graceful stop logs no spurious ERROR (shutdown_log)
            install_shutdown_race_fix()
        return
    more = f" ({len(errors) - 1} more: run kvtier check on this config)" if len(errors) > 1 else ""
    message = f"{errors[0].message}{more}"
    if command_line:
        print(f"ERROR kvtier: invalid --kv-transfer-config: {message}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    raise ConfigError(f"kvtier: {message}")


_probed: set[str] = set()


def warn_unreachable_shared_tier(transfer: dict[str, Any]) -> list[str]:
    """Probe the shared tier of a valid config (:func:`~kvtier.integrations.vllm.preflight.probe_shared_tiers`:
    connect + PING within 2 s, never a write) and print ``WARNING kvtier: <one sentence>`` to stderr
    when it is unreachable or refuses the password.  Never refuses to start: the tier may come up
    after the engine, and until then its lookups are misses.  Each URL is probed once per process
    (vLLM may build the transfer config more than once).

    Returns:
        The warning lines printed (empty when the tier answered, or none is configured).
    """
    lines = []
    for probe in probe_shared_tiers(transfer):
        if probe.result.url in _probed:
            continue
        _probed.add(probe.result.url)
        if probe.problem is not None:
            lines.append(f"WARNING kvtier: {probe.problem.message}")
            print(lines[-1], file=sys.stderr, flush=True)
        elif probe.result.address_key == NODE_ADDRESS_KEY:  # a live pool: node_gib against its real size
            for problem in node_pool_size_problems(kvtier_entries(transfer), PROBE_DEADLINE_S):
                if problem.message not in _probed:
                    _probed.add(problem.message)
                    lines.append(f"WARNING kvtier: {problem.message}")
                    print(lines[-1], file=sys.stderr, flush=True)
    return lines


def _block_divisor(argv: list[str]) -> int | None:
    """What every block size the engine may choose is a multiple of (:func:`cpu_block_divisor`),
    from ``--block-size`` on the command line; None when it cannot be known here: not the CPU
    backend (CUDA backends choose their own, vllm/platforms/interface.py), a ``--config`` file
    that may set it, or an unreadable value (vLLM's own argparse reports that)."""
    size: int | None = None
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name == "--config":
            return None
        if name.replace("_", "-") == "--block-size":
            value = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            try:
                size = int(value)
            except ValueError:
                return None
            if size <= 0:
                return None
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return None
    return cpu_block_divisor(size) if current_platform.is_cpu() else None


def _from_command_line() -> bool:
    """Whether vLLM's argparse is building this config (``parse_dataclass`` in vllm/engine/arg_utils.py)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "parse_dataclass" and frame.f_globals.get("__name__") == "vllm.engine.arg_utils":
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False
