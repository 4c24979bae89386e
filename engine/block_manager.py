"""Fixed-size KV blocks: reference counts, copy-on-write and an LRU prefix cache.

A full block is keyed by a hash chained over every token before it, so equal keys mean equal
prefixes. A freed block keeps its key and stays reusable until the pool needs it back; free blocks
are handed out least-recently-freed first, blocks that hold nothing cacheable before any others.

Where every layer attends to a sliding window (Mistral, Mixtral, Phi-3-mini-4k), a block that
lies wholly before the window of every query its sequence will still compute is given back to
the pool (its key stays cached) and its place in the table taken by `NULL_BLOCK`, which is never
handed out: a sequence then holds about `window` tokens of blocks however long it grows.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from conveyor.engine.logprob_entries import BlockLogprobs
from conveyor.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    key: bytes | None = None
    logprobs: BlockLogprobs | None = None  # its prompt logprobs, kept while its key is


# stands in a windowed sequence's table for the blocks it gave back; its KV stays zero, and the
# kernels read it only at positions the window masks
NULL_BLOCK = 0

# the root of the keys of a sequence on LongRoPE's long factors: its KV is not that of a
# sequence with the same tokens on the short ones
LONG_ROPE_ROOT = b"longrope:long"


def block_key(parent: bytes | None, tokens: Seq[int]) -> bytes:
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _keeps_logprobs(block: Block, k: int) -> bool:
    return block.logprobs is not None and block.logprobs.k >= k


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        window: int | None = None,
    ):
        """`window`: the sliding window of every layer (their largest), or None where a layer
        attends to the whole context."""
        reserved = 0 if window is None else 1  # NULL_BLOCK
        if num_blocks < 1 + reserved:
            raise ValueError(f"the KV cache needs at least {1 + reserved} blocks, got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict(
            (i, None) for i in range(reserved, num_blocks)
        )
        if reserved:
            self.blocks[NULL_BLOCK].ref_count = 1  # held for good
        self.cached: dict[bytes, int] = {}  # key -> block id, for blocks whose KV is written
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) the runner copies next step

    # ---- accounting -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Blocks a sequence can be given (not `NULL_BLOCK`)."""
        return len(self.blocks) - (self.window is not None)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    # ---- block life cycle -------------------------------------------------------------------
    def _take_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.key is not None:  # evict it from the cache
            if self.cached.get(block.key) == block_id:
                del self.cached[block.key]
            block.key = None
        block.logprobs = None
        block.ref_count = 1
        return block_id

    def _acquire(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"double free of block {block_id}"
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None
            if block.key is None:  # nothing worth keeping: hand it out first
                self._free.move_to_end(block_id, last=False)

    # ---- prefix cache -----------------------------------------------------------------------
    def block_keys(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The chained keys of the first `num_blocks` full blocks of `seq` (memoised on it)."""
        keys, size = seq.block_keys, self.block_size
        while len(keys) < num_blocks:
            i = len(keys)
            tokens = seq.token_ids[i * size : (i + 1) * size]
            root = LONG_ROPE_ROOT if seq.rope_long else None
            keys.append(block_key(keys[-1] if keys else root, tokens))
        return keys[:num_blocks]

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Leading cached blocks of `seq`, leaving at least one token to compute. For a request
        that asks for prompt logprobs, only blocks that kept at least as many alternatives."""
        if not self.enable_prefix_caching:
            return []
        k = seq.request.params.prompt_logprobs
        hits = []
        for key in self.block_keys(seq, (seq.num_tokens - 1) // self.block_size):
            block_id = self.cached.get(key)
            if block_id is None:
                break
            if k is not None and not _keeps_logprobs(self.blocks[block_id], k):
                break
            hits.append(block_id)
        return hits

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Offer every block of `seq` that is full of computed KV to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_registered_blocks:
            return
        keys = self.block_keys(seq, num_full)
        for i in range(seq.num_registered_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.key is None and keys[i] not in self.cached:
                block.key = keys[i]
                self.cached[keys[i]] = block.block_id
        seq.num_registered_blocks = num_full

    # ---- sequences --------------------------------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_new_tokens: int, hits: Seq[int] = ()) -> int:
        """Free blocks that scheduling `num_new_tokens` more tokens of `seq` would consume."""
        table_len = len(seq.block_table) or len(hits)
        computed = seq.num_computed_tokens if seq.block_table else len(hits) * self.block_size
        needed = max(0, cdiv(computed + num_new_tokens, self.block_size) - table_len)
        if self._needs_copy(seq):
            needed += 1
        # cached hits that sit in the free pool leave it when they are taken
        return needed + sum(1 for b in hits if self.blocks[b].ref_count == 0)

    def _needs_copy(self, seq: Sequence) -> bool:
        i = seq.num_computed_tokens // self.block_size
        return i < len(seq.block_table) and self.blocks[seq.block_table[i]].ref_count > 1

    def can_schedule(self, seq: Sequence, num_new_tokens: int, hits: Seq[int] = ()) -> bool:
        return self.blocks_needed(seq, num_new_tokens, hits) <= self.num_free_blocks

    def admit(self, seq: Sequence, hits: Seq[int]) -> None:
        """Start `seq` from the cached blocks `hits` (its table must be empty)."""
        assert not seq.block_table, "admit() is for a sequence that holds no blocks"
        for block_id in hits:
            self._acquire(block_id)
        seq.block_table = list(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_registered_blocks = len(hits)

    def reserve(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for the KV of the next `num_new_tokens` tokens; False if the pool is short.

        A shared block about to be written is first copied (copy-on-write): the copy is queued
        in `pending_copies` for the model runner.
        """
        table, computed = seq.block_table, seq.num_computed_tokens
        if (
            num_new_tokens > 0
            and computed + num_new_tokens <= len(table) * self.block_size
            and (self.blocks[table[computed // self.block_size]].ref_count == 1)
        ):  # most decode steps: the tokens go into blocks it already holds, alone
            return True
        if not self.can_schedule(seq, num_new_tokens):
            return False
        if self._needs_copy(seq):
            i = seq.num_computed_tokens // self.block_size
            src = seq.block_table[i]
            dst = self._take_free()
            self._release(src)
            seq.block_table[i] = dst
            self.pending_copies.append((src, dst))
        target = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
        while len(seq.block_table) < target:
            seq.block_table.append(self._take_free())
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let `child` share every block of `parent` (copied on first write)."""
        for block_id in parent.block_table[parent.num_released_blocks :]:
            self._acquire(block_id)
        child.block_table = list(parent.block_table)
        child.block_keys = list(parent.block_keys)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_registered_blocks = parent.num_registered_blocks
        child.num_released_blocks = parent.num_released_blocks

    def release_outside_window(self, seq: Sequence) -> None:
        """Give back the blocks of `seq` that lie wholly before the window of every query it
        will still compute (from position `num_computed_tokens` on); no-op without a window."""
        if self.window is None:
            return
        end = max(0, seq.num_computed_tokens - self.window + 1) // self.block_size
        table = seq.block_table
        for i in range(seq.num_released_blocks, min(end, len(table))):
            self._release(table[i])
            table[i] = NULL_BLOCK
        seq.num_released_blocks = max(seq.num_released_blocks, min(end, len(table)))

    def free(self, seq: Sequence) -> None:
        # tail blocks first, so a sequence's shared head outlives its private tail in the LRU
        for block_id in reversed(seq.block_table[seq.num_released_blocks :]):
            self._release(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        seq.num_released_blocks = 0

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies
