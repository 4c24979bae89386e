"""What the web page reads beside the batch objects, computed from a ledger written by hand:
error lines grouped by code, results over time, live workers and each model's queue. (The page
itself, in a browser, is tests/ui/test_page.py.)"""

from __future__ import annotations

import fnmatch
import json
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from conveyor.api import batch_summary
from conveyor.api.errors import APIError
from conveyor.api.workers_view import model_queues, worker_list
from conveyor.ledger.db import Ledger
from conveyor.ledger.models import BatchRow, RequestRow, ResultRow, ShardRow, WorkerRow

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def ledger(database_url: str) -> Iterator[Ledger]:
    ledger = Ledger(database_url)
    yield ledger
    ledger.dispose()


def add_batch(session: Session, batch_id: str, project: str = "default", model: str = "m"):
    session.add(
        BatchRow(
            id=batch_id,
            project=project,
            input_file_id="file-x",
            endpoint="/v1/chat/completions",
            completion_window="24h",
            model=model,
            status="in_progress",
            created_at=0,
        )
    )
    session.flush()


def add_results(session: Session, batch_id: str, results: list[tuple[float, str | None, int]]):
    """(created_at, error code or None for a result, completion tokens) per request."""
    for i, (at, code, tokens) in enumerate(results):
        request = RequestRow(batch_id=batch_id, line=i + 1, custom_id=f"c{i}", raw="{}")
        session.add(request)
        session.flush()
        error = None if code is None else {"code": code, "message": f"m{i}", "line": i + 1}
        line = {"id": f"{batch_id}-l{i}", "custom_id": f"c{i}", "response": None, "error": error}
        session.add(
            ResultRow(
                request_id=request.id,
                batch_id=batch_id,
                line_id=line["id"],
                ok=code is None,
                output=json.dumps(line),
                completion_tokens=tokens,
                created_at=at,
            )
        )


def add_worker(session: Session, name: str, model: str, seen_ago: float, stats=None) -> None:
    now = time.time()
    row = WorkerRow(
        id=name, models=[model], queues=[], started_at=now - 60, last_seen=now - seen_ago
    )
    row.stats = stats
    session.add(row)


def add_shards(session: Session, batch_id: str, shards: list[tuple[str, int, str | None]]):
    """(status, size, worker) per shard."""
    for i, (status, size, worker) in enumerate(shards):
        shard = ShardRow(batch_id=batch_id, index=i, queue="q", status=status, size=size)
        shard.prefix_key, shard.worker = "p", worker
        session.add(shard)


def test_error_lines_are_grouped_by_code_with_the_first_examples(ledger: Ledger, monkeypatch):
    codes = [None, "b", "a", "b", None, "b", "a", "c"]
    with ledger.session() as session:
        add_batch(session, "batch-1")
        add_results(session, "batch-1", [(100.0 + i, code, 1) for i, code in enumerate(codes)])
    with ledger.reads() as session:
        groups = batch_summary.error_groups(session, "batch-1", "default", examples=2)
        assert [(g.code, g.count) for g in groups.data] == [("b", 3), ("a", 2), ("c", 1)]
        assert [e.custom_id for e in groups.data[0].examples] == ["c1", "c3"]  # the first two
        assert groups.data[0].examples[0].message == "m1" and groups.data[0].examples[0].line == 2
        assert (groups.scanned, groups.complete) == (6, True)
        with pytest.raises(APIError) as other_project:
            batch_summary.error_groups(session, "batch-1", "team-b", examples=2)
        assert other_project.value.status == 404
        monkeypatch.setattr(batch_summary, "MAX_SCANNED", 4)
        partial = batch_summary.error_groups(session, "batch-1", "default", examples=0)
        assert (partial.scanned, partial.complete) == (4, False)
        assert sum(g.count for g in partial.data) == 4 and partial.data[0].examples == []


