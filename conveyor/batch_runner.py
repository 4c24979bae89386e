"""Run an OpenAI Batch input file through one engine, writing result lines as requests finish.

The input is read line by line and at most `max_pending` requests are in the engine at once, so
memory stays bounded for large files. Each result or error line is written and flushed as soon
as it is known, so an interrupted run keeps everything written so far. Result lines come in the
order requests finish, not the input order; match them up by `custom_id`.

The engine is duck-typed (`add_request`, `step`, `has_unfinished`, `abort`, `tokenizer`), which
keeps this module free of torch imports until an engine is actually handed in.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import IO, Any

from conveyor.engine.errors import InvalidRequestError
from conveyor.engine.outputs import RequestOutput
from conveyor.engine.protocol import Engine
from conveyor.request_outcome import (
    PreparedLine,
    internal_error_line,
    output_line,
    prepare_line,
    refused_line,
)
from conveyor.wire_format.request_line import BatchLineParser, ParsedRequest
from conveyor.wire_format.result_lines import (
    dump_line,
)
from conveyor.wire_format.token_text import TokenDecoder

log = logging.getLogger(__name__)


@dataclass
class BatchStats:
    lines: int = 0  # non-blank input lines handled
    succeeded: int = 0
    failed: int = 0


class BatchRunner:
    """Feeds batch lines to an engine and writes one output line per input line."""

    def __init__(
        self,
        llm: Engine,
        *,
        model_name: str,
        out: IO[str],
        error_out: IO[str] | None = None,
        served_model_names: Iterable[str] | None = None,
        max_pending: int = 1024,
        progress: Any | None = None,
    ) -> None:
        self.llm = llm
        self.model_name = model_name
        self.out = out
        self.error_out = error_out if error_out is not None else out
        self.parser = BatchLineParser(served_model_names)
        self.max_pending = max(1, max_pending)
        self.progress = progress
        self.decoder = TokenDecoder(llm.tokenizer)
        self.pending: dict[str, ParsedRequest] = {}
        self.stats = BatchStats()

    # ---- output ---------------------------------------------------------------------------
    def _emit(self, obj: dict[str, Any], *, ok: bool) -> None:
        stream = self.out if ok else self.error_out
        stream.write(dump_line(obj) + "\n")
        stream.flush()
        if ok:
            self.stats.succeeded += 1
        else:
            self.stats.failed += 1
        if self.progress is not None:
            self.progress.update(1)
            self.progress.set_postfix(ok=self.stats.succeeded, failed=self.stats.failed)

    # ---- input ----------------------------------------------------------------------------
    def submit(self, lineno: int, raw: bytes | str) -> None:
        """Check one line and hand it to the engine, or write its error line."""
        self.stats.lines += 1
        request_id = f"line-{lineno}"
        prepared = prepare_line(self.llm, raw, lineno, request_id, self.parser.parse)
        if not isinstance(prepared, PreparedLine):
            self._emit(prepared, ok=False)
            return
        try:
            self.llm.add_request(request_id, prepared.prompt, prepared.params)
        except Exception as err:  # refused by the engine, or a fault of its with this line
            if not isinstance(err, InvalidRequestError):
                with contextlib.suppress(Exception):  # whatever of it the engine kept
                    self.llm.abort(request_id)
            self._emit(refused_line(err, prepared.parsed, request_id), ok=False)
            return
        self.pending[request_id] = prepared.parsed

    def finish(self, output: RequestOutput) -> None:
        """Write the result line of a finished engine request."""
        request = self.pending.pop(output.request_id, None)
        if request is None:
            return
        line, ok = output_line(request, output, self.model_name, self.decoder, output.request_id)
        self._emit(line, ok=ok)

    # ---- loop -----------------------------------------------------------------------------
    def run(self, lines: Iterable[tuple[int, bytes | str]]) -> BatchStats:
        source = iter(lines)
        exhausted = False
        while True:
            while not exhausted and len(self.pending) < self.max_pending:
                item = next(source, None)
                if item is None:
                    exhausted = True
                    break
                self.submit(*item)
            if self.pending:
                if not self.llm.has_unfinished():
                    self._drop_lost_requests()
                    continue
                for output in self.llm.step():
                    if output.finished:
                        self.finish(output)
            elif exhausted:
                break
        return self.stats

    def abort_pending(self) -> None:
        for request_id in list(self.pending):
            with contextlib.suppress(Exception):
                self.llm.abort(request_id)

    def _drop_lost_requests(self) -> None:
        """The engine has nothing left but some requests never finished: report them."""
        for request_id, request in list(self.pending.items()):
            del self.pending[request_id]
            log.error("request %s: the engine dropped it without finishing it", request_id)
            self._emit(internal_error_line(request.custom_id, request.line, request_id), ok=False)


__all__ = [
    "BatchRunner",
    "BatchStats",
]
