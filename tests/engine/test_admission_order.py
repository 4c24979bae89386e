"""The order in which waiting sequences are admitted when the queue is too long to sort by
cached prefix: priority first, then arrival, with a preempted sequence back at the front of
its priority; and a step with no room admits nothing."""

from __future__ import annotations

from conveyor.engine.block_manager import BlockManager
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.scheduler import Scheduler
from conveyor.engine.sequence import Request, Sequence


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def make_seq(i: int, priority: int) -> Sequence:
    ids = [i + 1, i + 2, i + 3]
    return Sequence(Request(f"r{i}", None, ids, SamplingParams(), priority=priority), i, ids, 3)


def scheduler(max_num_seqs: int) -> Scheduler:
    bm = BlockManager(num_blocks=64, block_size=4)
    return Scheduler(bm, max_num_seqs, 1024, lpm_max_waiting=0, clock=Clock())


def admitted(sched: Scheduler) -> list[str]:
    return [item.seq.request.request_id for item in sched.schedule()]


def test_admission_goes_by_priority_then_arrival():
    sched = scheduler(max_num_seqs=3)
    for i, priority in enumerate([1, 1, 0, 1, 0]):
        sched.add(make_seq(i, priority))
    assert admitted(sched) == ["r2", "r4", "r0"]
    assert [s.request.request_id for s in sched.waiting] == ["r1", "r3"]


def test_a_full_step_admits_nothing_and_a_preempted_sequence_comes_back_first():
    sched = scheduler(max_num_seqs=2)
    for i in range(4):
        sched.add(make_seq(i, 1))
    assert admitted(sched) == ["r0", "r1"]
    assert admitted(sched) == ["r0", "r1"]  # running: no room for r2, r3
    sched.add(make_seq(9, 0))  # urgent: preempts r1, the last admitted
    assert admitted(sched) == ["r0", "r9"]
    assert [s.request.request_id for s in sched.waiting] == ["r1", "r2", "r3"]
    sched.finish(sched.running[0])
    assert admitted(sched) == ["r9", "r1"]


def test_sequences_of_one_priority_keep_arrival_order():
    sched = scheduler(max_num_seqs=8)
    for i in range(6):
        sched.add(make_seq(i, 3))
    assert admitted(sched) == [f"r{i}" for i in range(6)]
