"""Where compiled kernels are kept across restarts: `$XDG_CACHE_HOME/conveyor/`, by default
`~/.cache/conveyor/` (a worker's second start loads them instead of compiling again)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base, "conveyor", *parts)
