"""The ``latim-jax`` command line: one module per subcommand family over the public API (main: the parser
and convert / check / info / attribute / generate; dataset; evaluate)."""

from latim_jax.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
