"""Urgent (online) work takes at most its share of the engine's tokens while batch work is
present, starts at once when it comes alone, and takes everything when no batch is there."""

from __future__ import annotations

import pytest

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.config import EngineConfig
from conveyor.engine.scheduler import ScheduledSeq
from conveyor.engine.urgent_share import UrgentShare
from tests.hf_reference import random_prompts

BATCH, ONLINE = 1, 0
SHARE, BUDGET = 0.25, 64


def recording(llm: LLM) -> list[list[tuple[int, int]]]:
    """Each step's scheduled (priority, tokens), recorded as the engine schedules."""
    steps: list[list[tuple[int, int]]] = []
    schedule = llm.scheduler.schedule

    def record() -> list[ScheduledSeq]:
        scheduled = schedule()
        steps.append([(i.seq.request.priority, i.num_new_tokens) for i in scheduled])
        return scheduled

    llm.scheduler.schedule = record
    return steps


def engine(checkpoints, share: float) -> LLM:
    return LLM(
        str(checkpoints["llama"]), device="cpu", dtype="float32", max_num_seqs=8,
        max_num_batched_tokens=BUDGET, block_size=8, urgent_share=share,
    )  # fmt: skip


def add_flood(llm: LLM, batch: int, online: int) -> None:
    prompts = random_prompts(batch + online, 6, 12, seed=41)
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for i in range(batch):
        llm.add_request(f"batch-{i}", prompts[i], long, priority=BATCH)
    for i in range(online):
        llm.add_request(f"online-{i}", prompts[batch + i], short, priority=ONLINE)


def test_a_flood_of_online_requests_takes_only_its_share_while_a_batch_runs(checkpoints):
    llm = engine(checkpoints, SHARE)
    steps = recording(llm)
    add_flood(llm, batch=8, online=60)
    unfinished = {f"batch-{i}" for i in range(8)} | {f"online-{i}" for i in range(60)}
    batch_steps = 0
    while any(rid.startswith("batch") for rid in unfinished):
        unfinished -= {out.request_id for out in llm.step() if out.finished}
        batch_steps += 1
        assert batch_steps < 1000, "the batch never finished"
    total = sum(n for step in steps for _, n in step)
    urgent = sum(n for step in steps for p, n in step if p == ONLINE)
    # the bucket starts full (SHARE of a step's budget) and an admission may overdraw it by
    # one prompt (at most 12 tokens)
    assert urgent <= SHARE * total + SHARE * BUDGET + 12
    assert urgent > SHARE * total / 2  # the online requests did get their share
    assert all(any(p == BATCH for p, _ in step) for step in steps)  # the batch never stopped
    assert unfinished  # part of the flood is left: it runs once the batch is done
    while llm.has_unfinished():
        unfinished -= {out.request_id for out in llm.step() if out.finished}
    assert not unfinished


def test_online_requests_waiting_on_a_spent_share_cost_no_prefix_lookups(checkpoints):
    """Fifty online clients in a loop keep ~50 requests waiting on the share: while it is
    spent, ordering the waiting sequences looks up none of theirs (a step's host time)."""
    llm = engine(checkpoints, SHARE)
    add_flood(llm, batch=8, online=60)
    looked_up: list[tuple[int, bool]] = []
    scheduler = llm.scheduler
    match_prefix = scheduler.block_manager.match_prefix

    def recorded(seq):
        looked_up.append((seq.request.priority, scheduler.urgent.has_credit()))
        return match_prefix(seq)

    scheduler.block_manager.match_prefix = recorded
    spent_steps = 0
    while any(s.request.priority == BATCH for s in [*scheduler.running, *scheduler.waiting]):
        spent_steps += not scheduler.urgent.has_credit()
        llm.step()
    assert spent_steps > 10  # the share was spent, with online requests waiting, many times
    assert (ONLINE, True) in looked_up  # they were looked up when they could start
    assert (ONLINE, False) not in looked_up


def finish_order(llm: LLM) -> list[str]:
    order = []
    while llm.has_unfinished():
        order += [out.request_id for out in llm.step() if out.finished]
    return order


def test_without_the_bound_the_flood_goes_first(checkpoints):
    llm = engine(checkpoints, 1.0)
    add_flood(llm, batch=8, online=60)
    order = finish_order(llm)
    assert all(rid.startswith("online") for rid in order[:60])


def test_with_the_bound_the_batch_finishes_amid_the_flood(checkpoints):
    llm = engine(checkpoints, SHARE)
    add_flood(llm, batch=8, online=60)
    order = finish_order(llm)
    assert any(rid.startswith("batch") for rid in order[:60])
    assert sorted(order) == sorted(
        [f"batch-{i}" for i in range(8)] + [f"online-{i}" for i in range(60)]
    )


def test_one_online_request_starts_at_once_beside_a_batch(checkpoints):
    llm = engine(checkpoints, SHARE)
    add_flood(llm, batch=12, online=0)
    for _ in range(5):
        llm.step()
    llm.add_request("online", [5, 6, 7, 8], SamplingParams(max_tokens=2), priority=ONLINE)
    llm.step()
    assert "online" in {s.request.request_id for s in llm.scheduler.running}


def test_online_work_alone_is_not_bounded(checkpoints):
    llm = engine(checkpoints, SHARE)
    steps = recording(llm)
    add_flood(llm, batch=0, online=20)
    llm.step()
    assert sum(n for _, n in steps[0]) > BUDGET - 12  # the step's whole budget, not a share


def test_the_bucket_refills_by_its_share_and_only_fills_without_less_urgent_work():
    bucket = UrgentShare(0.1, step_tokens=100)
    assert bucket.credit == 10 and bucket.bounded
    bucket.admit(30)
    assert not bucket.has_credit()
    bucket.step_done(tokens=100, urgent_tokens=0, bounded=True)  # +10
    assert bucket.credit == pytest.approx(-10)
    bucket.step_done(tokens=100, urgent_tokens=5, bounded=True)  # +10 - 5
    assert bucket.credit == pytest.approx(-5)
    bucket.step_done(tokens=40, urgent_tokens=40, bounded=False)
    assert bucket.credit == 10  # refilled by the whole step, up to the burst
    assert not UrgentShare(1.0, 100).bounded


@pytest.mark.parametrize("share", [0.0, -0.1, 1.5])
def test_a_share_outside_0_1_is_refused(share):
    with pytest.raises(ValueError, match="urgent_share"):
        EngineConfig(urgent_share=share)
