"""SQLAlchemy models of the ledger.

A batch's requests are rows written once at creation. A request's outcome is one row in
`results` whose primary key is the request id, so it is recorded at most once whatever the
number of workers that ran it. Output and error files are views of `results`.
"""

from __future__ import annotations

import re
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy import false as sa_false
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from conveyor.wire_format.validation import CUSTOM_ID_MAX_CHARS, MODEL_MAX_CHARS

# BIGINT on Postgres, INTEGER on SQLite (where only INTEGER PRIMARY KEY autoincrements)
BigId = BigInteger().with_variant(Integer(), "sqlite")


DEFAULT_PROJECT = "default"
# results by (request key, model fingerprint): how exact reuse finds earlier results; the key,
# nearly unique, comes first (migration 0009)
REUSE_INDEX = "ix_results_reuse"


class Base(DeclarativeBase):
    pass


class ApiKeyRow(Base):
    """An API key: only the SHA-256 of its secret is kept (the secret is 256 random bits, so
    a plain hash is enough); the key's project owns what is made with it."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    project: Mapped[str] = mapped_column(String(128))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[int] = mapped_column(BigInteger)
    revoked_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class FileRow(Base):
    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    # the owner: the project of the API key that made it ("default" when auth is off)
    project: Mapped[str] = mapped_column(
        String(128), default=DEFAULT_PROJECT, server_default=DEFAULT_PROJECT, index=True
    )
    filename: Mapped[str] = mapped_column(String(512))
    purpose: Mapped[str] = mapped_column(String(32))
    bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    lines: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[int] = mapped_column(BigInteger)
    # uploads live in the API's file store; batch_output / batch_error files are built from
    # the results of `batch_id` when read
    storage_path: Mapped[str | None] = mapped_column(String(1024), nullable=True)
    batch_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    deleted: Mapped[bool] = mapped_column(Boolean, default=False)


class BatchRow(Base):
    __tablename__ = "batches"
    __table_args__ = (
        UniqueConstraint("project", "idempotency_key", name="uq_batches_project_idempotency_key"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    project: Mapped[str] = mapped_column(
        String(128), default=DEFAULT_PROJECT, server_default=DEFAULT_PROJECT, index=True
    )
    input_file_id: Mapped[str] = mapped_column(String(64))
    endpoint: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    model: Mapped[str | None] = mapped_column(String(MODEL_MAX_CHARS), nullable=True)
    status: Mapped[str] = mapped_column(String(16), index=True)
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON, nullable=True)
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, nullable=True)
    output_file_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    error_file_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    total: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[int] = mapped_column(BigInteger)
    in_progress_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    expires_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    finalizing_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    completed_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    failed_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    expired_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    cancelling_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    cancelled_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # first moment a result arrived: the base of the ETA estimate
    first_result_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    # running totals of its results, kept by the transactions that insert them, so that
    # reading a batch's progress costs one row however large the batch
    completed_count: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    failed_count: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # lines answered from an earlier batch's results ("exact" reuse, `ledger.reuse`)
    reused_count: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    reuse: Mapped[str | None] = mapped_column(String(16), nullable=True)
    # the client's `Idempotency-Key` of the create call: a re-sent create returns this batch
    idempotency_key: Mapped[str | None] = mapped_column(String(255), nullable=True)
    # since when no live worker serves the batch's model (None: one does, or it is not running)
    unserved_since: Mapped[float | None] = mapped_column(Float, nullable=True)


class ShardRow(Base):
    __tablename__ = "shards"
    __table_args__ = (UniqueConstraint("batch_id", "index"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"))
    index: Mapped[int] = mapped_column(Integer)
    queue: Mapped[str] = mapped_column(String(255))
    status: Mapped[str] = mapped_column(String(16), index=True)  # queued | running | done
    size: Mapped[int] = mapped_column(Integer)
    prefix_key: Mapped[str] = mapped_column(String(64))
    enqueue_count: Mapped[int] = mapped_column(Integer, default=0)
    enqueued_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    worker: Mapped[str | None] = mapped_column(String(255), nullable=True)
    heartbeat_at: Mapped[float | None] = mapped_column(Float, nullable=True)

    @property
    def task_id(self) -> str:
        return f"shard-{self.id}-{self.enqueue_count}"


def shard_of_task(task_id: str) -> tuple[int, int] | None:
    """(shard id, enqueue count) of a `ShardRow.task_id`; None for any other id."""
    match = re.fullmatch(r"shard-(\d+)-(\d+)", task_id)
    return None if match is None else (int(match[1]), int(match[2]))


class RequestRow(Base):
    __tablename__ = "requests"
    __table_args__ = (
        UniqueConstraint("batch_id", "custom_id"),
        Index("ix_requests_shard", "batch_id", "shard_index"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"))
    shard_index: Mapped[int | None] = mapped_column(Integer, nullable=True)  # None: rejected
    line: Mapped[int] = mapped_column(Integer)
    custom_id: Mapped[str] = mapped_column(String(CUSTOM_ID_MAX_CHARS))
    raw: Mapped[str] = mapped_column(Text)  # the input line as uploaded
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # engine deaths it was in the step of: once, it runs alone; twice, it is quarantined
    engine_failures: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    worker: Mapped[str | None] = mapped_column(String(255), nullable=True)
    started_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class ResultRow(Base):
    """The outcome of one request. `seq` orders results for streaming (`?after=`)."""

    __tablename__ = "results"
    __table_args__ = (
        Index("ix_results_batch_seq", "batch_id", "seq"),
        Index(REUSE_INDEX, "request_key", "fingerprint"),
    )

    seq: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    request_id: Mapped[int] = mapped_column(
        ForeignKey("requests.id", ondelete="CASCADE"), unique=True
    )
    batch_id: Mapped[str] = mapped_column(String(64))
    line_id: Mapped[str] = mapped_column(String(64))  # the output line's "id"
    ok: Mapped[bool] = mapped_column(Boolean)
    output: Mapped[str] = mapped_column(Text)  # the output or error line, as JSON text
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0)
    worker: Mapped[str | None] = mapped_column(String(255), nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    # what makes a deterministic result reusable (`ledger.reuse`): the model fingerprint it
    # came from and its request's normalised key; None for a result nobody may reuse
    fingerprint: Mapped[str | None] = mapped_column(String(64), nullable=True)
    request_key: Mapped[str | None] = mapped_column(String(64), nullable=True)
    reused: Mapped[bool] = mapped_column(Boolean, default=False, server_default=sa_false())


class BatchRunRow(Base):
    """What ran a batch: one row per worker and model fingerprint that took a shard of it, with
    the engine's settings and the sampling defaults in force, so that a score can be traced to
    exactly what produced it after the worker is gone."""

    __tablename__ = "batch_runs"

    batch_id: Mapped[str] = mapped_column(
        ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True
    )
    worker: Mapped[str] = mapped_column(String(255), primary_key=True)
    fingerprint: Mapped[str] = mapped_column(String(64), primary_key=True)
    record: Mapped[dict[str, Any]] = mapped_column(JSON)
    first_at: Mapped[float] = mapped_column(Float)


class WorkerRow(Base):
    """A live worker announces itself here; `GET /v1/models` lists what live workers serve."""

    __tablename__ = "workers"

    id: Mapped[str] = mapped_column(String(255), primary_key=True)
    models: Mapped[list[str]] = mapped_column(JSON)
    queues: Mapped[list[str]] = mapped_column(JSON)
    started_at: Mapped[float] = mapped_column(Float)
    last_seen: Mapped[float] = mapped_column(Float)
    stats: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
