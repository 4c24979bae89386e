"""The ledger on real PostgreSQL (and SQLite): migrations, at-most-once results, sharding."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from conveyor.ledger import intake, results, shard_lifecycle
from conveyor.ledger.db import Ledger
from conveyor.ledger.migrate import alembic_config
from conveyor.ledger.models import Base, BatchRow, RequestRow, ResultRow, ShardRow
from conveyor.settings import normalize_database_url
from conveyor.testing import batch_lines
from conveyor.wire_format.validation import validate

HEAD = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
TABLES = {"files", "batches", "shards", "requests", "results", "workers", "alembic_version"}


def migrate(url: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "conveyor", "migrate", "--database-url", url],
        capture_output=True,
        text=True,
    )


@pytest.fixture
def empty_database(postgres_server: str):
    import uuid

    admin = sa.create_engine(normalize_database_url(postgres_server), isolation_level="AUTOCOMMIT")
    name = f"conveyor_m_{uuid.uuid4().hex[:8]}"
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = normalize_database_url(postgres_server).rsplit("/", 1)[0] + f"/{name}"
    yield url
    with admin.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.mark.parametrize("backend", ["postgresql", "sqlite"])
def test_migrate_creates_the_ledger(backend, empty_database, tmp_path: Path):
    url = empty_database if backend == "postgresql" else f"sqlite:///{tmp_path / 'l.db'}"
    first = migrate(url)
    assert first.returncode == 0, first.stderr
    assert f"revision {HEAD}" in first.stdout
    engine = sa.create_engine(url)
    assert set(sa.inspect(engine).get_table_names()) >= TABLES
    with engine.connect() as conn:  # the migrations build exactly what the models describe
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == []
    engine.dispose()
    again = migrate(url)  # idempotent
    assert again.returncode == 0, again.stderr


def make_batch(ledger: Ledger, lines: list[dict], shard_size: int = 4) -> tuple[str, list]:
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    f = io.BytesIO(data)
    validation = validate(f, "/v1/chat/completions", 1 << 20, 1000)
    assert not validation.errors
    with ledger.session() as session:
        batch = BatchRow(
            id=f"batch_{time.time_ns()}",
            input_file_id="file-x",
            endpoint="/v1/chat/completions",
            completion_window="24h",
            model=validation.model,
            status="in_progress",
            created_at=0,
            total=len(validation.records),
        )
        session.add(batch)
        session.flush()
        shards = intake.store_requests(session, batch, f, validation, shard_size, "q")
        return batch.id, [(s.id, s.index, s.prefix_key) for s in shards]


def tally_results(session, batch_id: str) -> results.Counts:
    """A batch's totals counted from its result rows: what its counters must equal."""
    row = session.execute(
        sa.select(
            sa.func.count(ResultRow.seq).filter(ResultRow.ok),
            sa.func.count(ResultRow.seq).filter(~ResultRow.ok),
            sa.func.coalesce(sa.func.sum(ResultRow.prompt_tokens), 0),
            sa.func.coalesce(sa.func.sum(ResultRow.completion_tokens), 0),
            sa.func.coalesce(sa.func.sum(ResultRow.cached_tokens), 0),
        ).where(ResultRow.batch_id == batch_id)
    ).one()
    return results.Counts(*(int(x) for x in row))


def test_a_result_is_recorded_at_most_once(database_url: str):
    ledger = Ledger(normalize_database_url(database_url))
    batch_id, _ = make_batch(ledger, batch_lines(3))
    with ledger.session() as session:
        rid = session.execute(sa.select(RequestRow.id).limit(1)).scalar_one()

    def row(text: str) -> dict:
        return dict(
            request_id=rid,
            batch_id=batch_id,
            line_id=text,
            ok=True,
            output=text,
            created_at=time.time(),
            prompt_tokens=7,
            completion_tokens=3,
            cached_tokens=2,
        )

    with ledger.session() as session:
        results.record_results(session, [row("first")])
    with ledger.session() as session:
        results.record_results(session, [row("second")])  # a redelivered shard's duplicate
    with ledger.session() as session:
        outputs = (
            session.execute(sa.select(ResultRow.output).where(ResultRow.request_id == rid))
            .scalars()
            .all()
        )
        assert outputs == ["first"]
        # the batch's running counters counted the first result only
        counted = results.counts(session.get(BatchRow, batch_id))
        assert counted == tally_results(session, batch_id)
        assert (counted.completed, counted.failed, counted.prompt_tokens) == (1, 0, 7)
        assert (counted.completion_tokens, counted.cached_tokens) == (3, 2)
        # the constraint itself, not only the code, refuses a second result
        with pytest.raises(sa.exc.IntegrityError), session.begin_nested():
            session.execute(sa.insert(ResultRow), [row("third")])
    ledger.dispose()


