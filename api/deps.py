"""What routes depend on: the app's shared state and a database session per request."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated

from celery import Celery
from fastapi import Depends, Request
from sqlalchemy.orm import Session

from api.storage import FileStore
from conveyor.settings import Settings
from ledger.db import Ledger


@dataclass
class AppState:
    settings: Settings
    ledger: Ledger
    celery: Celery
    files: FileStore


def get_state(request: Request) -> AppState:
    return request.app.state.conveyor


def get_session(state: Annotated[AppState, Depends(get_state)]) -> Iterator[Session]:
    with state.ledger.session() as session:
        yield session


StateDep = Annotated[AppState, Depends(get_state)]
# scope="function": the transaction commits before the response is sent, so a client that
# acts on a 200 (cancel, delete) never reads the state from before it
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
