"""An upload's lines are counted and checked as its chunks stream by, wherever chunks split."""

from __future__ import annotations

import pytest

from api.errors import APIError
from api.storage import LineCounter, UploadLimits

LIMITS = UploadLimits(max_bytes=1000, max_lines=4, max_line_bytes=10)


def count(chunks: list[bytes], limits: UploadLimits = LIMITS) -> tuple[int, int]:
    counter = LineCounter(limits)
    for chunk in chunks:
        counter.feed(chunk)
    counter.close()
    return counter.size, counter.lines


def refused(chunks: list[bytes], limits: UploadLimits = LIMITS) -> APIError:
    with pytest.raises(APIError) as caught:
        count(chunks, limits)
    assert caught.value.status == 413
    return caught.value


def every_split(data: bytes) -> list[list[bytes]]:
    return [[data[:i], data[i:j], data[j:]] for i in range(len(data)) for j in range(i, len(data))]


def test_lines_are_counted_across_chunk_boundaries():
    data = b"0123456789\nab\n\nlast line"  # the last line has no newline
    for chunks in every_split(data):
        assert count(chunks) == (len(data), 4), chunks
    assert count([b"a\nb\n"]) == (4, 2)
    assert count([]) == (0, 0)


def test_a_line_over_the_limit_is_refused_naming_it():
    data = b"short\n0123456789X\nok\n"  # line 2 has 11 bytes
    for chunks in every_split(data):
        err = refused(chunks)
        assert err.code == "line_too_large" and "line 2 " in err.message, err.message
        assert "CONVEYOR_MAX_LINE_BYTES" in err.message
    # a line exactly at the limit is fine, newline not counted
    assert count([b"0123456789\n0123456789"]) == (21, 2)


def test_too_many_lines_and_too_many_bytes():
    err = refused([b"a\nb\nc\nd\ne\n"])
    assert err.code == "too_many_lines" and "at most 4 lines" in err.message
    assert count([b"a\nb\nc\nd"]) == (7, 4)
    err = refused([b"a\n" * 300, b"b\n" * 300], UploadLimits(1000, 10_000, 10))
    assert err.code == "file_too_large" and "1000 bytes" in err.message
