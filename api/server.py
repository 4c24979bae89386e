"""The API's HTTP server: uvicorn, stopped gracefully by SIGTERM and promptly by Ctrl-C."""

from __future__ import annotations

import logging
import signal
import socket
from types import FrameType
from typing import Any

import uvicorn

from conveyor.api.app import create_app

logger = logging.getLogger("conveyor.api")

# SIGTERM (a supervisor's stop): requests in flight get this long to finish
GRACEFUL_SECONDS = 30
# Ctrl-C: a person waits for the prompt; open streams and long polls are cut after this
INTERRUPT_SECONDS = 1


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on host:port, taken before anything slow starts, so that a port in
    use is refused at once (OSError) and no other server can take it while the API starts.
    Connections made before the API serves wait in its backlog."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # a restart may bind while the last run's connections linger in TIME_WAIT
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if sock.family == socket.AF_INET6 else f"http://{host}:{port}"


class ApiServer(uvicorn.Server):
    """uvicorn's server, whose graceful shutdown is short after Ctrl-C."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and sockets:  # uvicorn says nothing when handed its sockets
            logger.info("API serving on %s (Ctrl-C to stop)", url_of(sockets[0]))

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGINT:
            self.config.timeout_graceful_shutdown = INTERRUPT_SECONDS
        super().handle_exit(sig, frame)


def api_server(settings: Any) -> ApiServer:
    """The API's server, not yet running: `run(sockets=[listen(host, port)])` serves it."""
    config = uvicorn.Config(
        create_app(settings),
        log_level="info",
        log_config=None,  # uvicorn's lines go through our handler (text or JSON)
        timeout_graceful_shutdown=GRACEFUL_SECONDS,
    )
    return ApiServer(config)
