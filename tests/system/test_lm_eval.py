"""lm-eval from PyPI, unmodified, against Conveyor.

The tasks under tests/system/lm_eval_tasks (multiple choice with one few-shot prefix for every doc,
generation cut at stop sequences, rolling loglikelihood) run once with lm-eval's own `hf` model
on the tiny checkpoint and once through the service with `conveyor eval`: every per-sample
loglikelihood agrees within 1e-4, accuracies and generations are identical. Running the same
`conveyor eval` again, after a Ctrl-C or after it finished, attaches to the batches it made. The
same comparison runs through lm-eval's `local-completions` against `conveyor serve`'s online
completions endpoint. The first `conveyor eval` runs with lm-eval's own tasks indexed beside
these, as a user's does; the other runs index these alone (`lm_eval_own_tasks.py`).
"""

from __future__ import annotations

import functools
import glob
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from conveyor.cli.client_commands import lm_eval_argv
from conveyor.cli.common import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK
from conveyor.testing import Stack, embedded_serve
from tests.system.test_interrupt import PROMPT_SECONDS

TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"
OWN_TASKS_ONLY = Path(__file__).parent / "lm_eval_own_tasks.py"
TASKS = "conveyor_mc,conveyor_gen,conveyor_rolling"
# one loglikelihood (a continuation of a few tokens) may differ from transformers' by this much
LOGPROB_TOLERANCE = 1e-4
# a document's rolling loglikelihood sums one logprob per token: this much per token
ROLLING_TOLERANCE_PER_TOKEN = 1e-4


def lm_eval_env(root: Path, **extra: str) -> dict[str, str]:
    """The environment of an lm-eval run: datasets offline, caches under `root`."""
    env = dict(os.environ)
    env.update(
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_CACHE=str(root / "datasets-cache"),
        HF_HOME=str(root / "hf-home"),
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        **extra,
    )
    return env


def task_args(output_path: Path) -> list[str]:
    return ["--include_path", ".", "--tasks", TASKS, "--log_samples", "--output_path",
            str(output_path)]  # fmt: skip


def python(argv: list[str], all_tasks: bool) -> list[str]:
    """`python ARGV`; unless `all_tasks`, with lm-eval's task index narrowed to the tasks'
    folder (`lm_eval_own_tasks.py`: the index of lm-eval's own ~14,000 task files is ~15 s a
    run on a slow CPU)."""
    return [sys.executable, *([] if all_tasks else [str(OWN_TASKS_ONLY)]), *argv]


def run(
    argv: list[str], env: dict[str, str], timeout: float = 600, all_tasks: bool = False
) -> subprocess.CompletedProcess:
    """`python ARGV` in the tasks' folder (their data files are relative to it)."""
    return subprocess.run(
        python(argv, all_tasks),
        cwd=TASKS_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def conveyor_eval(model_args: str, output_path: Path) -> list[str]:
    return ["-m", "conveyor", "eval", "--model_args", model_args, *task_args(output_path)]


@dataclass
class EvalRun:
    """What lm-eval wrote: the results JSON and each task's samples by doc_id."""

    results: dict
    samples: dict[str, dict[int, dict]]


def read_run(output_path: Path) -> EvalRun:
    (results_file,) = glob.glob(str(output_path / "*" / "results_*.json"))
    samples = {}
    for task in TASKS.split(","):
        (path,) = glob.glob(str(output_path / "*" / f"samples_{task}_*.jsonl"))
        with open(path) as f:
            samples[task] = {s["doc_id"]: s for s in map(json.loads, f)}
    return EvalRun(json.loads(Path(results_file).read_text()), samples)


@pytest.fixture(scope="session")
def hf_run(chat_model: Path, tmp_path_factory) -> EvalRun:
    """The tasks run with lm-eval's own `hf` model on the tiny checkpoint: the reference."""
    root = tmp_path_factory.mktemp("lm-eval-hf")
    argv = ["-m", "lm_eval", "run", "--model", "hf", "--model_args",
            f"pretrained={chat_model},dtype=float32", "--device", "cpu", "--batch_size", "1",
            *task_args(root / "out")]  # fmt: skip
    done = run(argv, lm_eval_env(root))
    assert done.returncode == 0, done.stderr[-5000:]
    return read_run(root / "out")


@functools.cache
def token_count(model: Path, text: str) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(model)(text, add_special_tokens=False).input_ids)


