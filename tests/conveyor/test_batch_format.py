"""The batch-file format counts a file's lines one way: validation refuses the file the upload
refuses, with the same code and message, and neither counts blank lines."""

from __future__ import annotations

import io
import json

import pytest

from conveyor.testing import batch_lines
from conveyor.wire_format.errors import FileLimitError
from conveyor.wire_format.lines import UTF8_BOM, FileLimits, LineCounter, iter_request_lines
from conveyor.wire_format.validation import validate

CHAT = "/v1/chat/completions"


def jsonl(lines: list[dict], blank_between: int = 0) -> bytes:
    sep = b"\n" + b" \n" * blank_between
    return sep.join(json.dumps(line).encode() for line in lines) + b"\n"


def test_validation_and_upload_refuse_the_same_file_alike() -> None:
    data = jsonl(batch_lines(3))
    result = validate(io.BytesIO(data), CHAT, 1 << 20, max_lines=2)
    assert [e["code"] for e in result.errors] == ["too_many_lines"]
    counter = LineCounter(FileLimits(max_bytes=1 << 20, max_lines=2, max_line_bytes=1 << 20))
    with pytest.raises(FileLimitError) as refused:
        counter.feed(data)
    assert refused.value.code == "too_many_lines"
    assert result.errors[0]["message"] == str(refused.value)


def test_blank_lines_are_no_requests_for_either() -> None:
    data = jsonl(batch_lines(2), blank_between=5)
    result = validate(io.BytesIO(data), CHAT, 1 << 20, max_lines=2)
    assert not result.errors and len(result.records) == 2
    counter = LineCounter(FileLimits(max_bytes=1 << 20, max_lines=2, max_line_bytes=1 << 20))
    counter.feed(data)
    counter.close()
    assert counter.lines == 2


def test_a_file_opening_with_a_byte_order_mark_runs_as_without(tmp_path) -> None:
    """Windows tools write UTF-8 with a mark first (and end lines in CRLF): validation, the
    ledger's reads of each line (at its offset) and `conveyor run-batch` read the file as if it
    had none."""
    data = jsonl(batch_lines(2))
    result = validate(io.BytesIO(UTF8_BOM + data), CHAT, 1 << 20, max_lines=2)
    assert not result.errors and len(result.records) == 2
    plain = validate(io.BytesIO(data), CHAT, 1 << 20, max_lines=2)
    for marked, unmarked in zip(result.records, plain.records, strict=True):
        assert marked.offset == unmarked.offset + len(UTF8_BOM)
        assert marked.length == unmarked.length and marked.custom_id == unmarked.custom_id
        line = (UTF8_BOM + data)[marked.offset : marked.offset + marked.length]
        assert json.loads(line)["custom_id"] == marked.custom_id
    crlf = validate(io.BytesIO(UTF8_BOM + data.replace(b"\n", b"\r\n")), CHAT, 1 << 20, 2)
    assert not crlf.errors and [r.custom_id for r in crlf.records] == [
        r.custom_id for r in plain.records
    ]
    path = tmp_path / "marked.jsonl"
    path.write_bytes(UTF8_BOM + data)
    assert [json.loads(raw)["custom_id"] for _, raw in iter_request_lines(path)] == [
        r.custom_id for r in plain.records
    ]
