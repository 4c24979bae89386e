"""Owns the model and the paged KV cache; turns scheduled sequences into one forward pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.models import DecoderForCausalLM
from engine.scheduler import ScheduledSeq
from kernels import AttentionBackend, AttentionMetadata
from kernels.cascade import plan_cascade
from kernels.metadata import BatchTables


@dataclass
class ForwardResult:
    sample_logits: torch.Tensor  # [num sequences that complete, vocab], in `scheduled` order
    prompt_logits: dict[int, tuple[int, torch.Tensor]]  # seq_id -> (first position, logits)
    # seq_id -> (position, final hidden state) at the last position of each full prompt block
    # computed in this step, for the sequences whose prompt logprobs were computed
    prompt_boundaries: dict[int, list[tuple[int, torch.Tensor]]]


class ModelRunner:
    def __init__(
        self,
        model: DecoderForCausalLM,
        backend: AttentionBackend,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = device
        # shared prefixes read once per step for all their sequences (the CPU backends)
        self.cascade = getattr(backend, "cascade", False) and device.type == "cpu"
        shape = (num_blocks, model.num_kv_heads, block_size, model.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(model.num_layers)
        ]

    @staticmethod
    def bytes_per_block(model: DecoderForCausalLM, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * itemsize

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSeq], prompt_logprob_seqs: set[int]) -> ForwardResult:
        """One forward pass; `scheduled` must list decodes (one new token) before prefills."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        prompt_rows: dict[int, tuple[int, int, int]] = {}  # seq_id -> (first pos, row start, end)
        boundary_rows: dict[int, list[tuple[int, int]]] = {}  # seq_id -> [(position, row)]
        decode_tables, decode_lens = [], []
        prefill_tables, prefill_lens, query_start = [], [], [0]
        for item in scheduled:
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            row = len(input_ids)
            input_ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if n == 1 and not prefill_lens:
                decode_tables.append(table)
                decode_lens.append(start + 1)
            else:
                prefill_tables.append(table)
                prefill_lens.append(start + n)
                query_start.append(query_start[-1] + n)
            if item.completes:
                sample_rows.append(row + n - 1)
            if seq.seq_id in prompt_logprob_seqs:
                # rows predicting prompt tokens start+1 .. num_prompt_tokens-1
                end = min(start + n, seq.num_prompt_tokens - 1)
                if end > start:
                    prompt_rows[seq.seq_id] = (start, row, row + end - start)
                last = min(start + n, seq.num_prompt_tokens)
                first_boundary = (start // bs + 1) * bs - 1
                boundary_rows[seq.seq_id] = [
                    (p, row + p - start) for p in range(first_boundary, last, bs)
                ]

        dev = self.device
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=dev)
        tables = BatchTables(decode_tables, decode_lens, prefill_tables, prefill_lens, query_start)
        meta = AttentionMetadata.build(slot_mapping, tables, dev)
        if self.cascade:
            meta.cascade = plan_cascade(slot_mapping, tables, bs, dev)
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.kv_caches,
            meta,
            self.backend,
        )
        sample_logits = self.model.compute_logits(hidden[sample_rows]).float()
        prompt_logits = {
            seq_id: (first, self.model.compute_logits(hidden[a:b]).float())
            for seq_id, (first, a, b) in prompt_rows.items()
        }
        prompt_boundaries = {
            seq_id: [(p, hidden[r]) for p, r in rows] for seq_id, rows in boundary_rows.items()
        }
        return ForwardResult(sample_logits, prompt_logits, prompt_boundaries)
