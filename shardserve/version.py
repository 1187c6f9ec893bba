"""The package's version (pyproject.toml's), in a module that imports nothing, so any layer may read it."""

__version__ = "0.1.0"
