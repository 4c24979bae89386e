from __future__ import annotations

import functools
import os
from unittest import mock

# Triton reads this when it is first imported, and torch.compile (the compiled CPU attention)
# imports Triton early: set it before any test runs so the Triton kernels' tests run on the
# interpreter whatever ran before them. CPU code paths never launch Triton kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable, Iterator  # noqa: E402
from contextlib import AbstractContextManager, ExitStack  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from conveyor.demo_model import write_tiny_model  # noqa: E402
from conveyor.settings import normalize_database_url  # noqa: E402
from conveyor.testing import ServerMissing, Stack, databases, servers, stack_env  # noqa: E402  # noqa: E402

ARCHS = ("llama", "qwen2", "qwen3")


# ---- the service's servers, databases and processes (conveyor.testing) -------------------------
# PostgreSQL and Redis come from DATABASE_URL / REDIS_URL, else the default local ports, else
# throwaway servers from the local binaries; when those are missing too, the test fails saying
# what to install. Each test gets its own freshly migrated database (cloned from a template)
# and an empty Redis database.


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


@pytest.fixture
def redis_url(redis_server: str) -> str:
    return databases.random_redis_database(redis_server)


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory) -> Path:
    """A tiny random-weight Llama with a ChatML tokenizer, served as `tiny` in service tests."""
    return write_tiny_model(tmp_path_factory.mktemp("service-model") / "tiny", "llama")


@pytest.fixture
def stack(database_url: str, redis_url: str, tmp_path: Path) -> Iterator[Stack]:
    s = Stack(env=stack_env(database_url, redis_url, tmp_path), root=tmp_path)
    try:
        yield s
    finally:
        s.stop()


# ---- models and transformers as the reference ---------------------------------------------------


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Tiny random-weight Llama, Qwen2 and Qwen3 checkpoints written by transformers."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {arch: write_tiny_model(root / arch, arch) for arch in ARCHS}


@functools.cache
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@functools.cache
def _hf_greedy(path: str, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    """transformers' greedy continuation of one unpadded prompt (it stops at EOS, as we do)."""
    model = hf_model(path)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return tuple(out[0, len(prompt) :].tolist())


def hf_greedy(path: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    return list(_hf_greedy(str(path), tuple(prompt), max_new_tokens))


def hf_logprobs(path: Path, token_ids: list[int]) -> torch.Tensor:
    """log-softmax of transformers' logits at every position of `token_ids`: [len, vocab]."""
    with torch.no_grad():
        logits = hf_model(str(path))(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def random_prompts(
    count: int, min_len: int, max_len: int, vocab: int = 512, seed: int = 0
) -> list[list[int]]:
    """`count` random token-id prompts; the first is `min_len` and the second `max_len` long."""
    g = torch.Generator().manual_seed(seed)
    lengths = [min_len, max_len] + torch.randint(
        min_len, max_len + 1, (count - 2,), generator=g
    ).tolist()
    # avoid the special ids 0..2 so prompts never contain EOS
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def assert_greedy_matches_hf_through(path: Path, attention_backend: str, seed: int) -> None:
    """The engine's greedy equality with transformers through one attention backend: mixed
    lengths, long prompts split across steps, and a prompt whose prefix comes from the cache."""
    from engine import LLM, SamplingParams
    from kernels.cascade import plan_cascade

    prompts = random_prompts(6, 1, 90, seed=seed)
    max_tokens = [6, 3, 8, 5, 1, 7]
    llm = LLM(
        str(path),
        device="cpu",
        dtype="float32",
        block_size=8,
        max_num_batched_tokens=48,
        attention_backend=attention_backend,
    )
    assert llm.runner.backend.name == attention_backend
    params = [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, m, out in zip(prompts, max_tokens, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, m)

    # prompt 1 (90 tokens) left its blocks in the cache; these prompts start with its first
    # five and take them from there; the CPU backends read them once for all four (cascade)
    prefix = prompts[1][:40]
    shared = [prefix + tail for tail in random_prompts(4, 1, 20, seed=seed + 1)]
    plans = []

    def recording_plan(*args):
        plans.append(plan := plan_cascade(*args))
        return plan

    with mock.patch("engine.model_runner.plan_cascade", recording_plan):
        again = llm.generate(shared, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    for prompt, out in zip(shared, again, strict=True):
        assert out.num_cached_tokens == 40
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 6)
    used = [plan for plan in plans if plan is not None]
    if attention_backend == "triton":
        assert not used  # its kernels read the pages in place; no cascade there
    else:
        assert any(plan.suffix.num_prefills for plan in used)
        assert any(plan.suffix.num_decode_tokens for plan in used)
