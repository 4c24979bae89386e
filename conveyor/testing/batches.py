"""A client's side of a deployment, as the tests and benchmarks drive it: batch files, upload
and create, waiting on a batch, downloading a file, and API keys made with `conveyor keys`."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

import httpx

from conveyor.ledger.states import TERMINAL
from conveyor.testing.stack import conveyor_argv


def chat_request(custom_id: str, model: str, system: str, user: str, max_tokens: int = 8) -> dict:
    """One chat-completion request line of a batch file, greedy."""
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": model,
            "max_tokens": max_tokens,
            "temperature": 0,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": user},
            ],
        },
    }


def batch_lines(
    n: int,
    model: str = "tiny",
    system: str = "You are terse.",
    prefix: str = "q",
    max_tokens: int = 8,
) -> list[dict]:
    """`n` chat-completion request lines, custom_ids `<prefix>-<i>`."""
    return [
        chat_request(f"{prefix}-{i}", model, system, f"question number {i} of {prefix}", max_tokens)
        for i in range(n)
    ]


def write_jsonl(path: Path, lines: Iterable) -> Path:
    with open(path, "w") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return path


def upload_file(api: str, path: Path, headers: dict[str, str] | None = None) -> str:
    """Upload a JSONL file for batches; returns the file id."""
    with open(path, "rb") as f:
        upload = httpx.post(
            f"{api}/v1/files",
            files={"file": (path.name, f)},
            data={"purpose": "batch"},
            headers=headers,
            timeout=120,
        )
    if upload.status_code != 200:
        raise RuntimeError(f"the upload was answered {upload.status_code}: {upload.text}")
    return upload.json()["id"]


def submit_batch(
    api: str,
    path: Path,
    headers: dict[str, str] | None = None,
    endpoint: str = "/v1/chat/completions",
) -> str:
    """Upload a JSONL file and create a batch of it (chat completions unless `endpoint` says
    otherwise); returns the batch id."""
    body = {"input_file_id": upload_file(api, path, headers), "endpoint": endpoint}
    created = httpx.post(f"{api}/v1/batches", json=body, headers=headers, timeout=120)
    created.raise_for_status()
    return created.json()["id"]


def wait_for(
    api: str,
    batch_id: str,
    statuses: Collection[str] = TERMINAL,
    timeout: float = 300,
    headers: dict[str, str] | None = None,
) -> dict:
    """The batch object once its status is one of `statuses`; fails after `timeout` seconds."""
    deadline = time.time() + timeout
    # one client for every poll: a new httpx client costs ~20 ms of CPU (its TLS context)
    with httpx.Client(headers=headers, timeout=30) as client:
        while time.time() < deadline:
            batch = client.get(f"{api}/v1/batches/{batch_id}").json()
            if batch["status"] in statuses:
                return batch
            time.sleep(0.3)
    raise AssertionError(f"batch {batch_id} still {batch['status']} after {timeout}s: {batch}")


def download(api: str, file_id: str | None, headers: dict[str, str] | None = None) -> list[dict]:
    """The JSON lines of a file (none for no file)."""
    if file_id is None:
        return []
    r = httpx.get(f"{api}/v1/files/{file_id}/content", headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return [json.loads(line) for line in r.text.split("\n") if line.strip()]


def run_keys(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """`conveyor keys ARGS` against the deployment of `env`."""
    argv = conveyor_argv(["keys", *args])
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)


@dataclass(frozen=True)
class ApiKey:
    id: str
    secret: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.secret}"}


def create_key(env: dict[str, str], name: str) -> ApiKey:
    """A new key named `name` (its project too); the secret is alone on the last line."""
    made = run_keys(env, "create", "--name", name)
    if made.returncode != 0:
        raise RuntimeError(f"conveyor keys create failed ({made.returncode}): {made.stderr}")
    *head, secret = made.stdout.strip().splitlines()
    return ApiKey(head[0].split()[1], secret)
