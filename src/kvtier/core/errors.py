"""Every kvtier exception, in one module at the bottom of the package graph.

Every package (core, integrations, and the tools: audit, size, doctor, simulate, bench) raises these;
the CLI (:mod:`kvtier.cli.errors`) turns a :class:`UserError` into one line on stderr and exit code 2.
Nothing here imports anything of kvtier, so any module may import it.

Hierarchy::

    KVTierError
    └── UserError            a mistake in the user's input (flag, file, URL, config)
        ├── ConfigError      a kvtier configuration value (also a ValueError, for pydantic)
        └── ServerAnswerError  a server's page that cannot be fetched (in time, or at all)
            └── MetricsError   a /metrics page that cannot be fetched or parsed
    ServerStartError         a vLLM server kvtier started exited or did not answer in time
"""


class KVTierError(Exception):
    """Base class of kvtier errors."""


class UserError(KVTierError):
    """A mistake in the user's input; the message is one sentence naming what is wrong and the fix."""


class ConfigError(UserError, ValueError):
    """A configuration value is wrong; the message is one sentence naming the field and the fix.

    Attributes:
        env_var: the ``KVTIER_*`` environment variable the problem comes from (an unknown name, or
            the bad value of a field the explicit config did not set); None when it comes from the
            explicit config.
    """

    def __init__(self, message: str, env_var: str | None = None) -> None:
        super().__init__(message)
        self.env_var = env_var


class ServerAnswerError(UserError):
    """A server's HTTP page could not be fetched within its deadline (:mod:`kvtier.tools.httpget`);
    the message names the URL and the cause."""


class MetricsError(ServerAnswerError):
    """A server's ``/metrics`` could not be fetched or parsed; the message names the URL and the cause."""


class GeometryError(UserError, ValueError):
    """A model config cannot give its KV geometry (bytes per token); the message names the field."""


class TraceError(UserError, ValueError):
    """A trace file is missing, unreadable or malformed; the message names file, line and fix."""


class ChunkFormatError(KVTierError):
    """The bytes are not a valid kvtier chunk (torn, truncated, corrupt, or another format).

    Not a user error: the store treats such a chunk as a miss and never serves it.
    """


def length_problem(value_bytes: int, header_bytes: int, stored_bytes: int, what: str = "value") -> str | None:
    """Why a ``value_bytes``-byte value (a file: ``what``) disagrees with its header's
    ``header_bytes`` and ``stored_bytes`` (payload), in true numbers, for the :class:`ChunkFormatError`
    that refuses it; None when they agree."""
    if value_bytes < header_bytes:
        return f"{what} is {value_bytes:,} bytes, shorter than its {header_bytes:,}-byte header"
    if value_bytes - header_bytes != stored_bytes:
        return (f"{what} is {value_bytes:,} bytes: its {header_bytes:,}-byte header says {stored_bytes:,} payload "
                f"bytes follow, but {value_bytes - header_bytes:,} do")
    return None


class ServerStartError(KVTierError, RuntimeError):
    """A vLLM server started by kvtier (:mod:`kvtier.launch.serve`) exited or did not
    answer in time; the message names its log file."""
