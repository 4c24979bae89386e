"""What goes wrong with one request inside the engine fails that request alone: the others'
greedy outputs are unchanged and the engine goes on, in the engine itself, in the offline
runner and in the worker's engine loop."""

from __future__ import annotations

import io
import json
import threading
from pathlib import Path
from typing import Any

import pytest

from conveyor.engine import LLM, SamplingParams
from conveyor.worker.echo import EchoEngine
from conveyor.worker.engine_service import EngineJob, EngineService
from tests.hf_reference import random_prompts

ENGINE_KWARGS = dict(device="cpu", dtype="float32", block_size=8, num_kv_blocks=128)
BAD = "r2"


def break_request(llm: LLM, monkeypatch: pytest.MonkeyPatch, where: str, victim: str = BAD) -> None:
    """Make one step of `victim`'s post-processing raise, as a tokenizer or a bug could."""

    def bad(request_id: str) -> bool:
        return request_id == victim

    if where == "append_token":  # on its third generated token
        real_append = llm.output_processor.append_token

        def append(seq, token, top):
            if bad(seq.request.request_id) and seq.num_output_tokens == 2:
                raise IndexError("token table out of range")
            return real_append(seq, token, top)

        monkeypatch.setattr(llm.output_processor, "append_token", append)
    elif where == "stop_string":  # detokenizing for its stop-string check
        real_read_text = llm.output_processor.read_text

        def read_text(seq, token):
            if bad(seq.request.request_id) and seq.finish_reason is None:
                raise TypeError("the tokenizer cannot decode this")
            return real_read_text(seq, token)

        monkeypatch.setattr(llm.output_processor, "read_text", read_text)
    elif where == "sampling":  # building its row of the batch's sampling, on its third token
        real_sample_request = llm._sample_request

        def sample_request(seq):
            if bad(seq.request.request_id) and seq.num_output_tokens == 2:
                raise OverflowError("Overflow when unpacking long long")
            return real_sample_request(seq)

        monkeypatch.setattr(llm, "_sample_request", sample_request)
    else:  # building its RequestOutput
        real_output = llm.output_processor.request_output

        def request_output(request, finished=True):
            if bad(request.request_id):
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
            return real_output(request, finished)

        monkeypatch.setattr(llm.output_processor, "request_output", request_output)


def run(llm: LLM, prompts: list[list[int]]) -> dict[str, Any]:
    params = SamplingParams(temperature=0, max_tokens=8, stop=["never-appears"])
    for i, prompt in enumerate(prompts):
        llm.add_request(f"r{i}", prompt, params)
    outputs = {}
    while llm.has_unfinished():
        for output in llm.step():
            outputs[output.request_id] = output
    return outputs


@pytest.mark.parametrize("where", ["append_token", "stop_string", "request_output", "sampling"])
def test_a_request_whose_post_processing_raises_fails_alone(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    path = checkpoints["llama"]
    prompts = random_prompts(5, 3, 40, seed=11)
    clean = run(LLM(str(path), **ENGINE_KWARGS), prompts)

    llm = LLM(str(path), **ENGINE_KWARGS)
    break_request(llm, monkeypatch, where)
    outputs = run(llm, prompts)  # every step completes: nothing escapes step()

    assert set(outputs) == set(clean)
    for request_id, output in outputs.items():
        if request_id == BAD:
            continue
        assert output.error is None
        assert output.outputs[0].token_ids == clean[request_id].outputs[0].token_ids
        assert output.outputs[0].text == clean[request_id].outputs[0].text
    failed = outputs[BAD]
    assert failed.finished and failed.error is not None
    assert failed.error.internal  # the engine's fault with this request, not the request's
    assert failed.error.message.split(":")[0] in (
        "IndexError",
        "TypeError",
        "UnicodeDecodeError",
        "OverflowError",
    )
    assert [c.finish_reason for c in failed.outputs] == ["error"]
    # nothing of it is left behind, and the engine runs on as before
    assert not llm.has_unfinished() and not llm.scheduler.running and not llm.scheduler.waiting
    assert llm.stats().kv_blocks_used == 0
    monkeypatch.undo()
    again = run(llm, prompts)
    assert {k: v.outputs[0].token_ids for k, v in again.items()} == {
        k: v.outputs[0].token_ids for k, v in clean.items()
    }


@pytest.mark.parametrize("requests", [1, 3])
def test_an_error_no_request_raises_alone_is_the_engines(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch, requests: int
) -> None:
    """Sampling that fails whatever rows it is given cannot be pinned on a request (for a
    request alone in its step: a plain row fails too): the step raises, and the worker then
    rebuilds the engine or exits, instead of failing every request."""
    llm = LLM(str(checkpoints["llama"]), **ENGINE_KWARGS)
    for i, prompt in enumerate(random_prompts(3, 3, 20, seed=2)[:requests]):
        llm.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=4))

    def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(llm, "sampler", broken)
    with pytest.raises(RuntimeError, match="allocate"):
        llm.step()


