"""The live workers and the queue of each model: read-only, for the people watching the
service (the web page's Workers view)."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from conveyor.api import schemas, workers_view
from conveyor.api.deps import ProjectDep, StateDep, get_project, read_in_session
from conveyor.api.guard import KeyedRoute

router = APIRouter(tags=["system"], responses=schemas.error_responses(401), route_class=KeyedRoute)


@router.get("/v1/workers", response_model=schemas.WorkerList, dependencies=[Depends(get_project)])
async def list_workers(state: StateDep) -> schemas.WorkerList:
    """Extension: every live worker (heartbeat within `CONVEYOR_HEARTBEAT_TIMEOUT`) with its
    models, device and engine state as of its last heartbeat. Workers serve every project, so
    any valid key sees them all."""
    timeout = state.settings.heartbeat_timeout
    return await read_in_session(state, workers_view.worker_list, timeout)


@router.get("/v1/queues", response_model=schemas.QueueList)
async def list_queues(state: StateDep, project: ProjectDep) -> schemas.QueueList:
    """Extension: per model, its live workers and this project's queued and running shards
    and batches in progress."""
    timeout = state.settings.heartbeat_timeout
    return await read_in_session(state, workers_view.model_queues, project, timeout)
