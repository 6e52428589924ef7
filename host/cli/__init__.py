"""The ephost command line (`ephost`, `python -m host`), its benchmarks and model builders."""

from host.cli.app import main

__all__ = ["main"]