def loglikelihoods(sample: dict) -> list[tuple[float, bool]]:
    """A multiple-choice sample's (logprob, is_greedy) per choice (lm-eval writes strings)."""
    return [(float(lp), str(greedy) == "True") for ((lp, greedy),) in sample["resps"]]


def assert_matches_hf(got: EvalRun, hf: EvalRun, model: Path) -> None:
    mc, hf_mc = got.samples["conveyor_mc"], hf.samples["conveyor_mc"]
    assert mc.keys() == hf_mc.keys() and len(mc) == 27
    for doc_id, sample in mc.items():
        reference = hf_mc[doc_id]
        for (lp, greedy), (hf_lp, hf_greedy) in zip(
            loglikelihoods(sample), loglikelihoods(reference), strict=True
        ):
            assert abs(lp - hf_lp) <= LOGPROB_TOLERANCE, (doc_id, lp, hf_lp)
            assert greedy == hf_greedy, doc_id
        assert (sample["acc"], sample["acc_norm"]) == (reference["acc"], reference["acc_norm"])
    for metric in ("acc,none", "acc_norm,none"):
        assert (
            got.results["results"]["conveyor_mc"][metric]
            == (hf.results["results"]["conveyor_mc"][metric])
        )

    gen, hf_gen = got.samples["conveyor_gen"], hf.samples["conveyor_gen"]
    assert gen.keys() == hf_gen.keys() and len(gen) == 16
    for doc_id, sample in gen.items():
        assert sample["resps"] == hf_gen[doc_id]["resps"], doc_id
        assert sample["filtered_resps"] == hf_gen[doc_id]["filtered_resps"], doc_id
    # the stop sequences fire: greedy output of this checkpoint holds them right at the start
    assert any(s["resps"] == [[""]] for s in hf_gen.values())

    rolling, hf_rolling = got.samples["conveyor_rolling"], hf.samples["conveyor_rolling"]
    assert rolling.keys() == hf_rolling.keys() and len(rolling) == 12
    for doc_id, sample in rolling.items():
        ((value,),), ((hf_value,),) = sample["resps"], hf_rolling[doc_id]["resps"]
        tokens = token_count(model, sample["doc"]["text"])
        assert abs(float(value) - float(hf_value)) <= ROLLING_TOLERANCE_PER_TOKEN * tokens, (
            doc_id,
            value,
            hf_value,
        )


def batches(api: str) -> list[dict]:
    return httpx.get(f"{api}/v1/batches", params={"limit": 100}, timeout=30).json()["data"]


def test_conveyor_eval_matches_lm_eval_hf(
    stack: Stack, chat_model: Path, hf_run: EvalRun, tmp_path: Path
) -> None:
    api = stack.start_api()
    stack.start_worker("w1", chat_model)
    env = lm_eval_env(tmp_path, CONVEYOR_URL=api)  # base_url's default
    # no tokenizer given: the server's, through its /tokenize and /tokenizer_info; lm-eval's own
    # tasks indexed beside ours, as a user's run has them
    done = run(conveyor_eval("poll=0.2", tmp_path / "out"), env, all_tasks=True)
    assert done.returncode == EXIT_OK, done.stderr[-5000:]
    assert "Using remote tokenizer" in done.stderr
    assert_matches_hf(read_run(tmp_path / "out"), hf_run, chat_model)

    # one batch per request type, of `tiny`, the one model served (model's default)
    made = {b["metadata"]["lm_eval_request_type"]: b for b in batches(api)}
    assert sorted(made) == ["generate_until", "loglikelihood", "loglikelihood_rolling"]
    assert {b["status"] for b in made.values()} == {"completed"}
    assert {b["model"] for b in made.values()} == {"tiny"}
    counts = {kind: b["request_counts"]["total"] for kind, b in made.items()}
    assert counts == {"loglikelihood": 27 * 4, "generate_until": 16, "loglikelihood_rolling": 12}
    # the docs' shared three-shot prefix came from the prefix cache
    assert made["loglikelihood"]["usage"]["input_tokens_details"]["cached_tokens"] > 0


