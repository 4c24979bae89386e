"""`conveyor results BATCH_ID -o FILE` and `conveyor submit --wait -o FILE` write what produced
the results beside them, in FILE.meta.json (the batch's id and its `reproducibility`), and
say so on stderr; the result lines are written as the API gives them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conveyor.ledger.db import Ledger
from conveyor.testing import Stack
from tests.api.test_result_files import RECORD, finished_batch


def conveyor(stack: Stack, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "conveyor", *args, "--url", stack.api_url],
        env=stack.env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_results_and_submit_write_the_record_beside_the_results(
    stack: Stack, database_url: str, tmp_path: Path
):
    ledger = Ledger(database_url)
    try:
        batch_id, lines = finished_batch(ledger, [("w1", "fp-a"), ("w2", "fp-b")])
    finally:
        ledger.dispose()
    stack.start_api()

    out = tmp_path / "results.jsonl"
    done = conveyor(stack, "results", batch_id, "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""  # the lines went to the file
    assert [json.loads(x) for x in out.read_text().splitlines()] == lines  # unchanged
    meta = tmp_path / "results.jsonl.meta.json"
    record = json.loads(meta.read_text())
    assert record["batch_id"] == batch_id and record["status"] == "completed"
    runs = record["reproducibility"]
    assert [(r["worker"], r["fingerprint"]) for r in runs] == [("w1", "fp-a"), ("w2", "fp-b")]
    assert runs[0]["engine"] == RECORD["engine"]
    assert runs[0]["default_sampling"] == RECORD["default_sampling"]
    assert str(meta) in done.stderr and "fp-a, fp-b" in done.stderr

    printed = conveyor(stack, "results", batch_id)  # without -o: the lines on stdout, alone
    assert printed.returncode == 0 and printed.stderr == ""
    assert [json.loads(x) for x in printed.stdout.splitlines()] == lines

    # the pipeline's way: the batch's output file downloaded, and the same record beside it
    out, errors = tmp_path / "night" / "results.jsonl", tmp_path / "night" / "errors.jsonl"
    out.parent.mkdir()
    waited = conveyor(stack, "submit", "--resume", batch_id, "--wait", "-o", str(out),
                      "--errors", str(errors))  # fmt: skip
    assert waited.returncode == 6, waited.stderr  # one failed line, none tolerated
    assert [json.loads(x) for x in out.read_text().splitlines()] == lines[:2]
    assert [json.loads(x) for x in errors.read_text().splitlines()] == lines[2:]
    assert json.loads((out.parent / "results.jsonl.meta.json").read_text()) == record
    assert sorted(p.name for p in out.parent.iterdir()) == [
        "errors.jsonl", "results.jsonl", "results.jsonl.meta.json"
    ]  # fmt: skip
    assert f"{out.parent / 'results.jsonl.meta.json'}" in waited.stderr
