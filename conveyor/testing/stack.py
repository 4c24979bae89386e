"""The processes of one deployment on this machine: an API and any number of workers, each a
`conveyor` command in a process group of its own, logging to a file under `root`."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from conveyor.settings import normalize_database_url
from conveyor.testing.databases import migrate, scratch_database
from conveyor.testing.servers import LocalRedis, free_port, postgres_server, throwaway


def service_env(database_url: str, redis_url: str, root: Path) -> dict[str, str]:
    """This process's environment pointed at one database, one Redis and a data folder."""
    env = dict(os.environ)
    env.update(
        DATABASE_URL=database_url,
        REDIS_URL=redis_url,
        CONVEYOR_DATA_DIR=str(root / "data"),
        PYTHONUNBUFFERED="1",
    )
    return env


QUICK_TIMING = {
    "CONVEYOR_HEARTBEAT_INTERVAL": "0.5",
    "CONVEYOR_HEARTBEAT_TIMEOUT": "5",
    "CONVEYOR_RECONCILE_INTERVAL": "1",
}


def stack_env(database_url: str, redis_url: str, root: Path) -> dict[str, str]:
    """A test deployment's environment: quick heartbeats and reconciler rounds, small shards."""
    env = service_env(database_url, redis_url, root)
    env.update(QUICK_TIMING, CONVEYOR_SHARD_SIZE="8", CONVEYOR_VISIBILITY_TIMEOUT="600")
    return env


def conveyor_argv(args: list[str], launcher: list[str] | None = None) -> list[str]:
    """`conveyor ARGS` run by this Python, or `python LAUNCHER... ARGS` (an entry point of a
    test's own that ends in the CLI)."""
    return [sys.executable, *(launcher or ["-m", "conveyor"]), *args]