def test_throughput_counts_results_per_interval(ledger: Ledger) -> None:
    start = 1_700_000_000.0
    # 3 results in the first second, none in the next two, 2 (one failed) in the fourth
    short = [(start + 0.1, None, 5), (start + 0.5, None, 5), (start + 0.9, None, 2),
             (start + 3.2, "x", 0), (start + 3.7, None, 4)]  # fmt: skip
    # 200 results over 10 minutes: intervals of 10 s
    long = [(start + 3 * i, None, 1) for i in range(200)]
    with ledger.session() as session:
        for batch_id, results in (("b-short", short), ("b-long", long), ("b-none", [])):
            add_batch(session, batch_id)
            add_results(session, batch_id, results)
    with ledger.reads() as session:
        series = batch_summary.throughput(session, "b-short", "default")
        assert series.bucket_seconds == 1 and series.first_result_at == start + 0.1
        points = [
            (p.start - int(start), p.requests, p.failed, p.output_tokens) for p in series.data
        ]
        assert points == [(0, 3, 0, 12), (1, 0, 0, 0), (2, 0, 0, 0), (3, 2, 1, 4)]
        series = batch_summary.throughput(session, "b-long", "default")
        assert series.bucket_seconds == 10 and len(series.data) == 60
        assert {p.requests for p in series.data} <= {3, 4}
        assert sum(p.requests for p in series.data) == 200
        assert batch_summary.throughput(session, "b-none", "default").data == []
        with pytest.raises(APIError):
            batch_summary.throughput(session, "b-short", "team-b")


def test_live_workers_show_their_engine_state(ledger: Ledger) -> None:
    engine = {"num_running": 5, "num_waiting": 2, "in_flight": 7, "kv_blocks_total": 400,
              "kv_blocks_used": 100, "prompt_tokens_computed": 300, "prompt_tokens_cached": 100,
              "generation_tokens": 900, "num_preemptions": 1, "device": "cuda:0",
              "kv_bytes_per_token": 114688}  # fmt: skip
    with ledger.session() as session:
        add_worker(session, "gpu-1", "qwen3", seen_ago=1, stats=engine)
        add_worker(session, "echo-1", "echo", seen_ago=1, stats={"generation_tokens": 3})
        add_worker(session, "gone", "qwen3", seen_ago=60, stats=engine)
        add_batch(session, "batch-1", model="qwen3")
        running = ("running", 8, "gpu-1")
        add_shards(session, "batch-1", [running, running, ("queued", 8, None), ("done", 8, "w")])
    with ledger.reads() as session:
        workers = {w.id: w for w in worker_list(session, heartbeat_timeout=30).data}
    assert sorted(workers) == ["echo-1", "gpu-1"]  # not the one silent for a minute
    gpu = workers["gpu-1"]
    assert (gpu.device, gpu.running_requests, gpu.waiting_requests) == ("cuda:0", 5, 2)
    assert gpu.in_flight_requests == 7
    assert (gpu.kv_cache_usage, gpu.prefix_cache_hit_rate, gpu.running_shards) == (0.25, 0.25, 2)
    assert gpu.generation_tokens == 900 and gpu.preemptions == 1
    assert gpu.kv_bytes_per_token == 114688
    echo = workers["echo-1"]  # a null engine has no KV cache, no prefix cache, no shards now
    assert (echo.device, echo.kv_cache_usage, echo.prefix_cache_hit_rate) == (None, None, None)
    assert echo.kv_bytes_per_token is None
    assert (echo.running_requests, echo.generation_tokens, echo.running_shards) == (None, 3, 0)


def test_queues_count_the_projects_own_work(ledger: Ledger) -> None:
    with ledger.session() as session:
        add_worker(session, "w", "served", seen_ago=1)
        queued = [("queued", 8, None), ("queued", 3, None)]
        for project, batch_id, model, shards in (
            ("a", "batch-a1", "wanted", [*queued, ("running", 8, "w")]),
            ("a", "batch-a2", "served", [("done", 8, "w")]),
            ("b", "batch-b1", "wanted", [("queued", 8, None)]),
        ):
            add_batch(session, batch_id, project=project, model=model)
            add_shards(session, batch_id, shards)
    with ledger.reads() as session:
        queues = {q.model: q for q in model_queues(session, "a", heartbeat_timeout=30).data}
        assert sorted(queues) == ["served", "wanted"]
        wanted = queues["wanted"]
        assert (wanted.workers, wanted.queued_requests, wanted.queued_shards) == (0, 11, 2)
        assert (wanted.running_shards, wanted.batches_in_progress) == (1, 1)
        served = queues["served"]
        assert (served.workers, served.queued_requests, served.batches_in_progress) == (1, 0, 1)
        other = {q.model: q for q in model_queues(session, "c", heartbeat_timeout=30).data}
        assert list(other) == ["served"] and other["served"].batches_in_progress == 0


