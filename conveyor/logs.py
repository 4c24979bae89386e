"""Logging for the service processes: plain text, or one JSON object per line
(CONVEYOR_LOG_FORMAT=json) that carries the batch, shard and request a line concerns.

Ids come from the context the code sets around its work (`log_context`) and, for lines of
libraries that only name them in their text (Celery's task lines, access logs), from the text.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import re
import time
from collections.abc import Iterator

LOG_FORMATS = ("text", "json")
IDS = ("batch_id", "shard_id", "request_id", "file_id")
_context: contextvars.ContextVar[dict[str, object] | None] = contextvars.ContextVar(
    "conveyor_log_context", default=None
)
_PATTERNS = {
    "batch_id": re.compile(r"\b(batch_[0-9a-f]{24})\b"),
    "file_id": re.compile(r"\b(file-[0-9a-f]{24})\b"),
    "shard_id": re.compile(r"\bshard-(\d+)-\d+\b"),
}


@contextlib.contextmanager
def log_context(**ids: object) -> Iterator[None]:
    """Every line logged in this block (in this thread or task) carries `ids`."""
    outer = _context.get() or {}
    token = _context.set({**outer, **{k: v for k, v in ids.items() if v is not None}})
    try:
        yield
    finally:
        _context.reset(token)


def bind(**ids: object) -> None:
    """Add ids to the current `log_context` block (outside one, this does nothing)."""
    current = _context.get()
    if current is not None:
        current.update({k: v for k, v in ids.items() if v is not None})


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        line: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": message,
        }
        line.update(_context.get() or {})
        for key in IDS:
            if (value := getattr(record, key, None)) is not None:
                line[key] = value
        for key, pattern in _PATTERNS.items():
            if key not in line and (match := pattern.search(message)):
                line[key] = int(match.group(1)) if key == "shard_id" else match.group(1)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    if fmt not in LOG_FORMATS:
        raise ValueError(f"CONVEYOR_LOG_FORMAT must be 'text' or 'json', got {fmt!r}")
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Alembic logs each of its plugins' set-up at INFO: seven lines at every start of the service
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)
