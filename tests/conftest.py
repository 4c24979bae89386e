from __future__ import annotations

import os
import random

import torch

# Triton reads this when it is first imported, and torch.compile (the compiled CPU attention)
# imports Triton early: without a GPU, set it before any test runs so the Triton kernels' tests
# run on the interpreter whatever ran before them. With one they run compiled, on it. CPU code
# paths never launch Triton kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The services the tests start (workers, `conveyor serve`) compute in float32, where their
# answers can be compared with transformers' token for token; on a CPU with fast bfloat16 the
# default would be bfloat16, which has tests of its own (tests/engine/test_bfloat16.py). They
# use the eager attention and elementwise ops, which start without compiling: the compiled
# paths are tested in process (tests/engine, tests/kernels), where they compile once for the
# whole session.
os.environ.setdefault("CONVEYOR_DTYPE", "float32")
os.environ.setdefault("CONVEYOR_ATTENTION_BACKEND", "torch")
os.environ.setdefault("CONVEYOR_ELEMENTWISE", "eager")
# Run side by side (pytest-xdist, one process per core), each test process computes on one
# thread: two processes of a thread per core each would otherwise spin on each other's cores.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    torch.set_num_threads(1)

from collections.abc import Callable, Iterator, Sequence  # noqa: E402
from contextlib import AbstractContextManager, ExitStack  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from conveyor.demo_model import write_tiny_model  # noqa: E402
from conveyor.settings import normalize_database_url  # noqa: E402
from conveyor.testing import ServerMissing, Stack, databases, servers, stack_env  # noqa: E402
from tests.hf_reference import ARCHS  # noqa: E402

# ---- the service's servers, databases and processes (conveyor.testing) -------------------------
# PostgreSQL and Redis come from DATABASE_URL / REDIS_URL, else the default local ports, else
# throwaway servers from the local binaries; when those are missing too, the test fails saying
# what to install. Each test gets its own freshly migrated database (cloned from a template)
# and an empty Redis database.


# test folders by how long their files run, the longest first ("tests": the files at the top,
# which run the docs' build and the GPU check's dry run)
LONGEST_FIRST = ("system", "ui", "tests", "kernels", "engine")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # the longest files go out first (pyproject's addopts keep xdist from reordering them by
    # their count of tests), so that with a test process per core the short ones fill the gaps
    # at the end instead of one long file running alone
    def rank(item: pytest.Item) -> int:
        folder = item.path.parts[-2]
        return LONGEST_FIRST.index(folder) if folder in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)
    if torch.cuda.is_available():
        return
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU: torch sees none here")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not `keywords`: ids like [gpu] too
            item.add_marker(no_gpu)


def _server(server: Callable[[], AbstractContextManager[str]]) -> Iterator[str]:
    with ExitStack() as stack:
        try:
            url = stack.enter_context(server())
        except ServerMissing as err:
            pytest.fail(str(err))
        yield url


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    yield from _server(servers.postgres_server)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[str]:
    yield from _server(servers.redis_server)


@pytest.fixture(scope="session")
def template_database(postgres_server: str) -> Iterator[str]:
    """A database migrated once; each test's database is a copy of it."""
    with databases.migrated_template(postgres_server) as name:
        yield name


@pytest.fixture
def database_url(postgres_server: str, template_database: str) -> Iterator[str]:
    with databases.scratch_database(postgres_server, "conveyor_t_", template_database) as url:
        yield normalize_database_url(url)


class RedisDatabases:
    """The Redis databases (1-15) this test process uses, in turn. Under pytest-xdist each
    worker has its own share of them, so tests running side by side never empty each other's;
    one that a module's service keeps (`hold`) leaves the rotation."""

    def __init__(self, numbers: Sequence[int]) -> None:
        # a random start: separate runs on one Redis server rarely meet
        self.numbers, self.next, self.held = list(numbers), random.randrange(len(numbers)), set()

    def url(self, server: str, hold: bool = False) -> str:
        free = [n for n in self.numbers if n not in self.held]
        if not free:
            pytest.fail(f"no Redis test database left among {self.numbers}")
        number = free[self.next % len(free)]
        self.next += 1
        if hold:
            self.held.add(number)
        return databases.redis_database(server, number)


@pytest.fixture(scope="session")
def redis_databases(request: pytest.FixtureRequest) -> RedisDatabases:
    worker = getattr(request.config, "workerinput", None)  # set on pytest-xdist's workers
    if worker is None:
        return RedisDatabases(databases.REDIS_TEST_DBS)
    index, count = int(worker["workerid"].removeprefix("gw")), worker["workercount"]
    return RedisDatabases(databases.REDIS_TEST_DBS[index::count])


@pytest.fixture
def redis_url(redis_server: str, redis_databases: RedisDatabases) -> str:
    return redis_databases.url(redis_server)


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory) -> Path:
    """A tiny random-weight Llama with a ChatML tokenizer, served as `tiny` in service tests."""
    return write_tiny_model(tmp_path_factory.mktemp("service-model") / "tiny", "llama")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    report = yield
    if report.when == "call":
        item.stash[CALL_FAILED] = report.failed
    return report


CALL_FAILED = pytest.StashKey[bool]()


@pytest.fixture
def stack(
    database_url: str, redis_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Stack]:
    s = Stack(env=stack_env(database_url, redis_url, tmp_path), root=tmp_path)
    try:
        yield s
    finally:
        s.stop()
        if request.node.stash.get(CALL_FAILED, False):  # what the processes said, in the report
            for name in s.named:
                print(f"---- the end of {name}.log ----\n{s.log_tail(name, 60)}")


# ---- models and transformers as the reference ---------------------------------------------------


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Tiny random-weight checkpoints of every family in ARCHS, written by transformers."""
    root = tmp_path_factory.mktemp("checkpoints")
    # seed 0's Gemma 3 ends enough greedy continuations early (EOS) that the engine tests'
    # tiny pool never runs dry; seed 1's fill it
    seeds = {"gemma3": 1}
    return {arch: write_tiny_model(root / arch, arch, seed=seeds.get(arch, 0)) for arch in ARCHS}
