"""Conveyor: batch LLM inference. This package holds the CLI and torch-free helpers."""

__version__ = "0.1.0"
