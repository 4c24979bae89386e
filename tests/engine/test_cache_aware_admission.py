"""Cache-aware admission: longest cached prefix first, one computation per shared prefix, and
no starvation."""

from __future__ import annotations

import random

from conveyor.engine import LLM, SamplingParams

SYSTEM_LEN = 400  # 25 blocks of 16


def shared_prefix_workload(n: int, num_prompts: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 500) for _ in range(SYSTEM_LEN)] for _ in range(num_prompts)]
    prompts = [
        systems[i % num_prompts] + [rng.randrange(3, 500) for _ in range(rng.randint(8, 40))]
        for i in range(n)
    ]
    rng.shuffle(prompts)
    return prompts


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_each_system_prompt_is_computed_once(checkpoints):
    path = str(checkpoints["llama"])
    prompts = shared_prefix_workload(512, 8)
    total = sum(map(len, prompts))
    llm = LLM(path, dtype="float32", device="cpu", num_kv_blocks=4096, max_num_batched_tokens=4096)
    outputs = run(llm, prompts)
    stats = llm.stats()
    # every request but the first of each system prompt found all 25 of its blocks cached
    assert stats.prompt_tokens_cached == (512 - 8) * SYSTEM_LEN
    assert stats.prompt_tokens_computed == total - (512 - 8) * SYSTEM_LEN
    assert stats.kv_blocks_saved == (512 - 8) * SYSTEM_LEN // 16
    assert stats.num_deferred > 0

    uncached = LLM(
        path,
        dtype="float32",
        device="cpu",
        num_kv_blocks=4096,
        max_num_batched_tokens=4096,
        enable_prefix_caching=False,
    )
    assert run(uncached, prompts) == outputs
    assert uncached.stats().prompt_tokens_computed == total

    # arrival order alone computes a system prompt several times when its requests come
    # together: what the deferral saves
    fcfs = LLM(
        path,
        dtype="float32",
        device="cpu",
        num_kv_blocks=4096,
        max_num_batched_tokens=4096,
        admission_policy="fcfs",
    )
    assert run(fcfs, prompts) == outputs
    assert fcfs.stats().prompt_tokens_cached < (512 - 8) * SYSTEM_LEN


class StepClock:
    """A clock that moves one second per engine step."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def steps_until_done(llm: LLM, lone: list[int], crowd: list[list[int]], max_wait: float) -> int:
    clock = StepClock()
    llm.scheduler.clock = clock
    llm.scheduler.max_waiting_time = max_wait
    llm.scheduler.lpm_max_waiting = 10_000  # longest-prefix-first over the whole queue
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([crowd[0]], params, use_tqdm=False)  # the crowd's prefix is now cached
    llm.add_request("lone", lone, params)
    for i, prompt in enumerate(crowd):
        llm.add_request(f"crowd-{i}", prompt, params)
    step = 0
    while llm.has_unfinished():
        step += 1
        finished = {o.request_id for o in llm.step()}
        clock.now += 1.0
        if "lone" in finished:
            return step
    raise AssertionError("the lone request never finished")


def test_a_request_without_shared_prefix_is_not_starved(checkpoints):
    path = str(checkpoints["llama"])
    rng = random.Random(1)
    system = [rng.randrange(3, 500) for _ in range(64)]
    crowd = [system + [rng.randrange(3, 500) for _ in range(8)] for _ in range(1000)]
    lone = [rng.randrange(3, 500) for _ in range(70)]

    def engine() -> LLM:
        return LLM(path, dtype="float32", device="cpu", max_num_seqs=8, num_kv_blocks=512)

    # within its maximum wait (10 steps), plus the step that runs it
    assert steps_until_done(engine(), lone, crowd, max_wait=10.0) <= 12
    # without the limit, longest-prefix-first keeps it waiting behind the whole crowd
    assert steps_until_done(engine(), lone, crowd, max_wait=float("inf")) > 100
