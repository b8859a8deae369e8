"""The redis tier's configuration keys: its settings model, registered through its
:class:`~kvtier.core.tiers.registry.TierSpec` (``settings``).

The keys are given flat in ``kv_connector_extra_config`` (``{"redis_url": "redis://..."}``, as
always) or under ``tier_settings.redis``, and as ``KVTIER_REDIS_*`` environment variables; each
is checked here, with the same one-sentence errors as every other key
(:class:`kvtier.core.config.KVTierConfig`).  docs/shared-tier.md has the operator's table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvtier.core.config import redact_url

if TYPE_CHECKING:
    from kvtier.core.config import KVTierConfig

TIER = "redis"
"""The tier these settings belong to (its name in the registry)."""


class RedisSettings(BaseSettings):
    """The redis tier's keys; unset ``redis_url`` = no redis tier."""

    model_config = SettingsConfigDict(env_prefix="KVTIER_", extra="forbid", frozen=True)

    redis_url: str | None = Field(None, repr=False, description=(
        "redis:// or rediss:// (TLS) URL of the shared tier (Redis or Valkey); unset = no redis tier."),
        json_schema_extra={"tools": {"purge": {
            "help": "redis:// or rediss:// URL of the shared tier.", "metavar": "URL",
            "target": "the Redis/Valkey server the engines use",
            "empty": "give the Redis/Valkey URL the engines use (their redis_url)"},
            "bench-store": {"help": "Also measure the redis tier on this server (redis:// or rediss://); its keys "
                                    "are deleted afterwards.", "metavar": "URL", "target": "a seed node of the server",
                            "example": "redis://127.0.0.1:6379/0"},
            "size": {"help": "Add a shared Redis/Valkey tier on this URL to the kvtier recipe and size the server "
                             "(docs/shared-tier.md).", "metavar": "URL", "target": "the server the tier uses"}}})
    redis_cluster: bool = Field(False, description="The URL names a seed node of a Redis/Valkey Cluster.",
                                json_schema_extra={"tools": {"purge": {
                                    "help": "--redis-url names a Cluster seed node (every primary is purged)."},
                                    "bench-store": {"help": "--redis-url names a seed node of a Redis Cluster."}}})
    redis_password_env: str | None = Field(None, description="Environment variable holding the Redis password.",
                                           json_schema_extra={"names_env_var": "a Redis password", "tools": {
                                               "purge": {"help": "Environment variable holding the Redis password."},
                                               "bench-store": {"help": "Environment variable holding the Redis "
                                                                       "password.", "metavar": "NAME"}}})
    redis_password_file: str | None = Field(None, description="File holding the Redis password.",
                                            json_schema_extra={"tools": {"purge": {
                                                "help": "File holding the Redis password."},
                                                "bench-store": {"help": "File holding the Redis password.",
                                                                "metavar": "PATH"}}})
    redis_tls_ca_file: str | None = Field(None, description="CA bundle for rediss:// (default: the system's).",
                                          json_schema_extra={"tools": {"purge": {"help": "CA bundle for rediss://."},
                                                                       "bench-store": {"help": "CA bundle for rediss://.",
                                                                                       "metavar": "PATH"}}})
    redis_key_prefix: str = Field("kvtier:", max_length=128, description="Prefix of every key kvtier writes.",
                                  json_schema_extra={"tools": {"purge": {
                                      "help": "The engines' redis_key_prefix (default kvtier:)."}}})
    redis_ttl_s: int = Field(86400, gt=0, description="Seconds a value lives in Redis (SET ... EX).",
                             json_schema_extra={"tools": {"purge": {
                                 "help": "The engines' redis_ttl_s, for --older-than (default 86400)."}}})
    redis_connect_timeout_s: float = Field(0.5, gt=0, le=60, allow_inf_nan=False,
                                           description="Connect timeout of one Redis connection, seconds.")
    redis_timeout_s: float = Field(1.0, gt=0, le=60, allow_inf_nan=False,
                                   description="Read/write timeout of one Redis call, seconds.")
    redis_breaker_failures: int = Field(3, gt=0, description="Failed calls in a row that open the circuit breaker.")
    redis_breaker_probe_s: float = Field(2.0, gt=0, le=3600, allow_inf_nan=False,
                                         description="Seconds between probes while the breaker is open.")

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if urlsplit(value).scheme not in ("redis", "rediss"):
            raise ValueError("redis_url must start with redis:// or rediss:// (TLS), e.g. redis://10.0.0.5:6379/0")
        # redis-py parses the port the same way (urllib); a bad one raised in the worker after the model loaded
        try:
            port = urlsplit(value).port
        except ValueError:
            port = 0
        if port == 0:
            raise ValueError("redis_url's port must be a number from 1 to 65535, e.g. redis://10.0.0.5:6379/0")
        parts = urlsplit(value)
        if not parts.hostname:
            raise ValueError("redis_url names no host; give one, e.g. redis://10.0.0.5:6379/0")
        database = parts.path.strip("/")
        if database and not database.isdigit():  # redis-py reads the path as the database number
            raise ValueError(f"redis_url's database {database!r} must be a number, e.g. redis://10.0.0.5:6379/0")
        return value

    @model_validator(mode="after")
    def _one_password(self) -> RedisSettings:
        # redis-py takes a URL's password over the one passed beside it; the client reads the env before the file
        if self.redis_url and urlsplit(self.redis_url).password and (self.redis_password_file or self.redis_password_env):
            given = "redis_password_file" if self.redis_password_file else "redis_password_env"
            raise ValueError(f"give one of a password in redis_url or {given}, not both (one would never be "
                             f"used); remove the password from redis_url")
        if self.redis_password_file and self.redis_password_env:
            raise ValueError("give one of redis_password_env or redis_password_file, not both (the file would never "
                             "be read)")
        return self

    def public_dict(self) -> dict[str, Any]:
        """The settings with the URL's password (and user) hidden, safe to log or export."""
        out = self.model_dump()
        if self.redis_url:
            out["redis_url"] = redact_url(self.redis_url)
        return out


def redis_settings(config: KVTierConfig) -> RedisSettings:
    """The redis tier's settings of ``config`` (:meth:`KVTierConfig.settings_of`)."""
    return cast(RedisSettings, config.settings_of(TIER))
