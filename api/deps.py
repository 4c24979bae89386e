"""What routes depend on: the app's shared state and a database session per request."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Annotated, Concatenate, ParamSpec, TypeVar

from celery import Celery
from fastapi import Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from conveyor.api.served_models import ServedModels
from conveyor.api.storage import FileStore
from conveyor.dispatch.online import OnlineBus
from conveyor.ledger.db import Ledger
from conveyor.settings import Settings


@dataclass
class AppState:
    settings: Settings
    ledger: Ledger
    celery: Celery
    files: FileStore
    online: OnlineBus
    served: ServedModels


async def get_state(request: Request) -> AppState:
    # async: a plain attribute read must not cost a hop through the thread pool
    return request.app.state.conveyor


async def get_session(state: Annotated[AppState, Depends(get_state)]) -> AsyncIterator[Session]:
    """A transaction for the request: committed after the route returns, rolled back if it
    raises. Opening a Session does no I/O (it connects at its first query, in the route's
    thread), so only the commit takes a hop through the thread pool, not the opening too."""
    session = state.ledger.sessions()
    try:
        yield session
    except BaseException:
        await run_in_threadpool(session.close)  # closing rolls the transaction back
        raise
    await run_in_threadpool(_commit_and_close, session)


def _commit_and_close(session: Session) -> None:
    with session:
        session.commit()


P = ParamSpec("P")
T = TypeVar("T")


async def read_in_session(
    state: AppState, read: Callable[Concatenate[Session, P], T], *args: P.args, **kwargs: P.kwargs
) -> T:
    """`read(session, ...)` in one trip to the thread pool, in `Ledger.reads` (no BEGIN or
    COMMIT round trips). For the routes that only read and are called most (status
    polls, lists): a sync route with `SessionDep` takes three trips to the pool, for the route,
    its response's validation and the commit, and two more round trips to the database."""

    def run() -> T:
        with state.ledger.reads() as session:
            return read(session, *args, **kwargs)

    return await run_in_threadpool(run)


StateDep = Annotated[AppState, Depends(get_state)]
# scope="function": the transaction commits before the response is sent, so a client that
# acts on a 200 (cancel, delete) never reads the state from before it
SessionDep = Annotated[Session, Depends(get_session, scope="function")]


bearer = HTTPBearer(auto_error=False, description="a Conveyor API key (`conveyor keys create`)")


async def get_project(
    request: Request,
    _: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> str:
    """The project whose files and batches this request may see: the API key's project, or
    the default project when authentication is off. `api.guard.KeyedRoute` settled it from the
    headers before the body was read; `bearer` is here for the OpenAPI schema's security."""
    return request.state.project


ProjectDep = Annotated[str, Depends(get_project)]
