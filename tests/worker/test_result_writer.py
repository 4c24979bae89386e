"""The result writer on real PostgreSQL: a row the ledger cannot store holds up no other row."""

from __future__ import annotations

import json
import time

import sqlalchemy as sa

from conveyor.ledger.db import Ledger
from conveyor.ledger.models import BatchRow, ResultRow, ShardRow
from conveyor.ledger.results import counts
from conveyor.ledger.shard_lifecycle import claim_shard
from conveyor.settings import normalize_database_url
from conveyor.testing import batch_lines
from conveyor.wire_format.errors import INTERNAL_ERROR
from conveyor.worker.writer import PendingResults, ResultWriter, WriteItem
from tests.ledger.test_ledger import make_batch, tally_results


def output_row(batch_id: str, request_id: int, custom_id: str, text: str) -> dict:
    line = {
        "id": f"batch_req_{request_id}",
        "custom_id": custom_id,
        "response": {"status_code": 200, "body": {"choices": [{"text": text}]}},
        "error": None,
    }
    return dict(
        request_id=request_id,
        batch_id=batch_id,
        line_id=line["id"],
        ok=True,
        output=json.dumps(line, ensure_ascii=False),  # as a careless serializer would
        worker="w1",
        created_at=time.time(),
        prompt_tokens=5,
        completion_tokens=2,
        cached_tokens=0,
    )


def claimed_batch(ledger: Ledger) -> tuple[str, list[tuple[PendingResults, list]]]:
    """A batch of 6 requests in 2 shards, both claimed: (batch id, [(pending, requests)])."""
    batch_id, shards = make_batch(ledger, batch_lines(6), shard_size=3)
    claimed = []
    for shard_id, _, _ in shards:
        with ledger.session() as session:
            claim = claim_shard(session, shard_id, "w1")
        assert claim is not None
        claimed.append((PendingResults(shard_id, batch_id, len(claim.requests)), claim.requests))
    return batch_id, claimed


def custom_ids(ledger: Ledger, requests: list) -> dict[int, str]:
    from conveyor.ledger.models import RequestRow

    with ledger.session() as session:
        rows = session.execute(
            sa.select(RequestRow.id, RequestRow.custom_id).where(
                RequestRow.id.in_([r[0] for r in requests])
            )
        ).all()
    return dict(rows)


def test_a_row_that_cannot_be_stored_becomes_its_error_line(database_url: str) -> None:
    ledger = Ledger(normalize_database_url(database_url))
    batch_id, claimed = claimed_batch(ledger)
    writer = ResultWriter(ledger, heartbeat_timeout=60)
    items, bad = [], {}
    for pending, requests in claimed:
        names = custom_ids(ledger, requests)
        for request_id, line, *_ in requests:
            row = output_row(batch_id, request_id, names[request_id], f"answer {line}")
            items.append(WriteItem(row, pending, names[request_id], line))
    # one row per shard the ledger cannot take: a lone surrogate in the output (echoed
    # input), a NUL in a varchar column
    items[1].row["output"] = items[1].row["output"].replace("answer", "answer \ud800")
    items[4].row["line_id"] = "batch_req_\x00"
    bad = {items[1].row["request_id"]: items[1], items[4].row["request_id"]: items[4]}
    for item in items:  # all queued before the writer starts: one commit of six rows
        writer.put(item)
    writer.start()
    try:
        for pending, _ in claimed:
            assert pending.wait(30), "a shard's results were never all committed"
    finally:
        writer.stop()
        writer.join(10)

    with ledger.session() as session:
        rows = {r.request_id: r for r in session.execute(sa.select(ResultRow)).scalars()}
        batch = session.get(BatchRow, batch_id)
        shards = session.execute(sa.select(ShardRow.status)).scalars().all()
        counted = tally_results(session, batch_id)
    assert len(rows) == 6
    for item in items:
        row = rows[item.row["request_id"]]
        if item.row["request_id"] not in bad:
            assert row.ok and row.output == item.row["output"]  # stored as given
            continue
        assert not row.ok and row.output.isascii()
        line = json.loads(row.output)
        assert line["custom_id"] == item.custom_id and line["id"] == row.line_id
        assert line["response"]["status_code"] == 500
        assert line["error"]["code"] == INTERNAL_ERROR and line["error"]["line"] == item.line
        assert line["error"]["message"].startswith("the result could not be stored: ")
        assert (row.prompt_tokens, row.completion_tokens, row.worker) == (0, 0, "w1")
    why = {rid: json.loads(rows[rid].output)["error"]["message"] for rid in bad}
    assert "UnicodeEncodeError" in why[items[1].row["request_id"]]
    assert "0x00" in why[items[4].row["request_id"]]
    # the writer closed both shards and the last close completed the batch; the counters
    # agree with the rows
    assert shards == ["done", "done"]
    assert batch.status == "completed"
    assert (batch.completed_count, batch.failed_count) == (4, 2)
    assert counts(batch) == counted
    assert writer.committed == 6
    ledger.dispose()


def test_a_database_that_refuses_every_write_does_not_turn_results_into_errors(
    database_url: str,
) -> None:
    """A refusal that is not about a row (here: the database read-only) cannot be answered by
    replacing rows with error lines: the writer waits, and stores the results themselves."""
    url = normalize_database_url(database_url)
    ledger = Ledger(url)
    batch_id, claimed = claimed_batch(ledger)
    name = url.rsplit("/", 1)[1]
    admin = sa.create_engine(url.rsplit("/", 1)[0] + "/postgres", isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on'))
    ledger.dispose()  # new connections are read-only
    writer = ResultWriter(ledger, heartbeat_timeout=60)
    pending, requests = claimed[0]
    names = custom_ids(ledger, requests)
    for request_id, line, *_ in requests:
        row = output_row(batch_id, request_id, names[request_id], "fine")
        writer.put(WriteItem(row, pending, names[request_id], line))
    writer.start()
    try:
        assert not pending.wait(2)  # refused, and not settled with error lines either
        with admin.connect() as conn:
            conn.execute(sa.text(f'ALTER DATABASE "{name}" RESET default_transaction_read_only'))
            conn.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = :db AND pid <> pg_backend_pid()"
                ),
                {"db": name},
            )
        assert pending.wait(30)
    finally:
        writer.stop()
        writer.join(10)
        admin.dispose()
    with ledger.session() as session:
        oks = session.execute(sa.select(ResultRow.ok)).scalars().all()
    assert oks == [True, True, True]
    ledger.dispose()
