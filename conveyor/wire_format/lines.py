"""What a line of an input file is: a request is one non-blank line, counted alike when the file
uploads (`LineCounter`, chunk by chunk) and when it is validated or run (`iter_lines`). A UTF-8
byte order mark opening the file (Windows tools write one) is not part of its first line: JSON's
RFC 8259 lets a parser ignore it, and Python's `json` refuses it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from conveyor.wire_format.errors import (
    FILE_TOO_LARGE,
    LINE_TOO_LARGE,
    TOO_MANY_LINES,
    FileLimitError,
)

UTF8_BOM = b"\xef\xbb\xbf"


def iter_lines(f: IO[bytes], max_line_bytes: int) -> Iterator[tuple[int, int, bytes | None]]:
    """(line number, byte offset, content) for each non-blank line; content None if too long.
    The offset is where the content starts (after a byte order mark opening the file).

    Reads at most `max_line_bytes + 1` bytes of a line at a time, so a huge line costs no more
    memory than that.
    """
    offset, number = 0, 0
    while True:
        start = offset
        chunk = f.readline(max_line_bytes + 1)
        if not chunk:
            return
        number += 1
        if number == 1 and chunk.startswith(UTF8_BOM):
            if not chunk.endswith(b"\n"):  # as many of the line's own bytes as any line's
                chunk += f.readline(len(UTF8_BOM))
            chunk, offset = chunk[len(UTF8_BOM) :], offset + len(UTF8_BOM)
            start = offset
        offset += len(chunk)
        if len(chunk) > max_line_bytes and not chunk.endswith(b"\n"):
            while chunk and not chunk.endswith(b"\n"):  # skip the rest of the long line
                chunk = f.readline(1 << 20)
                offset += len(chunk)
            yield number, start, None
            continue
        if is_request_line(chunk):
            yield number, start, chunk


def count_request_lines(path: str | Path) -> int:
    """Requests (non-blank lines) in the file at `path`, read in a streaming way."""
    return sum(1 for _ in iter_request_lines(path))


def iter_request_lines(path: str | Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw line) for each request line of the file at `path`."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if number == 1:
                raw = raw.removeprefix(UTF8_BOM)
            if is_request_line(raw):
                yield number, raw


def is_request_line(raw: bytes) -> bool:
    """A line holds a request unless it is blank."""
    return bool(raw.strip())


@dataclass(frozen=True)
class FileLimits:
    max_bytes: int
    max_lines: int  # requests: non-blank lines
    max_line_bytes: int


class LineCounter:
    """Counts a file's bytes and requests as its chunks go by, and stops it (`FileLimitError`)
    at the first limit it breaks: a file too large, with too many requests, or with a line too
    long (named by its line number, blank lines counted, as validation names lines)."""

    def __init__(self, limits: FileLimits) -> None:
        self.limits = limits
        self.size = 0
        self.lines = 0  # requests: non-blank lines ended so far
        self.number = 0  # physical lines ended so far
        self.line_bytes = 0  # bytes of the line not yet ended
        self.line_blank = True  # whether the line not yet ended is blank so far
        self.mark: int | None = 0  # bytes of a byte order mark opening the file seen so far

    def feed(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.limits.max_bytes:
            raise file_too_large(self.limits.max_bytes)
        start = self._skip_mark(chunk)
        while (end := chunk.find(b"\n", start)) != -1:
            self._end_line(self.line_bytes + end - start, chunk[start:end])
            start = end + 1
        self._add(chunk[start:])

    def _skip_mark(self, chunk: bytes) -> int:
        """How many bytes opening `chunk` go on a byte order mark opening the file (whichever
        chunks it falls in); where the file's first bytes turn out not to be one, they are
        its first line's."""
        if self.mark is None:
            return 0
        n = 0
        while n < len(chunk) and self.mark < len(UTF8_BOM) and chunk[n] == UTF8_BOM[self.mark]:
            n, self.mark = n + 1, self.mark + 1
        if self.mark == len(UTF8_BOM):
            self.mark = None
        elif n < len(chunk):  # not a mark: the bytes taken for one were the line's own
            self.line_bytes, self.line_blank, self.mark = self.mark, self.mark == 0, None
        return n

    def close(self) -> None:
        if self.mark:  # the file ended inside what began like a mark: its bytes are a line
            self.line_bytes, self.line_blank, self.mark = self.mark, False, None
        if self.line_bytes:  # a last line without a newline
            self._end_line(self.line_bytes, b"")

    def _add(self, piece: bytes) -> None:
        self.line_bytes += len(piece)
        self.line_blank = self.line_blank and not piece.strip()
        self._check_line(self.line_bytes)

    def _end_line(self, n: int, last_piece: bytes) -> None:
        self._check_line(n)
        blank = self.line_blank and not last_piece.strip()
        self.number += 1
        self.lines += not blank
        self.line_bytes, self.line_blank = 0, True
        if self.lines > self.limits.max_lines:
            raise too_many_lines(self.limits.max_lines)

    def _check_line(self, n: int) -> None:
        if n > self.limits.max_line_bytes:
            raise FileLimitError(
                LINE_TOO_LARGE,
                f"line {self.number + 1} is longer than the limit of "
                f"{self.limits.max_line_bytes} bytes (CONVEYOR_MAX_LINE_BYTES)",
            )


def file_too_large(max_bytes: int) -> FileLimitError:
    return FileLimitError(
        FILE_TOO_LARGE,
        f"the file is larger than the limit of {max_bytes} bytes (CONVEYOR_MAX_UPLOAD_BYTES)",
    )


def too_many_lines(max_lines: int) -> FileLimitError:
    return FileLimitError(
        TOO_MANY_LINES,
        f"a batch input file holds at most {max_lines} lines of requests (blank lines do not "
        "count; CONVEYOR_MAX_BATCH_LINES); this file has more",
    )
