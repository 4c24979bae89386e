"""An upload's requests (non-blank lines, counted as validation counts them) and bytes are
checked as its chunks stream by, wherever chunks split."""

from __future__ import annotations

import io

import pytest

from conveyor.wire_format.errors import FileLimitError
from conveyor.wire_format.lines import UTF8_BOM, FileLimits, LineCounter, iter_lines

LIMITS = FileLimits(max_bytes=1000, max_lines=4, max_line_bytes=10)


def count(chunks: list[bytes], limits: FileLimits = LIMITS) -> tuple[int, int]:
    counter = LineCounter(limits)
    for chunk in chunks:
        counter.feed(chunk)
    counter.close()
    return counter.size, counter.lines


def refused(chunks: list[bytes], limits: FileLimits = LIMITS) -> FileLimitError:
    with pytest.raises(FileLimitError) as caught:
        count(chunks, limits)
    return caught.value


def every_split(data: bytes) -> list[list[bytes]]:
    return [[data[:i], data[i:j], data[j:]] for i in range(len(data)) for j in range(i, len(data))]


def test_requests_are_counted_across_chunk_boundaries_as_validation_counts_them():
    data = b"0123456789\nab\n \n\nlast line"  # two blank lines; the last has no newline
    validated = len(list(iter_lines(io.BytesIO(data), LIMITS.max_line_bytes)))
    assert validated == 3
    for chunks in every_split(data):
        assert count(chunks) == (len(data), validated), chunks
    assert count([b"a\nb\n"]) == (4, 2)
    assert count([]) == (0, 0)


def test_a_line_over_the_limit_is_refused_naming_it():
    data = b"\nshort\n0123456789X\nok\n"  # line 3 has 11 bytes (line 1 is blank)
    for chunks in every_split(data):
        err = refused(chunks)
        assert err.code == "line_too_large" and "line 3 " in str(err), str(err)
        assert "CONVEYOR_MAX_LINE_BYTES" in str(err)
    # a line exactly at the limit is fine, newline not counted
    assert count([b"0123456789\n0123456789"]) == (21, 2)


def test_too_many_requests_and_too_many_bytes():
    err = refused([b"a\nb\nc\nd\ne\n"])
    assert err.code == "too_many_lines" and "at most 4 lines" in str(err)
    assert count([b"a\nb\nc\nd"]) == (7, 4)
    assert count([b"a\n\nb\n\nc\n\nd\n\n"]) == (12, 4)  # blank lines are no requests
    err = refused([b"a\n" * 300, b"b\n" * 300], FileLimits(1000, 10_000, 10))
    assert err.code == "file_too_large" and "1000 bytes" in str(err)


def test_a_byte_order_mark_opening_the_file_is_no_byte_of_its_first_line():
    data = UTF8_BOM + b"0123456789\n\nab\n"  # line 1 at the limit without the mark
    assert list(iter_lines(io.BytesIO(data), LIMITS.max_line_bytes)) == [
        (1, 3, b"0123456789\n"),
        (3, 15, b"ab\n"),
    ]
    for chunks in every_split(data):
        assert count(chunks) == (len(data), 2), chunks
    assert count([UTF8_BOM, b"\n \n"]) == (len(UTF8_BOM) + 3, 0)  # a mark alone: no request
    # bytes that begin like a mark but are not one are the line's own, counted as such
    for data in (UTF8_BOM[:2] + b"x\n", UTF8_BOM[:2], b"\xef\xbb\xbfx" + UTF8_BOM + b"\n"):
        assert count([data]) == (len(data), 1)
        for chunks in every_split(data):
            assert count(chunks) == (len(data), 1), chunks
    err = refused([UTF8_BOM + b"0123456789X\n"])  # over the limit without the mark too
    assert err.code == "line_too_large" and "line 1 " in str(err)
    assert [raw for _, _, raw in iter_lines(io.BytesIO(UTF8_BOM + b"0123456789X\n"), 10)] == [None]
