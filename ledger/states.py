"""The states a batch and a shard go through: every status the ledger writes or tests is named
here, and changed only by `ledger.batch_lifecycle` and `ledger.shard_lifecycle`.

    validating -> in_progress -> finalizing -> completed
    validating -> failed
    in_progress -> failed (no live worker served its model for CONVEYOR_UNSERVED_TIMEOUT)
    in_progress -> expired
    validating | in_progress -> cancelling -> cancelled
"""

from __future__ import annotations

from enum import StrEnum


class BatchStatus(StrEnum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


TERMINAL = frozenset(
    {BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED, BatchStatus.CANCELLED}
)
CANCELLABLE = frozenset({BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS})


class ShardStatus(StrEnum):
    QUEUED = "queued"  # waiting for a worker (sent, or to be sent by the reconciler)
    RUNNING = "running"  # claimed by a worker, which heartbeats it
    DONE = "done"  # every request has a result, or its batch no longer wants it run
