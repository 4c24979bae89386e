"""The sequences waiting to be admitted: one queue per priority, each in arrival order with
preempted sequences back at its front.

The scheduler admits from the front of a priority's queue nearly always, and online requests
(a more urgent priority) arrive while thousands of batch sequences wait: admitting a few of
either must cost what was admitted, not what waits.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

from conveyor.engine.sequence import Sequence


class WaitingQueue:
    def __init__(self) -> None:
        self._queues: dict[int, deque[Sequence]] = {}  # priority -> its sequences, in line
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Sequence]:
        """Every waiting sequence: the most urgent priority (lowest number) first, then in
        line."""
        for priority in self.priorities():
            yield from self._queues[priority]

    def __contains__(self, seq: object) -> bool:
        if not isinstance(seq, Sequence):
            return False
        queue = self._queues.get(seq.request.priority)
        return queue is not None and seq in queue

    def priorities(self) -> list[int]:
        """The priorities with a sequence waiting, most urgent first."""
        return sorted(self._queues)

    def of(self, priority: int) -> deque[Sequence]:
        """The sequences of `priority`, in line (empty if none); not to be changed."""
        return self._queues.get(priority, deque())

    def append(self, seq: Sequence) -> None:
        """`seq` joins the back of its priority's line."""
        self._queues.setdefault(seq.request.priority, deque()).append(seq)
        self._len += 1

    def appendleft(self, seq: Sequence) -> None:
        """`seq` goes first in its priority's line (a preempted sequence)."""
        self._queues.setdefault(seq.request.priority, deque()).appendleft(seq)
        self._len += 1

    def remove(self, seq: Sequence) -> None:
        queue = self._queues[seq.request.priority]
        queue.remove(seq)
        self._len -= 1
        if not queue:
            del self._queues[seq.request.priority]

    def remove_admitted(self, admitted: Iterable[Sequence]) -> None:
        """Take `admitted` (all waiting) out of line: popped off the front of their queue,
        where admission takes them from, and the queue filtered only where one was passed
        over."""
        by_priority: dict[int, set[int]] = {}
        for seq in admitted:
            by_priority.setdefault(seq.request.priority, set()).add(seq.seq_id)
        for priority, ids in by_priority.items():
            queue = self._queues[priority]
            left = len(ids)
            while left and queue[0].seq_id in ids:
                queue.popleft()
                left -= 1
            if left:
                kept = deque(s for s in queue if s.seq_id not in ids)
                if len(queue) - len(kept) != left:
                    raise ValueError(f"{left} admitted sequences were not waiting")
                self._queues[priority] = queue = kept
            self._len -= len(ids)
            if not queue:
                del self._queues[priority]
