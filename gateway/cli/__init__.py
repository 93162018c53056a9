"""The `agent-gateway` command line, one module per command group."""

from gateway.cli.command import main

__all__ = ["main"]
