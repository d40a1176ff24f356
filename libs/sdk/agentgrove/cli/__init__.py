"""The `grove` command line: `grove --help` lists the commands."""

from agentgrove.cli.main import main

__all__ = ["main"]
