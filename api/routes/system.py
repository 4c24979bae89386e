"""Health, readiness and the models that live workers serve."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from sqlalchemy import text

from conveyor.api import schemas
from conveyor.api.deps import SessionDep, StateDep, get_project
from conveyor.api.guard import KeyedRoute
from conveyor.api.workers_view import default_sampling, fingerprint
from conveyor.dispatch.broker import ping
from conveyor.ledger.serving import unserved_models
from conveyor.ledger.workers import live_worker_rows
from conveyor.served_names import listed_names

router = APIRouter(tags=["system"])
models = APIRouter(tags=["system"], route_class=KeyedRoute)  # wants a key, as every /v1 route


@router.get("/healthz", response_model=schemas.Health)
async def healthz() -> schemas.Health:  # async: nothing in it to send to the thread pool
    return schemas.Health(status="ok")


@router.get("/readyz", response_model=schemas.Health, responses={503: {"model": schemas.Health}})
async def readyz(state: StateDep):
    checks: dict[str, str] = {}
    unserved: dict[str, int] = {}

    def check_db() -> None:
        with state.ledger.session() as session:
            session.execute(text("SELECT 1"))
            unserved.update(unserved_models(session))

    for name, probe in (
        ("database", check_db),
        ("broker", lambda: ping(state.settings.broker_url)),
    ):
        try:
            await run_in_threadpool(probe)
            checks[name] = "ok"
        except Exception as err:
            checks[name] = f"unreachable: {type(err).__name__}: {err}"
    ok = all(v == "ok" for v in checks.values())
    body = schemas.Health(
        status="ok" if ok else "unavailable", checks=checks, unserved_models=unserved
    )
    return JSONResponse(body.model_dump(), status_code=200 if ok else 503)


@models.get(
    "/v1/models",
    response_model=schemas.ModelList,
    dependencies=[Depends(get_project)],
    responses=schemas.error_responses(401),
)
def list_models(state: StateDep, session: SessionDep) -> schemas.ModelList:
    models: dict[str, schemas.Model] = {}
    for worker in live_worker_rows(session, state.settings.heartbeat_timeout):
        for name in listed_names(worker.models):  # its path alias is accepted, not listed
            if name in models:
                models[name].workers += 1
            else:
                models[name] = schemas.Model(
                    id=name,
                    created=int(worker.started_at),
                    workers=1,
                    default_sampling=default_sampling(worker.stats),
                )
            found = fingerprint(worker.stats)
            if found is not None and found not in models[name].fingerprints:
                models[name].fingerprints = sorted([*models[name].fingerprints, found])
    return schemas.ModelList(data=list(models.values()))
