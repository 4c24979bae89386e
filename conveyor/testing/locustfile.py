"""Clients polling a running batch and listing, for `conveyor.testing.load` (locust, headless).

--batch-id names the batch; CONVEYOR_API_KEY, when set, is sent as the bearer key.
Each user polls the batch's status and now and then lists batches and files, the way a
dashboard or a pipeline waiting on a batch does. The run ends when the batch is finished.
"""

from __future__ import annotations

import os

import gevent
from locust import FastHttpUser, between, events, task

KEY = os.environ.get("CONVEYOR_API_KEY")
FINISHED = {"completed", "failed", "expired", "cancelled"}


@events.init_command_line_parser.add_listener
def add_arguments(parser) -> None:
    parser.add_argument("--batch-id", help="the batch the clients poll", include_in_web_ui=False)


class Poller(FastHttpUser):
    """geventhttpclient rather than requests: the clients share the machine with the API, and
    a lighter client leaves it more of the CPU and adds less of its own time to each latency."""

    wait_time = between(0.2, 0.5)
    default_headers = {"Authorization": f"Bearer {KEY}"} if KEY else None

    def on_start(self) -> None:
        self.batch = self.environment.parsed_options.batch_id

    @task(6)
    def status(self) -> None:
        with self.client.get(
            f"/v1/batches/{self.batch}", name="GET /v1/batches/{id}", catch_response=True
        ) as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}: {r.text[:200]}")
            elif r.json()["status"] in FINISHED and self.environment.runner is not None:
                # from a greenlet of its own: quit() stops this user's greenlet too
                gevent.spawn(self.environment.runner.quit)

    @task(1)
    def list_batches(self) -> None:
        self.client.get("/v1/batches?limit=20", name="GET /v1/batches")

    @task(1)
    def list_files(self) -> None:
        self.client.get("/v1/files?limit=20", name="GET /v1/files")