def test_shards_group_requests_by_system_prompt(database_url: str):
    ledger = Ledger(normalize_database_url(database_url))
    lines = []
    for i in range(12):  # three system prompts, interleaved
        system = f"system prompt {i % 3}"
        lines += batch_lines(1, system=system, prefix=f"r{i}")
    batch_id, shards = make_batch(ledger, lines, shard_size=4)
    assert len(shards) == 3
    with ledger.session() as session:
        for _, index, _ in shards:
            raws = (
                session.execute(
                    sa.select(RequestRow.raw).where(
                        RequestRow.batch_id == batch_id, RequestRow.shard_index == index
                    )
                )
                .scalars()
                .all()
            )
            systems = {json.loads(r)["body"]["messages"][0]["content"] for r in raws}
            assert len(raws) == 4 and len(systems) == 1
        assert session.execute(sa.select(sa.func.count(ShardRow.id))).scalar_one() == 3
    ledger.dispose()


@pytest.fixture(params=["postgresql", "sqlite"])
def any_ledger(request, tmp_path: Path):
    if request.param == "postgresql":
        url = normalize_database_url(request.getfixturevalue("database_url"))
    else:
        url = f"sqlite:///{tmp_path / 'l.db'}"
        assert migrate(url).returncode == 0
    ledger = Ledger(url)
    yield ledger
    ledger.dispose()


def result_row(batch_id: str, request_id: int, ok: bool = True) -> dict:
    return dict(
        request_id=request_id,
        batch_id=batch_id,
        line_id=f"line-{request_id}",
        ok=ok,
        output="{}",
        created_at=time.time(),
    )


def test_a_shard_runs_to_the_end_of_its_batch(any_ledger: Ledger):
    """claim -> some results -> finish reopens the shard -> a second claim takes only what is
    left -> finish closes it -> the batch completes once every shard is done."""
    batch_id, shards = make_batch(any_ledger, batch_lines(6), shard_size=3)
    (first_id, _, _), (second_id, _, _) = shards
    with any_ledger.session() as session:
        claim = shard_lifecycle.claim_shard(session, first_id, "w1")
    assert claim is not None and claim.batch_id == batch_id and len(claim.requests) == 3
    assert claim.model == "tiny"
    done_ids = [request_id for request_id, *_ in claim.requests[:2]]
    with any_ledger.session() as session:
        results.record_results(session, [result_row(batch_id, i) for i in done_ids])
        shard_lifecycle.close_shards(session, [(first_id, batch_id)], 60)
    with any_ledger.session() as session:
        shard = session.get(ShardRow, first_id)
        assert shard.status == "queued"  # one request left
        assert shard.enqueued_at is None  # and no message carries it: the reconciler sends one
        again = shard_lifecycle.claim_shard(session, first_id, "w2")
    assert again is not None and [r[0] for r in again.requests] == [claim.requests[2][0]]
    with any_ledger.session() as session:
        shard = session.get(ShardRow, first_id)
        assert (shard.status, shard.attempts, shard.worker) == ("running", 2, "w2")
        results.record_results(session, [result_row(batch_id, again.requests[0][0], ok=False)])
        shard_lifecycle.close_shards(session, [(first_id, batch_id)], 60)
    with any_ledger.session() as session:
        assert session.get(BatchRow, batch_id).status == "in_progress"  # the second shard is open
    with any_ledger.session() as session:
        second = shard_lifecycle.claim_shard(session, second_id, "w1")
        results.record_results(session, [result_row(batch_id, r[0]) for r in second.requests])
        shard_lifecycle.close_shards(
            session, [(second_id, batch_id)], 60
        )  # the last one: the batch completes
    with any_ledger.session() as session:
        batch = session.get(BatchRow, batch_id)
        assert batch.status == "completed"
        assert (batch.completed_count, batch.failed_count) == (5, 1)
        assert batch.output_file_id and batch.error_file_id
        assert (
            shard_lifecycle.claim_shard(session, second_id, "w1") is None
        )  # a finished batch runs nothing


