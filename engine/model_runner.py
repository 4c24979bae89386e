"""Owns the model and the paged KV cache; turns scheduled sequences into one forward pass."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from conveyor.engine.cuda_graphs import Capture, DecodeGraphs, StepMeta, buckets_for
from conveyor.engine.kv_layout import KVLayout
from conveyor.engine.models import DecoderForCausalLM
from conveyor.engine.models.layers import LongRope
from conveyor.engine.scheduler import ScheduledSeq
from conveyor.engine.sequence import Sequence
from conveyor.kernels import AttentionBackend, AttentionMetadata
from conveyor.kernels.cascade import plan_cascade
from conveyor.kernels.metadata import BatchTables
from conveyor.kernels.upload import StepUpload, to_device


@dataclass
class ForwardResult:
    # [num sequences that complete, vocab], in `scheduled` order, in the model's dtype
    sample_logits: torch.Tensor
    # seq_id -> (first position, final hidden states of the rows predicting prompt tokens)
    prompt_hidden: dict[int, tuple[int, torch.Tensor]]
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
        layout: KVLayout | None = None,
        batch_invariant: bool = False,
    ):
        self.model = model
        self.backend = backend
        self.graphs: DecodeGraphs | None = None  # recorded decode steps (CUDA), see record_graphs
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.layout = layout or KVLayout.single(model.layer_windows())
        # shared prefixes read once per step for all their sequences (the CPU backends); not in
        # batch-invariant mode, where a prefix's sums would depend on who shares it
        cascade = getattr(backend, "cascade", False) and device.type == "cpu"
        self.cascade = cascade and not batch_invariant
        self.batch_invariant = batch_invariant
        # the Triton decode's split of long contexts is chosen from the batch's size unless fixed
        self.decode_splits = 1 if batch_invariant else None
        shape = (num_blocks, model.num_kv_heads, block_size, model.head_dim)
        self.slot_caches = [
            (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(self.layout.num_slots)
        ]
        # each layer's cache: its slot's (layers of different groups share one, by block id)
        self.kv_caches = [self.slot_caches[slot] for slot in self.layout.layer_slot]

    def forward_decode(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMeta
    ) -> torch.Tensor:
        """The final hidden states of every row of a decode step, eagerly."""
        return self.model(
            input_ids, positions, self.kv_caches, self._per_layer(meta), self.backend, None
        )

    def _per_layer(self, meta: StepMeta) -> StepMeta:
        """The model's metadata: the step's, or, for one per KV group, each layer's group's."""
        if not isinstance(meta, list):
            return meta
        return [meta[group] for group in self.layout.layer_group]

    @torch.inference_mode()
    def record_graphs(self, max_num_seqs: int, max_model_len: int, capture: Capture) -> str | None:
        """Record decode graphs and check one replay against the eager step; None when they
        are on, else why they are off."""
        self.graphs = None
        max_blocks = -(-max_model_len // self.block_size)
        try:
            graphs = DecodeGraphs.record(
                self.forward_decode, buckets_for(max_num_seqs), max_blocks, max_model_len,
                self.device, capture, self.layout.num_groups, self.decode_splits,
            )  # fmt: skip
            mismatch = self._check_graphs(graphs)
        except Exception as err:  # noqa: BLE001 - any failure means no graphs, said why
            return f"capture failed: {type(err).__name__}: {err}"
        if mismatch is not None:
            return mismatch
        self.graphs = graphs
        return None

    @torch.inference_mode()
    def _check_graphs(self, graphs: DecodeGraphs) -> str | None:
        """One decode step of up to 3 sequences (padded to its bucket) replayed and run
        eagerly on the same inputs: None when they agree. Each KV group's sequences hold
        blocks of their own."""
        groups = self.layout.num_groups
        n = min(3, graphs.max_batch, len(self.kv_caches[0][0]) // groups)
        bs = self.block_size
        positions = [bs - 1, bs // 2, 0][:n]
        metas = []
        for g in range(groups):
            blocks = [g * n + i for i in range(n)]
            tables = BatchTables([[b] for b in blocks], [p + 1 for p in positions], [], [], [0])
            slots = [b * bs + p for b, p in zip(blocks, positions, strict=True)]
            slots = to_device(slots, self.device)
            metas.append(AttentionMetadata.build(slots, tables, self.device))
            metas[-1].decode_splits = self.decode_splits
        meta = metas[0] if groups == 1 else metas
        ids, pos = to_device(list(range(1, n + 1)), self.device), to_device(positions, self.device)
        eager = self.forward_decode(ids, pos, meta).float()
        replayed = graphs.run(ids, pos, meta).float()
        tolerance = 1e-3 if self.dtype == torch.float32 else 3e-2
        if not torch.allclose(replayed, eager, rtol=tolerance, atol=tolerance):
            worst = float((replayed - eager).abs().max())
            return f"a replayed decode step differs from the eager one (by up to {worst:.3g})"
        return None

    @staticmethod
    def layer_block_bytes(model: DecoderForCausalLM, block_size: int, dtype: torch.dtype) -> int:
        """What one layer's block of `block_size` tokens holds (K and V)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * block_size * model.num_kv_heads * model.head_dim * itemsize

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for k_cache, v_cache in self.slot_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSeq], prompt_logprob_seqs: set[int]) -> ForwardResult:
        """One forward pass; `scheduled` must list decodes (one new token) before prefills."""
        step = StepLayout.of(
            scheduled, prompt_logprob_seqs, self.block_size, self.model.long_rope,
            self.layout.num_groups,
        )  # fmt: skip
        if self.batch_invariant:
            step.tables = [tables.every_row_a_decode() for tables in step.tables]
        dev = self.device
        kept = step.output_rows()
        at = {row: i for i, row in enumerate(kept or range(len(step.input_ids)))}
        # every integer input of the step in one host-to-device copy
        upload = StepUpload(dev)
        slots = [upload.add(group_slots) for group_slots in step.slots]
        input_ids = upload.add(step.input_ids)
        positions = upload.add(step.positions)
        kept_rows = None if kept is None else upload.add(kept)
        sample_rows = upload.add([at[r] for r in step.sample_rows])
        finish_metas = [AttentionMetadata.stage(tables, upload) for tables in step.tables]
        fetch = upload.send()
        metas = []
        for g, finish_meta in enumerate(finish_metas):
            slot_mapping = fetch(slots[g])
            meta = finish_meta(slot_mapping, fetch)
            meta.decode_splits = self.decode_splits
            if self.cascade and self.layout.windows[g] is None:
                meta.cascade = plan_cascade(slot_mapping, step.tables[g], self.block_size, dev)
            metas.append(meta)
        meta = metas[0] if len(metas) == 1 else metas
        graphs = self.graphs
        if (
            graphs is not None
            and kept_rows is None
            and metas[0].num_prefills == 0
            and all(m.cascade is None for m in metas)
            and graphs.covers(metas[0].num_decode_tokens)
        ):
            hidden = graphs.run(fetch(input_ids), fetch(positions), meta)
        else:
            hidden = self.model(
                fetch(input_ids),
                fetch(positions),
                self.kv_caches,
                self._per_layer(meta),
                self.backend,
                None if kept_rows is None else fetch(kept_rows),
            )
        sample_logits = self.model.compute_logits(hidden.index_select(0, fetch(sample_rows)))
        prompt_hidden = {
            seq_id: (first, hidden[at[a] : at[b - 1] + 1])
            for seq_id, (first, a, b) in step.prompt_rows.items()
        }
        prompt_boundaries = {
            seq_id: [(p, hidden[at[r]]) for p, r in rows]
            for seq_id, rows in step.boundary_rows.items()
        }
        return ForwardResult(sample_logits, prompt_hidden, prompt_boundaries)