def wait_for_batches(api: str, count: int, timeout: float = 180) -> list[dict]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if len(found := batches(api)) >= count:
            return found
        time.sleep(0.3)
    raise AssertionError(f"expected {count} batches, found {batches(api)}")


def test_rerunning_conveyor_eval_attaches_to_its_batches(
    stack: Stack, chat_model: Path, hf_run: EvalRun, tmp_path: Path
) -> None:
    api = stack.start_api()  # no worker yet: the batches wait
    env = lm_eval_env(tmp_path)
    # 50 lines a batch: the 108 loglikelihood requests go in three batches
    model_args = f"base_url={api},model=tiny,tokenizer={chat_model},poll=0.2,max_batch_lines=50"
    argv = conveyor_eval(model_args, tmp_path / "first")
    first = subprocess.Popen(
        python(argv, all_tasks=False), cwd=TASKS_DIR, env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        waiting = wait_for_batches(api, 3)
        time.sleep(0.5)
        interrupted = time.monotonic()
        first.send_signal(signal.SIGINT)  # Ctrl-C while it waits
        _, stderr = first.communicate(timeout=60)
        took = time.monotonic() - interrupted
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(10)
    assert first.returncode == EXIT_INTERRUPTED, stderr[-3000:]
    assert took < PROMPT_SECONDS, f"conveyor eval took {took:.1f} s to stop"
    assert "run the same command again" in stderr
    assert sorted(b["request_counts"]["total"] for b in waiting) == [8, 50, 50]
    interrupted = {b["id"] for b in waiting}

    stack.start_worker("w1", chat_model)
    again = run(conveyor_eval(model_args, tmp_path / "again"), env)
    assert again.returncode == EXIT_OK, again.stderr[-5000:]
    for batch_id in interrupted:
        assert f"attached to batch {batch_id}" in again.stderr
    after = {b["id"]: b for b in batches(api)}
    assert interrupted <= after.keys() and len(after) == 5  # + generation and rolling
    assert {b["status"] for b in after.values()} == {"completed"}
    assert_matches_hf(read_run(tmp_path / "again"), hf_run, chat_model)

    # once more after it finished: the same batches, the same results, nothing submitted
    third = run(conveyor_eval(model_args, tmp_path / "third"), env)
    assert third.returncode == EXIT_OK, third.stderr[-5000:]
    assert "submitted batch" not in third.stderr
    assert {b["id"] for b in batches(api)} == after.keys()
    rerun, previous = read_run(tmp_path / "third"), read_run(tmp_path / "again")
    for task, samples in rerun.samples.items():
        assert {d: s["resps"] for d, s in samples.items()} == {
            d: s["resps"] for d, s in previous.samples[task].items()
        }


def test_a_request_without_a_result_fails_the_evaluation_naming_it(
    stack: Stack, chat_model: Path, tmp_path: Path
) -> None:
    stack.env["CONVEYOR_MAX_TOKENS"] = "8"  # the generation task asks for 16
    api = stack.start_api()
    stack.start_worker("w1", chat_model)
    argv = ["-m", "conveyor", "eval", "--model_args", f"base_url={api},tokenizer={chat_model},"
            "poll=0.2", "--include_path", ".", "--tasks", "conveyor_gen", "--output_path",
            str(tmp_path / "out")]  # fmt: skip
    done = run(argv, lm_eval_env(tmp_path))
    assert done.returncode == EXIT_ERROR, done.stderr[-5000:]
    error = done.stderr[done.stderr.index("conveyor eval: error:") :]
    assert "16 of 16 generate_until requests got no result" in error
    assert "generate_until-0 (context 'Q: Add two and three.\\nA:'): max_tokens_too_large" in (
        error
    )
    assert "... and 6 more" in error
    assert not list((tmp_path / "out").glob("*/results_*.json"))


def test_local_completions_against_conveyor_serve_matches_lm_eval_hf(
    chat_model: Path, hf_run: EvalRun, tmp_path: Path
) -> None:
    with embedded_serve(tmp_path, chat_model, "tiny") as url:
        model_args = (
            f"model=tiny,base_url={url}/v1/completions,tokenized_requests=True,"
            f"tokenizer={chat_model},tokenizer_backend=huggingface,max_retries=1"
        )
        argv = ["-m", "lm_eval", "run", "--model", "local-completions", "--model_args",
                model_args, "--batch_size", "1", *task_args(tmp_path / "out")]  # fmt: skip
        done = run(argv, lm_eval_env(tmp_path))
    assert done.returncode == 0, done.stderr[-5000:]
    assert_matches_hf(read_run(tmp_path / "out"), hf_run, chat_model)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--tasks", "t"], ["run", "--model", "conveyor", "--tasks", "t"]),
        (["run", "--tasks", "t"], ["run", "--model", "conveyor", "--tasks", "t"]),
        (["--model", "hf", "--tasks", "t"], ["run", "--model", "hf", "--tasks", "t"]),
        (["-M", "hf"], ["run", "-M", "hf"]),
        (["--model=hf"], ["run", "--model=hf"]),
        (["--model_args", "model=x"], ["run", "--model", "conveyor", "--model_args", "model=x"]),
        (["ls", "tasks"], ["ls", "tasks"]),
        (["validate", "--tasks", "t"], ["validate", "--tasks", "t"]),
    ],
)
def test_conveyor_eval_is_lm_eval_run_with_the_conveyor_model(
    args: list[str], expected: list[str]
) -> None:
    assert lm_eval_argv(args) == ["lm-eval", *expected]


