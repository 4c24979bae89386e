"""Where uploaded input files live: one file per upload under the data directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

from api.errors import APIError

CHUNK = 1 << 20


class FileStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, file_id: str) -> Path:
        return self.root / f"{file_id}.jsonl"

    def save(self, file_id: str, source: BinaryIO, max_bytes: int) -> tuple[int, int]:
        """Copy an upload in chunks; returns (bytes, lines). Raises 413 past `max_bytes`."""
        target = self.path(file_id)
        tmp = target.with_suffix(".part")
        size = lines = 0
        last = b"\n"
        try:
            with open(tmp, "wb") as out:
                while chunk := source.read(CHUNK):
                    size += len(chunk)
                    if size > max_bytes:
                        raise APIError(
                            413,
                            f"the file is larger than the limit of {max_bytes} bytes",
                            code="file_too_large",
                            param="file",
                        )
                    lines += chunk.count(b"\n")
                    last = chunk[-1:]
                    out.write(chunk)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        if size and last != b"\n":
            lines += 1
        return size, lines

    def delete(self, file_id: str) -> None:
        self.path(file_id).unlink(missing_ok=True)
