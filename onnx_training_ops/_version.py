"""The package version (one place: the package, the CLI and the exports read it)."""

__version__ = "0.1.0"
