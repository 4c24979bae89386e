"""Iteration-level scheduling under a token budget, with recompute preemption.

Each step first continues the running sequences (decodes and unfinished prompt chunks) in
admission order; when the pool runs dry it preempts the most recently admitted one, freeing its
blocks to recompute it later. Then, if nothing was preempted, it admits waiting sequences while
the token budget, the sequence limit and the pool allow. A long prompt is split over several
steps (chunked prefill).

A request of a more urgent priority (a lower number: online requests before batch work) is
admitted first, preempting running sequences of a less urgent one when it has no room, but only
while it has credit left of its share of the tokens (`urgent_share.UrgentShare`). Within a
priority, admission is cache-aware (SGLang's longest-prefix-match): waiting sequences with the
longest prefix already in the cache go first, and a sequence whose next uncached block is being
computed right now by another sequence waits for it instead of computing the same KV again.
Sorting is skipped (arrival order) when more than `lpm_max_waiting` sequences wait, and a
sequence that has waited `max_waiting_time` seconds goes before all others of its priority, so
nothing starves.

Each priority's waiting line stays in arrival order (a preempted sequence goes back to its
front as overdue at once; `waiting_queue`), so the order of admission is read off it lazily: a
step with no room sorts nothing, and one with room for a few looks at a few.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from conveyor.engine.block_manager import BlockManager
from conveyor.engine.sequence import Sequence, SequenceStatus
from conveyor.engine.urgent_share import UrgentShare
from conveyor.engine.waiting_queue import WaitingQueue


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def completes(self) -> bool:
        """True if this chunk reaches the end of the sequence, so a token is sampled after it."""
        seq = self.seq
        return seq.num_computed_tokens + self.num_new_tokens == len(seq.token_ids)


@dataclass
class SchedulerCounters:
    num_preemptions: int = 0
    prompt_tokens_computed: int = 0
    prompt_tokens_cached: int = 0
    num_deferred: int = 0  # admissions put off to reuse a prefix another sequence computes
    kv_blocks_saved: int = 0  # blocks shared from the prefix cache instead of computed


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        *,
        cache_aware: bool = True,
        lpm_max_waiting: int = 128,
        max_waiting_time: float = 30.0,
        urgent_share: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.cache_aware = cache_aware and block_manager.enable_prefix_caching
        self.lpm_max_waiting = lpm_max_waiting
        self.max_waiting_time = max_waiting_time
        self.clock = clock
        self.waiting = WaitingQueue()
        self.running: list[Sequence] = []
        self.counters = SchedulerCounters()
        self.least_urgent = 0  # the highest priority number ever added
        self.urgent = UrgentShare(urgent_share, max_num_batched_tokens)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.arrival_time = self.clock()
        self.waiting.append(seq)
        self.least_urgent = max(self.least_urgent, seq.request.priority)

    def add_running(self, seq: Sequence) -> None:
        """A sequence forked from a running one joins the running set directly."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted = False
        bound = self._bounded_priority()
        if bound is None or self.urgent.has_credit():
            self._make_room_for_priority()

        # the loop below runs once per running sequence and step: kept lean
        i, running, reserve = 0, self.running, self.block_manager.reserve
        while i < len(running) and budget > 0:
            seq = running[i]
            computed = seq.num_computed_tokens
            num_new = min(len(seq.token_ids) - computed, budget)
            while not reserve(seq, num_new):
                victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                if computed < seq.num_prompt_tokens:
                    self._count_prompt_tokens(seq, num_new)
                scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
                i += 1

        num_running = len(scheduled)
        if not preempted:
            self._admit(scheduled, budget, bound)
        if self.urgent.bounded:
            self._count_urgent(scheduled, num_running, bound)
        return scheduled

    def _count_urgent(
        self, scheduled: list[ScheduledSeq], num_running: int, bound: int | None
    ) -> None:
        """Refill the urgent bucket by a step and draw what its urgent sequences compute,
        but for those it admitted (the items past `num_running`), which drew their tokens as
        they were admitted."""
        urgent = 0
        if bound is not None:
            urgent = sum(
                item.num_new_tokens
                for item in scheduled[:num_running]
                if item.seq.request.priority < bound
            )
        tokens = sum(item.num_new_tokens for item in scheduled)
        self.urgent.step_done(tokens, urgent, bound is not None)

    def _bounded_priority(self) -> int | None:
        """The least urgent priority present when work more urgent than it is bounded by
        the urgent share; None when nothing is bounded."""
        if not self.urgent.bounded or self.least_urgent == 0:
            return None
        waiting = max(self.waiting.priorities(), default=0)
        running = max((s.request.priority for s in self.running), default=0)
        return max(waiting, running) or None

    def _make_room_for_priority(self) -> None:
        """Preempt running sequences of a lower priority (a higher number), most recently
        admitted first, while the most urgent waiting sequence has no room to start."""
        most_urgent = min(self.waiting.priorities(), default=None)
        if most_urgent is None or most_urgent >= self.least_urgent:
            return  # nothing running can be less urgent (the common case: one priority)
        if all(s.request.priority <= most_urgent for s in self.running):
            return
        urgent = self.waiting.of(most_urgent)[0]
        bm = self.block_manager
        while True:
            lower = [s for s in self.running if s.request.priority > urgent.request.priority]
            if not lower:
                return
            hits = bm.match_prefix(urgent)
            first_chunk = min(
                urgent.num_tokens - len(hits) * bm.block_size, self.max_num_batched_tokens
            )
            if len(self.running) < self.max_num_seqs and bm.can_schedule(urgent, first_chunk, hits):
                return
            victim = lower[-1]
            self.running.remove(victim)
            self._preempt(victim)

    def _admit(self, scheduled: list[ScheduledSeq], budget: int, bound: int | None) -> None:
        if budget <= 0 or len(self.running) >= self.max_num_seqs or not self.waiting:
            return
        bm = self.block_manager
        in_flight = self._blocks_in_flight() if self.cache_aware else set()
        admitted: list[Sequence] = []
        # the share is spent: nothing more urgent than `bound` can start (credit only comes
        # back with the next step), so the order need not look up its prefixes
        spent = bound if bound is not None and not self.urgent.has_credit() else None
        for seq in self._admission_order(spent):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            urgent = bound is not None and seq.request.priority < bound
            if urgent and not self.urgent.has_credit():
                continue  # the urgent share is spent: less urgent work goes on
            hits = bm.match_prefix(seq)
            if (
                in_flight
                and not self._overdue(seq)
                and self._next_block_in_flight(seq, len(hits), in_flight)
            ):
                self.counters.num_deferred += 1
                continue
            num_cached = len(hits) * bm.block_size
            num_new = min(seq.num_tokens - num_cached, budget)
            if not bm.can_schedule(seq, num_new, hits):
                break
            bm.admit(seq, hits)
            reserved = bm.reserve(seq, num_new)
            assert reserved, "can_schedule() promised room"
            admitted.append(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if seq.request.num_cached_tokens is None:
                seq.request.num_cached_tokens = num_cached
            self.counters.prompt_tokens_cached += min(num_cached, seq.num_prompt_tokens)
            self.counters.kv_blocks_saved += len(hits)
            self._count_prompt_tokens(seq, num_new)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
            if urgent:
                self.urgent.admit(num_new)
            if self.cache_aware:
                in_flight.update(self._uncomputed_prompt_keys(seq))
        if admitted:
            self.waiting.remove_admitted(admitted)

    def _overdue(self, seq: Sequence) -> bool:
        return self.clock() - seq.arrival_time >= self.max_waiting_time

    def _admission_order(self, spent: int | None = None) -> Iterator[Sequence]:
        """The most urgent priority first; within one, overdue sequences first (arrival
        order), then the longest cached prefix first. Those more urgent than `spent` (their
        share spent) may be left out."""
        if not self.cache_aware or len(self.waiting) > self.lpm_max_waiting:
            # by priority, then arrival (overdue ones lead), taken as they are asked for
            return iter(self.waiting)
        bm = self.block_manager
        cutoff = self.clock() - self.max_waiting_time

        def key(seq: Sequence) -> tuple[int, int, float]:
            if seq.arrival_time <= cutoff:
                return (seq.request.priority, 0, seq.arrival_time)  # overdue: by arrival
            return (seq.request.priority, 1, -len(bm.match_prefix(seq)))

        waiting = self.waiting
        if spent is not None:  # fifty online requests waiting on the share: no prefix look-ups
            waiting = [seq for seq in waiting if seq.request.priority >= spent]
        return iter(sorted(waiting, key=key))

    def _uncomputed_prompt_keys(self, seq: Sequence) -> list[bytes]:
        """Keys of the full prompt blocks of `seq` whose KV is not computed yet."""
        bm = self.block_manager
        full = seq.num_prompt_tokens // bm.block_size
        first = seq.num_computed_tokens // bm.block_size
        if first >= full:
            return []
        return bm.block_keys(seq, full)[first:]

    def _blocks_in_flight(self) -> set[bytes]:
        keys: set[bytes] = set()
        for seq in self.running:
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                keys.update(self._uncomputed_prompt_keys(seq))
        return keys

    def _next_block_in_flight(self, seq: Sequence, num_hits: int, in_flight: set[bytes]) -> bool:
        """Whether the first block `seq` would compute is being computed by another sequence."""
        if num_hits >= (seq.num_tokens - 1) // self.block_manager.block_size:
            return False
        return self.block_manager.block_keys(seq, num_hits + 1)[num_hits] in in_flight

    def _count_prompt_tokens(self, seq: Sequence, num_new: int) -> None:
        prompt_part = min(seq.num_computed_tokens + num_new, seq.num_prompt_tokens)
        self.counters.prompt_tokens_computed += max(0, prompt_part - seq.num_computed_tokens)

    def _preempt(self, seq: Sequence) -> None:
        self._requeue(seq)
        self.counters.num_preemptions += 1

    def recompute(self, seq: Sequence) -> None:
        """Drop the KV of running `seq` to compute it again from its first token (LongRoPE's
        switch of factors); it goes first in line, as a preempted sequence does."""
        self.running.remove(seq)
        self._requeue(seq)

    def _requeue(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.arrival_time = float("-inf")  # overdue at once: first in line to come back
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Retire a finished or aborted sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
