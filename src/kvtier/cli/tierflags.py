"""A command's options for the registered tiers, built from their settings models
(:func:`kvtier.core.toolflags.tool_flags`): ``kvtier bench-store`` and ``kvtier size`` take them so
that a new tier needs no edit in :mod:`kvtier.cli` (issue 33 item 6; ``kvtier purge`` builds its own
the same way, :mod:`kvtier.cli.stored`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import typer

from kvtier.cli.errors import fail
from kvtier.core.toolflags import ToolFlag


def option(f: ToolFlag, negatable: bool = False) -> tuple[Any, Any]:
    """``(annotation, typer.Option)`` of one tier flag; a switch gets ``--no-<flag>`` too when ``negatable``."""
    if f.kind is bool:
        decl = f"{f.flag}/--no-{f.flag[2:]}" if negatable else f.flag
        return bool, typer.Option(bool(f.default), decl, help=f.help)
    if f.default is not None:
        return f.kind, typer.Option(f.default, f.flag, metavar=f.metavar, help=f.help)
    return f.kind | None, typer.Option(None, f.flag, metavar=f.metavar, help=f.help)


def given(f: ToolFlag, value: Any) -> bool:
    """Whether ``value`` of flag ``f`` was given (differs from its default)."""
    return value is not None and value != f.default and not (f.kind is bool and not value)


def build(body: Callable[..., None], options: dict[str, tuple[Any, Any]]) -> Callable[..., None]:
    """A Typer command calling ``body(**values)``, its signature the ``options`` (name -> annotation,
    typer.Option) in order."""

    def command(**values: Any) -> None:
        body(**values)

    params = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
              for name, (annotation, default) in options.items()]
    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    command.__doc__ = body.__doc__
    return command


def targets(flags: list[ToolFlag]) -> dict[str, ToolFlag]:
    """Tier name -> its target flag, in tier order (tiers without one are left out)."""
    return {f.tier: f for f in flags if f.target}


def refuse_stray(flags: list[ToolFlag], values: dict[str, Any], purpose: str, otherwise: str) -> None:
    """Refuse (one sentence, exit 2) a tier's flags given without its target: they would be ignored,
    the command answering for the other tiers as if they had been used.  ``purpose`` and
    ``otherwise`` finish the sentence (``{tier}`` and ``{target}``, the target's phrase, filled in):
    ``--s3-region needs --s3-bucket BUCKET <purpose>; add it, or drop it <otherwise>``."""
    for tier, target in targets(flags).items():
        if given(target, values.get(target.key)):
            continue
        stray = [f.flag for f in flags if f.tier == tier and f is not target and given(f, values.get(f.key))]
        if stray:
            one = len(stray) == 1
            words = {"tier": tier, "target": target.target}
            fail(f"{', '.join(stray)} {'needs' if one else 'need'} {target.flag} {target.metavar or 'VALUE'} "
                 f"{purpose.format(**words)}; add it, or drop {'it' if one else 'them'} {otherwise.format(**words)}")
