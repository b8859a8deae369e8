"""Entry point of the ``kvtier`` console script.

Each command module defines ``register(app: typer.Typer) -> None`` and keeps heavy imports
(matplotlib, torch, vLLM) inside its command functions so ``kvtier --help`` stays fast.
"""

from __future__ import annotations

import errno
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any

import typer

try:  # typer 0.29 and later run on their own copy of click, whose exceptions are not click's
    from typer._click.exceptions import ClickException, UsageError
except ImportError:  # older typer runs on the click package
    from click.exceptions import ClickException, UsageError  # type: ignore[assignment]
from typer.core import TyperGroup

from kvtier.cli.termination import exit_on_termination, say_interrupted, say_notes


class _Group(TyperGroup):
    """The ``kvtier`` command group: on/off flags show no ``<bool>`` type in ``--help``.

    Typer's rich help prints a type column for every option, ``<bool>`` included, even for plain
    flags such as ``--json`` and ``--help`` that take no value; an empty metavar hides it.  Applied
    here once, for every command, rather than in each flag's declaration.
    """

    def invoke(self, ctx: Any) -> Any:
        """Run the command; a stop by Ctrl-C or SIGTERM/SIGHUP says so on stderr (with what the command
        left behind, :mod:`kvtier.cli.termination`) before Typer turns Ctrl-C into a silent exit 130."""
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            say_interrupted()
            raise
        except SystemExit:
            say_notes()
            raise

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True, windows_expand_args: bool = True,
             **extra: Any) -> Any:
        """Run the CLI.  Typer/click run in their non-standalone mode (click's documented way to
        handle errors oneself, ``BaseCommand.main(standalone_mode=False)``), so that a usage error
        (unknown option, missing argument, a value of the wrong type) ends as every other kvtier
        error does: one ``error:`` line on stderr and exit 2 (:func:`_usage_error`), not Typer's
        boxed usage panel."""
        _plain_flags(self)
        with exit_on_termination():
            try:
                rv = super().main(args, prog_name, complete_var, standalone_mode=False,
                                  windows_expand_args=windows_expand_args, **extra)
            except ClickException as exc:
                if standalone_mode:
                    _click_error(exc)
                raise
            except typer.Abort:  # Ctrl-D at a prompt (click: "Aborted!", exit 1)
                if standalone_mode:
                    print("error: aborted", file=sys.stderr)
                    raise SystemExit(1) from None
                raise
            except OSError as exc:
                if exc.errno not in _DEVICE_FULL:
                    raise
                _device_full(exc.errno)
        if not standalone_mode:
            return rv
        # non-standalone click returns an Exit's code (typer.Exit, --help, errors.fail) as the value;
        # the commands themselves return None, which is success
        raise SystemExit(rv if isinstance(rv, int) else 0)


def _click_error(exc: ClickException) -> None:
    """Print a click error as one line on stderr, ``error: <what>`` plus the command's ``--help``
    hint for a usage error, and exit with its code (2 for usage errors, as click does)."""
    if type(exc).__name__ == "NoArgsIsHelpError":  # no arguments: the help was printed (Typer does the same)
        raise SystemExit(exc.exit_code)
    message = " ".join(exc.format_message().split()).rstrip(".")
    ctx = getattr(exc, "ctx", None)
    if isinstance(exc, UsageError) and ctx is not None and ctx.command.get_help_option(ctx) is not None:
        # a question ("Did you mean 'node'?") ends its own sentence: the hint is the next one
        hint = f"see '{ctx.command_path} {ctx.help_option_names[0]}'"
        message += f" ({hint[0].upper()}{hint[1:]}.)" if message.endswith("?") else f"; {hint}"
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(exc.exit_code)


_DEVICE_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
"""Write errors no command can do anything about but say so: a full disk (``kvtier size --json >
out.json`` on a full file system), a quota, a file too large."""


def _device_full(code: int) -> None:
    """One sentence on stderr and exit 2 for a write that failed for lack of room (a redirected
    stdout included); stdout is pointed at /dev/null first, so that the interpreter's own flush at
    exit does not print a second error (Python docs, "Note on SIGPIPE", the same dup2)."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    print(f"error: a write failed: {os.strerror(code)}; free space on that device (or send the output "
          "elsewhere) and run it again", file=sys.stderr)
    raise SystemExit(2)


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



def _version(value: bool) -> None:
    """``--version``: the installed distribution's version (``importlib.metadata``), then exit 0."""
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"kvtier {version('kvtier')}")
        except PackageNotFoundError:  # run from a source tree that was never installed
            print("kvtier (not installed: no package metadata)")
        raise typer.Exit(0)


@app.callback()
def _root(show_version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                            help="Print kvtier's version and exit.")) -> None:
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
    "kvtier.cli.stored",
    "kvtier.cli.node",
)

def _import_tier_modules() -> None:
    """Register the tiers of ``KVTIER_TIER_MODULES`` (the environment form of ``tier_modules``)
    before the commands are built, so that a tier from outside kvtier has its flags in ``kvtier
    purge``, ``bench-store`` and ``size`` (read from its settings model, :mod:`kvtier.core.toolflags`).
    A module that cannot be imported is one sentence on stderr and exit 2."""
    from kvtier.core.configload import env_list
    from kvtier.core.errors import ConfigError
    from kvtier.core.tiers.registry import import_tier_modules

    modules = env_list("KVTIER_TIER_MODULES")
    if not modules:
        return
    try:
        import_tier_modules(tuple(str(m) for m in modules))
    except ConfigError as exc:
        print(f"error: KVTIER_TIER_MODULES: {str(exc).rstrip('.')}.", file=sys.stderr)
        raise SystemExit(2) from None


_import_tier_modules()

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
