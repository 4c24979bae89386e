"""Service settings, read from the environment (pydantic-settings); each is declared once, with
its documentation (`setting`), from which the documentation site's tables are made.

With no `DATABASE_URL` the ledger is a SQLite file and with no `REDIS_URL` the broker is a
SQLite file too (kombu's SQLAlchemy transport), both under `CONVEYOR_DATA_DIR`: the embedded
default that needs no servers.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def window_seconds(window: str) -> int:
    """A completion window in seconds: `24h` (OpenAI's only window); we also take other
    `<n>h`, `<n>m` and `<n>s` windows."""
    match = re.fullmatch(r"([1-9][0-9]*)([hms])", window)
    if not match:
        raise ValueError(
            f"completion_window must look like '24h' (hours), '30m' or '90s', got {window!r}"
        )
    return int(match.group(1)) * {"h": 3600, "m": 60, "s": 1}[match.group(2)]


def setting(
    default: Any,
    doc: str,
    *,
    env: str | None = None,
    shown: str | None = None,
    group: str = "service",
    **limits: Any,
) -> Any:
    """A field of `Settings`, read from `CONVEYOR_<NAME>` (or from `env` where the variable has
    another name), within pydantic's `limits` (`ge`, `gt`, `allow_inf_nan`). Its documentation
    (`doc`, and `shown` for the default where its value alone does not say it) lives here, and
    the documentation site's tables are made from it (`{{ settings GROUP }}`)."""
    extra = {"shown": shown, "group": group}
    return Field(default, description=doc, validation_alias=env, json_schema_extra=extra, **limits)


# `auth` and `log_format` take their words in any case
Lowercase = BeforeValidator(lambda value: value.lower() if isinstance(value, str) else value)
MiB = 1024 * 1024
ONLINE = "online"  # the group of the limits on online work (docs/service.md)


class Settings(BaseSettings):
    """The service's settings: `Settings()` reads each from its variable where set (a blank one
    counts as unset), and a value its variable cannot hold stops the start, naming the
    variable. Keywords set a setting by its name, as in `Settings(shard_size=8)`."""

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_", validate_by_name=True)

    database_url: str | None = setting(
        None,
        "the ledger (`postgresql://...` in production)",
        env="DATABASE_URL",
        shown="SQLite file under `CONVEYOR_DATA_DIR`",
    )
    redis_url: str | None = setting(
        None,
        "the Celery broker",
        env="REDIS_URL",
        shown="SQLite file under `CONVEYOR_DATA_DIR`",
    )
    data_dir: Path = setting(
        Path("conveyor-data"),
        "uploaded files, embedded ledger and broker, demo model",
        shown="`./conveyor-data`",
    )
    shard_size: int = setting(32, "requests per shard task", gt=0)
    # Redis redelivers a task not acknowledged within this many seconds; shards finish far sooner
    visibility_timeout: int = setting(
        3600,
        "seconds before Redis redelivers an unacknowledged shard (set alike in every place "
        "Celery reads it)",
        gt=0,
    )
    heartbeat_interval: float = setting(2.0, "seconds between a running shard's heartbeats", gt=0)
    heartbeat_timeout: float = setting(
        30.0, "a running shard silent this long is taken as dead and re-sent", gt=0
    )
    reconcile_interval: float = setting(10.0, "seconds between reconciler rounds", gt=0)
    unserved_timeout: float = setting(
        1800.0,
        "seconds a batch in progress waits for a live worker that serves its model (a name no "
        "worker serves, or workers that never come back) before it fails with "
        "`model_not_found`; the lines that ran keep their results. 0 waits until the batch's "
        "completion window ends",
        ge=0,
        allow_inf_nan=False,
    )
    affinity_backlog: int = setting(
        16, "shards queued for one worker before its prefixes overflow to the shared queue", ge=0
    )
    max_upload_bytes: int = setting(
        200 * MiB, "largest upload (413 `file_too_large`)", shown="200 MiB", gt=0
    )
    max_line_bytes: int = setting(
        8 * MiB, "longest input line (413 `line_too_large` at upload)", shown="8 MiB", gt=0
    )
    max_batch_lines: int = setting(
        50_000, "most requests per batch (413 `too_many_lines` at upload)", shown="50,000", gt=0
    )
    auth: Annotated[Literal["off", "required"], Lowercase] = setting(
        "off",
        "`required`: every `/v1` route wants `Authorization: Bearer <key>` and a key sees "
        "only its project's files and batches",
        shown="`off` (compose: `required`)",
    )
    max_tokens_cap: int = setting(
        0,
        "most tokens a request may generate: a line asking for more fails alone (422 "
        "`max_tokens_too_large` in the error file), a line not saying gets this",
        env="CONVEYOR_MAX_TOKENS",
        shown="0 (no cap)",
        ge=0,
    )
    max_batches_in_flight: int = setting(
        0,
        "unfinished batches per project; creating one more is a 429 `too_many_batches` "
        "(concurrent creates included)",
        shown="0 (no limit)",
        ge=0,
    )
    max_json_body_bytes: int = setting(
        MiB,
        "largest JSON request body, e.g. a batch create (413 `request_too_large`)",
        shown="1 MiB",
        gt=0,
    )
    max_completion_window: str = setting(
        "168h",
        "longest `completion_window` a batch may ask for, as `<n>h`, `<n>m` or `<n>s` (400 "
        "above it)",
        shown="`168h`",
    )
    online_timeout: float = setting(
        600.0, "seconds an online request may wait for its answer before a 504", gt=0
    )
    max_request_failures: int = setting(
        2,
        "a batch request in the step of this many engine failures (after the first it runs "
        "alone) is quarantined: it gets a `request_quarantined` error line",
        ge=1,
    )
    max_shard_attempts: int = setting(
        3,
        "a shard whose worker died without a word (killed, where no request could be named) "
        "this many times while running it is quarantined: its unfinished requests get "
        "`request_quarantined` error lines",
        ge=1,
    )
    shutdown_timeout: float = setting(
        60.0,
        "on SIGTERM a worker takes no new shards and gives running ones this many seconds; "
        "then it aborts what is left, commits what finished and hands the rest back to the "
        "queue; a worker with none running exits 0 within about a second. Ctrl-C (SIGINT) "
        "hands them back at once: `conveyor worker` and `conveyor serve` exit 130 within "
        "about a second, and running them again goes on with the batch. Either way the shards "
        "sent to the worker that it had not started go back to the queue too",
        ge=0,
    )
    log_format: Annotated[Literal["text", "json"], Lowercase] = setting(
        "text",
        "`json`: one JSON object per log line, with `batch_id`, `shard_id`, `file_id` on the "
        "lines about them",
        shown="`text` (compose: `json`)",
    )
    gpu_lock_dir: Path | None = setting(
        None,
        "workers sharing a machine's GPUs each claim one through lock files in this directory",
        shown="unset (compose: `/locks`)",
    )
    max_online_prompts: int = setting(
        2048,
        'prompts in one completion\'s `prompt` list; more is a 400 with `param: "prompt"`, '
        "refused before the prompts are checked",
        shown="2048 (OpenAI's limit)",
        group=ONLINE,
        ge=0,
    )
    max_online_request_sequences: int = setting(
        4096,
        'sequences one request asks for, prompts × `n`; more is a 400 with `param: "n"`',
        group=ONLINE,
        ge=0,
    )
    max_online_sequences: int = setting(
        8192,
        "one project's online sequences (prompts × `n`) in flight at once; past it a 429 "
        "`rate_limit_exceeded` with `Retry-After`. Counted in Redis when there is one (shared "
        "by every API process; a request's hold that its API process could not give back "
        "lapses `CONVEYOR_ONLINE_TIMEOUT` + 60 s after the request began), else in the "
        "API's process",
        group=ONLINE,
        ge=0,
    )
    online_rate_limit: float = setting(
        0.0,
        "completions (plain, chat, streamed) one project may start per second, nginx's "
        "`limit_req`: past its burst a 429 `rate_limit_exceeded` with `Retry-After` (the "
        "seconds until the next one may start). Set it where online clients are not trusted: "
        "a client that opens requests in a loop otherwise takes the engine from the batches "
        "as fast as it is answered. Counted in Redis when there is one (shared by every API "
        "process, in Redis's clock), else in the API's process",
        shown="0 (none)",
        group=ONLINE,
        ge=0,
        allow_inf_nan=False,
    )
    online_burst: int = setting(
        0, "requests a project may start at once over the rate", shown="the rate, rounded up",
        group=ONLINE, ge=0,
    )  # fmt: skip

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as error:
            raise ValueError(_by_variable(error)) from None

    @model_validator(mode="before")
    @classmethod
    def _blank_is_unset(cls, values: Any) -> Any:
        """A value of blanks leaves the default, as an unset variable does; others lose the
        blanks around them."""
        if not isinstance(values, dict):
            return values
        stripped = {k: v.strip() if isinstance(v, str) else v for k, v in values.items()}
        return {k: v for k, v in stripped.items() if v != ""}

    @field_validator("max_completion_window")
    @classmethod
    def _a_window(cls, window: str) -> str:
        try:
            window_seconds(window)
        except ValueError:
            raise ValueError("must look like '168h', '30m' or '90s'") from None
        return window

    @classmethod
    def variable(cls, name: str) -> str:
        """The environment variable of the setting `name`."""
        alias, prefix = cls.model_fields[name].validation_alias, cls.model_config["env_prefix"]
        return alias if isinstance(alias, str) else prefix + name.upper()

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


def _by_variable(error: ValidationError) -> str:
    """`error`'s complaints, each naming the variable of the setting it is about."""
    variables = {name: Settings.variable(name) for name in Settings.model_fields}
    variables |= {v.lower(): v for v in variables.values()}  # a value read by its variable
    complaints = []
    for e in error.errors():
        key = str(e["loc"][0]) if e["loc"] else ""
        message = e["msg"].removeprefix("Value error, ")
        complaints.append(f"{variables.get(key.lower(), key)}={e['input']!r}: {message}")
    return "; ".join(complaints)


def normalize_database_url(url: str) -> str:
    """`postgresql://` means psycopg 3 here (SQLAlchemy would pick psycopg2, not installed)."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url
