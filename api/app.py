"""The FastAPI application."""

from __future__ import annotations

import gc
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from conveyor.api import errors
from conveyor.api.deps import AppState
from conveyor.api.metrics import api_registry
from conveyor.api.routes import batches, files, online, system, ui, workers
from conveyor.api.served_models import ServedModels
from conveyor.api.storage import FileStore
from conveyor.dispatch.celery_app import make_celery
from conveyor.dispatch.online import bus_for
from conveyor.dispatch.reconciler import ReconcilerLoop
from conveyor.ledger.db import Ledger
from conveyor.settings import Settings
from conveyor.version import __version__

log = logging.getLogger(__name__)


def create_app(settings: Settings | None = None, *, reconcile: bool = True) -> FastAPI:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        ledger = Ledger(settings.db_url)
        state = AppState(
            settings=settings,
            ledger=ledger,
            celery=make_celery(settings),
            files=FileStore(settings.files_dir),
            online=bus_for(settings.broker_url),
            served=ServedModels(ledger, settings.heartbeat_timeout),
        )
        app.state.conveyor = state
        loop = ReconcilerLoop(state.ledger, state.celery, settings) if reconcile else None
        if loop is not None:
            loop.start()
        # Everything loaded so far lives as long as the app: keep it out of the collector's
        # full passes, each of which would otherwise walk ~100k objects and stall every
        # request in flight for ~60 ms (the slowest status polls under load were these).
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            gc.unfreeze()
            if loop is not None:
                loop.stop()
            state.ledger.dispose()

    app = FastAPI(
        title="Conveyor",
        version=__version__,
        description="Batch LLM inference: OpenAI-compatible Files and Batches API.",
        lifespan=lifespan,
    )
    errors.install(app)
    app.include_router(files.router)
    app.include_router(files.uploads)
    app.include_router(batches.router)
    app.include_router(system.router)
    app.include_router(system.models)
    app.include_router(online.router)
    app.include_router(online.tokenizer)
    app.include_router(workers.router)
    ui.install(app)
    registry = api_registry(lambda: app.state.conveyor.ledger)

    @app.get("/metrics", tags=["system"], include_in_schema=False)
    def metrics() -> Response:
        """Prometheus metrics (no API key needed, like /healthz)."""
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
