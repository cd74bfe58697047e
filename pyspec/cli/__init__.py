"""Entry points: the ``pyspec`` command (run, bench, parity, models, demo)."""

from pyspec.cli.commands import main

__all__ = ["main"]
