"""Celery task definitions. The body lives in the process's `WorkerRuntime`."""

from __future__ import annotations

from celery import shared_task

from conveyor.dispatch.celery_app import RUN_SHARD


@shared_task(name=RUN_SHARD, acks_late=True, ignore_result=True)
def run_shard(shard_id: int) -> str:
    from conveyor.worker.runtime import get_runtime

    return get_runtime().run_shard(shard_id)
