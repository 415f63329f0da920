"""Crash-safe, resumable hidden-state extraction (import name `extraction`, console script `hsx`)."""

__version__ = "0.3.0"
