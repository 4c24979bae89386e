"""Hostile input and faulty engines stall nobody, on real API and worker processes.

Lines that no tokenizer or database can take are refused at the door; behind it, a request
the engine cannot take or whose result cannot be stored fails alone, a worker whose engine
dies withdraws at once and hands its shards back, and a line that keeps killing its worker
is quarantined. Other projects' batches complete meanwhile.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import httpx
import sqlalchemy as sa

from conveyor.settings import normalize_database_url
from conveyor.testing import (
    Stack,
    batch_lines,
    create_key,
    download,
    submit_batch,
    wait_for,
    write_jsonl,
)
from conveyor.worker.runtime import ENGINE_FAILED_EXIT

FAULTY_WORKER = str(Path(__file__).with_name("faulty_worker.py"))
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def faulty(*faults: str) -> list[str]:
    """A launcher for `Stack.start_worker`: the real worker over an engine with `faults`."""
    return [FAULTY_WORKER, *faults, "--"]


def query(stack: Stack, sql: str, **params) -> list:
    engine = sa.create_engine(normalize_database_url(stack.env["DATABASE_URL"]))
    try:
        with engine.connect() as conn:
            return list(conn.execute(sa.text(sql), params).all())
    finally:
        engine.dispose()


def every_line(api: str, batch: dict, headers: dict | None = None) -> list[dict]:
    """The batch's output and error lines; every custom_id of the input exactly once."""
    return download(api, batch["output_file_id"], headers) + download(
        api, batch["error_file_id"], headers
    )


def assert_each_once(lines: list[dict], wanted: list[dict]) -> dict[str, dict]:
    assert Counter(x["custom_id"] for x in lines) == Counter(x["custom_id"] for x in wanted)
    return {x["custom_id"]: x for x in lines}


# ---- the engine loop dies ---------------------------------------------------------------------


def test_a_worker_whose_engine_fails_withdraws_hands_back_and_exits(
    stack: Stack, tmp_path: Path
) -> None:
    stack.env["CONVEYOR_ECHO_STEP_SECONDS"] = "0.05"  # 4 requests a step: a batch of 10 steps
    api = stack.start_api()
    w1 = stack.start_worker(
        "w1", "echo", "--max-num-seqs", "4", launcher=faulty("--fail-after-steps", "6")
    )
    lines = batch_lines(40)
    batch_id = submit_batch(api, write_jsonl(tmp_path / "in.jsonl", lines))

    assert w1.wait(60) == ENGINE_FAILED_EXIT, stack.log("w1")[-3000:]
    # it stopped announcing itself and left no shard running, without any timeout passing
    assert query(stack, "SELECT id FROM workers WHERE last_seen > 0") == []
    assert httpx.get(f"{api}/v1/models", timeout=10).json()["data"] == []
    assert query(stack, "SELECT id FROM shards WHERE status = 'running'") == []
    done_before = query(stack, "SELECT count(*) FROM results")[0][0]
    assert 0 < done_before < len(lines)  # what the engine finished was committed
    log = stack.log("w1")
    assert "the engine failed" in log and "handing back what is unfinished" in log

    started = time.time()
    stack.start_worker("w2", "echo")
    batch = wait_for(api, batch_id, timeout=120)
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": 40, "completed": 40, "failed": 0, "reused": 0}
    assert_each_once(every_line(api, batch), lines)
    assert time.time() - started < 60
    by_worker = dict(query(stack, "SELECT worker, count(*) FROM results GROUP BY worker"))
    assert by_worker == {"w1": done_before, "w2": 40 - done_before}


# ---- two projects on one deployment -----------------------------------------------------------


def project_headers(stack: Stack, name: str) -> dict[str, str]:
    """The Authorization header of a new key of project `name`."""
    return create_key(stack.env, name).headers


def completion_lines(n: int, prefix: str) -> list[dict]:
    return [
        {
            "custom_id": f"{prefix}-{i}",
            "method": "POST",
            "url": COMPLETIONS,
            "body": {"model": "tiny", "prompt": f"say {i}", "max_tokens": 4},
        }
        for i in range(n)
    ]


class Deployment:
    """An API with auth, two projects, and the batches of each submitted so far."""

    def __init__(self, stack: Stack) -> None:
        stack.env["CONVEYOR_AUTH"] = "required"
        self.stack = stack
        self.api = stack.start_api()
        self.a = project_headers(stack, "A")
        self.b = project_headers(stack, "B")

    def wait(self, batch_id: str, headers: dict[str, str], timeout: float) -> dict:
        return wait_for(self.api, batch_id, timeout=timeout, headers=headers)

    def lines(self, batch: dict, headers: dict[str, str]) -> list[dict]:
        return every_line(self.api, batch, headers)


