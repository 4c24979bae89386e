"""Fixed-size KV blocks: reference counts, copy-on-write and an LRU prefix cache.

A full block is keyed by a hash chained over every token before it, so equal keys mean equal
prefixes. A freed block keeps its key and stays reusable until the pool needs it back; free blocks
are handed out least-recently-freed first, blocks that hold nothing cacheable before any others.

A sequence holds one block table per KV group (`kv_layout`: one group where every layer
attends alike). In a group whose layers attend to a sliding window (every layer of Mistral,
Mixtral, Phi-3-mini-4k; the local layers of Gemma 2 and 3), a block that lies wholly before the
window of every query its sequence will still compute is given back to the pool (its key stays
cached) and its place in the table taken by `NULL_BLOCK`, which is never handed out: the group
then holds about a window of blocks however long the sequence grows. A prefix hit in such a
group needs only the blocks inside the window of the first token to compute.
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


@dataclass
class PrefixHit:
    """The cached blocks a sequence can start from, the same number of positions in every
    group: per group, the table it starts with, whose first `released` entries are
    `NULL_BLOCK` (in a windowed group, blocks its queries will not see)."""

    tables: list[list[int]]
    released: list[int]

    def __len__(self) -> int:
        return len(self.tables[0])


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
        windows: tuple[int | None, ...] = (None,),
    ):
        """`windows`: the sliding window of each KV group's layers (None: full attention)."""
        self.windows = tuple(windows)
        self.windowed = any(w is not None for w in self.windows)
        reserved = int(self.windowed)  # NULL_BLOCK
        if num_blocks < 1 + reserved:
            raise ValueError(f"the KV cache needs at least {1 + reserved} blocks, got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_groups = len(self.windows)
        # a group's blocks are keyed apart from another's: the same tokens, other layers' KV
        self.key_suffixes = [b"" if g == 0 else b"group:%d" % g for g in range(self.num_groups)]
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
        return len(self.blocks) - self.windowed

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

    def match_prefix(self, seq: Sequence) -> PrefixHit:
        """The leading cached blocks of `seq`, leaving at least one token to compute. For a
        request that asks for prompt logprobs, only blocks that kept at least as many
        alternatives, and in every group from the first block on."""
        if not self.enable_prefix_caching:
            return self._hit(seq, [[] for _ in self.windows], 0)
        k = seq.request.params.prompt_logprobs
        keys = self.block_keys(seq, (seq.num_tokens - 1) // self.block_size)
        found = []
        length = len(keys)
        for g, window in enumerate(self.windows):
            ids = self._cached_run(keys, g, length, k, contiguous=window is None or k is not None)
            found.append(ids)
            if window is None or k is not None:
                length = min(length, len(ids))
        for g, window in enumerate(self.windows):
            if window is not None and k is None:
                length = self._window_hit(found[g], length, window)
        return self._hit(seq, found, length)

    def _cached_run(
        self, keys: list[bytes], group: int, length: int, k: int | None, contiguous: bool
    ) -> list[int | None]:
        """The cached block of each of the first `length` keys in `group`: up to the first
        miss where `contiguous`, else every one (None where missing)."""
        suffix, found = self.key_suffixes[group], []
        for key in keys[:length]:
            block_id = self.cached.get(key + suffix if suffix else key)
            logprobs_short = group == 0 and k is not None  # its logprobs live in group 0
            if (
                block_id is not None
                and logprobs_short
                and not _keeps_logprobs(self.blocks[block_id], k)
            ):
                block_id = None
            if block_id is None and contiguous:
                break
            found.append(block_id)
        return found

    def _window_hit(self, ids: list[int | None], length: int, window: int) -> int:
        """The longest hit of at most `length` blocks whose blocks inside the window of its
        first uncomputed token are all in `ids`."""
        while length > 0:
            first = self._first_in_window(length * self.block_size, window)
            missing = [i for i in range(first, length) if ids[i] is None]
            if not missing:
                return length
            length = missing[-1]
        return 0

    def _first_in_window(self, position: int, window: int) -> int:
        """The first block a query at `position` (and every later one) may read."""
        return max(0, position - window + 1) // self.block_size

    def _hit(self, seq: Sequence, found: list[list[int | None]], length: int) -> PrefixHit:
        tables, released = [], []
        for g, window in enumerate(self.windows):
            first = 0
            if window is not None and seq.request.params.prompt_logprobs is None:
                first = self._first_in_window(length * self.block_size, window)
            ids = found[g][first:length]
            tables.append([NULL_BLOCK] * first + ids)
            released.append(first)
        return PrefixHit(tables, released)

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Offer every block of `seq` that is full of computed KV to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_registered_blocks:
            return
        keys = self.block_keys(seq, num_full)
        groups = zip(seq.tables, self.key_suffixes, seq.released, strict=True)
        for table, suffix, released in groups:
            for i in range(max(seq.num_registered_blocks, released), num_full):
                block = self.blocks[table[i]]
                key = keys[i] + suffix if suffix else keys[i]
                if block.key is None and key not in self.cached:
                    block.key = key
                    self.cached[key] = block.block_id
        seq.num_registered_blocks = num_full

    # ---- sequences --------------------------------------------------------------------------
    def blocks_needed(
        self, seq: Sequence, num_new_tokens: int, hits: PrefixHit | Seq[int] = ()
    ) -> int:
        """Free blocks that scheduling `num_new_tokens` more tokens of `seq` would consume."""
        if seq.block_table:
            table_len, computed, held = len(seq.block_table), seq.num_computed_tokens, ()
        else:
            hit = self._as_hit(hits)
            table_len, computed = len(hit), len(hit) * self.block_size
            held = [b for t, r in zip(hit.tables, hit.released, strict=True) for b in t[r:]]
        new = max(0, cdiv(computed + num_new_tokens, self.block_size) - table_len)
        needed = new * self.num_groups + self._copies_needed(seq)
        # cached hits that sit in the free pool leave it when they are taken
        return needed + sum(1 for b in held if self.blocks[b].ref_count == 0)

    def _as_hit(self, hits: PrefixHit | Seq[int]) -> PrefixHit:
        if isinstance(hits, PrefixHit):
            return hits
        assert self.num_groups == 1 or not hits, "a plain list of hits is one group's"
        return PrefixHit([list(hits)] + [[] for _ in self.windows[1:]], [0] * self.num_groups)

    def _copies_needed(self, seq: Sequence) -> int:
        i = seq.num_computed_tokens // self.block_size
        return sum(
            1 for table in seq.tables if i < len(table) and self.blocks[table[i]].ref_count > 1
        )

    def can_schedule(
        self, seq: Sequence, num_new_tokens: int, hits: PrefixHit | Seq[int] = ()
    ) -> bool:
        return self.blocks_needed(seq, num_new_tokens, hits) <= self.num_free_blocks

    def admit(self, seq: Sequence, hits: PrefixHit | Seq[int]) -> None:
        """Start `seq` from the cached blocks `hits` (its tables must be empty)."""
        assert not seq.block_table, "admit() is for a sequence that holds no blocks"
        hit = self._as_hit(hits)
        for table, released in zip(hit.tables, hit.released, strict=True):
            for block_id in table[released:]:
                self._acquire(block_id)
        seq.tables = [list(table) for table in hit.tables]
        seq.released = list(hit.released)
        seq.num_computed_tokens = len(hit) * self.block_size
        seq.num_registered_blocks = len(hit)

    def reserve(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for the KV of the next `num_new_tokens` tokens; False if the pool is short.

        A shared block about to be written is first copied (copy-on-write): the copy is queued
        in `pending_copies` for the model runner.
        """
        tables, computed, bs = seq.tables, seq.num_computed_tokens, self.block_size
        if num_new_tokens > 0 and computed + num_new_tokens <= len(tables[0]) * bs:
            i, blocks = computed // bs, self.blocks
            for table in tables:
                if blocks[table[i]].ref_count != 1:
                    break
            else:  # most decode steps: the tokens go into blocks it already holds, alone
                return True
        if not self.can_schedule(seq, num_new_tokens):
            return False
        i = computed // bs
        for table in tables:
            if i < len(table) and self.blocks[table[i]].ref_count > 1:
                src, dst = table[i], self._take_free()
                self._release(src)
                table[i] = dst
                self.pending_copies.append((src, dst))
        target = cdiv(computed + num_new_tokens, bs)
        for table in tables:
            while len(table) < target:
                table.append(self._take_free())
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let `child` share every block of `parent` (copied on first write)."""
        for table, released in zip(parent.tables, parent.released, strict=True):
            for block_id in table[released:]:
                self._acquire(block_id)
        child.tables = [list(table) for table in parent.tables]
        child.released = list(parent.released)
        child.block_keys = list(parent.block_keys)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_registered_blocks = parent.num_registered_blocks

    def release_outside_window(self, seq: Sequence) -> None:
        """Give back the blocks of `seq` that lie wholly before the window of every query it
        will still compute (from position `num_computed_tokens` on), in each windowed group."""
        for g, window in enumerate(self.windows):
            if window is None:
                continue
            table = seq.tables[g]
            end = min(self._first_in_window(seq.num_computed_tokens, window), len(table))
            for i in range(seq.released[g], end):
                self._release(table[i])
                table[i] = NULL_BLOCK
            seq.released[g] = max(seq.released[g], end)

    def free(self, seq: Sequence) -> None:
        # tail blocks first, so a sequence's shared head outlives its private tail in the LRU
        for table, released in zip(seq.tables, seq.released, strict=True):
            for block_id in reversed(table[released:]):
                self._release(block_id)
        seq.tables = [[] for _ in self.windows]
        seq.released = [0] * self.num_groups
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies
