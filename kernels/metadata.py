"""What an attention backend needs to know about one flattened batch of tokens.

The batch holds the decode tokens (one query per sequence) first, then the prefill chunks
(several queries per sequence). Every query at absolute position p attends to positions 0..p of
its own sequence, all of which are in the paged cache once this step's K/V is written.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from conveyor.kernels.upload import Fetch, StepUpload


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] cache slot (block * block_size + offset) per token
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks], padded with 0
    decode_context_lens: torch.Tensor  # [num_decodes] tokens in the cache incl. this one
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks], padded with 0
    prefill_query_start: list[int]  # [num_prefills + 1] offsets into the prefill queries
    prefill_context_lens: list[int]  # [num_prefills] tokens in the cache after this chunk
    # the same on the device, and the maxima, for kernels that must not sync with the host
    prefill_query_start_tensor: torch.Tensor | None = None
    prefill_context_lens_tensor: torch.Tensor | None = None
    decode_max_context_len: int = 0
    prefill_max_query_len: int = 0
    # blocks that several sequences share at the start of their tables, to be read once for all
    # of them (kernels.cascade); None when nothing is worth it or the backend does not use it
    cascade: CascadePlan | None = None
    # how many parts a long context's decode attention is split into and merged from (Triton);
    # None lets the kernel choose by the batch's size, 1 keeps each query's sums in one order
    decode_splits: int | None = None

    @property
    def num_prefills(self) -> int:
        return len(self.prefill_context_lens)

    @classmethod
    def build(
        cls, slot_mapping: torch.Tensor, batch: BatchTables, device: torch.device
    ) -> AttentionMetadata:
        """The metadata of `batch`, its tensors copied to `device` in one go."""
        upload = StepUpload(device)
        finish = cls.stage(batch, upload)
        return finish(slot_mapping, upload.send())

    @classmethod
    def stage(
        cls, batch: BatchTables, upload: StepUpload
    ) -> Callable[[torch.Tensor, Fetch], AttentionMetadata]:
        """Stage `batch`'s tensors in a step's upload; the returned function builds the
        metadata from the uploaded views."""
        decode_tables = upload.add_rows(batch.decode_tables)
        decode_lens = upload.add(batch.decode_lens)
        prefill_tables = upload.add_rows(batch.prefill_tables)
        query_start = upload.add(batch.query_start)
        prefill_lens = upload.add(batch.prefill_lens)

        def finish(slot_mapping: torch.Tensor, fetch: Fetch) -> AttentionMetadata:
            return cls(
                slot_mapping=slot_mapping,
                num_decode_tokens=len(batch.decode_lens),
                decode_block_tables=fetch(decode_tables),
                decode_context_lens=fetch(decode_lens),
                prefill_block_tables=fetch(prefill_tables),
                prefill_query_start=batch.query_start,
                prefill_context_lens=batch.prefill_lens,
                prefill_query_start_tensor=fetch(query_start),
                prefill_context_lens_tensor=fetch(prefill_lens),
                decode_max_context_len=max(batch.decode_lens, default=0),
                prefill_max_query_len=max(
                    (b - a for a, b in zip(batch.query_start, batch.query_start[1:], strict=False)),
                    default=0,
                ),
            )

        return finish


@dataclass
class BatchTables:
    """A step's sequences as the scheduler lays them out: the decodes (one query each), then
    the prefill chunks, each with its block table and context length."""

    decode_tables: list[list[int]]
    decode_lens: list[int]
    prefill_tables: list[list[int]]
    prefill_lens: list[int]
    query_start: list[int]  # where each prefill chunk's queries start, and the end: [S + 1]

    def every_row_a_decode(self) -> BatchTables:
        """The same rows with each prefill query as a decode of its own (its chunk's table, the
        keys up to its position): batch-invariant mode attends every token with the decode
        kernel, whose sums over a query's keys do not depend on how its prompt was chunked."""
        tables, lens = list(self.decode_tables), list(self.decode_lens)
        for i, (table, end) in enumerate(zip(self.prefill_tables, self.prefill_lens, strict=True)):
            first = end - (self.query_start[i + 1] - self.query_start[i])
            tables += [table] * (end - first)
            lens += range(first + 1, end + 1)
        return BatchTables(tables, lens, [], [], [0])


@dataclass
class SharedPrefix:
    """Blocks at the start of several sequences' tables that all their queries see in full."""

    block_ids: torch.Tensor  # [num_blocks]
    rows: torch.Tensor  # [R] the batch rows (query tokens) of those sequences


@dataclass
class CascadePlan:
    prefixes: list[SharedPrefix]
    # the same batch with every shared prefix cut from its sequences' tables and lengths: the
    # attention over what each sequence has of its own
    suffix: AttentionMetadata