def test_a_heartbeat_touches_only_a_running_shard(any_ledger: Ledger):
    batch_id, [(shard_id, _, _)] = make_batch(any_ledger, batch_lines(2), shard_size=2)
    with any_ledger.session() as session:
        claim = shard_lifecycle.claim_shard(session, shard_id, "w1")
        session.get(ShardRow, shard_id).heartbeat_at = 1.0
    with any_ledger.session() as session:
        assert shard_lifecycle.shard_heartbeat(session, shard_id) == "in_progress"
        assert session.get(ShardRow, shard_id).heartbeat_at > 1.0
        results.record_results(session, [result_row(batch_id, r[0]) for r in claim.requests])
        shard_lifecycle.close_shards(session, [(shard_id, batch_id)], 60)
    with any_ledger.session() as session:  # a late heartbeat of the run that closed it
        assert shard_lifecycle.shard_heartbeat(session, shard_id) == "completed"
        shard = session.get(ShardRow, shard_id)
        assert (shard.status, shard.heartbeat_at) == ("done", None)


def test_a_cancelled_batch_gives_no_shard_to_run(any_ledger: Ledger):
    batch_id, shards = make_batch(any_ledger, batch_lines(4), shard_size=4)
    with any_ledger.session() as session:
        session.get(BatchRow, batch_id).status = "cancelling"
    with any_ledger.session() as session:
        assert shard_lifecycle.claim_shard(session, shards[0][0], "w1") is None
        assert session.get(ShardRow, shards[0][0]).attempts == 0


def test_a_shard_that_keeps_failing_is_quarantined(any_ledger: Ledger):
    """Runs that end cleanly do not count; after `max_attempts` failed runs the next claim,
    whatever sent the shard again, gives its unfinished requests error lines and closes it."""
    lines = batch_lines(5)
    batch_id, [(shard_id, _, _)] = make_batch(any_ledger, lines, shard_size=5)

    def claim() -> shard_lifecycle.ClaimedShard | None:
        with any_ledger.session() as session:
            return shard_lifecycle.claim_shard(
                session, shard_id, "w1", max_attempts=2, heartbeat_timeout=60
            )

    def attempts() -> int:
        with any_ledger.session() as session:
            return session.get(ShardRow, shard_id).attempts

    first = claim()
    assert first is not None and len(first.requests) == 5 and not first.quarantined
    with any_ledger.session() as session:  # two results, then a clean hand-back (SIGTERM)
        results.record_results(session, [result_row(batch_id, r[0]) for r in first.requests[:2]])
        shard_lifecycle.close_shards(session, [(shard_id, batch_id)], 60)
        shard_lifecycle.give_back_attempt(session, shard_id)
    assert attempts() == 0
    for failures in (1, 2):  # runs whose worker died: re-sent without a close
        again = claim()
        assert again is not None and len(again.requests) == 3 and not again.quarantined
        assert attempts() == failures
    quarantined = claim()
    assert quarantined is not None and quarantined.quarantined and quarantined.requests == []
    with any_ledger.session() as session:
        shard = session.get(ShardRow, shard_id)
        batch = session.get(BatchRow, batch_id)
        errors = [
            json.loads(output)
            for output in session.execute(
                sa.select(ResultRow.output).where(ResultRow.ok.is_(False))
            ).scalars()
        ]
        assert shard.status == "done"
        assert batch.status == "completed"  # its last shard: the batch finished
        assert (batch.completed_count, batch.failed_count) == (2, 3)
        assert results.counts(batch) == tally_results(session, batch_id)
    taken = {r[0] for r in first.requests[2:]}
    assert len(errors) == 3
    for error in errors:
        assert error["error"]["code"] == "request_quarantined"
        assert error["response"]["status_code"] == 500
        assert "failed 2 times" in error["error"]["message"]
        assert "CONVEYOR_MAX_SHARD_ATTEMPTS=2" in error["error"]["message"]
    assert sorted(e["error"]["line"] for e in errors) == sorted(
        line for rid, line, *_ in first.requests if rid in taken
    )
    assert {e["custom_id"] for e in errors} == {
        lines[line - 1]["custom_id"] for rid, line, *_ in first.requests if rid in taken
    }
    assert claim() is None  # a finished batch runs nothing


