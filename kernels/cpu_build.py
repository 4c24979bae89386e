"""What the CPU kernels are built with and where they are kept: the C++ compiler (`$CXX`, else
g++, else c++), and `$XDG_CACHE_HOME/conveyor/`, by default `~/.cache/conveyor/`, so that a
worker's second start loads them instead of compiling again."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base, "conveyor", *parts)


def cxx() -> str | None:
    """The C++ compiler's path, or None when there is none on PATH."""
    return shutil.which(os.environ.get("CXX") or "g++") or shutil.which("c++")
