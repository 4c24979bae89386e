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

    @property
    def num_prefills(self) -> int:
        return len(self.prefill_context_lens)
