"""The configuration of the lower tiers' codec chains and of encryption at rest (issue 36):
``codecs: {disk: [...], redis: [...], s3: [...]}`` and ``encryption: {master_key_file | master_key_env,
previous_key_files, previous_key_envs}`` (docs/security.md, docs/vllm.md).

Validating is pure (names only): the key files and variables are read by :func:`load_keyring`, which
a tier's factory and ``kvtier check`` call, so a missing file fails start-up and the check alike.
A master key is never a configuration value: only where to read it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol, TypedDict

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvtier.core import codecs, encryption
from kvtier.core.errors import ConfigError
from kvtier.core.tiers.registry import codec_tiers


class EncryptionSettings(BaseModel):
    """Where the master keys of the ``aes-256-gcm`` codec are read from (exactly one current key)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    master_key_file: str | None = Field(None, description="File holding the current master key (>= 32 bytes).")
    master_key_env: str | None = Field(None, description="Environment variable holding the current master key.")
    previous_key_files: tuple[str, ...] = Field((), description="Files of earlier master keys: they still decrypt.")
    previous_key_envs: tuple[str, ...] = Field((), description="Variables of earlier master keys: they still decrypt.")

    @model_validator(mode="after")
    def _one_current_key(self) -> EncryptionSettings:
        if (self.master_key_file is None) == (self.master_key_env is None):
            raise ValueError("give exactly one of master_key_file or master_key_env (where the current master key "
                             "is read from; never the key itself)")
        return self


def check_codecs(value: Mapping[str, Sequence[str]]) -> dict[str, tuple[str, ...]]:
    """``codecs`` as tier name -> chain of codec names, each checked against the registered tiers
    that write a codec chain (:func:`kvtier.core.tiers.registry.codec_tiers`).

    Raises:
        ValueError: one sentence naming a tier that writes no codec chain (the top tier, or a lower
            tier whose record says so: its values would stay as the engine wrote them, in the
            clear), a codec that is unknown, a chain too long or encryption not last.
    """
    lower = codec_tiers()
    out: dict[str, tuple[str, ...]] = {}
    for tier, chain in value.items():
        if tier not in lower:
            raise ValueError(f"codecs is set for tier {tier!r}, which writes no codec chain; set it for a tier "
                             f"that does: {', '.join(lower)} (the cpu tier, and any other tier not listed, "
                             "holds chunks as the engine wrote them)")
        if isinstance(chain, str) or not all(isinstance(c, str) for c in chain):
            raise ValueError(f"codecs of tier {tier!r} must be a list of codec names, e.g. [zstd, aes-256-gcm]")
        if len(chain) > 5:
            raise ValueError(f"codecs of tier {tier!r} lists {len(chain)} codecs; a chain holds at most 5")
        try:
            codecs.chain_of(tuple(chain))
        except codecs.CodecError as exc:
            raise ValueError(f"codecs of tier {tier!r}: {exc}; choose from {', '.join(codecs.names())}") from None
        out[tier] = tuple(chain)
    return out


def needs_keys(chains: Mapping[str, Sequence[str]], settings: EncryptionSettings | None) -> None:
    """Raises ValueError (one sentence) when a chain encrypts and no master key is configured."""
    if settings is not None:
        return
    for tier, chain in chains.items():
        if encryption.CODEC_NAME in chain:
            raise ValueError(f"codecs of tier {tier!r} include {encryption.CODEC_NAME} but encryption is not set; "
                             "add encryption: {master_key_file: /path/to/key} (or master_key_env)")


def _read_key(what: str, file: str | None, env: str | None) -> encryption.MasterKey:
    if file is not None:
        try:
            raw = Path(file).read_bytes().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read encryption {what} file {file!r}: {exc.strerror}; fix the path or its "
                              "permissions") from None
        where = f"file {file!r}"
    else:
        assert env is not None
        text = os.environ.get(env)
        if text is None:
            raise ConfigError(f"environment variable {env} (encryption {what}) is not set; set it to the key, "
                              "e.g. from openssl rand -hex 32")
        raw, where = text.strip().encode(), f"environment variable {env}"
    if len(raw) < encryption.MIN_MASTER_KEY_BYTES:
        raise ConfigError(f"encryption {what} in {where} holds fewer than {encryption.MIN_MASTER_KEY_BYTES} "
                          "characters; use a long random key, e.g. openssl rand -hex 32")
    return encryption.MasterKey.of(raw)


def load_keyring(settings: EncryptionSettings | None) -> encryption.KeyRing | None:
    """The key ring ``settings`` names, read as start-up reads it (``None`` without ``encryption``).
    Nothing about a key is logged or put in a message but its id.

    Raises:
        ConfigError: a file that cannot be read, a variable that is not set, or a key too short.
    """
    if settings is None:
        return None
    current = _read_key("master key", settings.master_key_file, settings.master_key_env)
    previous = [_read_key("previous key", f, None) for f in settings.previous_key_files]
    previous += [_read_key("previous key", None, e) for e in settings.previous_key_envs]
    return encryption.KeyRing(current, previous)


class CodecArgs(TypedDict):
    """An envelope's codec arguments: ``chain`` (codec names in write order) and ``keyring``."""

    chain: tuple[str, ...]
    keyring: encryption.KeyRing | None


NO_CODECS: CodecArgs = {"chain": ("identity",), "keyring": None}
"""The identity chain without keys (a tier built without a configuration)."""


class Configured(Protocol):
    """What :func:`envelope_args` reads of a configuration (:class:`kvtier.core.config.KVTierConfig`)."""

    @property
    def codecs(self) -> Mapping[str, tuple[str, ...]]: ...

    @property
    def encryption(self) -> EncryptionSettings | None: ...


def envelope_args(config: Configured, tier: str) -> CodecArgs:
    """``chain`` and ``keyring`` of tier ``tier``'s envelope under ``config`` (identity by default).

    Raises:
        ConfigError: as :func:`load_keyring`.
    """
    return {"chain": config.codecs.get(tier, ("identity",)), "keyring": load_keyring(config.encryption)}
