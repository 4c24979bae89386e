"""Service settings, read from the environment (every name is documented in README.md).

With no `DATABASE_URL` the ledger is a SQLite file and with no `REDIS_URL` the broker is a
SQLite file too (kombu's SQLAlchemy transport), both under `CONVEYOR_DATA_DIR`: the embedded
default that needs no servers.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {raw!r}") from None


def window_seconds(window: str) -> int:
    """A completion window in seconds: `24h` (OpenAI's only window); we also take other
    `<n>h`, `<n>m` and `<n>s` windows."""
    match = re.fullmatch(r"([1-9][0-9]*)([hms])", window)
    if not match:
        raise ValueError(
            f"completion_window must look like '24h' (hours), '30m' or '90s', got {window!r}"
        )
    return int(match.group(1)) * {"h": 3600, "m": 60, "s": 1}[match.group(2)]


AUTH_MODES = ("off", "required")


@dataclass
class Settings:
    data_dir: Path = field(default_factory=lambda: Path("conveyor-data"))
    database_url: str | None = None
    redis_url: str | None = None
    shard_size: int = 32  # requests per shard task
    # Redis redelivers a task not acknowledged within this many seconds; shards finish far sooner
    visibility_timeout: int = 3600
    heartbeat_interval: float = 2.0  # a running shard touches its row this often
    heartbeat_timeout: float = 30.0  # a running shard whose row is older than this is dead
    reconcile_interval: float = 10.0
    affinity_backlog: int = 16  # shards queued for one worker before the overflow queue is used
    max_upload_bytes: int = 200 * 1024 * 1024
    max_line_bytes: int = 8 * 1024 * 1024
    max_batch_lines: int = 50_000
    # workers that share a machine's GPUs each claim one through lock files here
    gpu_lock_dir: Path | None = None
    auth: str = "off"  # "required": every /v1 route wants a project's API key
    max_tokens_cap: int = 0  # most tokens a request may generate; 0: the model's context
    max_batches_in_flight: int = 0  # unfinished batches per project; 0: no limit
    max_json_body_bytes: int = 1024 * 1024  # largest JSON request body (a batch create)
    max_completion_window: str = "168h"  # longest completion_window a batch may ask for
    online_timeout: float = 600.0  # seconds an online request may take before its 504
    # on SIGTERM a worker's running shards get this long before they are handed back
    shutdown_timeout: float = 60.0
    log_format: str = "text"  # or "json": one object per line, with batch/shard/request ids
    # a shard whose worker died without a word (killed) this many times while running it is
    # not run again
    max_shard_attempts: int = 3
    # a request in the step of this many engine failures (the last one run alone) is not run
    # again: it gets a request_quarantined error line
    max_request_failures: int = 2
    # one online request: prompts in a completion's list (OpenAI's limit), and prompts × n;
    # one project: online sequences (prompts × n) in flight at once. 0: no limit
    max_online_prompts: int = 2048
    max_online_request_sequences: int = 4096
    max_online_sequences: int = 8192
    # online requests a project may start per second, and at once over that (nginx's
    # limit_req rate and burst; a burst of 0 is the rate rounded up). 0: no limit
    online_rate_limit: float = 0.0
    online_burst: int = 0

    def __post_init__(self) -> None:
        if self.auth not in AUTH_MODES:
            raise ValueError(f"CONVEYOR_AUTH must be 'required' or 'off', got {self.auth!r}")
        if self.log_format not in ("text", "json"):
            raise ValueError(
                f"CONVEYOR_LOG_FORMAT must be 'text' or 'json', got {self.log_format!r}"
            )
        if self.max_request_failures < 1:
            raise ValueError(
                f"CONVEYOR_MAX_REQUEST_FAILURES must be at least 1, got {self.max_request_failures}"
            )
        if self.max_shard_attempts < 1:
            raise ValueError(
                f"CONVEYOR_MAX_SHARD_ATTEMPTS must be at least 1, got {self.max_shard_attempts}"
            )
        try:
            window_seconds(self.max_completion_window)
        except ValueError:
            raise ValueError(
                "CONVEYOR_MAX_COMPLETION_WINDOW must look like '168h', '30m' or '90s', got "
                f"{self.max_completion_window!r}"
            ) from None
        if self.max_json_body_bytes < 1:
            raise ValueError("CONVEYOR_MAX_JSON_BODY_BYTES must be at least 1")
        for name in ("max_online_prompts", "max_online_request_sequences", "max_online_sequences"):
            if getattr(self, name) < 0:
                raise ValueError(f"CONVEYOR_{name.upper()} must be 0 (no limit) or more")
        if not self.online_rate_limit >= 0 or self.online_rate_limit == float("inf"):
            raise ValueError("CONVEYOR_ONLINE_RATE_LIMIT must be 0 (no limit) or a rate per second")
        if self.online_burst < 0:
            raise ValueError("CONVEYOR_ONLINE_BURST must be 0 (the rate, rounded up) or more")

    @classmethod
    def from_env(cls) -> Settings:
        return cls(
            data_dir=Path(os.environ.get("CONVEYOR_DATA_DIR") or "conveyor-data"),
            database_url=os.environ.get("DATABASE_URL") or None,
            redis_url=os.environ.get("REDIS_URL") or None,
            shard_size=_env_int("CONVEYOR_SHARD_SIZE", 32),
            visibility_timeout=_env_int("CONVEYOR_VISIBILITY_TIMEOUT", 3600),
            heartbeat_interval=_env_float("CONVEYOR_HEARTBEAT_INTERVAL", 2.0),
            heartbeat_timeout=_env_float("CONVEYOR_HEARTBEAT_TIMEOUT", 30.0),
            reconcile_interval=_env_float("CONVEYOR_RECONCILE_INTERVAL", 10.0),
            affinity_backlog=_env_int("CONVEYOR_AFFINITY_BACKLOG", 16),
            max_upload_bytes=_env_int("CONVEYOR_MAX_UPLOAD_BYTES", 200 * 1024 * 1024),
            max_line_bytes=_env_int("CONVEYOR_MAX_LINE_BYTES", 8 * 1024 * 1024),
            max_batch_lines=_env_int("CONVEYOR_MAX_BATCH_LINES", 50_000),
            gpu_lock_dir=Path(lock) if (lock := os.environ.get("CONVEYOR_GPU_LOCK_DIR")) else None,
            auth=(os.environ.get("CONVEYOR_AUTH") or "off").strip().lower(),
            max_tokens_cap=_env_int("CONVEYOR_MAX_TOKENS", 0),
            max_batches_in_flight=_env_int("CONVEYOR_MAX_BATCHES_IN_FLIGHT", 0),
            max_json_body_bytes=_env_int("CONVEYOR_MAX_JSON_BODY_BYTES", 1024 * 1024),
            max_completion_window=(
                os.environ.get("CONVEYOR_MAX_COMPLETION_WINDOW") or "168h"
            ).strip(),
            shutdown_timeout=_env_float("CONVEYOR_SHUTDOWN_TIMEOUT", 60.0),
            log_format=(os.environ.get("CONVEYOR_LOG_FORMAT") or "text").strip().lower(),
            max_shard_attempts=_env_int("CONVEYOR_MAX_SHARD_ATTEMPTS", 3),
            max_request_failures=_env_int("CONVEYOR_MAX_REQUEST_FAILURES", 2),
            online_timeout=_env_float("CONVEYOR_ONLINE_TIMEOUT", 600.0),
            max_online_prompts=_env_int("CONVEYOR_MAX_ONLINE_PROMPTS", 2048),
            max_online_request_sequences=_env_int("CONVEYOR_MAX_ONLINE_REQUEST_SEQUENCES", 4096),
            max_online_sequences=_env_int("CONVEYOR_MAX_ONLINE_SEQUENCES", 8192),
            online_rate_limit=_env_float("CONVEYOR_ONLINE_RATE_LIMIT", 0.0),
            online_burst=_env_int("CONVEYOR_ONLINE_BURST", 0),
        )

    @property
    def online_rate_burst(self) -> int:
        return self.online_burst or max(1, math.ceil(self.online_rate_limit))

    @property
    def embedded(self) -> bool:
        return self.database_url is None and self.redis_url is None

    @property
    def db_url(self) -> str:
        if self.database_url:
            return normalize_database_url(self.database_url)
        return f"sqlite:///{(self.data_dir / 'conveyor.db').resolve()}"

    @property
    def broker_url(self) -> str:
        if self.redis_url:
            return self.redis_url
        return f"sqla+sqlite:///{(self.data_dir / 'broker.db').resolve()}"

    @property
    def files_dir(self) -> Path:
        return self.data_dir / "files"


def normalize_database_url(url: str) -> str:
    """`postgresql://` means psycopg 3 here (SQLAlchemy would pick psycopg2, not installed)."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url
