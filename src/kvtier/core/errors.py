"""Exceptions of the kvtier core."""


class KVTierError(Exception):
    """Base class of kvtier errors."""


class ConfigError(KVTierError, ValueError):
    """A configuration value is wrong; the message is one sentence naming the field and the fix."""
