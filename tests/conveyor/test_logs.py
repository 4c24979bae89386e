"""The service's log set-up: what it lets through at INFO."""

from __future__ import annotations

import logging

import pytest

from conveyor.logs import setup_logging


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    plugins = logging.getLogger("alembic.runtime.plugins")
    plugins_level = plugins.level
    yield
    root.handlers[:], root.level = handlers, level
    plugins.setLevel(plugins_level)


def test_alembic_plugin_chatter_is_left_out_and_its_migrations_kept(restore_logging):
    """Each start of the embedded service migrates its ledger: the migrations it runs are worth
    a line each at INFO, Alembic's set-up of its seven plugins is not."""
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.NOTSET)
    setup_logging("INFO")
    assert not logging.getLogger("alembic.runtime.plugins").isEnabledFor(logging.INFO)
    assert logging.getLogger("alembic.runtime.plugins").isEnabledFor(logging.WARNING)
    assert logging.getLogger("alembic.runtime.migration").isEnabledFor(logging.INFO)
