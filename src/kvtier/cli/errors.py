"""One way to end a command on a user mistake: one sentence on stderr, non-zero exit, no traceback."""

from __future__ import annotations

import sys
from typing import NoReturn

import typer


class UserError(Exception):
    """A mistake in the user's input; the message is one sentence naming what is wrong and the fix."""


def fail(message: str, code: int = 2) -> NoReturn:
    """Print ``error: message`` to stderr and exit with ``code``."""
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(code)
