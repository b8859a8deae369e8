"""vLLM's dotted config flags: ``--kv-transfer-config.KEY=VALUE`` (and ``.A.B=VALUE`` nested).

vLLM 0.32's ``FlexibleArgumentParser.parse_args`` (vllm/utils/argparse_utils.py) turns every
``--NAME.KEY[.KEY...]=VALUE`` (or ``--NAME.KEY VALUE``) word into a nested dict, merges the dicts
of one ``NAME`` in order (dicts merged key by key, lists extended, anything else replaced),
and appends ``--NAME <that dict as JSON>`` *after* all other arguments.  argparse keeps the last
value, so the dotted keys **replace** a ``--NAME '{...}'`` JSON given anywhere on the line: with
``--kv-transfer-config '{"kv_connector":"KVTierConnector",...}'
--kv-transfer-config.kv_connector_extra_config.chunk_tokens=0`` the server runs with
``kv_connector`` unset, i.e. without any KV connector.  Values are read as JSON, else as vLLM's
human-readable integers (``1k`` = 1000, ``1K`` = 1024), else kept as strings; ``NAME.KEY+=a,b``
gives the list ``["a", "b"]``.  Only the part before the first dot has its ``_`` read as ``-``.
"""

from __future__ import annotations

import json
import re
from typing import Any

_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def dotted_value(raw: str) -> Any:
    """A dotted flag's value as vLLM reads it: JSON, else a human-readable integer, else the string.

    Raises:
        RecursionError: the JSON is nested too deeply for Python's parser.
    """
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        pass
    text = raw.strip()
    match = _HUMAN_INT.fullmatch(text)
    if match:
        number, suffix = match.groups()
        if suffix in _DECIMAL:
            return int(float(number) * _DECIMAL[suffix])
        if number.isdigit():
            return int(number) * _BINARY[suffix]
        return raw  # vLLM refuses decimals with a binary suffix; the string is what the audit can show
    try:
        return int(text)
    except ValueError:
        return raw


def _merge(original: dict[str, Any], update: dict[str, Any]) -> None:
    """vLLM's ``recursive_dict_update``, without recursion (a word may hold thousands of dots)."""
    stack = [(original, update)]
    while stack:
        into, new = stack.pop()
        for key, value in new.items():
            if isinstance(value, dict) and isinstance(into.get(key), dict):
                stack.append((into[key], value))
            elif isinstance(value, list) and isinstance(into.get(key), list):
                into[key] = into[key] + value
            else:
                into[key] = value


def merge_dotted(flag: str, flags: list[tuple[str, str | None]]) -> dict[str, Any] | None:
    """The dict vLLM builds for ``flag`` (e.g. ``--kv-transfer-config``) from its dotted forms in
    ``flags`` (``(name, value)`` pairs in order, names as :func:`normalise_flag` leaves them);
    None when ``flags`` holds none.

    Raises:
        RecursionError: a value's JSON is nested too deeply for Python's parser.
    """
    merged: dict[str, Any] | None = None
    for name, raw in flags:
        if not name.startswith(flag + "."):
            continue
        path = name[len(flag) + 1:]
        value: Any = dotted_value(raw if raw is not None else "")
        if path.endswith("+"):
            path = path[:-1]
            value = (raw or "").split(",")
        for key in reversed(path.split(".")):
            value = {key: value}
        merged = {} if merged is None else merged
        _merge(merged, value)
    return merged
