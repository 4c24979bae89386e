"""Iteration-level scheduling under a token budget, with recompute preemption.

Each step first continues the running sequences (decodes and unfinished prompt chunks) in
admission order; when the pool runs dry it preempts the most recently admitted one, freeing its
blocks to recompute it later. Then, if nothing was preempted, it admits waiting sequences while
the token budget, the sequence limit and the pool allow. A long prompt is split over several
steps (chunked prefill).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def completes(self) -> bool:
        """True if this chunk reaches the end of the sequence, so a token is sampled after it."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerCounters:
    num_preemptions: int = 0
    prompt_tokens_computed: int = 0
    prompt_tokens_cached: int = 0


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.counters = SchedulerCounters()

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

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

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.reserve(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                self._count_prompt_tokens(seq, num_new)
                scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
                i += 1

        while (
            not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
        ):
            seq = self.waiting[0]
            hits = (
                []
                if seq.request.params.prompt_logprobs is not None
                else (self.block_manager.match_prefix(seq))
            )
            num_cached = len(hits) * self.block_manager.block_size
            num_new = min(seq.num_tokens - num_cached, budget)
            if not self.block_manager.can_schedule(seq, num_new, hits):
                break
            self.waiting.popleft()
            self.block_manager.admit(seq, hits)
            reserved = self.block_manager.reserve(seq, num_new)
            assert reserved, "can_schedule() promised room"
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if seq.request.num_cached_tokens is None:
                seq.request.num_cached_tokens = num_cached
            self.counters.prompt_tokens_cached += min(num_cached, seq.num_prompt_tokens)
            self._count_prompt_tokens(seq, num_new)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return scheduled

    def _count_prompt_tokens(self, seq: Sequence, num_new: int) -> None:
        prompt_part = min(seq.num_computed_tokens + num_new, seq.num_prompt_tokens)
        self.counters.prompt_tokens_computed += max(0, prompt_part - seq.num_computed_tokens)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.counters.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Retire a finished or aborted sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
