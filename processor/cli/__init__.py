"""The `ksow` command line."""

from processor.cli.commands import main

__all__ = ["main"]
