"""Everything a worker process holds for its lifetime: the ledger connection, the engine loop,
the result writer, the reconciler, and its registration as a live worker.

Celery runs shard tasks on threads of this same process (the threads pool), so every task
feeds the one engine. `run_shard` is the task body.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections import Counter
from functools import partial
from typing import Any

from sqlalchemy import update

from conveyor.batch_format.errors import INTERNAL_ERROR, BatchRequestError, classify_engine_error
from conveyor.batch_format.request_line import (
    ParsedRequest,
    apply_max_tokens_cap,
    parse_request_line,
    peek_custom_id,
)
from conveyor.batch_format.result_lines import (
    build_error_line,
    build_output_line,
    error_line_from_exception,
)
from conveyor.batch_format.token_text import TokenDecoder
from conveyor.dispatch.celery_app import make_celery
from conveyor.dispatch.online import bus_for, online_queue
from conveyor.dispatch.queues import queue_for, worker_queue
from conveyor.dispatch.reconciler import ReconcilerLoop, reconcile
from conveyor.engine_request import prepare_request
from conveyor.logs import bind, log_context
from conveyor.settings import Settings
from ledger.db import Ledger
from ledger.models import WorkerRow
from ledger.results import result_row
from ledger.shard_lifecycle import (
    ClaimedShard,
    claim_shard,
    close_shards,
    give_back_attempt,
    shard_heartbeat,
)
from ledger.states import BatchStatus
from worker.engine_service import EngineJob, EngineService
from worker.metrics import WorkerMetrics
from worker.online import OnlineServer
from worker.writer import PendingResults, ResultWriter, WriteItem

log = logging.getLogger(__name__)

# batch work runs behind online requests (priority 0) in the engine
BATCH_PRIORITY = 1

# the exit status of a worker whose engine failed (sysexits' EX_SOFTWARE): its supervisor
# restarts it
ENGINE_FAILED_EXIT = 70

_runtime: WorkerRuntime | None = None


def get_runtime() -> WorkerRuntime:
    if _runtime is None:
        raise RuntimeError("this process has no worker runtime; start it with `conveyor worker`")
    return _runtime


class WorkerRuntime:
    def __init__(
        self,
        settings: Settings,
        engine: Any,
        model_names: list[str],
        name: str | None = None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.model_names = list(dict.fromkeys(model_names))
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        shared = list(dict.fromkeys(queue_for(m) for m in self.model_names))
        # the model's shared queue, and this worker's own for shards routed to it by prefix
        self.queues = shared + [worker_queue(q, self.name) for q in shared]
        self.shard_prefixes: Counter[str] = Counter()  # prefix key -> shards run here
        # no ping per checkout: every ledger call here retries or is re-run by the reconciler
        self.ledger = Ledger(settings.db_url, pre_ping=False)
        self.app = make_celery(settings, tasks=["worker.tasks"])
        self.service = EngineService(engine, on_failure=self._engine_failed)
        self.metrics = WorkerMetrics(engine, self.model_names[0])
        self.writer = ResultWriter(
            self.ledger, settings.heartbeat_timeout, on_lag=self.metrics.writer_lag.observe
        )
        self.reconciler = ReconcilerLoop(self.ledger, self.app, settings)
        self.decoder = TokenDecoder(getattr(engine, "tokenizer", None))
        self.online = OnlineServer(
            bus_for(settings.broker_url),
            [online_queue(q) for q in shared],
            self.service,
            engine,
            self.decoder,
            settings.max_tokens_cap,
        )
        self.stopped = threading.Event()
        # set by a SIGTERM's deadline: running shards abort what is left and go back to queued
        self.handing_back = threading.Event()
        # set when the engine loop died: running shards go back, the process exits
        self.engine_failed = threading.Event()
        self._registration = threading.Lock()  # a heartbeat cannot revive a withdrawn row
        self.heartbeat = threading.Thread(
            target=self._heartbeat_loop, daemon=True, name="conveyor-worker-heartbeat"
        )
        self.started_at = time.time()

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        global _runtime
        _runtime = self
        self._register()
        self.service.start()
        self.writer.start()
        self.online.bus.consume(self.online.queue_names)
        self.online.start()
        try:
            reconcile(self.ledger, self.app, self.settings)
        except Exception:
            log.exception("the first reconcile failed; the periodic one will retry")
        self.reconciler.start()
        self.heartbeat.start()

    def stop(self) -> None:
        self.stopped.set()
        self.reconciler.stop()
        self.online.stop()
        self.service.stop()
        self.writer.stop()
        self.writer.join(timeout=30)
        self._withdraw()

    def _register(self) -> None:
        with self._registration:
            if self.engine_failed.is_set():
                return
            with self.ledger.session() as session:
                session.merge(
                    WorkerRow(
                        id=self.name,
                        models=self.model_names,
                        queues=self.queues,
                        started_at=self.started_at,
                        last_seen=time.time(),
                        stats=self.stats(),
                    )
                )

    def _withdraw(self) -> None:
        """No longer announce this worker: `GET /v1/models` and shard routing drop it. Its
        row stays, marked as not seen, so that its models are known to have been served
        (an online request for one is a 503 to retry, not a 404)."""
        with self._registration:
            try:
                with self.ledger.session() as session:
                    session.execute(
                        update(WorkerRow).where(WorkerRow.id == self.name).values(last_seen=0.0)
                    )
            except Exception:
                log.warning("could not deregister worker %s", self.name)

    def _engine_failed(self, err: BaseException) -> None:
        """The engine loop died (called from its thread): stop announcing this worker, and
        shut down as on SIGTERM; the running shards see the failure and hand their unfinished
        requests back, and `conveyor worker` then exits with ENGINE_FAILED_EXIT."""
        log.error(
            "the engine failed (%s: %s): worker %s withdraws, hands its shards back and exits "
            "with status %d",
            type(err).__name__,
            err,
            self.name,
            ENGINE_FAILED_EXIT,
        )
        self.engine_failed.set()
        self._withdraw()
        os.kill(os.getpid(), signal.SIGTERM)

    def _heartbeat_loop(self) -> None:
        while not self.stopped.wait(min(5.0, self.settings.heartbeat_interval * 2)):
            try:
                self._register()
            except Exception:
                log.warning("worker heartbeat failed; retrying")

    def stats(self) -> dict[str, Any]:
        data = self.service.snapshot()
        data["results_committed"] = self.writer.committed
        data["shard_prefixes"] = dict(self.shard_prefixes)
        data["writer_lag_seconds"] = round(self.writer.lag, 3)
        data["device"] = str(getattr(self.engine, "device", None) or "none")  # echo: none
        return data

    # ---- one shard -------------------------------------------------------------------------
    def begin_shutdown(self, timeout: float) -> None:
        """A warm shutdown began (SIGTERM): Celery takes no more shards and waits for the
        running ones; those not done within `timeout` seconds are handed back."""
        log.info("shutting down: running shards get %.0fs to finish", timeout)
        timer = threading.Timer(timeout, self.handing_back.set)
        timer.daemon = True
        timer.start()

    def run_shard(self, shard_id: int) -> str:
        with log_context(shard_id=shard_id, worker=self.name):
            return self._run_shard(shard_id)

    def _run_shard(self, shard_id: int) -> str:
        if self.handing_back.is_set() or self.engine_failed.is_set():
            return "handed back"  # delivered during shutdown: leave it to another worker
        claim = self._claim(shard_id)
        if claim is None:
            return "skipped"
        if claim.quarantined:
            return "quarantined"
        bind(batch_id=claim.batch_id)
        log.info("shard %s: %d requests to run", shard_id, len(claim.requests))
        self.shard_prefixes[claim.prefix_key] += 1
        pending = PendingResults(shard_id, claim.batch_id, len(claim.requests))
        jobs = [self._job(claim, pending, *request) for request in claim.requests]
        jobs = [job for job in jobs if job is not None]
        self.service.submit(jobs)
        if not claim.requests:  # all done on an earlier run: the writer has nothing to close
            self._finish_shard(shard_id, claim.batch_id, cleanly=True)
            return "done"
        if self._wait_for_results(shard_id, pending):
            return "done"  # the writer closed the shard with its last result
        pending.take_over()
        self.service.abort([job.request_id for job in jobs])
        return self._stop_early(shard_id, claim.batch_id)

    def _claim(self, shard_id: int) -> ClaimedShard | None:
        settings = self.settings
        with self.ledger.session() as session:
            claim = claim_shard(
                session,
                shard_id,
                self.name,
                settings.max_shard_attempts,
                settings.heartbeat_timeout,
            )
        if claim is not None and claim.quarantined:
            log.warning(
                "shard %s failed %d times: quarantined, its unfinished requests get error lines",
                shard_id,
                settings.max_shard_attempts,
            )
        return claim

    def _job(
        self, claim: ClaimedShard, pending: PendingResults, request_id: int, line: int, raw: str
    ) -> EngineJob | None:
        """The engine job of one request of the shard, or None when the request fails before
        it reaches the engine (its error line is written)."""
        batch_id = claim.batch_id
        try:
            parsed = parse_request_line(raw, line=line)
            apply_max_tokens_cap(parsed, self.settings.max_tokens_cap)
            prompt, params = prepare_request(self.engine, parsed)
        except BatchRequestError as err:
            self._write(batch_id, request_id, error_line_from_exception(err), pending, line)
            return None
        except Exception as err:  # a fault of ours with this line: it fails alone
            log.exception("shard %s: request %s could not be prepared", claim.shard_id, request_id)
            message = f"could not prepare this request: {type(err).__name__}: {err}"
            error = build_error_line(
                peek_custom_id(raw), INTERNAL_ERROR, message, line=line, status_code=500
            )
            self._write(batch_id, request_id, error, pending, line)
            return None
        return EngineJob(
            f"{batch_id}:{request_id}",
            prompt,
            params,
            on_done=partial(self._on_done, batch_id, request_id, parsed, claim.model, pending),
            on_error=partial(self._on_refused, batch_id, request_id, parsed, pending),
            priority=BATCH_PRIORITY,
        )

    def _wait_for_results(self, shard_id: int, pending: PendingResults) -> bool:
        """Heartbeat the shard until all its results are committed (True), or until it must
        stop early (False): shutdown, the engine failed, or its batch no longer runs."""
        while not pending.wait(self.settings.heartbeat_interval):
            if self.handing_back.is_set() or self.engine_failed.is_set():
                return False
            try:
                with self.ledger.session() as session:
                    status = shard_heartbeat(session, shard_id)
            except Exception:
                log.warning("shard %s heartbeat failed; retrying", shard_id)
                continue
            if status != BatchStatus.IN_PROGRESS:  # cancelled or expired: stop spending on it
                return False
        return True

    def _stop_early(self, shard_id: int, batch_id: str) -> str:
        """Close a shard stopped before its end: what finished stays, the rest is queued
        again; the run counts as a failure only when the engine failed."""
        if self.engine_failed.is_set():
            log.warning("shard %s: the engine failed; handing back what is unfinished", shard_id)
            # what the engine finished before is committed first, so no run repeats it
            self.writer.drain(timeout=max(5.0, self.settings.heartbeat_timeout))
            self._finish_shard(shard_id, batch_id)
            return "handed back: the engine failed"
        if self.handing_back.is_set():
            log.info("shard %s: handing back its unfinished requests", shard_id)
        self._finish_shard(shard_id, batch_id, cleanly=True)
        return "handed back" if self.handing_back.is_set() else "stopped"

    def _finish_shard(self, shard_id: int, batch_id: str, cleanly: bool = False) -> None:
        delay = 0.2
        while True:
            try:
                with self.ledger.session() as session:
                    close_shards(session, [(shard_id, batch_id)], self.settings.heartbeat_timeout)
                    if cleanly:
                        give_back_attempt(session, shard_id)
                return
            except Exception:
                log.warning("could not close shard %s; retrying in %.1fs", shard_id, delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    # ---- results (called from the engine thread) -------------------------------------------
    def _on_done(self, batch_id, request_id, parsed, model, pending, output) -> None:
        if (error := getattr(output, "error", None)) is not None:
            line = self._internal_error(parsed, f"the engine failed on this request: {error}")
            self._write(batch_id, request_id, line, pending, parsed.line)
            return
        self.metrics.observe_request(output)
        try:
            line = build_output_line(parsed, output, model, self.decoder)
        except Exception as err:
            line = self._internal_error(
                parsed, f"could not format the result: {type(err).__name__}: {err}"
            )
            self._write(batch_id, request_id, line, pending, parsed.line)
            return
        completion = sum(len(c.token_ids) for c in output.outputs)
        self._write(
            batch_id,
            request_id,
            line,
            pending,
            number=parsed.line,
            ok=True,
            prompt_tokens=len(output.prompt_token_ids or []),
            completion_tokens=0 if parsed.drop_generation else completion,
            cached_tokens=int(getattr(output, "num_cached_tokens", 0) or 0),
        )

    def _on_refused(self, batch_id, request_id, parsed, pending, err: Exception) -> None:
        if isinstance(err, ValueError):  # the engine's word that the request is bad
            code, param = classify_engine_error(str(err), parsed.is_chat)
            line = build_error_line(parsed.custom_id, code, str(err), line=parsed.line, param=param)
        else:
            line = self._internal_error(
                parsed, f"the engine failed on this request: {type(err).__name__}: {err}"
            )
        self._write(batch_id, request_id, line, pending, parsed.line)

    @staticmethod
    def _internal_error(parsed: ParsedRequest, message: str) -> dict[str, Any]:
        return build_error_line(
            parsed.custom_id, INTERNAL_ERROR, message, line=parsed.line, status_code=500
        )

    def _write(self, batch_id, request_id, line, pending, number=None, ok=False, **tokens) -> None:
        row = result_row(request_id, batch_id, line, ok=ok, worker=self.name, **tokens)
        self.writer.put(WriteItem(row, pending, line.get("custom_id"), number))
