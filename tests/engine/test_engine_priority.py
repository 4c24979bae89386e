"""Online work goes ahead of batch work in the engine, and a streamed request reports every
step's tokens."""

from __future__ import annotations

from conveyor.engine import LLM, SamplingParams
from tests.hf_reference import hf_greedy, random_prompts

BATCH, ONLINE = 1, 0


def run_until_done(llm: LLM, ids: set[str]) -> tuple[dict, list[str]]:
    """Step until every request of `ids` finished: their final outputs, and the order in which
    they finished."""
    done, order = {}, []
    while ids - done.keys():
        for out in llm.step():
            if out.finished:
                done[out.request_id] = out
                order.append(out.request_id)
    return done, order


def test_an_urgent_request_preempts_batch_work_and_outputs_stay_exact(checkpoints):
    path = checkpoints["llama"]
    llm = LLM(str(path), device="cpu", dtype="float32", max_num_seqs=2, block_size=8)
    prompts = random_prompts(5, 10, 30, seed=21)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for i, prompt in enumerate(prompts[:4]):
        llm.add_request(f"batch-{i}", prompt, params, priority=BATCH)
    for _ in range(3):
        llm.step()
    assert {s.request.request_id for s in llm.scheduler.running} == {"batch-0", "batch-1"}
    urgent = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.add_request("online", prompts[4], urgent, priority=ONLINE)
    llm.step()
    running = {s.request.request_id for s in llm.scheduler.running}
    assert "online" in running and len(running) == 2  # a batch request made room
    assert llm.stats().num_preemptions == 1
    done, order = run_until_done(llm, {"online", *(f"batch-{i}" for i in range(4))})
    assert order[0] == "online"
    for i, prompt in enumerate(prompts[:4]):  # the preempted one was recomputed exactly
        assert done[f"batch-{i}"].outputs[0].token_ids == hf_greedy(path, prompt, 24)
    assert done["online"].outputs[0].token_ids == hf_greedy(path, prompts[4], 4)


def test_urgent_requests_are_admitted_before_waiting_batch_work(checkpoints):
    llm = LLM(str(checkpoints["qwen2"]), dtype="float32", device="cpu", max_num_seqs=1)
    prompts = random_prompts(3, 8, 12, seed=22)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.add_request("batch-0", prompts[0], params, priority=BATCH)
    llm.add_request("batch-1", prompts[1], params, priority=BATCH)
    llm.add_request("online", prompts[2], params, priority=ONLINE)
    _, order = run_until_done(llm, {"batch-0", "batch-1", "online"})
    assert order == ["online", "batch-0", "batch-1"]


def test_a_streamed_request_reports_each_step(checkpoints):
    path = checkpoints["qwen3"]
    llm = LLM(str(path), device="cpu", dtype="float32")
    prompt = random_prompts(2, 12, 12, seed=23)[0]
    llm.add_request("s", prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                    stream=True)  # fmt: skip
    llm.add_request("quiet", prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    seen = []
    while llm.has_unfinished():
        seen += [out for out in llm.step() if out.request_id in ("s", "quiet")]
    streamed = [out for out in seen if out.request_id == "s"]
    assert [out.finished for out in streamed] == [False] * 5 + [True]
    assert [len(out.outputs[0].token_ids) for out in streamed] == [1, 2, 3, 4, 5, 6]
    final = streamed[-1].outputs[0]
    assert final.token_ids == hf_greedy(path, prompt, 6)
    for partial in streamed[:-1]:
        tokens = partial.outputs[0].token_ids
        assert final.token_ids[: len(tokens)] == tokens
        assert partial.outputs[0].finish_reason is None
    assert [out.finished for out in seen if out.request_id == "quiet"] == [True]
