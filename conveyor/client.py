"""A small client of the Conveyor REST API (httpx), used by `conveyor submit/status/...` and by
`conveyor eval`'s lm-eval model: upload a file, create a batch (or find the one made earlier with
an idempotency key), wait for batches with a progress bar, download their files."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from conveyor.ledger.states import TERMINAL
from conveyor.wire_format.errors import IDEMPOTENCY_KEY_REUSED

DEFAULT_URL = "http://127.0.0.1:8000"
API_OUTAGE_TOLERANCE = 300.0  # seconds a waiting client rides out an unreachable API


def json_lines(chunks: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    """The JSON lines of a byte stream, split at "\n" alone: httpx's `iter_lines`, as
    `str.splitlines`, also splits at characters a JSON string may hold as they are (U+2028,
    U+2029, U+0085), and a model can write them."""
    rest = b""
    for chunk in chunks:
        *lines, rest = (rest + chunk).split(b"\n")
        for line in lines:
            if line.strip():
                yield json.loads(line)
    if rest.strip():
        yield json.loads(rest)


class ServiceError(Exception):
    """The service answered with an error (the API's own is `conveyor.api.errors.APIError`)."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.code = code


# what a call to the service can raise: its answer, the connection's failure (httpx's), a file
CLIENT_ERRORS = (ServiceError, httpx.HTTPError, OSError)


def client_error_text(err: Exception) -> str:
    """One of `CLIENT_ERRORS` in a line: the service's error, or where the connection failed."""
    if not isinstance(err, httpx.HTTPError):
        return str(err)
    try:
        where = f" ({err.request.method} {err.request.url})"
    except RuntimeError:  # an error made without its request
        where = ""
    return f"cannot reach the service: {type(err).__name__}: {err}{where}"


class ConveyorClient:
    def __init__(self, base_url: str | None = None, timeout: float = 600.0) -> None:
        self.base_url = (base_url or os.environ.get("CONVEYOR_URL") or DEFAULT_URL).rstrip("/")
        headers = {}
        if key := os.environ.get("CONVEYOR_API_KEY"):
            headers["Authorization"] = f"Bearer {key}"
        self.http = httpx.Client(base_url=self.base_url, timeout=timeout, headers=headers)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> ConveyorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check(self, response: httpx.Response) -> httpx.Response:
        if response.status_code >= 400:
            code = None
            try:
                error = response.json()["error"]
                message, code = error["message"], error.get("code")
            except (ValueError, KeyError, TypeError, AttributeError):
                message = response.text[:500]
            raise ServiceError(response.status_code, message, code)
        return response

    def wait_ready(self, timeout: float) -> None:
        """Wait until `/readyz` answers 200 (the API is up and reaches its database and broker)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.http.get("/readyz", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise ServiceError(
                    503, f"the API at {self.base_url} was not ready after {timeout:.0f}s"
                )
            time.sleep(0.5)

    def models(self) -> list[str]:
        """The names of the models live workers serve."""
        return [m["id"] for m in self._check(self.http.get("/v1/models")).json()["data"]]

    def upload(self, path: Path) -> dict[str, Any]:
        with open(path, "rb") as f:
            files = {"file": (path.name, f, "application/jsonl")}
            return self._check(
                self.http.post("/v1/files", files=files, data={"purpose": "batch"})
            ).json()

    def create_batch(
        self,
        file_id: str,
        endpoint: str,
        window: str = "24h",
        metadata: dict[str, str] | None = None,
        idempotency_key: str | None = None,
        reuse: str | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "input_file_id": file_id,
            "endpoint": endpoint,
            "completion_window": window,
            "metadata": metadata,
        }
        if reuse is not None:
            body["reuse"] = reuse
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._check(self.http.post("/v1/batches", json=body, headers=headers)).json()

    def batch_for_key(self, idempotency_key: str) -> dict[str, Any] | None:
        """The batch created with this idempotency key, if any."""
        params = {"idempotency_key": idempotency_key}
        data = self._check(self.http.get("/v1/batches", params=params)).json()["data"]
        return data[0] if data else None

    def find_or_create_batch(
        self,
        path: Path,
        endpoint: str,
        window: str = "24h",
        metadata: dict[str, str] | None = None,
        idempotency_key: str | None = None,
        reuse: str | None = None,
    ) -> tuple[dict[str, Any], bool]:
        """The batch made earlier with `idempotency_key` and True, else a new batch of the
        uploaded `path` and False. When a concurrent create with the key wins, its batch is
        returned (and True) and the upload made here is deleted."""
        if idempotency_key:
            batch = self.batch_for_key(idempotency_key)
            if batch is not None:
                return batch, True
        file = self.upload(path)
        try:
            batch = self.create_batch(
                file["id"], endpoint, window, metadata, idempotency_key, reuse
            )
        except ServiceError as err:
            if err.code != IDEMPOTENCY_KEY_REUSED or not idempotency_key:
                raise
            batch = self.batch_for_key(idempotency_key)
            if batch is None:
                raise
        reused = batch["input_file_id"] != file["id"]
        if reused:
            self.delete_file(file["id"])
        return batch, reused

    def delete_file(self, file_id: str) -> None:
        self._check(self.http.delete(f"/v1/files/{file_id}"))

    def batch(self, batch_id: str) -> dict[str, Any]:
        return self._check(self.http.get(f"/v1/batches/{batch_id}")).json()

    def poll(
        self, batch_id: str, on_outage: Callable[[Exception], None] | None = None
    ) -> dict[str, Any]:
        """The batch, retrying while the API is unreachable or answers 5xx (restarting), for up
        to API_OUTAGE_TOLERANCE seconds; `on_outage` hears of each failed try."""
        deadline = time.monotonic() + API_OUTAGE_TOLERANCE
        while True:
            try:
                return self.batch(batch_id)
            except (httpx.TransportError, ServiceError) as err:
                if isinstance(err, ServiceError) and err.status < 500:
                    raise
                if time.monotonic() > deadline:
                    raise
                if on_outage is not None:
                    on_outage(err)
                time.sleep(2.0)

    def wait(
        self, batch_ids: Sequence[str], poll: float = 1.0, desc: str | None = None
    ) -> list[dict[str, Any]]:
        """The batches once each has ended (completed, failed, expired or cancelled), showing
        their finished requests of their total on one progress bar."""
        from tqdm.auto import tqdm

        batches = [self.batch(batch_id) for batch_id in batch_ids]
        total = sum(b["request_counts"]["total"] for b in batches)
        with tqdm(total=total, desc=desc or ", ".join(batch_ids), unit="req") as bar:

            def show() -> None:
                counts = [b["request_counts"] for b in batches]
                bar.total = sum(c["total"] for c in counts)
                bar.n = sum(c["completed"] + c["failed"] for c in counts)
                status = ",".join(sorted({b["status"] for b in batches}))
                bar.set_postfix(status=status, failed=sum(c["failed"] for c in counts))
                bar.refresh()

            def outage(err: Exception) -> None:
                bar.write(f"the API is unavailable ({err}); retrying")

            show()
            while any(b["status"] not in TERMINAL for b in batches):
                time.sleep(poll)
                batches = [
                    b if b["status"] in TERMINAL else self.poll(b["id"], outage) for b in batches
                ]
                show()
        return batches

    def cancel(self, batch_id: str) -> dict[str, Any]:
        return self._check(self.http.post(f"/v1/batches/{batch_id}/cancel")).json()

    def download(self, file_id: str, target: Path) -> int:
        """Stream a file's content to `target`; returns the number of lines."""
        lines = 0
        with self.http.stream("GET", f"/v1/files/{file_id}/content") as response:
            if response.status_code >= 400:
                response.read()
                self._check(response)
            with open(target, "wb") as out:
                for chunk in response.iter_bytes():
                    lines += chunk.count(b"\n")
                    out.write(chunk)
        return lines

    def results(self, batch_id: str, after: str | None = None) -> Iterator[dict[str, Any]]:
        params = {"after": after} if after else {}
        with self.http.stream("GET", f"/v1/batches/{batch_id}/results", params=params) as r:
            if r.status_code >= 400:
                r.read()
                self._check(r)
            yield from json_lines(r.iter_bytes())
