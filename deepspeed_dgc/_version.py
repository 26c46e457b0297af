"""The package version (compared between ranks at initialize)."""

__version__ = "0.1.0"