def test_a_config_file_may_choose_the_model_type(tmp_path: Path) -> None:
    named = tmp_path / "named.yaml"
    named.write_text("model: hf\ntasks: [t]\n")
    unnamed = tmp_path / "unnamed.yaml"
    unnamed.write_text("tasks: [t]\n")
    assert lm_eval_argv(["--config", str(named)]) == ["lm-eval", "run", "--config", str(named)]
    assert lm_eval_argv([f"-C{named}"]) == ["lm-eval", "run", f"-C{named}"]
    assert lm_eval_argv(["--config", str(unnamed)]) == [
        "lm-eval", "run", "--model", "conveyor", "--config", str(unnamed),
    ]  # fmt: skip


class FakeService:
    """The calls the conveyor model makes of its client, answered in memory: a batch per
    idempotency key, ending in the next of `statuses` (then `completed`), whose result lines
    `answer(custom_id, body)` gives (None: no line)."""

    def __init__(self, answer, statuses: tuple[str, ...] = ()) -> None:
        self.answer = answer
        self.statuses = list(statuses)
        self.by_key: dict[str, dict] = {}
        self.files: dict[str, list[dict]] = {}

    def find_or_create_batch(self, path, endpoint, window, metadata, idempotency_key):
        if idempotency_key in self.by_key:
            return self.by_key[idempotency_key], True
        lines = [json.loads(x) for x in Path(path).read_text().splitlines()]
        n = len(self.by_key)
        results = [self.answer(line["custom_id"], line["body"]) for line in lines]
        self.files[f"file-{n}"] = [r for r in results if r is not None]
        status = self.statuses.pop(0) if self.statuses else "completed"
        batch = {
            "id": f"batch_{n}", "status": status, "output_file_id": f"file-{n}",
            "error_file_id": None, "lines": len(lines),
            "request_counts": {"total": len(lines), "completed": len(lines), "failed": 0,
                               "reused": 0},
        }  # fmt: skip
        self.by_key[idempotency_key] = batch
        return batch, False

    def wait(self, batch_ids, poll, desc=None):
        return [b for i in batch_ids for b in self.by_key.values() if b["id"] == i]

    def download(self, file_id: str, target: Path) -> int:
        target.write_text("".join(json.dumps(r) + "\n" for r in self.files[file_id]))
        return len(self.files[file_id])


def ok(custom_id: str, body: dict) -> dict:
    text = f"answer to {len(body['prompt'])} tokens"
    response = {"status_code": 200, "body": {"choices": [{"index": 0, "text": text}]}}
    return {"custom_id": custom_id, "response": response, "error": None}


def generation_requests(*contexts: str) -> list:
    from lm_eval.api.instance import Instance

    return [
        Instance("generate_until", {}, (c, {"until": ["\n"], "max_gen_toks": 4}), idx=0)
        for c in contexts
    ]


def conveyor_lm(chat_model: Path, service: FakeService, **args):
    from conveyor.lm_eval_model import ConveyorLM

    lm = ConveyorLM(base_url="http://127.0.0.1:9", model="tiny", tokenizer=str(chat_model), **args)
    lm.client = service
    return lm


