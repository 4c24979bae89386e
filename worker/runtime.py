"""Everything a worker process holds for its lifetime: the ledger connection, the engine loop,
the result writer, the reconciler, and its registration as a live worker.

Celery runs shard tasks on threads of this same process (the threads pool), so every task
feeds the one engine. `run_shard` is the task body.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from celery.worker import state as worker_state
from sqlalchemy.orm import Session

from conveyor.dispatch.broker import take_waiting
from conveyor.dispatch.celery_app import make_celery
from conveyor.dispatch.online import bus_for, online_queue
from conveyor.dispatch.queues import queue_for, queue_owner, worker_queue
from conveyor.dispatch.reconciler import ReconcilerLoop, reconcile
from conveyor.engine.protocol import Engine
from conveyor.ledger.batch_runs import record_run
from conveyor.ledger.db import Ledger, until_reached
from conveyor.ledger.results import result_row
from conveyor.ledger.reuse import REUSE_EXACT, find_reusable
from conveyor.ledger.shard_lifecycle import (
    ClaimedShard,
    claim_shard,
    close_shards,
    forget_message,
    forget_tasks,
    give_back_attempt,
    record_engine_failure,
    shard_heartbeat,
)
from conveyor.ledger.states import BatchStatus
from conveyor.ledger.workers import announce, withdraw
from conveyor.logs import bind, log_context
from conveyor.request_outcome import (
    PreparedLine,
    output_line,
    prepare_line,
    refused_line,
    reuse_key,
)
from conveyor.settings import Settings
from conveyor.version import __version__
from conveyor.wire_format.errors import REQUEST_QUARANTINED
from conveyor.wire_format.request_line import (
    ParsedRequest,
    apply_max_tokens_cap,
    parse_request_line,
    peek_custom_id,
)
from conveyor.wire_format.result_lines import build_error_line, reused_line
from conveyor.wire_format.token_text import TokenDecoder
from conveyor.worker.engine_service import EngineJob, EngineService
from conveyor.worker.metrics import WorkerMetrics
from conveyor.worker.online import OnlineServer
from conveyor.worker.writer import PendingResults, ResultWriter, WriteItem

log = logging.getLogger(__name__)
STOP_CHECK_SECONDS = 0.05  # how soon a running shard sees that it must stop
INTERRUPT_HANDOVER_SECONDS = 1.0  # Ctrl-C: how long running shards get to hand back
SLOW_SHUTDOWN_SECONDS = 20.0  # after SIGTERM: then the log gets every thread's stack

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
        engine: Engine,
        model_names: list[str],
        name: str | None = None,
        rebuild_engine: Callable[[], Any] | None = None,
    ) -> None:
        """`rebuild_engine`, when given, makes a new engine after the engine failed, and the
        runtime goes on with it (the embedded service, which nothing restarts); without it the
        process shuts down, to be restarted by its supervisor."""
        self.settings = settings
        self.rebuild_engine = rebuild_engine
        self.engine = engine
        self.model_names = list(dict.fromkeys(model_names))
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        shared = list(dict.fromkeys(queue_for(m) for m in self.model_names))
        # the model's shared queue, and this worker's own for shards routed to it by prefix
        self.queues = shared + [worker_queue(q, self.name) for q in shared]
        self.shard_prefixes: Counter[str] = Counter()  # prefix key -> shards run here
        # no ping per checkout: every ledger call here retries or is re-run by the reconciler
        self.ledger = Ledger(settings.db_url, pre_ping=False)
        self.app = make_celery(settings, tasks=["conveyor.worker.tasks"])
        self.service = EngineService(engine, on_failure=self._engine_failed)
        self.metrics = WorkerMetrics(engine, self.model_names[0])
        self.writer = ResultWriter(
            self.ledger, settings.heartbeat_timeout, on_lag=self.metrics.writer_lag.observe
        )
        self.reconciler = ReconcilerLoop(self.ledger, self.app, settings)
        self.decoder = TokenDecoder(engine.tokenizer)
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
        # set when the engine loop died: running shards go back, the process exits (or, with
        # `rebuild_engine`, waits for a new engine: `engine_ready` is set again)
        self.engine_failed = threading.Event()
        self.engine_ready = threading.Event()
        self.engine_ready.set()
        self.engine_restarts = 0
        self._runs_recorded: set[tuple[str, str]] = set()  # (batch, fingerprint) in batch_runs
        self._shard_runs = 0  # shard tasks running now
        self._running_shards: set[int] = set()  # their shards
        self._shard_runs_lock = threading.Lock()
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
        self._forget_unstarted()

    def _forget_unstarted(self) -> None:
        """The shards sent to this worker that will not start here: those Celery took and had
        not started (the embedded broker never delivers a taken message again) and those in
        this worker's own queues (routed here by prefix), which it empties: no one else reads
        them, and a worker started again under the same name (a container's host and pid)
        would run them twice. Their messages are forgotten, so that the next reconcile (another
        worker's, or this one's when it starts again) sends them at once, where it would wait
        out the grace it gives a message that may still be on its way (a restarted `conveyor
        serve` stalled 20-30 s)."""
        task_ids = {request.id for request in list(worker_state.reserved_requests)}
        own = [queue for queue in self.queues if queue_owner(queue) == self.name]
        try:
            task_ids |= take_waiting(self.settings.broker_url, own)
            with self.ledger.session() as session:
                forgotten = forget_tasks(session, task_ids)
        except Exception:  # the reconciler finds them once their grace has passed
            log.warning("could not hand back the shards that did not start here", exc_info=True)
            return
        if forgotten:
            log.info("%d shard(s) sent here and not started go back to the queue", forgotten)

    def _register(self) -> None:
        with self._registration:
            if self.engine_failed.is_set():
                return
            with self.ledger.session() as session:
                announce(session, self.name, self.model_names, self.queues, self.started_at,
                         self.stats())  # fmt: skip

    def _withdraw(self) -> None:
        """No longer announce this worker: `GET /v1/models` and shard routing drop it. Its
        row stays, marked as not seen, so that its models are known to have been served
        (an online request for one is a 503 to retry, not a 404)."""
        with self._registration:
            try:
                with self.ledger.session() as session:
                    withdraw(session, self.name)
            except Exception:
                log.warning("could not deregister worker %s", self.name)

    def _engine_failed(self, err: BaseException) -> None:
        """The engine loop died (called from its thread): count the failure against the
        batch requests of its step, and stop announcing this worker; the running shards see
        the failure and hand their unfinished requests back. Then the engine is built anew
        (`rebuild_engine`), or the process shuts down as on SIGTERM and `conveyor worker`
        exits with ENGINE_FAILED_EXIT."""
        self.engine_ready.clear()
        self.engine_failed.set()
        suspects = self._record_suspects(self.service.suspects)
        then = (
            "builds a new engine"
            if self.rebuild_engine is not None
            else f"exits with status {ENGINE_FAILED_EXIT}"
        )
        log.error(
            "the engine failed (%s: %s) with %d batch request(s) in its step: worker %s "
            "withdraws, hands its shards back and %s",
            type(err).__name__,
            err,
            suspects,
            self.name,
            then,
        )
        self._withdraw()
        self.online.fail_in_flight()
        if self.rebuild_engine is None:
            os.kill(os.getpid(), signal.SIGTERM)
            return
        threading.Thread(target=self._restart_engine, name="conveyor-engine-restart").start()

    def _record_suspects(self, engine_ids: list[str]) -> int:
        """Count one engine failure against each batch request in the failed step (online
        requests are answered with an error and not retried)."""
        ids = [int(i.rsplit(":", 1)[1]) for i in engine_ids if i.startswith("batch_")]
        for delay in (0.2, 1.0, 5.0, None):
            try:
                with self.ledger.session() as session:
                    record_engine_failure(session, ids)
                return len(ids)
            except Exception:
                if delay is None:  # the shards' runs count as failures instead
                    log.exception("could not record the engine failure against its requests")
                    return 0
                time.sleep(delay)
        return 0

    def _restart_engine(self) -> None:
        """Wait for the running shards to hand back, build a new engine, take work again."""
        deadline = time.monotonic() + max(10.0, 3 * self.settings.heartbeat_timeout)
        while self._shard_runs and time.monotonic() < deadline:
            time.sleep(0.1)
        try:
            engine = self.rebuild_engine()  # type: ignore[misc]
        except Exception:
            log.exception("could not build a new engine: worker %s shuts down", self.name)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self.engine = engine
        self.service = EngineService(engine, on_failure=self._engine_failed)
        self.service.start()
        self.online.use_engine(self.service, engine)
        self.metrics.use_engine(engine)
        self.engine_restarts += 1
        self.engine_failed.clear()
        self.engine_ready.set()
        self._register()
        log.info("worker %s runs a new engine (restart %d)", self.name, self.engine_restarts)
        try:  # the shards handed back go out again now, not at the next periodic pass
            reconcile(self.ledger, self.app, self.settings)
        except Exception:
            log.exception("reconcile after the engine restart failed; the periodic one retries")

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
        slow = threading.Timer(SLOW_SHUTDOWN_SECONDS, self._report_slow_shutdown)
        slow.daemon = True
        slow.start()

    def hand_back_now(self) -> int:
        """Ctrl-C: a person waits for the prompt. Running shards go back to the queue at once
        (their finished requests' results kept), the results written so far are committed and
        the worker withdraws, without waiting for Celery's consumer loop. Returns how many
        shards had not handed back in time (the reconciler re-sends those)."""
        self.handing_back.set()
        deadline = time.monotonic() + INTERRUPT_HANDOVER_SECONDS
        while self._shard_runs and time.monotonic() < deadline:
            time.sleep(0.02)
        left = self._shard_runs
        self.stop()
        return left

    def _report_slow_shutdown(self) -> None:
        """Still here long after SIGTERM: say what every thread is doing, once, so that a
        shutdown that hangs shows where."""
        log.warning(
            "still shutting down %.0f s after the signal (%d shards running); thread stacks "
            "follow on stderr", SLOW_SHUTDOWN_SECONDS, self._shard_runs,
        )  # fmt: skip
        # sys.__stderr__: Celery's worker replaces sys.stderr by a logging proxy, which has no
        # file descriptor for faulthandler to write to
        faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)

    def run_shard(self, shard_id: int) -> str:
        with log_context(shard_id=shard_id, worker=self.name):
            if not self._engine_up():  # delivered during shutdown: leave it to another worker
                self._forget_message(shard_id)
                return "handed back"
            with self._shard_runs_lock:
                # a second message for a shard running here (handed back by a worker that
                # stopped and re-sent by the reconciler too): the run under way finishes it,
                # and two would put the same requests in the engine twice
                if shard_id in self._running_shards:
                    log.info("shard %s is already running here; this delivery is dropped", shard_id)
                    return "already running"
                self._running_shards.add(shard_id)
                self._shard_runs += 1
            try:
                return self._run_shard(shard_id)
            finally:
                with self._shard_runs_lock:
                    self._shard_runs -= 1
                    self._running_shards.discard(shard_id)

    def _engine_up(self) -> bool:
        """Whether shards can run here: not shutting down, and the engine is up (or comes
        back up within the heartbeat timeout, when it is being rebuilt)."""
        if self.handing_back.is_set():
            return False
        if self.rebuild_engine is not None:
            self.engine_ready.wait(max(30.0, 2 * self.settings.heartbeat_timeout))
        return not self.engine_failed.is_set() and not self.handing_back.is_set()

    def _forget_message(self, shard_id: int) -> None:
        try:
            with self.ledger.session() as session:
                forget_message(session, shard_id)
        except Exception:  # the reconciler finds it once its grace has passed
            log.warning("could not mark shard %s as needing a new message", shard_id)

    def _run_shard(self, shard_id: int) -> str:
        claim = self._claim(shard_id)
        if claim is None:
            return "skipped"
        if claim.quarantined:
            return "quarantined"
        bind(batch_id=claim.batch_id)
        log.info("shard %s: %d requests to run", shard_id, len(claim.requests))
        if claim.requests:
            self._record_run(claim.batch_id)
        self.shard_prefixes[claim.prefix_key] += 1
        pending = PendingResults(shard_id, claim.batch_id, len(claim.requests))
        keyed: dict[str, Keyed] = {}
        jobs = [self._job(claim, pending, keyed, *request) for request in claim.requests]
        jobs = [job for job in jobs if job is not None]
        if claim.reuse == REUSE_EXACT and keyed:
            jobs = self._reuse(claim, pending, jobs, keyed)
        service = self.service
        service.submit(jobs)
        if not claim.requests:  # all done on an earlier run: the writer has nothing to close
            self._finish_shard(shard_id, claim.batch_id, cleanly=True)
            return "done"
        if self._wait_for_results(shard_id, pending, service):
            return "done"  # the writer closed the shard with its last result
        if not pending.take_over():  # it stopped as its last results were being committed
            pending.wait(self.settings.heartbeat_timeout)
            return "done"  # the writer closes the shard with them
        service.abort([job.request_id for job in jobs])
        return self._stop_early(shard_id, claim.batch_id, service)

    @property
    def fingerprint(self) -> str | None:
        """The model fingerprint of the engine (None for the echo engine, which has no model:
        its lines are neither recorded for reuse nor reused)."""
        return getattr(self.engine, "fingerprint", None)

    def _record_run(self, batch_id: str) -> None:
        """Note in the ledger, once per batch and engine, what runs the batch here: the
        model fingerprint, the engine's settings and its sampling defaults."""
        fingerprint = self.fingerprint
        if fingerprint is None or (batch_id, fingerprint) in self._runs_recorded:
            return  # the echo engine has no model to fingerprint
        try:
            with self.ledger.session() as session:
                record_run(session, batch_id, self.name, fingerprint, run_record(self.engine))
        except Exception:  # the record is for people; the shard runs without it
            log.warning("could not record what runs batch %s", batch_id, exc_info=True)
            return
        self._runs_recorded.add((batch_id, fingerprint))

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

    def _reuse(
        self,
        claim: ClaimedShard,
        pending: PendingResults,
        jobs: list[EngineJob],
        keyed: dict[str, Keyed],
    ) -> list[EngineJob]:
        """Answer the jobs whose key an earlier result of the project has under this model's
        fingerprint with that result; the others, to run."""
        fingerprint = self.fingerprint
        assert fingerprint is not None, "only a fingerprinted engine keys its lines"
        try:
            with self.ledger.reads() as session:
                found = find_reusable(
                    session, claim.project, fingerprint, (k.key for k in keyed.values())
                )
        except Exception:  # nothing is lost: the lines are computed
            log.warning("could not look up reusable results; computing them", exc_info=True)
            return jobs
        left = []
        for job in jobs:
            entry = keyed.get(job.request_id)
            hit = None if entry is None else found.get(entry.key)
            if hit is None:
                left.append(job)
                continue
            parsed = entry.parsed
            line = reused_line(hit.output, parsed.custom_id, hit.batch_id, hit.line_id)
            self._write(claim.batch_id, entry.request_id, line, pending, parsed.line, True,
                        prompt_tokens=hit.prompt_tokens, completion_tokens=hit.completion_tokens,
                        cached_tokens=hit.cached_tokens, fingerprint=fingerprint,
                        request_key=entry.key, reused=True)  # fmt: skip
        if len(left) < len(jobs):
            log.info("shard %s: %d lines answered from earlier results",
                     claim.shard_id, len(jobs) - len(left))  # fmt: skip
        return left

    def _job(
        self,
        claim: ClaimedShard,
        pending: PendingResults,
        keyed: dict[str, Keyed],
        request_id: int,
        line: int,
        raw: str,
        engine_failures: int,
    ) -> EngineJob | None:
        """The engine job of one request of the shard, or None when the request fails before
        it reaches the engine (its error line is written). A request that was in the step of
        an engine failure runs alone; one in `max_request_failures` of them is quarantined."""
        batch_id = claim.batch_id
        if engine_failures >= self.settings.max_request_failures:
            self._write(batch_id, request_id, self._quarantined(raw, line), pending, line)
            return None
        engine_id = f"{batch_id}:{request_id}"
        prepared = prepare_line(self.engine, raw, line, engine_id, self._parse)
        if not isinstance(prepared, PreparedLine):  # its error line
            self._write(batch_id, request_id, prepared, pending, line)
            return None
        parsed = prepared.parsed
        key = reuse_key(prepared) if self.fingerprint is not None else None
        if key is not None:
            keyed[engine_id] = Keyed(key, request_id, parsed)
        return EngineJob(
            engine_id,
            prepared.prompt,
            prepared.params,
            on_done=partial(
                self._on_done, batch_id, request_id, parsed, claim.model, pending, key
            ),  # fmt: skip
            on_error=partial(self._on_refused, batch_id, request_id, parsed, pending),
            priority=BATCH_PRIORITY,
            solo=engine_failures > 0,
        )

    def _parse(self, raw: str | bytes, line: int) -> ParsedRequest:
        parsed = parse_request_line(raw, line=line)
        apply_max_tokens_cap(parsed, self.settings.max_tokens_cap)
        return parsed

    def _quarantined(self, raw: str, line: int) -> dict[str, Any]:
        failures = self.settings.max_request_failures
        message = (
            f"this request was not run again: the engine failed {failures} times while it "
            "ran (after the first time, it ran with no other request beside it; "
            f"CONVEYOR_MAX_REQUEST_FAILURES={failures})"
        )
        log.warning("line %d quarantined: %s", line, message)
        return build_error_line(
            peek_custom_id(raw), REQUEST_QUARANTINED, message, line=line, status_code=500
        )

    def _wait_for_results(
        self, shard_id: int, pending: PendingResults, service: EngineService
    ) -> bool:
        """Heartbeat the shard until all its results are committed (True), or until it must
        stop early (False): shutdown, the engine (`service`'s) failed, or its batch no longer
        runs."""
        next_beat = time.monotonic() + self.settings.heartbeat_interval
        # woken often, so that a hand-back (Ctrl-C) or the engine's failure stops it at once
        while not pending.wait(STOP_CHECK_SECONDS):
            if self.handing_back.is_set() or service.failure is not None:
                return False
            if time.monotonic() < next_beat:
                continue
            next_beat = time.monotonic() + self.settings.heartbeat_interval
            try:
                with self.ledger.session() as session:
                    status = shard_heartbeat(session, shard_id)
            except Exception:
                log.warning("shard %s heartbeat failed; retrying", shard_id)
                continue
            if status != BatchStatus.IN_PROGRESS:  # cancelled or expired: stop spending on it
                return False
        return True

    def _stop_early(self, shard_id: int, batch_id: str, service: EngineService) -> str:
        """Close a shard stopped before its end: what finished stays, the rest is queued
        again. The engine's failure counts against the requests of its step; it counts against
        the shard's run only when those could not be named."""
        if service.failure is not None:
            log.warning("shard %s: the engine failed; handing back what is unfinished", shard_id)
            # what the engine finished before is committed first, so no run repeats it
            self.writer.drain(timeout=max(5.0, self.settings.heartbeat_timeout))
            self._finish_shard(shard_id, batch_id, cleanly=bool(service.suspects))
            return "handed back: the engine failed"
        if self.handing_back.is_set():
            log.info("shard %s: handing back its unfinished requests", shard_id)
        self._finish_shard(shard_id, batch_id, cleanly=True)
        return "handed back" if self.handing_back.is_set() else "stopped"

    def _finish_shard(self, shard_id: int, batch_id: str, cleanly: bool = False) -> None:
        """Close the shard in the ledger, waiting out a database that is away; any other error
        ends this run of the shard with its text in the log (the shard's heartbeat stops, and
        the reconciler sends it again)."""

        def close(session: Session) -> None:
            close_shards(session, [(shard_id, batch_id)], self.settings.heartbeat_timeout)
            if cleanly:
                give_back_attempt(session, shard_id)

        try:
            until_reached(self.ledger, close, f"the close of shard {shard_id}")
        except Exception:
            log.exception("shard %s could not be closed; it runs again elsewhere", shard_id)
            raise

    # ---- results (called from the engine thread) -------------------------------------------
    def _on_done(self, batch_id, request_id, parsed, model, pending, key, output) -> None:
        if output.error is None:  # it ran to its end
            self.metrics.observe_request(output)
        line, ok = output_line(parsed, output, model, self.decoder, f"{batch_id}:{request_id}")
        if not ok:
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
            cached_tokens=output.num_cached_tokens,
            # a deterministic answer may answer an equal line later (`ledger.reuse`)
            fingerprint=None if key is None else self.fingerprint,
            request_key=key,
        )

    def _on_refused(self, batch_id, request_id, parsed, pending, err) -> None:
        """The engine refused the request, or gave up on it (`err`: an exception or the
        output's `RequestFailure`)."""
        line = refused_line(err, parsed, f"{batch_id}:{request_id}")
        self._write(batch_id, request_id, line, pending, parsed.line)

    def _write(self, batch_id, request_id, line, pending, number=None, ok=False, **tokens) -> None:
        row = result_row(request_id, batch_id, line, ok=ok, worker=self.name, **tokens)
        self.writer.put(WriteItem(row, pending, line.get("custom_id"), number))


@dataclass
class Keyed:
    """A line of a shard that has a reuse key (`request_outcome.reuse_key`)."""

    key: str
    request_id: int
    parsed: ParsedRequest


def run_record(engine: Any) -> dict[str, Any]:
    """What `batch_runs` keeps of an engine: its settings (JSON-safe), how each piece runs, the
    sampling defaults in force and Conveyor's version."""
    config = getattr(engine, "engine_config", None)
    settings = {} if config is None else json_safe(dataclasses.asdict(config))
    plan = getattr(engine, "plan", None)
    if plan is not None:
        settings["plan"] = json_safe(plan.as_dict())
    return {
        "conveyor": __version__,
        "engine": settings,
        "default_sampling": dict(getattr(engine, "default_sampling", {})),
    }


def json_safe(value: Any) -> Any:
    """`value` with what JSON cannot hold (a torch dtype, a path) as its text."""
    return json.loads(json.dumps(value, default=str))