def test_engine_failures_count_per_request_and_reach_the_next_claim(any_ledger: Ledger):
    """The requests in a failed engine step each count one failure; the next claim of their
    shard says how many each has (the worker runs those alone, or quarantines them)."""
    batch_id, shards = make_batch(any_ledger, batch_lines(3), shard_size=3)
    ((shard_id, _, _),) = shards
    with any_ledger.session() as session:
        claim = shard_lifecycle.claim_shard(session, shard_id, "w1")
    assert claim is not None and [r[3] for r in claim.requests] == [0, 0, 0]
    first, second, _ = (r[0] for r in claim.requests)
    with any_ledger.session() as session:
        shard_lifecycle.record_engine_failure(session, [first, second])
        shard_lifecycle.record_engine_failure(session, [second])
        shard_lifecycle.record_engine_failure(session, [])
        shard_lifecycle.close_shards(session, [(shard_id, batch_id)], 60)
    with any_ledger.session() as session:
        again = shard_lifecycle.claim_shard(session, shard_id, "w2")
    assert again is not None and [r[3] for r in again.requests] == [1, 2, 0]


def test_a_task_that_ends_unclaimed_leaves_its_shard_to_the_reconciler(any_ledger: Ledger):
    batch_id, shards = make_batch(any_ledger, batch_lines(2), shard_size=2)
    ((shard_id, _, _),) = shards
    with any_ledger.session() as session:
        shard_lifecycle.mark_enqueued(session, [session.get(ShardRow, shard_id)])
    with any_ledger.session() as session:
        assert shard_lifecycle.shards_to_enqueue(session, batch_id, lambda: None, 60, 60) == []
        shard_lifecycle.forget_message(session, shard_id)
    with any_ledger.session() as session:
        lost = shard_lifecycle.shards_to_enqueue(session, batch_id, lambda: None, 60, 60)
    assert [s.id for s in lost] == [shard_id]  # even where the broker cannot be looked into


def test_the_tasks_of_a_stopping_worker_are_forgotten_only_as_sent(any_ledger: Ledger):
    """`forget_tasks`: a queued shard under that very task goes back to the reconciler; one
    sent again since (a newer task id), one running and an id of anything else are left."""
    batch_id, shards = make_batch(any_ledger, batch_lines(6), shard_size=2)
    (first, _, _), (second, _, _), (third, _, _) = shards
    with any_ledger.session() as session:
        tasks = shard_lifecycle.mark_enqueued(
            session, [session.get(ShardRow, i) for i in (first, second, third)]
        )
    stale = tasks[1].task_id
    with any_ledger.session() as session:
        shard_lifecycle.mark_enqueued(session, [session.get(ShardRow, second)])  # sent again
        assert shard_lifecycle.claim_shard(session, third, "w1") is not None  # running
    ids = [tasks[0].task_id, stale, tasks[2].task_id, "celery-task-1", "shard-x-1"]
    with any_ledger.session() as session:
        assert shard_lifecycle.forget_tasks(session, ids) == 1
    with any_ledger.session() as session:
        lost = shard_lifecycle.shards_to_enqueue(session, batch_id, lambda: None, 60, 60)
    assert [s.id for s in lost] == [first]


def test_what_ran_a_batch_is_noted_once_per_worker_and_fingerprint(any_ledger: Ledger):
    from conveyor.ledger.batch_runs import record_run, runs_of

    batch_id, _ = make_batch(any_ledger, batch_lines(2), shard_size=2)
    other_id, _ = make_batch(any_ledger, batch_lines(2), shard_size=2)
    record = {"conveyor": "0.1.0", "engine": {"dtype": "torch.bfloat16"}, "default_sampling": {}}
    with any_ledger.session() as session:
        record_run(session, batch_id, "w1", "fp-a", record)
    with any_ledger.session() as session:
        record_run(session, batch_id, "w1", "fp-a", {"engine": {"dtype": "later"}})  # kept first
        record_run(session, batch_id, "w2", "fp-b", record)
    with any_ledger.reads() as session:
        runs = runs_of(session, [batch_id, other_id])
    assert [(r["worker"], r["fingerprint"]) for r in runs[batch_id]] == [
        ("w1", "fp-a"), ("w2", "fp-b")
    ]  # fmt: skip
    assert runs[batch_id][0]["engine"] == {"dtype": "torch.bfloat16"} and runs[other_id] == []
    with any_ledger.session() as session:  # deleting the batch deletes what ran it
        session.delete(session.get(BatchRow, batch_id))
    with any_ledger.reads() as session:
        assert runs_of(session, [batch_id])[batch_id] == []


