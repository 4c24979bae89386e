"""The API's HTTP server: uvicorn, stopped gracefully by SIGTERM and promptly by Ctrl-C."""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any

import uvicorn

from conveyor.api.app import create_app

# SIGTERM (a supervisor's stop): requests in flight get this long to finish
GRACEFUL_SECONDS = 30
# Ctrl-C: a person waits for the prompt; open streams and long polls are cut after this
INTERRUPT_SECONDS = 1


class ApiServer(uvicorn.Server):
    """uvicorn's server, whose graceful shutdown is short after Ctrl-C."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGINT:
            self.config.timeout_graceful_shutdown = INTERRUPT_SECONDS
        super().handle_exit(sig, frame)


def api_server(settings: Any, host: str, port: int) -> ApiServer:
    """The API's server, not yet running."""
    config = uvicorn.Config(
        create_app(settings),
        host=host,
        port=port,
        log_level="info",
        log_config=None,  # uvicorn's lines go through our handler (text or JSON)
        timeout_graceful_shutdown=GRACEFUL_SECONDS,
    )
    return ApiServer(config)