def poison_batches(tmp_path: Path) -> tuple[list[dict], list[dict]]:
    """Project A's chat batch with a lone surrogate in one message, and its completions batch
    whose one prompt is a lone surrogate (the two lines of issue 16)."""
    chat = batch_lines(10, prefix="a")
    chat[3]["body"]["messages"][1]["content"] = "\ud800"
    completions = completion_lines(5, prefix="ac")
    completions[2]["body"]["prompt"] = "\udfff"
    return chat, completions


def assert_poison_failed_alone(
    deployment: Deployment, ids: tuple[str, str], chat: list, completions: list
) -> None:
    for batch_id, lines, poison, param in (
        (ids[0], chat, "a-3", "body.messages[1].content"),
        (ids[1], completions, "ac-2", "body.prompt"),
    ):
        batch = deployment.wait(batch_id, deployment.a, timeout=60)
        assert batch["status"] == "completed", batch
        n = len(lines)
        assert batch["request_counts"] == {"total": n, "completed": n - 1, "failed": 1, "reused": 0}
        got = assert_each_once(deployment.lines(batch, deployment.a), lines)
        error = got[poison]["error"]
        assert (error["code"], error["param"]) == ("invalid_unicode", param)
        assert got[poison]["response"]["status_code"] == 400
        assert all(got[x["custom_id"]]["error"] is None for x in lines if x["custom_id"] != poison)


def test_poison_lines_fail_alone_and_stall_no_one(stack: Stack, tmp_path: Path) -> None:
    deployment = Deployment(stack)
    stack.start_worker("w1", "echo")
    chat, completions = poison_batches(tmp_path)
    api, a, b = deployment.api, deployment.a, deployment.b
    ids = (
        submit_batch(api, write_jsonl(tmp_path / "a.jsonl", chat), a),
        submit_batch(api, write_jsonl(tmp_path / "ac.jsonl", completions), a, COMPLETIONS),
    )
    others = batch_lines(40, prefix="b", system="Project B's system prompt.")
    started = time.time()
    b_id = submit_batch(api, write_jsonl(tmp_path / "b.jsonl", others), b)

    batch = deployment.wait(b_id, b, timeout=30)  # the other project is not held up
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": 40, "completed": 40, "failed": 0, "reused": 0}
    assert time.time() - started < 30
    assert_each_once(deployment.lines(batch, b), others)
    assert_poison_failed_alone(deployment, ids, chat, completions)
    assert "could not commit" not in stack.log("w1")


def test_poison_lines_stall_no_one_after_a_worker_is_killed(stack: Stack, tmp_path: Path) -> None:
    stack.env["CONVEYOR_ECHO_STEP_SECONDS"] = "0.1"  # 4 requests a step: batches take a while
    deployment = Deployment(stack)
    stack.start_worker("w1", "echo", "--max-num-seqs", "4")
    chat, completions = poison_batches(tmp_path)
    api, a, b = deployment.api, deployment.a, deployment.b
    ids = (
        submit_batch(api, write_jsonl(tmp_path / "a.jsonl", chat), a),
        submit_batch(api, write_jsonl(tmp_path / "ac.jsonl", completions), a, COMPLETIONS),
    )
    others = batch_lines(40, prefix="b", system="Project B's system prompt.")
    b_id = submit_batch(api, write_jsonl(tmp_path / "b.jsonl", others), b)
    deadline = time.time() + 60
    while query(stack, "SELECT count(*) FROM results WHERE ok")[0][0] < 8:
        assert time.time() < deadline, stack.log("w1")[-3000:]
        time.sleep(0.1)
    stack.kill("w1")  # SIGKILL mid-run: its shards are re-sent to the next worker
    runnable = len(others) + len(chat) - 1 + len(completions) - 1
    assert query(stack, "SELECT count(*) FROM results WHERE ok")[0][0] < runnable

    started = time.time()
    stack.start_worker("w2", "echo", "--max-num-seqs", "4")
    batch = deployment.wait(b_id, b, timeout=90)
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": 40, "completed": 40, "failed": 0, "reused": 0}
    assert time.time() - started < 90  # the heartbeat timeout, then 10 s of steps
    assert_each_once(deployment.lines(batch, b), others)
    assert_poison_failed_alone(deployment, ids, chat, completions)
    assert "could not commit" not in stack.log("w2")


# ---- behind the door ---------------------------------------------------------------------------


