"""The ``kvtier`` command line (Typer + rich).  Each command lives in its own module with a
``register(app)`` function; :mod:`kvtier.cli.main` wires them together."""
