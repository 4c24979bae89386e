"""Where uploaded input files live: one file per upload under the data directory."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from api.errors import APIError


@dataclass(frozen=True)
class UploadLimits:
    max_bytes: int
    max_lines: int
    max_line_bytes: int


class LineCounter:
    """Counts an upload's bytes and lines as its chunks go by, and stops it (413) at the first
    limit it breaks: a file too large, with too many lines, or with a line too long."""

    def __init__(self, limits: UploadLimits) -> None:
        self.limits = limits
        self.size = self.lines = 0
        self.line_bytes = 0  # bytes of the line not yet ended

    def feed(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.limits.max_bytes:
            raise file_too_large(self.limits.max_bytes)
        start = 0
        while (end := chunk.find(b"\n", start)) != -1:
            self._end_line(self.line_bytes + end - start)
            start = end + 1
        self.line_bytes += len(chunk) - start
        self._check_line(self.line_bytes)

    def close(self) -> None:
        if self.line_bytes:  # a last line without a newline
            self._end_line(self.line_bytes)

    def _end_line(self, n: int) -> None:
        self._check_line(n)
        self.lines += 1
        self.line_bytes = 0
        if self.lines > self.limits.max_lines:
            raise _too_large(
                "too_many_lines",
                f"a batch input file holds at most {self.limits.max_lines} lines "
                "(CONVEYOR_MAX_BATCH_LINES); this file has more",
            )

    def _check_line(self, n: int) -> None:
        if n > self.limits.max_line_bytes:
            raise _too_large(
                "line_too_large",
                f"line {self.lines + 1} is longer than the limit of "
                f"{self.limits.max_line_bytes} bytes (CONVEYOR_MAX_LINE_BYTES)",
            )


def file_too_large(max_bytes: int) -> APIError:
    return _too_large(
        "file_too_large",
        f"the file is larger than the limit of {max_bytes} bytes (CONVEYOR_MAX_UPLOAD_BYTES)",
    )


def _too_large(code: str, message: str) -> APIError:
    return APIError(413, message, code=code, param="file")


class UploadWriter:
    """An upload on its way to the store: `write` counts each chunk and writes it (413 at the
    first limit the file breaks, before that chunk is written), `commit` puts the whole file in
    place, `discard` drops what was written."""

    def __init__(self, target: Path, limits: UploadLimits) -> None:
        self.target = target
        self.part = target.with_suffix(".part")
        self.counter = LineCounter(limits)
        self.out: BinaryIO | None = None

    @property
    def size(self) -> int:
        return self.counter.size

    def write(self, chunk: bytes) -> None:
        self.counter.feed(chunk)
        if self.out is None:
            self.out = open(self.part, "wb")  # noqa: SIM115 (closed by commit or discard)
        self.out.write(chunk)

    def commit(self) -> tuple[int, int]:
        """Returns the file's (bytes, lines)."""
        self.counter.close()
        if self.out is None:
            self.out = open(self.part, "wb")  # noqa: SIM115
        self.out.close()
        os.replace(self.part, self.target)
        return self.counter.size, self.counter.lines

    def discard(self) -> None:
        if self.out is not None:
            self.out.close()
        self.part.unlink(missing_ok=True)


class FileStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, file_id: str) -> Path:
        return self.root / f"{file_id}.jsonl"

    def writer(self, file_id: str, limits: UploadLimits) -> UploadWriter:
        return UploadWriter(self.path(file_id), limits)

    def delete(self, file_id: str) -> None:
        self.path(file_id).unlink(missing_ok=True)
