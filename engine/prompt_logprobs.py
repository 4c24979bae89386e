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

import torch

from conveyor.engine.block_manager import BlockManager
from conveyor.engine.logprob_entries import BlockLogprobs, LogprobEntry
from conveyor.engine.models import DecoderForCausalLM
from conveyor.engine.outputs import TokenLogprobs
from conveyor.engine.scheduler import ScheduledSeq
from conveyor.engine.sequence import Request, Sequence
from conveyor.kernels.upload import to_device


class PromptLogprobs:
    """Computes, records and shares the prompt logprobs of the requests that ask for them."""

    def __init__(
        self, block_manager: BlockManager, model: DecoderForCausalLM, chunk_rows: int
    ) -> None:
        """`chunk_rows`: the most prompt positions whose logits are held at once (see
        `chunk_rows_for`)."""
        self.block_manager = block_manager
        self.model = model
        self.chunk_rows = chunk_rows

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
            k = request.params.prompt_logprobs or 0
            entries.extend(self.entries(boundary[None], [seq.token_ids[start]], k))

    def _cached(self, seq: Sequence, block_index: int) -> BlockLogprobs:
        kept = self.block_manager.blocks[seq.block_table[block_index]].logprobs
        assert kept is not None, "the scheduler admits only blocks that kept logprobs"
        return kept

    def record(
        self,
        scheduled: list[ScheduledSeq],
        prompt_hidden: dict[int, tuple[int, torch.Tensor]],
    ) -> None:
        """After the forward pass: the logprobs of the prompt positions this step predicted
        (row j of a sequence's hidden states predicts position first + j + 1), those not
        recorded yet."""
        for item in scheduled:
            entry = prompt_hidden.get(item.seq.seq_id)
            if entry is None:
                continue
            first, hidden = entry
            request = item.seq.request
            assert request.prompt_entries is not None
            skip = len(request.prompt_entries) - (first + 1)  # rows recorded already
            if skip < 0 or skip >= hidden.shape[0]:
                continue
            targets = request.prompt_token_ids[first + 1 + skip : first + 1 + hidden.shape[0]]
            k = request.params.prompt_logprobs or 0
            request.prompt_entries.extend(self.entries(hidden[skip:], targets, k))

    @torch.inference_mode()
    def entries(self, hidden: torch.Tensor, targets: list[int], k: int) -> list[LogprobEntry]:
        """The entries of `hidden`'s rows, row j predicting `targets[j]`, `chunk_rows` rows at
        a time: a long prompt never holds all its logits at once, and each chunk is read from
        the device in three copies, not three per position."""
        found: list[LogprobEntry] = []
        for start in range(0, len(targets), self.chunk_rows):
            tokens = targets[start : start + self.chunk_rows]
            logits = self.model.compute_logits(hidden[start : start + len(tokens)]).float()
            logprobs = torch.log_softmax(logits, dim=-1)
            del logits
            at = to_device(tokens, logprobs.device)
            chosen = logprobs.gather(1, at[:, None])[:, 0].tolist()
            if k > 0:
                values, ids = logprobs.topk(k, dim=-1)
                tops = [
                    tuple(zip(i, v, strict=True))
                    for i, v in zip(ids.tolist(), values.tolist(), strict=True)
                ]
            else:
                tops = [()] * len(tokens)
            found.extend(map(LogprobEntry, tokens, chosen, tops))
        return found

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
    def chunk_rows_for(memory: int, vocab_size: int, dtype: torch.dtype) -> int:
        """Rows of prompt logits that fit in `memory` bytes: each holds the logits in the
        model's dtype, widened to float32, and their log-softmax."""
        per_row = vocab_size * (torch.empty((), dtype=dtype).element_size() + 4 + 4)
        return max(1, memory // per_row)

    @staticmethod
    def output(request: Request) -> list[TokenLogprobs | None] | None:
        """The request's prompt logprobs as its output gives them."""
        if request.prompt_entries is None:
            return None
        k = request.params.prompt_logprobs or 0
        return [None if e is None else e.as_dict(k) for e in request.prompt_entries]