def test_the_page_files_ship_with_the_package() -> None:
    # a non-editable install (the API's image) must carry every file the API serves
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["conveyor.api.ui"]
    ui = ROOT / "api" / "ui"
    files = [p.relative_to(ui).as_posix() for p in ui.rglob("*")]
    assert {"index.html", "app.js", "style.css"} <= set(files)
    for name in files:
        assert any(fnmatch.fnmatchcase(name, p) for p in patterns), f"{name} would not ship"


def test_models_list_the_default_sampling_their_workers_run(ledger: Ledger):
    """`GET /v1/models` says what a request that leaves a sampling field out gets."""
    from types import SimpleNamespace

    from conveyor.api.routes.system import list_models

    defaults = {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    with ledger.session() as session:
        add_worker(session, "w1", "qwen", 1.0, stats={"default_sampling": defaults})
        add_worker(session, "w2", "plain", 1.0, stats={"default_sampling": {}})
        # a worker of another version wrote something else: left out, never a 500
        add_worker(session, "w3", "odd", 1.0, stats={"default_sampling": {"top_k": "x"}})
    state = SimpleNamespace(settings=SimpleNamespace(heartbeat_timeout=60.0))
    with ledger.reads() as session:
        models = {m.id: m for m in list_models(state, session).data}
    assert models["qwen"].default_sampling == defaults
    assert models["plain"].default_sampling == models["odd"].default_sampling == {}
    with ledger.reads() as session:
        workers = {w.id: w for w in worker_list(session, 60.0).data}
    assert workers["w1"].default_sampling == defaults and workers["w3"].default_sampling == {}


def test_models_and_workers_show_the_fingerprints_of_what_runs(ledger: Ledger):
    """Two workers of one name on other weights show two fingerprints; one of another version
    that wrote none shows none."""
    from types import SimpleNamespace

    from conveyor.api.routes.system import list_models

    with ledger.session() as session:
        add_worker(session, "w1", "llama", 1.0, stats={"fingerprint": "fp-b"})
        add_worker(session, "w2", "llama", 1.0, stats={"fingerprint": "fp-a"})
        add_worker(session, "w3", "llama", 1.0, stats={"fingerprint": "fp-a"})
        add_worker(session, "w4", "old", 1.0, stats={"fingerprint": 7})
    state = SimpleNamespace(settings=SimpleNamespace(heartbeat_timeout=60.0))
    with ledger.reads() as session:
        models = {m.id: m for m in list_models(state, session).data}
        workers = {w.id: w for w in worker_list(session, 60.0).data}
    assert models["llama"].fingerprints == ["fp-a", "fp-b"] and models["llama"].workers == 3
    assert models["old"].fingerprints == []
    assert workers["w1"].fingerprint == "fp-b" and workers["w4"].fingerprint is None


def test_a_batch_diff_names_what_changed_since_another(ledger: Ledger):
    """`GET /v1/batches/{id}/diff?against=`: lines by custom_id, in the project only."""
    from conveyor.api.batch_summary import batch_diff

    def answer(batch_id: str, answers: dict[str, str]) -> None:
        for i, (custom_id, text) in enumerate(answers.items()):
            request = RequestRow(batch_id=batch_id, line=i + 1, custom_id=custom_id, raw="{}")
            session.add(request)
            session.flush()
            body = {
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "message": {"role": "assistant", "content": text},
                    }
                ]
            }
            line = {"id": f"{batch_id}-{i}", "custom_id": custom_id, "error": None,
                    "response": {"status_code": 200, "body": body}}  # fmt: skip
            session.add(ResultRow(request_id=request.id, batch_id=batch_id, line_id=line["id"],
                                  ok=True, output=json.dumps(line), created_at=1.0))  # fmt: skip

    with ledger.session() as session:
        add_batch(session, "b1")
        add_batch(session, "b2")
        add_batch(session, "theirs", project="other")
        answer("b1", {"a": "yes", "b": "no", "c": "maybe"})
        answer("b2", {"a": "yes", "b": "NO", "d": "new"})
    with ledger.reads() as session:
        found = batch_diff(session, "b2", "b1", "default", top=10, tolerance=0.0)
        assert found.differs and found.same == 1
        assert [c["custom_id"] for c in found.changed] == ["b"]
        assert (found.new, found.gone) == (["d"], ["c"])
        assert not batch_diff(session, "b1", "b1", "default", top=10, tolerance=0.0).differs
        with pytest.raises(APIError):  # another project's batch is not found
            batch_diff(session, "b2", "theirs", "default", top=10, tolerance=0.0)