def test_what_the_engine_cannot_take_or_the_ledger_cannot_store_fails_alone(
    stack: Stack, tmp_path: Path
) -> None:
    """Validation will miss something some day: a prompt the engine's tokenizer raises on,
    model text with a lone surrogate. Each fails (or is stored) alone, and the worker and the
    other project's batch go on."""
    deployment = Deployment(stack)
    w1 = stack.start_worker(
        "w1",
        "echo",
        launcher=faulty("--refuse-prompt-with", "TOKENIZER-FAILS", "--surrogate-text-for", "ODD"),
    )
    api, a, b = deployment.api, deployment.a, deployment.b
    lines = completion_lines(6, prefix="a")
    lines[1]["body"]["prompt"] = "TOKENIZER-FAILS here"
    lines[4]["body"]["prompt"] = "ODD text"
    lines[5]["body"]["prompt"] = "a NUL \x00 is text"  # storable: JSON escapes it
    a_id = submit_batch(api, write_jsonl(tmp_path / "a.jsonl", lines), a, COMPLETIONS)
    others = batch_lines(20, prefix="b")
    b_id = submit_batch(api, write_jsonl(tmp_path / "b.jsonl", others), b)

    batch = deployment.wait(a_id, a, timeout=30)
    assert batch["request_counts"] == {"total": 6, "completed": 5, "failed": 1, "reused": 0}, batch
    got = assert_each_once(deployment.lines(batch, a), lines)
    refused = got["a-1"]
    assert refused["error"]["code"] == "internal_error" and refused["error"]["line"] == 2
    assert refused["response"]["status_code"] == 500
    # no internals in the line: the request's id, which the worker's log line carries
    engine_id = f"{a_id}:"
    assert f"internal error (request {engine_id}" in refused["error"]["message"]
    assert "TypeError" not in refused["error"]["message"]
    assert any(engine_id in line and "TypeError" in line for line in stack.log("w1").splitlines())
    assert got["a-4"]["response"]["body"]["choices"][0]["text"] == "ODD text \udc80"
    assert got["a-5"]["response"]["body"]["choices"][0]["text"] == "a NUL \x00 is text"
    assert deployment.wait(b_id, b, timeout=30)["status"] == "completed"
    assert w1.poll() is None  # still up, and still announcing itself
    assert [r[0] for r in query(stack, "SELECT id FROM workers WHERE last_seen > 0")] == ["w1"]


# ---- quarantine -------------------------------------------------------------------------------


def test_a_line_that_keeps_killing_its_worker_is_quarantined_alone(
    stack: Stack, tmp_path: Path
) -> None:
    deployment = Deployment(stack)
    api, a, b = deployment.api, deployment.a, deployment.b
    # one worker thread: a shard in flight with the poisoned one would share its fate
    launcher = faulty("--fail-while-in-flight", "KILLS-THE-ENGINE")
    w1 = stack.start_worker("w1", "echo", "--concurrency", "1", launcher=launcher)
    poisoned = batch_lines(12, prefix="a")  # shards: lines 1-8 and 9-12
    poisoned[1]["body"]["messages"][1]["content"] += " KILLS-THE-ENGINE"
    a_id = submit_batch(api, write_jsonl(tmp_path / "a.jsonl", poisoned), a)
    others = batch_lines(16, prefix="b", system="Project B's system prompt.")
    started = time.time()
    b_id = submit_batch(api, write_jsonl(tmp_path / "b.jsonl", others), b)

    exits, b_done = [], None
    deadline = time.time() + 240
    while True:
        a_batch = httpx.get(f"{api}/v1/batches/{a_id}", headers=a, timeout=10).json()
        if b_done is None:
            b_batch = httpx.get(f"{api}/v1/batches/{b_id}", headers=b, timeout=10).json()
            if b_batch["status"] == "completed":
                b_done = time.time() - started
        if a_batch["status"] == "completed" and b_done is not None:
            break
        if w1.poll() is not None:  # the supervisor restarts it (compose: unless-stopped)
            exits.append(w1.returncode)
            w1 = stack.start_worker(
                "w1", "echo", "--concurrency", "1", launcher=launcher, wait=False
            )
        assert time.time() < deadline, (a_batch, exits, stack.log("w1")[-3000:])
        time.sleep(0.2)

    # the first failure blames the 8 lines in flight; each then runs alone, and the second
    # failure, alone, names the poisoned one (CONVEYOR_MAX_REQUEST_FAILURES, by default 2)
    assert exits == [ENGINE_FAILED_EXIT] * 2
    assert a_batch["request_counts"] == {"total": 12, "completed": 11, "failed": 1, "reused": 0}
    got = assert_each_once(deployment.lines(a_batch, a), poisoned)
    for i in range(12):
        line = got[f"a-{i}"]
        if i == 1:
            assert line["error"]["code"] == "request_quarantined", line
            assert line["response"]["status_code"] == 500
            assert "failed 2 times" in line["error"]["message"]
            assert "CONVEYOR_MAX_REQUEST_FAILURES=2" in line["error"]["message"]
        else:
            assert line["error"] is None, line
    assert "quarantined" in stack.log("w1")
    b_batch = deployment.wait(b_id, b, timeout=10)
    assert b_batch["request_counts"] == {"total": 16, "completed": 16, "failed": 0, "reused": 0}
    assert b_done < 60, b_done
