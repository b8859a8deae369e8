"""Entry point of the ``kvtier`` console script.

Each command module defines ``register(app: typer.Typer) -> None`` and keeps heavy imports
(matplotlib, torch, vLLM) inside its command functions so ``kvtier --help`` stays fast.
"""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="kvtier",
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
