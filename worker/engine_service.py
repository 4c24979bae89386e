"""One engine per worker process, stepped by one thread; shard tasks hand it requests.

The engine is not thread-safe, so only the loop thread touches it: tasks put jobs and aborts on
queues, and the loop adds them between steps. A step's batch mixes requests of every shard
(and every batch) in flight in the process. Finished requests go to each job's callback from
the loop thread, which must return quickly (it hands the output to the result writer).

What goes wrong with one request (the engine refuses it, a callback raises) is that job's error
alone; only an error of the engine itself (a step that raises) ends the loop, and the requests
in that step are its suspects. A suspect job (`solo`) is run alone: new jobs wait while the
engine drains, then each solo job runs with nothing beside it, so a second failure names the
request that causes it.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from conveyor.engine.outputs import RequestOutput
from conveyor.engine.protocol import Engine, Prompt
from conveyor.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class EngineJob:
    request_id: str  # "<batch id>:<request row id>"
    prompt: Prompt  # prepared (`Engine.prepare_prompt`) on the thread that made the job
    params: SamplingParams
    on_done: Callable[[RequestOutput], None]  # called with the engine's last output
    # called if the engine refuses the request (an InvalidRequestError says the request is
    # bad; any other exception is the engine's) or `on_done` raised
    on_error: Callable[[Exception], None]
    priority: int = 0  # lower goes first: online requests before batch work
    # called with the output so far after each step that gives a streamed request a token
    on_partial: Callable[[RequestOutput], None] | None = None
    solo: bool = False  # run with no other request in the engine (it was in a failed step)

    @staticmethod
    def batch_of(request_id: str) -> str:
        return request_id.rsplit(":", 1)[0]


class EngineService(threading.Thread):
    def __init__(
        self, engine: Engine, on_failure: Callable[[BaseException], None] | None = None
    ) -> None:
        super().__init__(name="conveyor-engine", daemon=True)
        self.engine = engine
        self.on_failure = on_failure  # called from the loop thread as the loop dies
        self.inbox: queue.SimpleQueue[EngineJob] = queue.SimpleQueue()
        self.aborts: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.jobs: dict[str, EngineJob] = {}
        self.stopped = threading.Event()
        self.wakeup = threading.Event()
        # pairs of batches whose requests ran in the same engine step, and how often
        self.co_scheduled: Counter[tuple[str, str]] = Counter()
        self.steps = 0
        self.failure: BaseException | None = None
        self.suspects: list[str] = []  # the requests in the step that failed
        self.solo: deque[EngineJob] = deque()  # to run alone, one after the other
        self.held: deque[EngineJob] = deque()  # waiting for the solo jobs to end
        self.solo_running: str | None = None

    # ---- called from task threads ------------------------------------------------------------
    def submit(self, jobs: list[EngineJob]) -> None:
        for job in jobs:
            self.inbox.put(job)
        self.wakeup.set()

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.aborts.put(request_id)
        self.wakeup.set()

    def stop(self, timeout: float = 10.0) -> None:
        """End the loop after its current step and wait for it: a process that exits while
        this thread is inside a torch op aborts ("terminate called without an active
        exception"), because the interpreter unwinds a daemon thread through C++ frames."""
        self.stopped.set()
        self.wakeup.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)
            if self.is_alive():
                log.warning("the engine loop did not end its step within %.0f s", timeout)

    def snapshot(self) -> dict[str, Any]:
        stats = self.engine.stats()
        data = {k: v for k, v in vars(stats).items() if isinstance(v, int | float)}
        data["engine_steps"] = self.steps
        data["in_flight"] = len(self.jobs)
        data["co_scheduled"] = [[a, b, n] for (a, b), n in self.co_scheduled.most_common(50)]
        # what a request that leaves a sampling field out gets (generation_config.json)
        data["default_sampling"] = dict(getattr(self.engine, "default_sampling", {}))
        data["fingerprint"] = getattr(self.engine, "fingerprint", None)  # engine.fingerprint
        if self.engine.plan is not None:  # how each piece runs
            data["plan"] = self.engine.plan.as_dict()
        return data

    # ---- the loop --------------------------------------------------------------------------
    def run(self) -> None:
        try:
            while not self.stopped.is_set():
                self._take_jobs()
                self._take_aborts()  # after: an abort that came with its job finds it
                if not self.engine.has_unfinished():
                    self.wakeup.wait(0.5)
                    self.wakeup.clear()
                    continue
                outputs = self.engine.step()
                self._record_mix(outputs)
                for output in outputs:
                    self._deliver(output)
                self.steps += 1
        except BaseException as err:  # the engine broke: the process must not look healthy
            self.failure = err
            self.suspects = self._in_step()
            log.exception("the engine loop failed; in its step: %s", self.suspects)
            if self.on_failure is not None:
                try:
                    self.on_failure(err)
                except Exception:
                    log.exception("could not act on the engine's failure")
            raise

    def _in_step(self) -> list[str]:
        """The requests of the step that failed: those the engine runs (all in flight, for an
        engine that does not say)."""
        try:
            return sorted(set(self.engine.running_request_ids()) & self.jobs.keys())
        except Exception:
            return sorted(self.jobs)

    def _take_jobs(self) -> None:
        for job in _drained(self.inbox):
            if job.solo:
                self.solo.append(job)
            elif self.solo or self.solo_running is not None:
                self.held.append(job)
            else:
                self._add(job)
        if self.solo_running is not None and self.solo_running not in self.jobs:
            self.solo_running = None
        if self.solo_running is None and self.solo and not self.engine.has_unfinished():
            job = self.solo.popleft()
            if self._add(job):
                self.solo_running = job.request_id
        if self.solo_running is None and not self.solo:
            while self.held:
                self._add(self.held.popleft())

    def _add(self, job: EngineJob) -> bool:
        """Hand `job` to the engine; False when the engine refused it."""
        try:
            self.engine.add_request(
                job.request_id,
                job.prompt,
                job.params,
                priority=job.priority,
                stream=job.on_partial is not None,
            )
        except ValueError as err:  # the request is bad (too long, ...): the engine is fine
            self._refuse(job, err)
            return False
        except Exception as err:
            log.warning(
                "the engine could not take request %s: %s: %s",
                job.request_id,
                type(err).__name__,
                err,
            )
            with contextlib.suppress(Exception):  # whatever of it the engine kept
                self.engine.abort(job.request_id)
            self._refuse(job, err)
            return False
        self.jobs[job.request_id] = job
        return True

    def _deliver(self, output: RequestOutput) -> None:
        finished = output.finished
        job = (
            self.jobs.pop(output.request_id, None) if finished else self.jobs.get(output.request_id)
        )
        if job is None:
            return
        try:
            if finished:
                job.on_done(output)
            elif job.on_partial is not None:
                job.on_partial(output)
        except Exception as err:
            log.exception("request %s: its result could not be handed on", job.request_id)
            if not finished:  # it fails now: stop spending the engine on it
                self.jobs.pop(output.request_id, None)
                with contextlib.suppress(Exception):
                    self.engine.abort(output.request_id)
            self._refuse(job, err)

    def _refuse(self, job: EngineJob, err: Exception) -> None:
        try:
            job.on_error(err)
        except Exception:  # nothing is left to tell: its shard waits until it is stopped
            log.exception("request %s: its error could not be handed on", job.request_id)

    def _take_aborts(self) -> None:
        for request_id in _drained(self.aborts):
            if self.jobs.pop(request_id, None) is not None:
                self.engine.abort(request_id)
            else:  # not yet in the engine
                self.solo = deque(j for j in self.solo if j.request_id != request_id)
                self.held = deque(j for j in self.held if j.request_id != request_id)

    def _record_mix(self, finished: list[Any]) -> None:
        """Count the pairs of batches whose requests were in the step that just ran."""
        ids = set(self.engine.running_request_ids())
        ids.update(output.request_id for output in finished)
        batches = sorted({EngineJob.batch_of(i) for i in ids})
        for i, a in enumerate(batches[:8]):
            for b in batches[i + 1 : 8]:
                self.co_scheduled[(a, b)] += 1


def _drained(q: queue.Queue[T]) -> Iterator[T]:
    """What `q` holds now, taken one at a time without waiting."""
    while True:
        try:
            yield q.get_nowait()
        except queue.Empty:
            return
