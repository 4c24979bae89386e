"""Object ids in OpenAI's style: `file-…`, `batch_…`, `batch_req_…`."""

from __future__ import annotations

import uuid


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex[:24]}"


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex[:24]}"


def new_line_id() -> str:
    return f"batch_req_{uuid.uuid4().hex[:24]}"