def test_a_request_alone_in_its_step_fails_alone(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(str(checkpoints["llama"]), **ENGINE_KWARGS)
    break_request(llm, monkeypatch, "sampling", victim="r0")
    output = run(llm, random_prompts(2, 3, 20, seed=3)[:1])["r0"]
    assert output.error is not None and output.error.internal
    assert output.error.message.startswith("OverflowError")
    assert not llm.has_unfinished() and llm.stats().kv_blocks_used == 0


def test_the_offline_runner_writes_an_error_line_for_it(
    checkpoints: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from conveyor.batch_runner import BatchRunner

    path = checkpoints["llama"]
    lines = [
        json.dumps(
            {
                "custom_id": f"c{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": "m", "prompt": prompt, "max_tokens": 6, "temperature": 0},
            }
        )
        for i, prompt in enumerate(random_prompts(4, 3, 20, seed=5))
    ]

    def results(llm: LLM) -> dict[str, dict]:
        out = io.StringIO()
        runner = BatchRunner(llm, model_name="m", out=out)
        stats = runner.run(enumerate(lines, 1))
        rows = {r["custom_id"]: r for r in map(json.loads, out.getvalue().splitlines())}
        assert stats.lines == len(rows) == 4
        return rows

    clean = results(LLM(str(path), **ENGINE_KWARGS))
    llm = LLM(str(path), **ENGINE_KWARGS)
    break_request(llm, monkeypatch, "append_token", victim="line-3")  # the runner's id of c2
    rows = results(llm)
    bad = rows["c2"]
    assert bad["error"]["code"] == "internal_error" and bad["response"]["status_code"] == 500
    assert bad["error"]["line"] == 3
    # no internals in the line: the id that the log line with the details carries
    assert "internal error (request line-3)" in bad["error"]["message"]
    assert "IndexError" not in bad["error"]["message"]
    assert any(
        "line-3" in r.getMessage() and "IndexError" in r.getMessage() for r in caplog.records
    )
    for custom_id in ("c0", "c1", "c3"):
        body, clean_body = rows[custom_id]["response"]["body"], clean[custom_id]["response"]["body"]
        assert body["choices"] == clean_body["choices"]


class RefusingEcho(EchoEngine):
    """An echo engine whose tokenizer cannot take one prompt (as a real one fails on a lone
    surrogate)."""

    def add_request(self, request_id: str, prompt: Any, params: Any, **options: Any) -> None:
        if prompt == "poison":
            raise TypeError("TextEncodeInput must be Union[TextInputSequence, ...]")
        if prompt == "too long":
            raise ValueError("the prompt has 9 tokens, but max_model_len is 4")
        super().add_request(request_id, prompt, params, **options)


def test_the_engine_loop_survives_a_request_it_cannot_take() -> None:
    service = EngineService(RefusingEcho())
    done: dict[str, Any] = {}
    finished = threading.Event()

    def job(name: str, prompt: str, fail_delivery: bool = False) -> EngineJob:
        def on_done(output: Any) -> None:
            if fail_delivery:
                raise RuntimeError("the writer's queue is gone")
            done[name] = output.outputs[0].text
            if len(done) == 5:
                finished.set()

        def on_error(err: Exception) -> None:
            done[name] = err
            if len(done) == 5:
                finished.set()

        return EngineJob(f"b:{name}", prompt, None, on_done, on_error)

    service.start()
    try:
        service.submit([job("a", "hello"), job("p", "poison"), job("l", "too long")])
        service.submit([job("d", "x", fail_delivery=True), job("b", "again")])
        assert finished.wait(10), done
    finally:
        service.stop()
        service.join(5)
    assert service.failure is None
    assert done["a"] == "hello" and done["b"] == "again"
    assert isinstance(done["p"], TypeError) and isinstance(done["l"], ValueError)
    assert isinstance(done["d"], RuntimeError)


def test_stopping_the_engine_loop_waits_for_its_step_to_end() -> None:
    """A worker that exits while its engine thread is inside a step aborts the process (C++
    frames unwound at interpreter exit): stop() returns only once the loop has ended."""
    in_step, release = threading.Event(), threading.Event()

    class SlowEngine(EchoEngine):
        def step(self):
            in_step.set()
            release.wait(10)
            return super().step()

    service = EngineService(SlowEngine())
    service.start()
    service.submit([EngineJob("b:1", "hello", None, lambda _: None, lambda _: None)])
    assert in_step.wait(10)
    threading.Timer(0.3, release.set).start()
    service.stop()
    assert release.is_set()  # it waited for the step
    assert not service.is_alive()
    assert service.failure is None
