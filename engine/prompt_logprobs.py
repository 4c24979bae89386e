"""Prompt logprobs, kept with the prefix cache so that scoring shares prefixes as generation does.

A prompt token's logprob (and its top-k alternatives) depends on every token up to it, so the
logprobs of the positions of a full block are fixed by the block's chained key, like its KV.
When a request asking for prompt logprobs computes a full prompt block, they are kept with the
cached block, with the final hidden state at the block's last position (the block's
`boundary`), from which the logprobs of the next block's first token come. A later request
whose prompt starts with cached blocks takes their logprobs from there instead of recomputing
the prefix; one asking for more alternatives than a block kept computes from that block on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.block_manager import BlockManager
from engine.models import DecoderForCausalLM
from engine.outputs import TokenLogprobs
from engine.scheduler import ScheduledSeq
from engine.sequence import Request, Sequence


@dataclass(frozen=True)
class LogprobEntry:
    """One prompt position: its token's logprob and the most likely tokens there."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token, logprob), most likely first

    @classmethod
    def from_row(cls, row: torch.Tensor, token: int, k: int) -> LogprobEntry:
        """From a row of log-softmaxed logits."""
        top: tuple[tuple[int, float], ...] = ()
        if k > 0:
            values, ids = row.topk(k)
            top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
        return cls(token, float(row[token]), top)

    def as_dict(self, k: int) -> TokenLogprobs:
        """{token: its logprob} plus the `k` most likely tokens, as the outputs give them."""
        result = {self.token: self.logprob}
        for t, v in self.top[:k]:
            result.setdefault(t, v)
        return result


@dataclass
class BlockLogprobs:
    """What a cached prompt block keeps: the logprobs of its positions and its boundary."""

    k: int  # alternatives kept per position
    entries: list[LogprobEntry | None]  # one per position; None only for a prompt's first
    boundary: torch.Tensor  # final hidden state at its last position: [hidden]


class PromptLogprobs:
    """Computes, records and shares the prompt logprobs of the requests that ask for them."""

    def __init__(self, block_manager: BlockManager, model: DecoderForCausalLM) -> None:
        self.block_manager = block_manager
        self.model = model

    def seqs_to_compute(self, scheduled: list[ScheduledSeq]) -> set[int]:
        """The sequences of this step whose prompt logprobs are not all known yet."""
        return {
            item.seq.seq_id
            for item in scheduled
            if (entries := item.seq.request.prompt_entries) is not None
            and len(entries) < item.seq.num_prompt_tokens
        }

    def fill_from_cache(self, scheduled: list[ScheduledSeq]) -> None:
        """Before the forward pass: the logprobs of the positions a sequence took from the
        prefix cache, up to and including its first position to compute."""
        size = self.block_manager.block_size
        for item in scheduled:
            seq, request = item.seq, item.seq.request
            entries = request.prompt_entries
            start = seq.num_computed_tokens  # a whole number of cached blocks, if any
            if entries is None or len(entries) > start or len(entries) >= seq.num_prompt_tokens:
                continue
            assert start % size == 0, "only whole cached blocks come before a gap"
            for position in range(len(entries), start):
                entries.append(self._cached(seq, position // size).entries[position % size])
            boundary = self._cached(seq, start // size - 1).boundary
            row = torch.log_softmax(self.model.compute_logits(boundary[None]).float(), -1)
            k = request.params.prompt_logprobs or 0
            entries.append(LogprobEntry.from_row(row[0], seq.token_ids[start], k))

    def _cached(self, seq: Sequence, block_index: int) -> BlockLogprobs:
        kept = self.block_manager.blocks[seq.block_table[block_index]].logprobs
        assert kept is not None, "the scheduler admits only blocks that kept logprobs"
        return kept

    def record(
        self,
        scheduled: list[ScheduledSeq],
        prompt_logits: dict[int, tuple[int, torch.Tensor]],
    ) -> None:
        """After the forward pass: the logprobs of the prompt positions this step predicted."""
        for item in scheduled:
            entry = prompt_logits.get(item.seq.seq_id)
            if entry is None:
                continue
            first, logits = entry
            request = item.seq.request
            assert request.prompt_entries is not None
            k = request.params.prompt_logprobs or 0
            logprobs = torch.log_softmax(logits, dim=-1)
            for j in range(logits.shape[0]):
                target = first + j + 1  # the prompt position this row predicts
                if target == len(request.prompt_entries):
                    token = request.prompt_token_ids[target]
                    request.prompt_entries.append(LogprobEntry.from_row(logprobs[j], token, k))

    def keep(
        self,
        scheduled: list[ScheduledSeq],
        boundaries: dict[int, list[tuple[int, torch.Tensor]]],
    ) -> None:
        """After the step's blocks are registered: give each full prompt block this step
        finished its logprobs and boundary, unless its cached copy keeps as many already."""
        bm = self.block_manager
        if not bm.enable_prefix_caching:
            return
        size = bm.block_size
        for item in scheduled:
            seq = item.seq
            request = seq.request
            for position, hidden in boundaries.get(seq.seq_id, ()):
                index = position // size
                entries = request.prompt_entries
                if entries is None or len(entries) < (index + 1) * size:
                    continue
                block_id = bm.cached.get(bm.block_keys(seq, index + 1)[index])
                if block_id is None:
                    continue
                block = bm.blocks[block_id]
                k = request.params.prompt_logprobs or 0
                if block.logprobs is None or block.logprobs.k < k:
                    block.logprobs = BlockLogprobs(
                        k, list(entries[index * size : (index + 1) * size]), hidden.clone()
                    )

    @staticmethod
    def output(request: Request) -> list[TokenLogprobs | None] | None:
        """The request's prompt logprobs as its output gives them."""
        if request.prompt_entries is None:
            return None
        k = request.params.prompt_logprobs or 0
        return [None if e is None else e.as_dict(k) for e in request.prompt_entries]
