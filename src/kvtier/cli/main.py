"""Entry point of the ``kvtier`` console script.

Each command module defines ``register(app: typer.Typer) -> None`` and keeps heavy imports
(matplotlib, torch, vLLM) inside its command functions so ``kvtier --help`` stays fast.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import threading
from typing import Any

import typer
from typer.core import TyperGroup


class _Group(TyperGroup):
    """The ``kvtier`` command group: on/off flags show no ``<bool>`` type in ``--help``.

    Typer's rich help prints a type column for every option, ``<bool>`` included, even for plain
    flags such as ``--json`` and ``--help`` that take no value; an empty metavar hides it.  Applied
    here once, for every command, rather than in each flag's declaration.
    """

    def main(self, *args: Any, **kwargs: Any) -> Any:
        _plain_flags(self)
        previous = _exit_on_termination()
        try:
            return super().main(*args, **kwargs)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


def _signal_child_sessions(signum: int) -> None:
    """Send ``signum`` to the process group of each child of this process that leads a session of its
    own (the servers kvtier starts with ``start_new_session``); other children are left alone."""
    me = os.getpid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            if ppid == me and os.getsid(pid) == pid:
                os.killpg(pid, signum)
        except (OSError, ValueError, IndexError):
            continue


def _exit_on_termination() -> dict[int, Any]:
    """Make SIGTERM and SIGHUP raise ``SystemExit(128 + signal)`` in the main thread, as Ctrl-C raises
    KeyboardInterrupt, so the ``finally`` blocks and context managers of a command run: ``bench
    compare`` and ``demo`` start vLLM servers and a redis-server in sessions of their own, which
    Python's default action (exit at once) left running when a CI timeout or ``kill`` stopped kvtier.
    Says so in one line on stderr; a second SIGTERM/SIGHUP while the servers stop is ignored, so it
    cannot cut their clean-up short (SIGKILL still ends kvtier at once).  Returns the handlers it
    replaced (none outside the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def stop(signum: int, frame: Any) -> None:
        if _inside_popen(frame):  # raising now would lose the handle of a child being started
            retry = threading.Timer(0.05, os.kill, (os.getpid(), signum))
            retry.daemon = True
            retry.start()
            return
        for other in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(other, signal.SIG_IGN)
        sys.stderr.write(f"kvtier: stopped by {signal.Signals(signum).name}; stopping what it started, then exiting "
                         f"with {128 + signum}\n")
        sys.stderr.flush()
        _signal_child_sessions(signal.SIGTERM)  # belt and braces: a child whose handle was lost all the same
        raise SystemExit(128 + signum)

    return {signum: signal.signal(signum, stop) for signum in (signal.SIGTERM, signal.SIGHUP)}


def _inside_popen(frame: Any) -> bool:
    """Whether ``frame`` runs inside ``subprocess.Popen()``: an exception raised there after the fork
    leaves the new child (a vLLM server or redis-server in a session of its own) running, its
    ``Popen`` object never returned to the code that would stop it."""
    while frame is not None:
        if frame.f_code is subprocess.Popen.__init__.__code__:
            return True
        frame = frame.f_back
    return False


def _plain_flags(command: Any) -> None:
    """Give every flag of ``command`` (and its subcommands), ``--help`` included, an empty metavar.

    ``command`` is a Typer click command (Typer ships its own copy of click, so this reads
    attributes rather than checking click classes)."""
    help_option = command.get_help_option(command.context_class(command))
    for param in [*command.params, *([help_option] if help_option is not None else [])]:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    for sub in getattr(command, "commands", {}).values():
        _plain_flags(sub)


app = typer.Typer(
    name="kvtier",
    cls=_Group,
    help="Tiered KV cache for vLLM: size, audit, simulate, benchmark and run KV offload.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)



@app.callback()
def _root() -> None:
    """Tiered KV cache for vLLM: size, audit, simulate, benchmark and run KV offload."""


COMMAND_MODULES = (
    "kvtier.cli.demo",
    "kvtier.cli.bench_store",
    "kvtier.cli.bench",
    "kvtier.cli.simulate",
    "kvtier.cli.trace",
    "kvtier.cli.size",
    "kvtier.cli.audit",
    "kvtier.cli.check",
    "kvtier.cli.doctor",
)

for _name in COMMAND_MODULES:
    try:
        _module = importlib.import_module(_name)
    except ModuleNotFoundError as exc:  # a command not written yet must not break the others
        if exc.name != _name:
            raise
        continue
    _module.register(app)


if __name__ == "__main__":  # pragma: no cover
    app()
