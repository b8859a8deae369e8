"""How a command ends on a user mistake: one sentence on stderr, exit code 2, no traceback.

The exception classes themselves live in :mod:`kvtier.core.errors` (the bottom of the package
graph), so library packages never import the CLI.
"""

from __future__ import annotations

import sys
from typing import NoReturn

import typer


def fail(message: str, code: int = 2) -> NoReturn:
    """Print ``error: message`` to stderr and exit with ``code``."""
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(code)
