"""The version of Conveyor, in one place: the package, the wheel and the API report it."""

__version__ = "0.1.0"
