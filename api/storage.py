"""Where uploaded input files live: one file per upload under the data directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

from conveyor.api.errors import APIError
from conveyor.wire_format.errors import FileLimitError
from conveyor.wire_format.lines import FileLimits, LineCounter


def too_large(err: FileLimitError) -> APIError:
    """The 413 of a file over a limit."""
    return APIError(413, str(err), code=err.code, param="file")


class UploadWriter:
    """An upload on its way to the store: `write` counts each chunk and writes it (413 at the
    first limit the file breaks, before that chunk is written), `commit` puts the whole file in
    place, `discard` drops what was written."""

    def __init__(self, target: Path, limits: FileLimits) -> None:
        self.target = target
        self.part = target.with_suffix(".part")
        self.counter = LineCounter(limits)
        self.out: BinaryIO | None = None

    @property
    def size(self) -> int:
        return self.counter.size

    def write(self, chunk: bytes) -> None:
        try:
            self.counter.feed(chunk)
        except FileLimitError as err:
            raise too_large(err) from None
        if self.out is None:
            self.out = open(self.part, "wb")  # noqa: SIM115 (closed by commit or discard)
        self.out.write(chunk)

    def commit(self) -> tuple[int, int]:
        """Returns the file's (bytes, requests)."""
        try:
            self.counter.close()
        except FileLimitError as err:
            raise too_large(err) from None
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

    def writer(self, file_id: str, limits: FileLimits) -> UploadWriter:
        return UploadWriter(self.path(file_id), limits)

    def delete(self, file_id: str) -> None:
        self.path(file_id).unlink(missing_ok=True)
