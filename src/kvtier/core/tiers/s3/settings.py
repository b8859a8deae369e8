"""The s3 tier's configuration keys: its settings model, registered through its
:class:`~kvtier.core.tiers.registry.TierSpec` (``settings``).

The keys are given flat in ``kv_connector_extra_config`` (``{"s3_bucket": "kv", ...}``) or under
``tier_settings.s3``, and as ``KVTIER_S3_*`` environment variables; each is checked here with the
same one-sentence errors as every other key (:class:`kvtier.core.config.KVTierConfig`).
docs/s3.md has the operator's table.

Credentials are never a key: they come from the standard AWS environment variables
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``), from a file in the AWS
shared-credentials format named by ``s3_credentials_file``, or from the AWS default chain
(instance profile, web identity, container credentials) that obstore follows when neither is
given.  An endpoint URL carrying a user or password is refused without echoing it (the field is
``repr=False``, like ``redis_url``), so no credential reaches a serve line, a log or ``/metrics``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlsplit

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvtier.core.config import redact_url

if TYPE_CHECKING:
    from kvtier.core.config import KVTierConfig

TIER = "s3"
"""The tier these settings belong to (its name in the registry)."""
MAX_CAPACITY_GIB = float(1 << 20)
"""Largest ``s3_capacity_gib``, GiB: 1 PiB, the bound of ``kvtier size --offload-gib`` and of
``kvtier simulate --shared-gib`` (which models this cap); 1e300 passed as a cap that never binds."""


class S3Settings(BaseSettings):
    """The s3 tier's keys; unset ``s3_bucket`` (and ``s3_endpoint_url``) = no s3 tier."""

    model_config = SettingsConfigDict(env_prefix="KVTIER_", extra="forbid", frozen=True)

    s3_bucket: str | None = Field(None, min_length=3, max_length=63, description=(
        "Bucket of the s3 tier (created beforehand; kvtier never creates buckets); unset = no s3 tier."),
        json_schema_extra={"tools": {"purge": {"help": "The s3 tier's bucket (its s3_bucket).", "metavar": "BUCKET",
                                               "target": "the bucket the engines use",
                                               "empty": "give the bucket the engines use (their s3_bucket)"},
                                     "bench-store": {"help": (
                                         "Also measure the s3 tier on this bucket (created beforehand; credentials "
                                         "from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or --s3-credentials-file); its "
                                         "objects are deleted afterwards."), "metavar": "BUCKET",
                                         "target": "the bucket to measure",
                                         "example": "kvcache --s3-endpoint-url https://minio:9000"},
                                     "size": {"help": ("Add the object-store tier on this bucket to the kvtier recipe, "
                                                       "with its modeled load time per chunk (docs/s3.md)."),
                                              "metavar": "BUCKET", "target": "the bucket the tier uses"}}})
    s3_endpoint_url: str | None = Field(None, repr=False, description=(
        "http(s):// URL of an S3-compatible server (MinIO, Ceph RGW, R2, rclone serve s3); unset = AWS S3 "
        "in s3_region."), json_schema_extra={"tools": {"purge": {
            "help": "https:// URL of an S3-compatible server (unset: AWS S3).", "metavar": "URL"},
            "bench-store": {"help": "S3-compatible server of --s3-bucket (default: AWS S3).", "metavar": "URL"},
            "size": {"help": "With --s3-bucket: an S3-compatible server (MinIO, Ceph RGW, R2), https://host[:port]; "
                             "unset: AWS S3.", "metavar": "URL"}}})
    s3_region: str = Field("us-east-1", min_length=1, description=(
        "Region the requests are signed for (AWS: the bucket's region; most other servers accept us-east-1)."),
        json_schema_extra={"tools": {"purge": {"help": "The bucket's region (default us-east-1)."},
                                     "bench-store": {"help": "Region the s3 requests are signed for (default "
                                                             "us-east-1)."}}})
    s3_key_prefix: str = Field("kvtier/", max_length=256, description=(
        "Prefix of every object kvtier writes; empty or ending in '/'."),
        json_schema_extra={"tools": {"purge": {"help": "The engines' s3_key_prefix (default kvtier/)."}}})
    s3_virtual_hosted_style: bool = Field(False, description=(
        "Address the bucket as BUCKET.host (virtual-hosted style) instead of host/BUCKET (path style)."))
    s3_allow_http: bool = Field(False, description="Allow a plain http:// s3_endpoint_url (no TLS).",
                                json_schema_extra={"tools": {"purge": {"help": "Allow a plain http:// --s3-endpoint-url."},
                                                             "bench-store": {"help": "Allow a plain http:// --s3-endpoint-url."}}})
    s3_credentials_file: str | None = Field(None, description=(
        "File in the AWS shared-credentials format (aws_access_key_id, aws_secret_access_key, optional "
        "aws_session_token) holding the s3 tier's credentials; unset = the AWS environment variables or chain."),
        json_schema_extra={"tools": {"purge": {"metavar": "FILE", "help": (
            "AWS credentials file (else AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or the AWS chain).")},
            "bench-store": {"metavar": "FILE", "help": "AWS shared-credentials file for --s3-bucket."}}})
    s3_profile: str = Field("default", min_length=1, description="Section of s3_credentials_file to read.")
    s3_capacity_gib: float | None = Field(None, gt=0, allow_inf_nan=False, description=(
        "Cap on the objects of this cache's namespace in the bucket, GiB, total across tensor-parallel ranks (each "
        "rank's namespace holds its share), at most 1,048,576 (1 PiB); past it the oldest are deleted. Unset = no "
        "cap (use s3_ttl_s or a lifecycle rule)."),
        json_schema_extra={"tools": {"size": {"help": "With --s3-bucket: cap on the cache's objects, GiB (unset: "
                                                      "objects expire after a week)."}}})
    s3_ttl_s: int | None = Field(None, gt=0, description=(
        "Seconds an object lives: older objects are misses and a background sweep deletes them. Unset = forever."))
    s3_sweep_interval_s: float = Field(300.0, gt=0, le=86400, allow_inf_nan=False, description=(
        "Seconds between background passes (a LIST of the namespace) that delete expired objects and "
        "re-count the namespace under s3_capacity_gib; only with s3_ttl_s or s3_capacity_gib."))
    s3_concurrency: int = Field(16, gt=0, le=256, description=(
        "Requests in flight at most to the S3 server (parallel GETs of one load, PUTs of one save)."))
    s3_conditional_put: bool = Field(True, description=(
        "Write with If-None-Match: * so the server refuses to replace an existing object and a save needs no "
        "HEAD per chunk (a server that ignores the header, or answers 501 to it, is found by one probe and gets a "
        "HEAD before each PUT without the header); off: no probe, a HEAD before each PUT."))
    s3_connect_timeout_s: float = Field(1.0, gt=0, le=60, allow_inf_nan=False,
                                        description="Connect timeout of one S3 connection, seconds.")
    s3_timeout_s: float = Field(30.0, gt=0, le=600, allow_inf_nan=False, description=(
        "Timeout of one S3 request, seconds (the caller gives up earlier, at shared_deadline_s or "
        "shared_transfer_deadline_s; this bounds the request left running)."))
    s3_max_retries: int = Field(2, ge=0, le=10, description=(
        "Retries of one request on a dropped connection or a 5xx reply, within the caller's deadline."))
    s3_breaker_failures: int = Field(3, gt=0, description="Failed calls in a row that open the circuit breaker.")
    s3_breaker_probe_s: float = Field(2.0, gt=0, le=3600, allow_inf_nan=False,
                                      description="Seconds between probes while the breaker is open.")

    @field_validator("s3_endpoint_url")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https"):
            raise ValueError("s3_endpoint_url must start with https:// (or http:// with s3_allow_http), "
                             "e.g. https://minio.example:9000")
        if parts.username is not None or parts.password is not None:
            raise ValueError("s3_endpoint_url must not carry credentials; put them in AWS_ACCESS_KEY_ID and "
                             "AWS_SECRET_ACCESS_KEY or in the file named by s3_credentials_file")
        try:
            port = parts.port
        except ValueError:
            port = 0
        if port == 0 or not parts.hostname:
            raise ValueError("s3_endpoint_url needs a host and, if given, a port from 1 to 65535, "
                             "e.g. https://minio.example:9000")
        if parts.path.strip("/") or parts.query:
            raise ValueError("s3_endpoint_url is the server alone; give the bucket in s3_bucket, "
                             "e.g. https://minio.example:9000")
        return value

    @field_validator("s3_capacity_gib")
    @classmethod
    def _capacity(cls, value: float | None) -> float | None:
        if value is not None and value > MAX_CAPACITY_GIB:
            raise ValueError(f"s3_capacity_gib must be at most {MAX_CAPACITY_GIB:,.0f} GiB (1 PiB); for no cap "
                             "leave it unset (objects then expire by s3_ttl_s or a lifecycle rule)")
        return value

    @field_validator("s3_bucket")
    @classmethod
    def _bucket(cls, value: str | None) -> str | None:
        if value is None:
            return None
        allowed = set("abcdefghijklmnopqrstuvwxyz0123456789.-")
        if not set(value) <= allowed or value[0] in ".-" or value[-1] in ".-":
            raise ValueError("s3_bucket must be 3-63 lower-case letters, digits, '.' and '-', starting and "
                             "ending with a letter or digit (the S3 bucket naming rules)")
        return value

    @field_validator("s3_key_prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        if value and (not value.endswith("/") or value.startswith("/") or "//" in value):
            raise ValueError("s3_key_prefix must be empty or end in '/' (no leading '/', no '//'), e.g. kvtier/")
        allowed = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789!-_.*'()/")
        if not set(value) <= allowed:
            raise ValueError("s3_key_prefix may hold only letters, digits and !-_.*'()/ (S3's safe key characters)")
        return value

    def public_dict(self) -> dict[str, Any]:
        """The settings, safe to log or export (an endpoint URL is shown without any user or password)."""
        out = self.model_dump()
        if self.s3_endpoint_url:
            out["s3_endpoint_url"] = redact_url(self.s3_endpoint_url)
        return out


def s3_settings(config: KVTierConfig) -> S3Settings:
    """The s3 tier's settings of ``config`` (:meth:`KVTierConfig.settings_of`)."""
    return cast(S3Settings, config.settings_of(TIER))
