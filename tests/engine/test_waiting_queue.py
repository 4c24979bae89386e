"""The scheduler's waiting line: per priority, in arrival order, preempted sequences first."""

from __future__ import annotations

import pytest

from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.sequence import Request, Sequence
from conveyor.engine.waiting_queue import WaitingQueue


def make_seq(name: str, priority: int) -> Sequence:
    return Sequence(Request(name, None, [1, 2], SamplingParams(), priority=priority), 0, [1, 2], 2)


def names(seqs) -> list[str]:
    return [s.request.request_id for s in seqs]


def filled(spec: list[tuple[str, int]]) -> tuple[WaitingQueue, dict[str, Sequence]]:
    queue, seqs = WaitingQueue(), {}
    for name, priority in spec:
        seqs[name] = make_seq(name, priority)
        queue.append(seqs[name])
    return queue, seqs


def test_iterates_the_most_urgent_priority_first_then_in_line():
    queue, seqs = filled([("b0", 1), ("o0", 0), ("b1", 1), ("o1", 0), ("x0", 5)])
    queue.appendleft(make_seq("b-preempted", 1))
    assert names(queue) == ["o0", "o1", "b-preempted", "b0", "b1", "x0"]
    assert queue.priorities() == [0, 1, 5]
    assert names(queue.of(1)) == ["b-preempted", "b0", "b1"] and not queue.of(3)
    assert len(queue) == 6 and queue
    assert seqs["b1"] in queue and make_seq("b1", 1) not in queue and "b1" not in queue


def test_removing_a_priority_s_last_sequence_drops_the_priority():
    queue, seqs = filled([("b0", 1), ("o0", 0)])
    queue.remove(seqs["o0"])
    assert queue.priorities() == [1] and names(queue) == ["b0"] and len(queue) == 1
    queue.remove(seqs["b0"])
    assert not queue and len(queue) == 0 and queue.priorities() == []


def test_admitted_sequences_leave_from_the_front_or_from_between():
    queue, seqs = filled([(f"b{i}", 1) for i in range(6)] + [("o0", 0), ("o1", 0)])
    queue.remove_admitted([seqs["o0"], seqs["o1"], seqs["b0"], seqs["b1"]])  # fronts
    assert names(queue) == ["b2", "b3", "b4", "b5"] and queue.priorities() == [1]
    queue.remove_admitted([seqs["b2"], seqs["b4"]])  # b3 was passed over
    assert names(queue) == ["b3", "b5"] and len(queue) == 2
    with pytest.raises(ValueError, match="not waiting"):
        queue.remove_admitted([seqs["b0"], seqs["b5"]])
