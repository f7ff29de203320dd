"""The library version (a module of its own: results record it, and no module imports the package top)."""

__version__ = "0.1.0"
