"""The client commands against a service that does not answer: a one-line error naming where
the connection failed, and exit 1, never a traceback."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from conveyor.cli import main
from conveyor.cli.common import EXIT_ERROR


@pytest.fixture
def closed_url() -> str:
    """The URL of a port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.mark.parametrize(
    "command",
    [["status", "batch_x"], ["results", "batch_x"], ["cancel", "batch_x"],
     ["diff", "batch_x", "batch_y"], ["submit", "{input}"]],
)  # fmt: skip
def test_an_unreachable_service_is_a_one_line_error(command, closed_url, tmp_path: Path, capsys):
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}  # fmt: skip
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(line) + "\n")
    argv = [arg.format(input=path) for arg in command]
    assert main([*argv, "--url", closed_url]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith(f"conveyor {command[0]}: error: cannot reach the service: ConnectError")
    assert closed_url in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
