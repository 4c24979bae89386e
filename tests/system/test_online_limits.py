"""The limits on online work, in the embedded service with a slow null engine: prompts and
prompts × n in one request (400 naming the field), a project's sequences in flight (429 with
Retry-After, given back when clients go away), and waiting requests that hold no thread, so the
rest of the API stays quick while hundreds wait."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from conveyor.testing import embedded_serve

WAITING = 200
LIMITS = {
    "CONVEYOR_MAX_ONLINE_PROMPTS": "4",
    "CONVEYOR_MAX_ONLINE_REQUEST_SEQUENCES": "16",
    "CONVEYOR_MAX_ONLINE_SEQUENCES": str(WAITING),
    # one answer a second: the waiting requests stay waiting
    "CONVEYOR_ECHO_STEP_SECONDS": "1",
}


def body(prompt: str | list[str] = "a b c", **fields) -> dict:
    return {"model": "echo", "prompt": prompt, "max_tokens": 4, **fields}


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> str:
    with pytest.MonkeyPatch.context() as env:
        for name, value in LIMITS.items():
            env.setenv(name, value)
        root = tmp_path_factory.mktemp("limits")
        with embedded_serve(root, "echo", "echo", "--max-num-seqs", "1") as url:
            yield url


def test_too_many_prompts_or_samples_are_refused_naming_the_field(service: str):
    many = httpx.post(service + "/v1/completions", json=body(["x"] * 5))
    assert many.status_code == 400
    assert (
        many.json()["error"]["param"] == "prompt" and "5 prompts" in many.json()["error"]["message"]
    )
    huge = httpx.post(service + "/v1/completions", json=body(["x"] * 50_000))
    assert huge.status_code == 400 and huge.json()["error"]["param"] == "prompt"
    samples = httpx.post(service + "/v1/completions", json=body(["x"] * 4, n=5))
    assert samples.status_code == 400
    assert (
        samples.json()["error"]["param"] == "n"
        and "20 sequences" in samples.json()["error"]["message"]
    )


async def _while_many_wait(url: str) -> dict:
    """Starts WAITING requests, times a few batch listings and two more requests while they
    wait, then drops them all."""
    limits = httpx.Limits(max_connections=WAITING + 10)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        waiting = [
            asyncio.create_task(client.post("/v1/completions", json=body(f"wait {i}")))
            for i in range(WAITING)
        ]
        await asyncio.sleep(3)  # all in, and waiting for their turn in the engine
        done = [task for task in waiting if task.done()]
        assert len(done) < 10, [t.exception() or t.result().status_code for t in done[:5]]
        listings = []
        for _ in range(5):
            start = time.perf_counter()
            assert (await client.get("/v1/batches")).status_code == 200
            listings.append(time.perf_counter() - start)
        over = await client.post("/v1/completions", json=body(["x", "y", "z"], n=4))
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
    return {"listings": listings, "over": over}


def test_a_project_over_its_sequences_gets_a_429_and_waiting_costs_no_thread(service: str):
    seen = asyncio.run(_while_many_wait(service))
    assert max(seen["listings"]) < 0.5, seen["listings"]
    print(f"GET /v1/batches while {WAITING} online requests wait: {seen['listings']}")
    over = seen["over"]
    assert over.status_code == 429 and over.headers["Retry-After"]
    error = over.json()["error"]
    assert (
        error["code"] == "rate_limit_exceeded"
        and "CONVEYOR_MAX_ONLINE_SEQUENCES" in error["message"]
    )
    # the dropped requests gave their sequences back (and left the engine): this one runs
    deadline = time.monotonic() + 30
    while True:
        again = httpx.post(service + "/v1/completions", json=body(["x", "y", "z"], n=4), timeout=30)
        if again.status_code != 429 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert again.status_code == 200, again.text


def test_a_project_that_starts_requests_too_fast_gets_a_429(tmp_path):
    env = {
        "CONVEYOR_ONLINE_RATE_LIMIT": "0.5",  # one every 2 s
        "CONVEYOR_ONLINE_BURST": "2",
        "CONVEYOR_ECHO_STEP_SECONDS": "0",
    }

    async def at_once(url: str, n: int) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            posts = [client.post("/v1/completions", json=body(f"go {i}")) for i in range(n)]
            return await asyncio.gather(*posts)

    with embedded_serve(tmp_path, "echo", "echo", env=env) as url:
        answers = asyncio.run(at_once(url, 3))
        assert sorted(r.status_code for r in answers) == [200, 200, 429]
        over = next(r for r in answers if r.status_code == 429)
        assert over.headers["Retry-After"] in ("1", "2")
        error = over.json()["error"]
        assert error["code"] == "rate_limit_exceeded"
        assert "CONVEYOR_ONLINE_RATE_LIMIT" in error["message"]
        streamed = httpx.post(url + "/v1/completions", json=body(stream=True))
        assert streamed.status_code == 429  # streams count too
        time.sleep(float(streamed.headers["Retry-After"]) + 0.1)
        assert httpx.post(url + "/v1/completions", json=body("again")).status_code == 200
