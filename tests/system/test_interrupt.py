"""Ctrl-C is prompt: `conveyor worker`, `conveyor serve` and `conveyor submit --wait` stop soon
after SIGINT with a line saying what became of the work, and running them again goes on with it
(`conveyor eval`'s Ctrl-C is in test_lm_eval.py). A worker hands its running shards back at once
instead of letting them finish, as SIGTERM does (test_faults.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from conveyor.testing import Stack, batch_lines, submit_batch, wait_for, write_jsonl
from tests.system.test_embedded import embedded_env, serving
from tests.system.test_service_recovery import assert_each_once

EXIT_INTERRUPTED = 130
PROMPT_SECONDS = 3.0  # the goal is 2 s; the rest is room for a loaded machine


def interrupt(proc: subprocess.Popen) -> float:
    """Ctrl-C to `proc`; the seconds until it exited."""
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    return time.monotonic() - started


def wait_running(api: str, batch_id: str) -> None:
    """Until some of the batch's requests finished (its shards are running)."""
    deadline = time.monotonic() + 120
    while httpx.get(f"{api}/v1/batches/{batch_id}").json()["request_counts"]["completed"] < 1:
        assert time.monotonic() < deadline, "the batch never started"
        time.sleep(0.1)


def unfinished(api: str, batch_id: str, total: int) -> bool:
    counts = httpx.get(f"{api}/v1/batches/{batch_id}").json()["request_counts"]
    return counts["completed"] + counts["failed"] < total


def test_ctrl_c_stops_a_worker_and_submit_at_once_and_the_batch_goes_on(
    stack: Stack, chat_model: Path, tmp_path: Path
) -> None:
    api = stack.start_api()
    worker = stack.start_worker("w1", chat_model)
    lines = batch_lines(240, max_tokens=48)
    batch_id = submit_batch(api, write_jsonl(tmp_path / "in.jsonl", lines))
    wait_running(api, batch_id)

    took = interrupt(worker)
    assert worker.returncode == EXIT_INTERRUPTED, stack.log("w1")[-3000:]
    assert took < PROMPT_SECONDS, f"the worker took {took:.1f} s to stop"
    assert "conveyor worker: interrupted; its running shards went back" in stack.log("w1")
    assert unfinished(api, batch_id, len(lines)), "the batch ended first; make it longer"

    # no worker now: `submit --wait` waits, and Ctrl-C leaves it at once, naming the batch
    waiting = subprocess.Popen(
        [sys.executable, "-m", "conveyor", "submit", "--resume", batch_id, "--wait",
         "--url", api, "--poll", "0.2"],
        env=stack.env, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    time.sleep(2)
    took = interrupt(waiting)
    said = waiting.stderr.read()
    assert waiting.returncode == EXIT_INTERRUPTED, said
    assert took < PROMPT_SECONDS, f"submit took {took:.1f} s to stop"
    assert f"batch {batch_id} goes on" in said and f"--resume {batch_id}" in said

    stack.start_worker("w2", chat_model)
    done = wait_for(api, batch_id, timeout=240)
    assert done["request_counts"] == {"total": 240, "completed": 240, "failed": 0, "reused": 0}
    assert_each_once(api, done, lines)


def test_ctrl_c_stops_serve_at_once_and_serving_again_finishes_the_batch(tmp_path: Path) -> None:
    env = embedded_env(tmp_path / "data")
    lines = batch_lines(400, model="demo", max_tokens=64)
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    with serving(sys.executable, tmp_path, env) as (url, proc):
        batch_id = submit_batch(url, path)
        wait_running(url, batch_id)
        assert unfinished(url, batch_id, len(lines)), "the batch ended first; make it longer"
        took = interrupt(proc)
        assert proc.returncode == EXIT_INTERRUPTED
        assert took < PROMPT_SECONDS, f"serve took {took:.1f} s to stop"
    log = (tmp_path / "serve.log").read_text()
    assert "conveyor serve: interrupted; its running shards went back" in log
    # the shards routed to it and not started went back too: started again, the service sends
    # them at once instead of after the grace it gives a message that may be on its way
    assert "sent here and not started go back to the queue" in log, log[-3000:]

    with serving(sys.executable, tmp_path, env) as (url, _):
        done = wait_for(url, batch_id, timeout=240)
        assert done["request_counts"] == {"total": 400, "completed": 400, "failed": 0, "reused": 0}
        assert_each_once(url, done, lines)
