"""What requests that can share KV blocks have in common: a batch's requests are sorted and
sharded by it, and shards are routed to workers by it."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from conveyor.wire_format.request_line import ParsedRequest


def prefix_key(request: ParsedRequest) -> str:
    """What requests that can share KV blocks have in common: the system prompt, or the
    leading part of the prompt."""
    if request.messages:
        first = request.messages[0]
        lead: Any = (
            first
            if first.get("role") in ("system", "developer")
            else first.get("content", "")[:256]
        )
    elif isinstance(request.prompt, str):
        lead = request.prompt[:256]
    else:
        lead = list(request.prompt or [])[:64]
    return hashlib.blake2b(json.dumps(lead).encode(), digest_size=8).hexdigest()
