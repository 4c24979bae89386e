"""Alembic environment: the URL comes from the caller (`conveyor migrate`) or DATABASE_URL."""

from __future__ import annotations

from alembic import context

from conveyor.ledger.db import make_engine
from conveyor.ledger.models import Base
from conveyor.settings import Settings

config = context.config
url = config.get_main_option("sqlalchemy.url") or Settings().db_url


def run_offline() -> None:
    context.configure(url=url, target_metadata=Base.metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    engine = make_engine(url)
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=Base.metadata,
            render_as_batch=connection.dialect.name == "sqlite",
        )
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
