"""Service settings, read from the environment; each is declared once, with its documentation
(`setting`), from which the documentation site's tables are made.

With no `DATABASE_URL` the ledger is a SQLite file and with no `REDIS_URL` the broker is a
SQLite file too (kombu's SQLAlchemy transport), both under `CONVEYOR_DATA_DIR`: the embedded
default that needs no servers.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any


def _parsed(f: Field, raw: str) -> Any:
    """A setting's value from the text of its variable, by the field's type."""
    name, kind = f.metadata["env"], str(f.type)
    if kind == "int":
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{name} must be an integer, got {raw!r}") from None
    if kind == "float":
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{name} must be a number, got {raw!r}") from None
    if kind.startswith("Path"):
        return Path(raw)
    return raw.lower() if f.metadata["lower"] else raw


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


def setting(
    default: Any,
    env: str,
    doc: str,
    *,
    shown: str | None = None,
    group: str = "service",
    lower: bool = False,
) -> Any:
    """A field of `Settings`, read from `env`: its documentation (`doc`, and `shown` for the
    default where its value alone does not say it) lives here, and the documentation site's
    tables are made from it (`{{ settings GROUP }}`)."""
    meta = {"env": env, "doc": doc, "shown": shown, "group": group, "lower": lower}
    if isinstance(default, Path):
        return field(default_factory=lambda: default, metadata=meta)
    return field(default=default, metadata=meta)


MiB = 1024 * 1024
ONLINE = "online"  # the group of the limits on online work (docs/service.md)


@dataclass
class Settings:
    database_url: str | None = setting(
        None,
        "DATABASE_URL",
        "the ledger (`postgresql://...` in production)",
        shown="SQLite file under `CONVEYOR_DATA_DIR`",
    )
    redis_url: str | None = setting(
        None, "REDIS_URL", "the Celery broker", shown="SQLite file under `CONVEYOR_DATA_DIR`"
    )
    data_dir: Path = setting(
        Path("conveyor-data"),
        "CONVEYOR_DATA_DIR",
        "uploaded files, embedded ledger and broker, demo model",
        shown="`./conveyor-data`",
    )
    shard_size: int = setting(32, "CONVEYOR_SHARD_SIZE", "requests per shard task")
    # Redis redelivers a task not acknowledged within this many seconds; shards finish far sooner
    visibility_timeout: int = setting(
        3600,
        "CONVEYOR_VISIBILITY_TIMEOUT",
        "seconds before Redis redelivers an unacknowledged shard (set alike in every place "
        "Celery reads it)",
    )
    heartbeat_interval: float = setting(
        2.0, "CONVEYOR_HEARTBEAT_INTERVAL", "seconds between a running shard's heartbeats"
    )
    heartbeat_timeout: float = setting(
        30.0,
        "CONVEYOR_HEARTBEAT_TIMEOUT",
        "a running shard silent this long is taken as dead and re-sent",
    )
    reconcile_interval: float = setting(
        10.0, "CONVEYOR_RECONCILE_INTERVAL", "seconds between reconciler rounds"
    )
    unserved_timeout: float = setting(
        1800.0,
        "CONVEYOR_UNSERVED_TIMEOUT",
        "seconds a batch in progress waits for a live worker that serves its model (a name no "
        "worker serves, or workers that never come back) before it fails with "
        "`model_not_found`; the lines that ran keep their results. 0 waits until the batch's "
        "completion window ends",
    )
    affinity_backlog: int = setting(
        16,
        "CONVEYOR_AFFINITY_BACKLOG",
        "shards queued for one worker before its prefixes overflow to the shared queue",
    )
    max_upload_bytes: int = setting(
        200 * MiB,
        "CONVEYOR_MAX_UPLOAD_BYTES",
        "largest upload (413 `file_too_large`)",
        shown="200 MiB",
    )
    max_line_bytes: int = setting(
        8 * MiB,
        "CONVEYOR_MAX_LINE_BYTES",
        "longest input line (413 `line_too_large` at upload)",
        shown="8 MiB",
    )
    max_batch_lines: int = setting(
        50_000,
        "CONVEYOR_MAX_BATCH_LINES",
        "most requests per batch (413 `too_many_lines` at upload)",
        shown="50,000",
    )
    auth: str = setting(
        "off",
        "CONVEYOR_AUTH",
        "`required`: every `/v1` route wants `Authorization: Bearer <key>` and a key sees "
        "only its project's files and batches",
        shown="`off` (compose: `required`)",
        lower=True,
    )
    max_tokens_cap: int = setting(
        0,
        "CONVEYOR_MAX_TOKENS",
        "most tokens a request may generate: a line asking for more fails alone (422 "
        "`max_tokens_too_large` in the error file), a line not saying gets this",
        shown="0 (no cap)",
    )
    max_batches_in_flight: int = setting(
        0,
        "CONVEYOR_MAX_BATCHES_IN_FLIGHT",
        "unfinished batches per project; creating one more is a 429 `too_many_batches` "
        "(concurrent creates included)",
        shown="0 (no limit)",
    )
    max_json_body_bytes: int = setting(
        MiB,
        "CONVEYOR_MAX_JSON_BODY_BYTES",
        "largest JSON request body, e.g. a batch create (413 `request_too_large`)",
        shown="1 MiB",
    )
    max_completion_window: str = setting(
        "168h",
        "CONVEYOR_MAX_COMPLETION_WINDOW",
        "longest `completion_window` a batch may ask for, as `<n>h`, `<n>m` or `<n>s` (400 "
        "above it)",
        shown="`168h`",
    )
    online_timeout: float = setting(
        600.0,
        "CONVEYOR_ONLINE_TIMEOUT",
        "seconds an online request may wait for its answer before a 504",
    )
    max_request_failures: int = setting(
        2,
        "CONVEYOR_MAX_REQUEST_FAILURES",
        "a batch request in the step of this many engine failures (after the first it runs "
        "alone) is quarantined: it gets a `request_quarantined` error line",
    )
    max_shard_attempts: int = setting(
        3,
        "CONVEYOR_MAX_SHARD_ATTEMPTS",
        "a shard whose worker died without a word (killed, where no request could be named) "
        "this many times while running it is quarantined: its unfinished requests get "
        "`request_quarantined` error lines",
    )
    shutdown_timeout: float = setting(
        60.0,
        "CONVEYOR_SHUTDOWN_TIMEOUT",
        "on SIGTERM a worker takes no new shards and gives running ones this many seconds; "
        "then it aborts what is left, commits what finished and hands the rest back to the "
        "queue. Ctrl-C (SIGINT) hands them back at once: `conveyor worker` and `conveyor "
        "serve` exit 130 within about a second, and running them again goes on with the batch",
    )
    log_format: str = setting(
        "text",
        "CONVEYOR_LOG_FORMAT",
        "`json`: one JSON object per log line, with `batch_id`, `shard_id`, `file_id` on the "
        "lines about them",
        shown="`text` (compose: `json`)",
        lower=True,
    )
    gpu_lock_dir: Path | None = setting(
        None,
        "CONVEYOR_GPU_LOCK_DIR",
        "workers sharing a machine's GPUs each claim one through lock files in this directory",
        shown="unset (compose: `/locks`)",
    )
    max_online_prompts: int = setting(
        2048,
        "CONVEYOR_MAX_ONLINE_PROMPTS",
        'prompts in one completion\'s `prompt` list; more is a 400 with `param: "prompt"`, '
        "refused before the prompts are checked",
        shown="2048 (OpenAI's limit)",
        group=ONLINE,
    )
    max_online_request_sequences: int = setting(
        4096,
        "CONVEYOR_MAX_ONLINE_REQUEST_SEQUENCES",
        'sequences one request asks for, prompts × `n`; more is a 400 with `param: "n"`',
        group=ONLINE,
    )
    max_online_sequences: int = setting(
        8192,
        "CONVEYOR_MAX_ONLINE_SEQUENCES",
        "one project's online sequences (prompts × `n`) in flight at once; past it a 429 "
        "`rate_limit_exceeded` with `Retry-After`. Counted in Redis when there is one (shared "
        "by every API process; a count an API process could not give back expires "
        "`CONVEYOR_ONLINE_TIMEOUT` + 60 s after the project's last request), else in the "
        "API's process",
        group=ONLINE,
    )
    online_rate_limit: float = setting(
        0.0,
        "CONVEYOR_ONLINE_RATE_LIMIT",
        "completions (plain, chat, streamed) one project may start per second, nginx's "
        "`limit_req`: past its burst a 429 `rate_limit_exceeded` with `Retry-After` (the "
        "seconds until the next one may start). Set it where online clients are not trusted: "
        "a client that opens requests in a loop otherwise takes the engine from the batches "
        "as fast as it is answered. Counted in Redis when there is one (shared by every API "
        "process, in Redis's clock), else in the API's process",
        shown="0 (none)",
        group=ONLINE,
    )
    online_burst: int = setting(
        0, "CONVEYOR_ONLINE_BURST", "requests a project may start at once over the rate",
        shown="the rate, rounded up", group=ONLINE,
    )  # fmt: skip

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
        if not 0 <= self.unserved_timeout < float("inf"):
            raise ValueError(
                f"CONVEYOR_UNSERVED_TIMEOUT must be a number of seconds >= 0, got "
                f"{self.unserved_timeout}"
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
        """The settings of the environment: each field from its variable, where set."""
        values = {}
        for f in fields(cls):
            raw = (os.environ.get(f.metadata["env"]) or "").strip()
            if raw:
                values[f.name] = _parsed(f, raw)
        return cls(**values)

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