def test_reusable_results_stay_in_their_project_fingerprint_and_key(any_ledger: Ledger):
    from conveyor.ledger.reuse import find_reusable

    batch_id, shards = make_batch(any_ledger, batch_lines(3), shard_size=3)
    with any_ledger.session() as session:
        claim = shard_lifecycle.claim_shard(session, shards[0][0], "w1")
        ids = [r[0] for r in claim.requests]
        rows = [result_row(batch_id, i) for i in ids]
        for row, key in zip(rows, ["k0", "k1", "k2"], strict=True):
            row.update(fingerprint="fp-a", request_key=key)
        rows[2]["ok"] = False  # an error is never reused
        results.record_results(session, rows)
    with any_ledger.reads() as session:
        project = session.get(BatchRow, batch_id).project
        found = find_reusable(session, project, "fp-a", ["k0", "k1", "k2", "k9"])
        assert sorted(found) == ["k0", "k1"] and found["k0"].batch_id == batch_id
        assert find_reusable(session, project, "fp-b", ["k0"]) == {}  # other weights
        assert find_reusable(session, "someone-else", "fp-a", ["k0"]) == {}


def keyed_results(ledger: Ledger, project: str, keys: list[str], fingerprint: str = "fp-a"):
    """A batch of `project` whose lines have results under `keys`; the batch's id."""
    batch_id, shards = make_batch(ledger, batch_lines(len(keys)), shard_size=len(keys))
    with ledger.session() as session:
        session.get(BatchRow, batch_id).project = project
        claim = shard_lifecycle.claim_shard(session, shards[0][0], "w1")
        rows = [result_row(batch_id, request[0]) for request in claim.requests]
        for row, key in zip(rows, keys, strict=True):
            row.update(fingerprint=fingerprint, request_key=key)
        results.record_results(session, rows)
    return batch_id


def test_a_key_is_reused_from_its_own_project_across_lookup_chunks(any_ledger, monkeypatch):
    # the results are found by key first and their batches' project checked after: another
    # project's earlier result of the same key is passed over, in every chunk of keys
    from conveyor.ledger import reuse

    monkeypatch.setattr(reuse, "LOOKUP_CHUNK", 2)
    keys = ["k0", "k1", "k2", "k3", "k4"]
    theirs = keyed_results(any_ledger, "theirs", keys)
    ours = keyed_results(any_ledger, "ours", keys[1:])
    later = keyed_results(any_ledger, "ours", keys[1:])
    with any_ledger.reads() as session:
        found = reuse.find_reusable(session, "ours", "fp-a", [*keys, "k9", "k1"])
        assert sorted(found) == keys[1:]
        assert {hit.batch_id for hit in found.values()} == {ours} != {later}  # the earliest
        found = reuse.find_reusable(session, "theirs", "fp-a", keys)
        assert sorted(found) == keys and {hit.batch_id for hit in found.values()} == {theirs}


def test_the_reuse_lookup_goes_through_its_index(any_ledger: Ledger):
    # a schema change that dropped the index, or put the fingerprint before the key again,
    # would turn each lookup into a read of every result (bench/reuse_lookup.py)
    from conveyor.ledger.models import REUSE_INDEX
    from conveyor.ledger.reuse import LOOKUP_CHUNK, lookup_plan

    keys = [f"{i:032x}" for i in range(LOOKUP_CHUNK)]
    with any_ledger.session() as session:
        if not any_ledger.is_sqlite:  # an empty table: only a forbidden scan makes it choose
            session.execute(sa.text("SET LOCAL enable_seqscan = off"))
        plan = lookup_plan(session, "fp-a", keys)
    assert REUSE_INDEX in plan, plan
    (index,) = [i for i in sa.inspect(any_ledger.engine).get_indexes("results")
                if i["name"] == REUSE_INDEX]  # fmt: skip
    assert index["column_names"] == ["request_key", "fingerprint"]  # the nearly unique key first
