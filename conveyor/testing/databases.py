"""Databases of their own on a shared server: a PostgreSQL database per test or bench run
(migrated, or copied from a migrated template) and a Redis database index, emptied first."""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit, urlunsplit

import redis
import sqlalchemy as sa

from conveyor.settings import normalize_database_url

REDIS_TEST_DBS = range(1, 16)  # a random one per test, so parallel runs rarely meet


def with_database(url: str, name: str) -> str:
    """`url` (any postgres scheme) pointing at database `name`, as a plain postgresql:// URL
    (what psycopg takes; `normalize_database_url` makes SQLAlchemy's form of it)."""
    parts = urlsplit(url)
    scheme = parts.scheme.split("+", 1)[0]  # postgresql+psycopg:// (SQLAlchemy's form) too
    scheme = "postgresql" if scheme in ("postgres", "postgresql") else scheme
    return urlunsplit(parts._replace(scheme=scheme, path=f"/{name}"))


def _admin(server_url: str, statement: str) -> None:
    admin = sa.create_engine(normalize_database_url(server_url), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(statement))
    finally:
        admin.dispose()


def create_database(server_url: str, name: str, template: str | None = None) -> str:
    """Database `name` on the server of `server_url` (a copy of `template` if given); its
    URL."""
    copy = f' TEMPLATE "{template}"' if template else ""
    _admin(server_url, f'CREATE DATABASE "{name}"{copy}')
    return with_database(server_url, name)


def drop_database(server_url: str, name: str) -> None:
    _admin(server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def migrate(url: str) -> None:
    from conveyor.ledger.migrate import upgrade

    upgrade(normalize_database_url(url))


@contextmanager
def scratch_database(
    server_url: str, prefix: str, template: str | None = None, keep: bool = False
) -> Iterator[str]:
    """The plain URL of a new database `<prefix><hex>`, a copy of `template` or else empty;
    dropped at exit unless `keep`."""
    name = f"{prefix}{uuid.uuid4().hex[:10]}"
    try:
        yield create_database(server_url, name, template)
    finally:
        if not keep:
            drop_database(server_url, name)


@contextmanager
def migrated_template(server_url: str) -> Iterator[str]:
    """The name of a database migrated once, for `scratch_database(template=...)` to copy."""
    with scratch_database(server_url, "conveyor_tpl_") as url:
        migrate(url)
        yield urlsplit(url).path.lstrip("/")


def redis_database(server_url: str, db: int) -> str:
    """`server_url` pointing at database index `db`, emptied."""
    url = urlunsplit(urlsplit(server_url)._replace(path=f"/{db}"))
    flush_redis(url)
    return url


def random_redis_database(server_url: str) -> str:
    """One of the test databases 1-15, at random, emptied."""
    return redis_database(server_url, random.choice(REDIS_TEST_DBS))


def flush_redis(url: str) -> None:
    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()