def _leading_decodes(scheduled: list[ScheduledSeq], prompt_logprob_seqs: set[int]) -> int:
    """How many of the first `scheduled` are decodes without prompt logprobs."""
    for i, item in enumerate(scheduled):
        if item.num_new_tokens != 1 or item.seq.seq_id in prompt_logprob_seqs:
            return i
    return len(scheduled)


@dataclass
class StepLayout:
    """Where each scheduled sequence's tokens sit in one step's flat batch."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # rows of the rope table (`LongRope`)
    # per KV group: the cache slot of each token, and the batch's block tables
    slots: list[list[int]] = field(default_factory=lambda: [[]])
    sample_rows: list[int] = field(default_factory=list)  # rows whose logits are sampled
    # seq_id -> (first position, row start, row end) of the rows predicting prompt tokens
    prompt_rows: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    # seq_id -> [(position, row)] of the last position of each full prompt block
    boundary_rows: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    tables: list[BatchTables] = field(default_factory=lambda: [BatchTables([], [], [], [], [0])])

    @classmethod
    def of(
        cls,
        scheduled: list[ScheduledSeq],
        prompt_logprob_seqs: set[int],
        block_size: int,
        long_rope: LongRope | None = None,
        num_groups: int = 1,
    ) -> StepLayout:
        # the leading decodes (most of a step, a prompt chunk or two after them) are laid out
        # whole lists at a time; the rest a token at a time
        num_decodes = 0
        if long_rope is None and num_groups == 1:
            num_decodes = _leading_decodes(scheduled, prompt_logprob_seqs)
        step, bs = cls._decodes(scheduled[:num_decodes], block_size), block_size
        if num_decodes == len(scheduled):
            return step
        tables, slots = step.tables[0], step.slots[0]
        # the other groups: their own tables and slots, the lengths of the first group's
        step.tables += [
            BatchTables([], tables.decode_lens, [], tables.prefill_lens, tables.query_start)
            for _ in range(num_groups - 1)
        ]
        step.slots += [[] for _ in range(num_groups - 1)]
        for item in scheduled[num_decodes:]:
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            row = len(step.input_ids)
            table = seq.tables[0]
            if long_rope is not None:
                step.positions.extend(long_rope.rows(start, n, seq.rope_long))
            elif n == 1:
                step.positions.append(start)
            else:
                step.positions.extend(range(start, start + n))
            if n == 1:  # a decode: the common case, without slices and generators
                step.input_ids.append(seq.token_ids[start])
                slots.append(table[start // bs] * bs + start % bs)
            else:
                step.input_ids.extend(seq.token_ids[start : start + n])
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            decode = n == 1 and not tables.prefill_lens
            if decode:
                tables.decode_tables.append(table)
                tables.decode_lens.append(start + 1)
            else:
                tables.prefill_tables.append(table)
                tables.prefill_lens.append(start + n)
                tables.query_start.append(tables.query_start[-1] + n)
            if num_groups > 1:
                step._other_groups(seq, start, n, decode, bs)
            if item.completes:
                step.sample_rows.append(row + n - 1)
            if seq.seq_id in prompt_logprob_seqs:
                step._prompt_rows(seq, start, n, row, bs)
        return step

    @classmethod
    def _decodes(cls, scheduled: list[ScheduledSeq], bs: int) -> StepLayout:
        """`of` for steps of one new token per sequence, one KV group, no prompt logprobs and
        no LongRoPE (most steps, or their leading decodes): whole lists at a time instead of a
        token at a time."""
        step = cls()
        seqs = [item.seq for item in scheduled]
        starts = [seq.num_computed_tokens for seq in seqs]
        pairs = list(zip(seqs, starts, strict=True))
        step.positions = starts
        step.input_ids = [seq.token_ids[p] for seq, p in pairs]
        step.slots[0] = [seq.tables[0][p // bs] * bs + p % bs for seq, p in pairs]
        tables = step.tables[0]
        tables.decode_tables.extend([seq.tables[0] for seq in seqs])
        tables.decode_lens.extend([p + 1 for p in starts])
        # a one-token chunk of a longer prompt runs as a decode but samples nothing
        step.sample_rows = [i for i, (seq, p) in enumerate(pairs) if p + 1 == len(seq.token_ids)]
        return step

    def _other_groups(self, seq: Sequence, start: int, n: int, decode: bool, bs: int) -> None:
        """The slots and tables of `seq`'s KV groups past the first (a hybrid layout)."""
        groups = zip(self.slots[1:], self.tables[1:], seq.tables[1:], strict=True)
        for slots, tables, table in groups:
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            (tables.decode_tables if decode else tables.prefill_tables).append(table)

    def output_rows(self) -> list[int] | None:
        """The rows whose final hidden states are used (sampled, or giving prompt logprobs),
        in order; None when that is every row. At least one row, so no product is empty."""
        rows = set(self.sample_rows)
        for _, a, b in self.prompt_rows.values():
            rows.update(range(a, b))
        for boundaries in self.boundary_rows.values():
            rows.update(r for _, r in boundaries)
        if len(rows) == len(self.input_ids):
            return None
        return sorted(rows) or [0]

    def _prompt_rows(self, seq: Sequence, start: int, n: int, row: int, bs: int) -> None:
        # rows predicting prompt tokens start+1 .. num_prompt_tokens-1
        end = min(start + n, seq.num_prompt_tokens - 1)
        if end > start:
            self.prompt_rows[seq.seq_id] = (start, row, row + end - start)
        last = min(start + n, seq.num_prompt_tokens)
        first_boundary = (start // bs + 1) * bs - 1
        self.boundary_rows[seq.seq_id] = [
            (p, row + p - start) for p in range(first_boundary, last, bs)
        ]
