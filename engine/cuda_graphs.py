"""CUDA graphs for decode steps: one launch of a recorded graph instead of a thousand kernels.

At warm-up the model's forward pass over a decode step is recorded once per batch-size bucket
(1, 2, 4, 8, then every 16 up to `max_num_seqs`), reading its inputs from static buffers; a
decode step of `n` sequences copies its inputs into the first `n` rows, pads the rest (KV slot
-1, which the store kernel skips; context length 0, which attends to nothing) and replays the
smallest bucket that holds it. Steps with prompt chunks run eagerly. The attention's split count
is fixed at capture by planning for `max_model_len` (a graph cannot ask the host), which the
kernels compute from the context lengths in memory at replay.

A graph that replays wrongly is worse than none, and CI has no GPU to catch it, so after
capture the runner checks itself: one step replayed against the eager forward pass on the same
inputs; if they differ, or capture raised, graphs are off with the reason logged.

A hybrid KV layout (`kv_layout`) has a block table and KV slots per layer group: the static
buffers hold one of each per group, and the forward pass gets one metadata per group.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from conveyor.kernels.metadata import AttentionMetadata

log = logging.getLogger(__name__)

# a decode step's metadata: one, or one per KV group
StepMeta = AttentionMetadata | list[AttentionMetadata]
Forward = Callable[[torch.Tensor, torch.Tensor, StepMeta], torch.Tensor]
# records `run` (a forward pass over the static buffers), returns what replays it and the
# tensor its output lands in
Replay = tuple[Callable[[], None], torch.Tensor]
Capture = Callable[[Callable[[], torch.Tensor]], Replay]


def buckets_for(max_num_seqs: int) -> list[int]:
    """The batch sizes graphs are recorded for (nano-vllm's and vLLM's shape of list)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


def cuda_capture(device: torch.device) -> Capture:
    """Recording on a CUDA device, every graph in one memory pool (they never run at once)."""
    pool = torch.cuda.graph_pool_handle()

    def capture(run: Callable[[], torch.Tensor]) -> Replay:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            run()  # once outside the graph: lazy initialisation never happens inside it
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = run()
        return graph.replay, out

    return capture


@dataclass
class StaticInputs:
    """The buffers every graph reads: one row per sequence, `max_batch` rows; the KV slots
    and block tables once per KV group."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: list[torch.Tensor]
    tables: list[torch.Tensor]  # [max_batch, blocks of the longest sequence]
    context_lens: torch.Tensor

    @classmethod
    def empty(
        cls, max_batch: int, max_blocks: int, device: torch.device, num_groups: int = 1
    ) -> StaticInputs:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        groups = range(num_groups)
        return cls(zeros(max_batch), zeros(max_batch), [zeros(max_batch).fill_(-1) for _ in groups],
                   [zeros(max_batch, max_blocks) for _ in groups], zeros(max_batch))  # fmt: skip

    def metadata(
        self, batch: int, max_context_len: int, decode_splits: int | None = None
    ) -> StepMeta:
        """A decode step of the first `batch` rows, its split count planned for
        `max_context_len` unless `decode_splits` fixes it: one metadata per KV group (a single
        one for one group)."""
        metas = [
            self._group_metadata(g, batch, max_context_len, decode_splits)
            for g in range(len(self.slots))
        ]
        return metas[0] if len(metas) == 1 else metas

    def _group_metadata(
        self, group: int, batch: int, max_context_len: int, decode_splits: int | None
    ) -> AttentionMetadata:
        device = self.input_ids.device
        return AttentionMetadata(
            slot_mapping=self.slots[group][:batch],
            num_decode_tokens=batch,
            decode_block_tables=self.tables[group][:batch],
            decode_context_lens=self.context_lens[:batch],
            prefill_block_tables=torch.zeros((0, 0), dtype=torch.long, device=device),
            prefill_query_start=[0],
            prefill_context_lens=[],
            prefill_query_start_tensor=torch.zeros(1, dtype=torch.long, device=device),
            prefill_context_lens_tensor=torch.zeros(0, dtype=torch.long, device=device),
            decode_max_context_len=max_context_len,
            decode_splits=decode_splits,
        )

    def fill(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: StepMeta,
        bucket: int,
    ) -> None:
        """Copy a decode step's inputs into the first rows (device to device) and pad the rows
        up to `bucket` so that they write nothing and read nothing."""
        n = input_ids.shape[0]
        metas = meta if isinstance(meta, list) else [meta]
        for slots, tables, group_meta in zip(self.slots, self.tables, metas, strict=True):
            # a table may hold a block reserved beyond max_model_len's; no query reads it
            width = min(group_meta.decode_block_tables.shape[1], tables.shape[1])
            slots[:n].copy_(group_meta.slot_mapping)
            tables[:n, :width].copy_(group_meta.decode_block_tables[:, :width])
            slots[n:bucket].fill_(-1)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.context_lens[:n].copy_(metas[0].decode_context_lens)
        self.input_ids[n:bucket].zero_()
        self.positions[n:bucket].zero_()
        self.context_lens[n:bucket].zero_()


class DecodeGraphs:
    """The recorded decode steps of one model runner."""

    def __init__(
        self, static: StaticInputs, replays: dict[int, tuple[Callable[[], None], torch.Tensor]]
    ):
        self.static = static
        self.replays = replays
        self.max_batch = max(replays)

    @classmethod
    def record(
        cls,
        forward: Forward,
        buckets: list[int],
        max_blocks: int,
        max_context_len: int,
        device: torch.device,
        capture: Capture,
        num_groups: int = 1,
        decode_splits: int | None = None,
    ) -> DecodeGraphs:
        static = StaticInputs.empty(max(buckets), max_blocks, device, num_groups)
        replays = {}
        for bucket in sorted(buckets, reverse=True):  # the largest first: the pool fits all
            meta = static.metadata(bucket, max_context_len, decode_splits)
            ids, positions = static.input_ids[:bucket], static.positions[:bucket]
            replays[bucket] = capture(
                lambda ids=ids, pos=positions, meta=meta: forward(ids, pos, meta)
            )
        return cls(static, replays)

    def covers(self, batch: int) -> bool:
        return 0 < batch <= self.max_batch

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMeta) -> torch.Tensor:
        """The final hidden states of a decode step of `len(input_ids)` sequences."""
        n = input_ids.shape[0]
        bucket = min(b for b in self.replays if b >= n)
        self.static.fill(input_ids, positions, meta, bucket)
        replay, out = self.replays[bucket]
        replay()
        return out[:n]
