"""Flags ``vllm serve`` does not know, and values its parser refuses: vLLM stops at start-up
(argparse: "unrecognized arguments", "expected one argument", "invalid int value", "invalid
choice"), so such a line never serves.

The reference is vLLM 0.32.0's own parser, bundled as ``kvtier/data/vllm_serve_flags.json``
(written by ``scripts/vllm_serve_flags.py`` from ``vllm/entrypoints/launchers/cli_args.py``
``make_arg_parser``; ``tests/audit/test_serve_flags.py`` checks it against the installed vLLM).
A line audited for another vLLM release may use flags 0.32 lacks: there only a flag that looks
like a misspelling of a known one is reported.
"""

from __future__ import annotations

import difflib
import json
import re
from functools import cache
from importlib import resources
from typing import Any

from kvtier.audit.model import ServeConfig
from kvtier.audit.parse_command import is_number
from kvtier.audit.rules.base import RULES, rule
from kvtier.audit.rules.pitfalls import SGLANG_FLAGS

REFERENCE = "0.32"
"""The vLLM release (major.minor) whose ``vllm serve`` options the bundled table holds."""


@cache
def serve_flags() -> dict[str, dict[str, Any]]:
    """Option → ``{"kind": "switch" | "int" | "float" | "value", "choices": [...] | None}``."""
    text = (resources.files("kvtier") / "data" / "vllm_serve_flags.json").read_text()
    flags: dict[str, dict[str, Any]] = json.loads(text)["flags"]
    return flags


def _base(flag: str) -> str:
    """A dotted flag's option (``--kv-transfer-config.kv_role`` → ``--kv-transfer-config``)."""
    return flag.split(".", 1)[0] if flag.startswith("--") else flag


def _known(flag: str) -> bool:
    return _base(flag) in serve_flags() or flag.startswith("-O")  # -O3, -O.level: vLLM's compilation shorthand


def _close(flag: str) -> str | None:
    close = difflib.get_close_matches(_base(flag), [f for f in serve_flags() if f.startswith("--")], n=1, cutoff=0.8)
    return close[0] if close else None


@rule("serve-flag-unknown", "error", "A flag vllm serve does not know",
      "Fix the flag's spelling (vLLM takes --a-b and --a_b alike) or remove it; `vllm serve --help` lists them.",
      "vLLM vllm/entrypoints/launchers/cli_args.py make_arg_parser (0.32.0): argparse refuses "
      "unrecognized arguments at start-up")
def unknown_flag(c: ServeConfig) -> str | None:
    reference = c.version is None or f"{c.version.major}.{c.version.minor}" == REFERENCE
    said = []
    for flag, _ in c.flags:
        if _known(flag) or flag in SGLANG_FLAGS:  # (SGLang's have a rule of their own, sglang-flag)
            continue
        close = _close(flag)
        if close is not None:
            said.append(f"{flag} (did you mean {close}?)")
        elif reference:
            said.append(flag)
    if not said:
        return None
    return (f"{', '.join(dict.fromkeys(said))} {'is not a flag' if len(said) == 1 else 'are not flags'} of vllm "
            f"serve {REFERENCE}; vLLM refuses to start with an unrecognized argument.")


@rule("serve-flag-value", "error", "A flag's value vLLM's parser refuses",
      "Give the flag the value it takes (a whole number, a number, one of its choices), or remove it.",
      "vLLM vllm/entrypoints/launchers/cli_args.py make_arg_parser and vllm/engine/arg_utils.py (0.32.0): "
      "argparse converts each value at start-up")
def bad_value(c: ServeConfig) -> str | None:
    own = {r.locate for r in RULES if r.id.endswith("-invalid") and r.locate}  # checked by rules of their own
    reference = c.version is None or f"{c.version.major}.{c.version.minor}" == REFERENCE  # choices change
    said = []
    for flag, value in c.flags:
        spec = serve_flags().get(flag)
        if spec is None or flag in own or spec["kind"] == "switch" or (value is not None and "$" in value):
            continue
        if value is None:
            said.append(f"{flag} has no value")
        elif spec["kind"] == "int" and not _whole(value):
            said.append(f"{flag} {value!r} is not a whole number")
        elif spec["kind"] == "float" and not is_number(value):
            said.append(f"{flag} {value!r} is not a number")
        elif spec["kind"].startswith("size") and not _size(value, spec["kind"] == "size_or_auto"):
            said.append(f"{flag} {value!r} is not a whole number (or 32k, 1M: k/m/g = 1,000s, K/M/G = 1,024s"
                        f"{'; auto or -1: the most that fits' if spec['kind'] == 'size_or_auto' else ''})")
        elif spec["choices"] and value not in spec["choices"] and reference:
            said.append(f"{flag} {value!r} is not one of {', '.join(spec['choices'])}")
    if not said:
        return None
    return f"{'; '.join(said)}: vLLM refuses it at start-up."


def _whole(word: str) -> bool:
    try:
        int(word, 10)
    except ValueError:
        return False
    return True


def _size(word: str, auto: bool) -> bool:
    """Whether vLLM's ``human_readable_int`` (``auto``: ``human_readable_int_or_auto``) takes ``word``
    (vllm/utils/argparse_utils.py: a whole number, or digits with a k/m/g/t suffix, decimals only
    with the lower-case, decimal ones)."""
    word = word.strip()
    if auto and (word == "-1" or word.lower() == "auto"):
        return True
    return _whole(word) or re.fullmatch(r"\d+(\.\d+)?[kmgt]|\d+[KMGT]", word) is not None
