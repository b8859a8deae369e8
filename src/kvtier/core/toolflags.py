"""A tool's flags for a tier, read from the tier's settings model (issue 33 item 6): a new tier needs
no edit in :mod:`kvtier.cli` for ``kvtier purge`` to reach its storage, ``kvtier bench-store`` to
measure it or ``kvtier size`` to put it in a recipe (tools ``purge``, ``bench-store``, ``size``).

A settings field (the model a tier's plug-in names, :meth:`~kvtier.core.tiers.plugin.TierPlugin.settings`)
becomes ``--<key with dashes>`` of a tool when it carries
``json_schema_extra={"tools": {"<tool>": {...}}}`` with:

- ``help``: the flag's help line;
- ``metavar`` (optional): the value's placeholder (``URL``, ``BUCKET``);
- ``target`` (optional): the field names the tier's storage, which the tool then reaches; the
  phrase names it (``"the bucket the engines use"``), for the sentence refusing the tier's other
  flags without it;
- ``empty`` (optional): what to say when the target is given empty;
- ``example`` (optional): a value of the target an error may show (``redis://127.0.0.1:6379/0``).
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from typing import Any

from kvtier.core.tiers.registry import settings_model, specs


@dataclass(frozen=True)
class ToolFlag:
    """One flag a tool takes for a tier.

    Attributes:
        tier: the tier's registry name.
        key: the configuration key it sets.
        kind: ``bool`` (a switch), ``int``, ``float`` or ``str``.
        help: the help line.
        metavar: the value's placeholder, or ``None``.
        target: the phrase naming the storage when the key is the tier's target, else ``None``.
        empty: what to say when the target is given empty, or ``None``.
        example: a value of the target for an error to show, or ``None``.
        default: the option's value when not given (``None``: not given; a tool's own knobs, not a
            settings field's, may have another, e.g. ``kvtier bench-store --s3-in-flight 1,4,16``).
    """

    tier: str
    key: str
    kind: type
    help: str
    metavar: str | None = None
    target: str | None = None
    empty: str | None = None
    example: str | None = None
    default: Any = None

    @property
    def flag(self) -> str:
        """``--<key with dashes>``."""
        return "--" + self.key.replace("_", "-")


def _kind(annotation: Any) -> type:
    """``bool``, ``int``, ``float`` or ``str`` of a field's annotation (``X | None`` read as ``X``)."""
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) or \
        typing.get_origin(annotation) is typing.Union else (annotation,)
    for kind in (bool, int, float, str):
        if kind in args:
            return kind
    return str


def tool_flags(tool: str) -> list[ToolFlag]:
    """Every registered tier's flags of ``tool`` (``"purge"``), in tier order, each tier's target first.

    Raises:
        ConfigError: a tier's plug-in cannot be imported.
    """
    out: list[ToolFlag] = []
    for record in specs():
        model = settings_model(record.name)
        flags = []
        for key, field in (model.model_fields.items() if model is not None else ()):
            extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
            tools = extra.get("tools")
            spec = tools.get(tool) if isinstance(tools, dict) else None
            if not isinstance(spec, dict):
                continue
            flags.append(ToolFlag(record.name, key, _kind(field.annotation), str(spec.get("help", field.description)),
                                  _text(spec.get("metavar")), _text(spec.get("target")), _text(spec.get("empty")),
                                  _text(spec.get("example"))))
        out += sorted(flags, key=lambda f: f.target is None)
    return out


def _text(value: object) -> str | None:
    return None if value is None else str(value)