def test_a_failed_or_missing_result_line_fails_the_evaluation(chat_model: Path) -> None:
    from conveyor.lm_eval_model import EvaluationError

    def answer(custom_id: str, body: dict) -> dict | None:
        if custom_id.endswith("-1"):
            error = {"code": "internal_error", "message": "the engine failed"}
            response = {"status_code": 500, "body": {"error": error}}
            return {"custom_id": custom_id, "response": response, "error": None}
        return None if custom_id.endswith("-2") else ok(custom_id, body)

    lm = conveyor_lm(chat_model, FakeService(answer))
    with pytest.raises(EvaluationError) as failed:
        lm.generate_until(generation_requests("first", "second", "third"))
    message = str(failed.value)
    assert "2 of 3 generate_until requests got no result (batch batch_0)" in message
    assert "generate_until-1 (context 'second'): internal_error: the engine failed" in message
    assert "generate_until-2 (context 'third'): no result line" in message
    assert "generate_until-0" not in message


def test_a_cancelled_or_expired_batch_is_submitted_again_under_the_next_key(
    chat_model: Path,
) -> None:
    service = FakeService(ok, statuses=("expired",))
    lm = conveyor_lm(chat_model, service, max_batch_lines=2)
    requests = generation_requests("one", "two", "three")
    texts = lm.generate_until(requests)
    assert texts == [ok("", {"prompt": lm.tok_encode(c)})["response"]["body"]["choices"][0]["text"]
                     for c in ("one", "two", "three")]  # fmt: skip
    keys = list(service.by_key)
    assert [service.by_key[k]["lines"] for k in keys] == [2, 2, 1]  # two batches of <= 2
    first, retried, second = keys
    assert first.startswith("conveyor-eval:generate_until:") and retried == f"{first}:2"
    assert second != first and ":" not in second.removeprefix("conveyor-eval:generate_until:")
    # the same requests again: the same batches, nothing new
    assert lm.generate_until(requests) == texts
    assert list(service.by_key) == keys


class RecordingCache:
    """lm-eval's cache hook (`--use_cache`), recording what it is handed."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def add_partial(self, attr: str, req: tuple, res: object) -> None:
        self.calls.append((attr, req, res))


def scored(custom_id: str, body: dict) -> dict:
    """An echoed completion in which every prompt token after the first has logprob -1 (and is
    the greedy one), then one generated token."""
    n = len(body["prompt"])
    logprobs = {
        "token_logprobs": [None] + [-1.0] * (n - 1) + [-0.5],
        "top_logprobs": [None] + [{"t": -1.0}] * (n - 1) + [{"t": -0.5}],
    }
    choice = {"index": 0, "text": "", "logprobs": logprobs, "finish_reason": "length"}
    response = {"status_code": 200, "body": {"choices": [choice]}}
    return {"custom_id": custom_id, "response": response, "error": None}


def test_results_reach_lm_eval_and_its_cache_hook(chat_model: Path) -> None:
    from lm_eval.api.instance import Instance

    service = FakeService(scored)
    lm = conveyor_lm(chat_model, service, max_length=8)  # windows of 6 tokens
    lm.cache_hook = RecordingCache()
    pair = ("The quick brown fox", " jumps over")
    (answer,) = lm.loglikelihood([Instance("loglikelihood", {}, pair, idx=0)])
    assert answer == (-1.0 * len(lm.tok_encode(" jumps over")), True)

    text = "Write a short poem about the sea, then translate it into German."
    (total,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), idx=0)])
    tokens = len(lm.tok_encode(text))
    assert total == -1.0 * tokens  # every token scored once, over several windows
    rolling = [b for k, b in service.by_key.items() if ":loglikelihood_rolling:" in k]
    assert len(rolling) == 1 and rolling[0]["lines"] == -(-tokens // 6)  # one batch of windows

    (generated,) = lm.generate_until(generation_requests("Q: hello"))
    assert lm.cache_hook.calls == [
        ("loglikelihood", pair, answer),
        ("loglikelihood_rolling", (text,), total),
        ("generate_until", ("Q: hello", {"until": ["\n"], "max_gen_toks": 4}), generated),
    ]
