"""What an attention backend needs to know about one flattened batch of tokens.

The batch holds the decode tokens (one query per sequence) first, then the prefill chunks
(several queries per sequence). Every query at absolute position p attends to positions 0..p of
its own sequence, all of which are in the paged cache once this step's K/V is written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    @property
    def num_prefills(self) -> int:
        return len(self.prefill_context_lens)

    @classmethod
    def build(
        cls, slot_mapping: torch.Tensor, batch: BatchTables, device: torch.device
    ) -> AttentionMetadata:
        return cls(
            slot_mapping=slot_mapping,
            num_decode_tokens=len(batch.decode_lens),
            decode_block_tables=pad_tables(batch.decode_tables, device),
            decode_context_lens=torch.tensor(batch.decode_lens, dtype=torch.long, device=device),
            prefill_block_tables=pad_tables(batch.prefill_tables, device),
            prefill_query_start=batch.query_start,
            prefill_context_lens=batch.prefill_lens,
            prefill_query_start_tensor=torch.tensor(
                batch.query_start, dtype=torch.long, device=device
            ),
            prefill_context_lens_tensor=torch.tensor(
                batch.prefill_lens, dtype=torch.long, device=device
            ),
            decode_max_context_len=max(batch.decode_lens, default=0),
            prefill_max_query_len=max(
                (b - a for a, b in zip(batch.query_start, batch.query_start[1:], strict=False)),
                default=0,
            ),
        )


@dataclass
class BatchTables:
    """A step's sequences as the scheduler lays them out: the decodes (one query each), then
    the prefill chunks, each with its block table and context length."""

    decode_tables: list[list[int]]
    decode_lens: list[int]
    prefill_tables: list[list[int]]
    prefill_lens: list[int]
    query_start: list[int]  # where each prefill chunk's queries start, and the end: [S + 1]


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


def pad_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """Block tables as one [len(tables), longest] tensor, padded with block 0."""
    width = max((len(t) for t in tables), default=0)
    padded = [t + [0] * (width - len(t)) for t in tables]
    return torch.tensor(padded, dtype=torch.long, device=device).view(len(tables), width)
