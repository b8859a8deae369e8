"""Write ``src/kvtier/data/vllm_serve_flags.json``: every option of ``vllm serve`` in the installed
vLLM, read from its own parser (``vllm/entrypoints/launchers/cli_args.py`` ``make_arg_parser``), for
``kvtier audit``'s flag rules (:mod:`kvtier.audit.rules.flags`): kind (``switch``: no value; ``int``,
``float``: argparse converts and refuses other words; ``size``, ``size_or_auto``: vLLM's
``human_readable_int`` (``"32k"``, ``"1M"``) and ``human_readable_int_or_auto`` (also ``auto``,
``-1``); ``value``: anything) and choices.
``tests/audit/test_serve_flags.py`` checks the file against the installed vLLM.

Usage::

    python scripts/vllm_serve_flags.py [--out src/kvtier/data/vllm_serve_flags.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[1] / "src" / "kvtier" / "data" / "vllm_serve_flags.json"


def serve_flags() -> dict[str, Any]:
    """``{"vllm": version, "flags": {option: {"kind": ..., "choices": [...] | None}}}`` of the installed vLLM."""
    import vllm
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    flags: dict[str, dict[str, Any]] = {}
    for action in make_arg_parser(FlexibleArgumentParser())._actions:
        named = getattr(action.type, "__name__", "")  # vllm/utils/argparse_utils.py's "1k", "2M" (, "auto") parsers
        kind = ("switch" if action.nargs == 0 else "int" if action.type is int
                else "float" if action.type is float else "size_or_auto" if named == "human_readable_int_or_auto"
                else "size" if named == "human_readable_int" else "value")
        choices = sorted(map(str, action.choices)) if action.choices and kind != "switch" else None
        for option in action.option_strings:
            flags[option] = {"kind": kind, "choices": choices}
    return {"vllm": vllm.__version__, "flags": dict(sorted(flags.items()))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    args.out.write_text(json.dumps(serve_flags(), indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
