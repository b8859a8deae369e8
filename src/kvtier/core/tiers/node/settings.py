"""The node tier's configuration keys: its settings model, registered through its
:class:`~kvtier.core.tiers.registry.TierSpec` (``settings``).

Given flat in ``kv_connector_extra_config`` (``{"node_socket": "/run/kvtier/node.sock"}``), under
``tier_settings.node``, or as ``KVTIER_NODE_*`` environment variables.  docs/node.md has the
operator's table.  The pool itself (its file and size) is the owner's, ``kvtier node serve``;
``node_gib`` here says how big the engines' pool is, for ``kvtier size``, ``check`` and ``audit``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, cast

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

if TYPE_CHECKING:
    from kvtier.core.config import KVTierConfig

TIER = "node"
"""The tier these settings belong to (its name in the registry)."""

SOCKET_PATH_MAX_BYTES = 107
"""Longest UNIX socket path Linux binds or connects to (``sun_path`` is 108 bytes with its NUL)."""


def socket_path_problem(path: str, name: str) -> str | None:
    """Why ``path`` can never be a UNIX socket (one sentence naming ``name``, the key or flag), or None."""
    num_bytes = len(os.fsencode(path))
    if num_bytes > SOCKET_PATH_MAX_BYTES:
        return (f"{name} path is {num_bytes} bytes; a UNIX socket path holds at most {SOCKET_PATH_MAX_BYTES}: "
                "give a shorter path")
    return None


class NodeSettings(BaseSettings):
    """The node tier's keys; unset ``node_socket`` = no node tier."""

    model_config = SettingsConfigDict(env_prefix="KVTIER_", extra="forbid", frozen=True)

    node_socket: str | None = Field(None, min_length=1, description=(
        "UNIX socket of this host's node pool owner (kvtier node serve --socket); unset = no node tier."),
        json_schema_extra={"tools": {"size": {
            "help": "Add this host's shared DRAM pool (the node tier: its owner's socket, kvtier node serve --socket) "
                    "to the kvtier recipe (docs/node.md).", "metavar": "PATH", "target": "the pool owner's socket",
            "example": "/run/kvtier/node.sock"},
            "purge": {"help": "This host's node pool (its owner's socket, the engines' node_socket).",
                      "metavar": "PATH", "target": "the node pool the engines use",
                      "empty": "give the socket the engines use (their node_socket)"},
            "bench-store": {"help": "Also measure the node tier on this host's pool (its owner's socket); the "
                                    "chunks written are deleted afterwards.", "metavar": "PATH",
                            "target": "the pool owner's socket", "example": "/run/kvtier/node.sock"}}})
    node_gib: float = Field(0.0, ge=0, le=1 << 20, allow_inf_nan=False, description=(
        "Size of the host's node pool in GiB (the owner's --node-gib), for kvtier size, check and audit; "
        "0 = not said."), json_schema_extra={"tools": {"size": {
            "help": "The host's node pool in GiB (its owner's --node-gib), for the recipe and kvtier audit.",
            "metavar": "GIB"}}})
    node_timeout_s: float = Field(1.0, gt=0, le=60, allow_inf_nan=False,
                                  description="Bound of one connect, send or receive to the owner, seconds.")
    node_breaker_failures: int = Field(3, gt=0, description="Failed calls in a row that open the circuit breaker.")
    node_breaker_probe_s: float = Field(1.0, gt=0, le=3600, allow_inf_nan=False,
                                        description="Seconds between probes while the breaker is open.")

    @field_validator("node_socket")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("/"):
            raise ValueError(f"node_socket must be an absolute path (the owner's --socket), got {value!r}")
        if value is not None and (problem := socket_path_problem(value, "node_socket")):
            raise ValueError(problem)
        return value


def node_settings(config: KVTierConfig) -> NodeSettings:
    """The node tier's settings of ``config`` (:meth:`KVTierConfig.settings_of`)."""
    return cast(NodeSettings, config.settings_of(TIER))