def resident_kib(pid: int) -> int:
    """The resident memory of process `pid` (VmRSS), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for process {pid}")


@dataclass
class Stack:
    """The processes of one deployment: an API and any number of workers."""

    env: dict[str, str]
    root: Path
    api_url: str = ""
    poll_interval: float = 0.1
    procs: list[subprocess.Popen] = field(default_factory=list)  # every one started
    named: dict[str, subprocess.Popen] = field(default_factory=dict)  # the latest of a name
    workers: dict[str, subprocess.Popen] = field(default_factory=dict)

    def start(
        self, name: str, argv: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        """Run `argv` with its output in `<root>/<name>.log`."""
        with open(self.root / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(
                argv,
                env=self.env if env is None else env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: Ctrl-C here does not reach it
            )
        self.procs.append(proc)
        self.named[name] = proc
        return proc

    def log(self, name: str) -> str:
        path = self.root / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def log_tail(self, name: str, lines: int = 40) -> str:
        return "\n".join(self.log(name).splitlines()[-lines:])

    def start_api(self, *extra: str, timeout: float = 60) -> str:
        """`conveyor serve EXTRA...` on a free port; its URL once it serves there."""

        def launch(port: int) -> subprocess.Popen:
            args = ["serve", "--host", "127.0.0.1", "--port", str(port), *extra]
            return self.start("api", conveyor_argv(args))

        _, port = serve_on_free_port(launch, lambda: self.log("api"), timeout)
        self.api_url = f"http://127.0.0.1:{port}"
        return self.api_url

    def start_worker(
        self,
        name: str,
        model: str | Path,
        *extra: str,
        served: str = "tiny",
        wait: bool = True,
        launcher: list[str] | None = None,
    ) -> subprocess.Popen:
        args = ["worker", "--model", str(model), "--name", name, "--loglevel", "INFO", *extra]
        if served:
            args += ["--served-model-name", served]
        proc = self.start(name, conveyor_argv(args, launcher))
        self.workers[name] = proc
        if wait:
            self.wait_worker_ready(name)
        return proc

    def wait_worker_ready(self, name: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        proc = self.workers[name]
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"worker {name} exited with {proc.returncode}:\n{self.log(name)}"
                )
            if "ready." in self.log(name):  # Celery's consumer is connected
                return
            time.sleep(self.poll_interval)
        raise RuntimeError(f"worker {name} did not start:\n{self.log(name)}")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.workers[name]
        os.killpg(proc.pid, sig)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"worker {name} did not exit within 30 s of signal {sig}; its log ends:\n"
                + self.log_tail(name, 120)
            ) from None

    def stop(self, grace: float = 15) -> None:
        """SIGTERM every process group, then SIGKILL what is still there after `grace` s."""
        for proc in self.procs:  # all at once, so that they stop together
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            reap_group(proc, grace)


@contextlib.contextmanager
def embedded_serve(
    root: Path,
    model: Path | str,
    served_name: str,
    *extra: str,
    timeout: float = 180,
    launcher: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[str]:
    """`conveyor serve` with the API and its worker in one process (no PostgreSQL, no Redis),
    serving `model` as `served_name`, run by `launcher` (see `conveyor_argv`) with `env` added
    to this process's environment; yields its URL once the worker is ready."""
    base = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env = base | {"CONVEYOR_DATA_DIR": str(root / "data"), "PYTHONUNBUFFERED": "1"} | (env or {})
    log_path = root / "serve.log"
    log_path.write_bytes(b"")

    def log_text() -> str:
        return log_path.read_text(errors="replace")

    def launch(port: int) -> subprocess.Popen:
        args = ["serve", "--port", str(port), "--model", str(model),
                "--served-model-name", served_name, *extra]  # fmt: skip
        with open(log_path, "ab") as log:
            return subprocess.Popen(
                conveyor_argv(args, launcher), env=env, cwd=root, stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    proc, port = serve_on_free_port(launch, log_text, timeout)
    try:
        deadline = time.time() + timeout
        while "ready." not in log_text():  # the worker consumes
            assert proc.poll() is None, log_text()
            assert time.time() < deadline, log_text()
            time.sleep(0.3)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_group(proc)


# `free_port` closes the port it found, so another process may take it before `conveyor serve`
# binds it: serve then exits saying so, and is started again on another
PORT_TRIES = 5


def serve_on_free_port(
    launch: Callable[[int], subprocess.Popen], log: Callable[[], str], timeout: float
) -> tuple[subprocess.Popen, int]:
    """(process, port) of the `conveyor serve` that `launch(port)` starts on a free port, once
    it serves there (`await_serving`), started again on another port while the one picked was
    taken; a serve that fails otherwise is stopped and the error raised."""
    for _ in range(PORT_TRIES):
        port = free_port()
        proc = launch(port)
        try:
            if await_serving(proc, port, log, timeout):
                return proc, port
        except BaseException:
            stop_group(proc)
            raise
    raise RuntimeError(f"{PORT_TRIES} free ports in a row were taken before serve bound")


def await_serving(
    proc: subprocess.Popen, port: int, log: Callable[[], str], timeout: float
) -> bool:
    """Wait until `proc`, a `conveyor serve` on 127.0.0.1:`port`, serves there (True; its
    /healthz answers), or exits because the port was taken (False). An answer on the port
    before serve says it serves could come from another server: it is not taken for serve's.
    Raises RuntimeError when serve exits otherwise or is not serving within `timeout` s."""
    serving, taken = f"API serving on http://127.0.0.1:{port} ", f"listen on 127.0.0.1:{port}:"
    deadline = time.monotonic() + timeout
    while serving not in log():
        if proc.poll() is not None:
            if taken in log():
                return False
            raise RuntimeError(f"serve exited with {proc.returncode}:\n{log()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"serve did not start in {timeout:.0f} s:\n{log()}")
        time.sleep(0.1)
    health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10)
    if health.status_code != 200:
        raise RuntimeError(f"serve's /healthz answered {health.status_code}:\n{log()}")
    return True


def stop_group(proc: subprocess.Popen, grace: float = 30) -> None:
    """SIGTERM the process group `proc` leads (started with `start_new_session`), SIGKILL it
    if it is still there after `grace` seconds."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    reap_group(proc, grace)


def reap_group(proc: subprocess.Popen, grace: float) -> None:
    """Wait up to `grace` seconds for `proc` to end (after a SIGTERM), then SIGKILL its group."""
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """SIGTERM raises SystemExit in the main thread while inside, so that the `finally`s that
    stop child processes run (Python's default for SIGTERM exits at once, leaving them)."""

    def leave(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, leave)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def service_deployment(name: str, **env: str) -> Iterator[Stack]:
    """A bench run's deployment: a fresh database on the PostgreSQL server, a throwaway
    redis-server, and a stack on them with a deployment's heartbeat and reconciler timing (not
    the tests' quick one), `env` added; its processes are stopped at the end, a SIGTERM to
    this process (`timeout`, a CI runner giving up) included."""
    with (
        sigterm_unwinds(),
        tempfile.TemporaryDirectory(prefix=f"conveyor-{name}-") as tmp,
        postgres_server() as server,
        scratch_database(server, f"conveyor_{name}_") as db_url,
        throwaway(LocalRedis, "conveyor-redis-") as redis_server,
    ):
        migrate(db_url)
        root = Path(tmp)
        stack_env = service_env(normalize_database_url(db_url), redis_server.url, root)
        stack = Stack(env=stack_env | env, root=root)
        try:
            yield stack
        finally:
            stack.stop()
