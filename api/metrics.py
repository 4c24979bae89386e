"""The API's Prometheus metrics: the ledger's view of the work, read at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import func, select

from conveyor.ledger.db import Ledger
from conveyor.ledger.models import BatchRow, ShardRow
from conveyor.ledger.serving import unserved_models
from conveyor.ledger.states import BatchStatus, ShardStatus


class LedgerCollector(Collector):
    def __init__(self, ledger: Callable[[], Ledger]) -> None:
        self.ledger = ledger  # the app's ledger exists only while the app runs

    def collect(self) -> Iterator[Metric]:
        with self.ledger().session() as session:
            by_status = dict(
                session.execute(
                    select(BatchRow.status, func.count()).group_by(BatchRow.status)
                ).all()
            )
            queued = session.execute(
                select(BatchRow.model, func.coalesce(func.sum(ShardRow.size), 0))
                .join(BatchRow, BatchRow.id == ShardRow.batch_id)
                .where(ShardRow.status == ShardStatus.QUEUED)
                .group_by(BatchRow.model)
            ).all()
            unserved = unserved_models(session)
        batches = GaugeMetricFamily(
            "conveyor:batches", "Batches in the ledger by status.", labels=["status"]
        )
        for status in BatchStatus:
            batches.add_metric([status], by_status.get(status, 0))
        yield batches
        depth = GaugeMetricFamily(
            "conveyor:queue_depth",
            "Requests in shards that no worker has started yet, by model.",
            labels=["model_name"],
        )
        for model, requests in queued:
            depth.add_metric([model or ""], int(requests))
        yield depth
        waiting = GaugeMetricFamily(
            "conveyor:unserved_batches",
            "Batches in progress whose model no live worker serves, by model.",
            labels=["model_name"],
        )
        for model, n in unserved.items():
            waiting.add_metric([model], n)
        yield waiting


def api_registry(ledger: Callable[[], Ledger]) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(LedgerCollector(ledger))
    return registry
