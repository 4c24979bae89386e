"""Property tests: random interleavings of allocate / append / fork / free on the block manager.

A shadow cache stores, for every slot, the token whose KV would be there. Each step checks the
reference counts against the live block tables, and that every live sequence reads back exactly
its own tokens through each of its block tables (which catches a missed copy-on-write or a bad
cache hit), with one KV group, one windowed group, and a full and a windowed group side by side.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from conveyor.engine.block_manager import NULL_BLOCK, BlockManager
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.sequence import Request, Sequence

BLOCK_SIZE = 4
NUM_BLOCKS = 24
# a tiny alphabet and shared stems make prefix-cache hits common
tokens = st.lists(st.integers(0, 2), min_size=1, max_size=14)
stems = st.sampled_from([[], [1, 1, 1, 1], [2, 0, 2, 0, 1, 1, 1, 1]])


class BlockManagerMachine(RuleBasedStateMachine):
    windows: tuple[int | None, ...] = (None,)  # each KV group's sliding window, or None

    def __init__(self):
        super().__init__()
        self.windowed = any(w is not None for w in self.windows)
        reserved = self.windowed  # NULL_BLOCK
        self.bm = BlockManager(NUM_BLOCKS + reserved, BLOCK_SIZE, enable_prefix_caching=True,
                               windows=self.windows)  # fmt: skip
        self.slots: dict[int, int] = {}  # slot -> token whose KV it holds
        self.live: list[Sequence] = []

    def _compute(self, seq: Sequence, num_new: int) -> bool:
        """Reserve and 'compute' the next `num_new` tokens, as the engine's step does."""
        if not self.bm.reserve(seq, num_new):
            return False
        for src, dst in self.bm.take_pending_copies():
            for off in range(BLOCK_SIZE):
                if src * BLOCK_SIZE + off in self.slots:
                    self.slots[dst * BLOCK_SIZE + off] = self.slots[src * BLOCK_SIZE + off]
        start = seq.num_computed_tokens
        for table in seq.tables:
            for pos in range(start, start + num_new):
                slot = table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
                self.slots[slot] = seq.token_ids[pos]
        seq.num_computed_tokens += num_new
        self.bm.register_computed_blocks(seq)
        self.bm.release_outside_window(seq)
        return True

    @rule(stem=stems, body=tokens)
    def allocate(self, stem, body):
        ids = stem + body
        seq = Sequence(Request("r", None, ids, SamplingParams()), 0, list(ids), len(ids))
        hits = self.bm.match_prefix(seq)
        assert len(hits) * BLOCK_SIZE < len(ids), "a hit must leave a token to compute"
        num_new = len(ids) - len(hits) * BLOCK_SIZE
        if not self.bm.can_schedule(seq, num_new, hits):
            return
        self.bm.admit(seq, hits)
        assert self._compute(seq, num_new)
        self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), token=st.integers(0, 2))
    def append(self, i, token):
        seq = self.live[i % len(self.live)]
        seq.token_ids.append(token)
        if not self._compute(seq, 1):
            seq.token_ids.pop()  # the engine would preempt instead; here we just skip

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def fork(self, i):
        parent = self.live[i % len(self.live)]
        child = Sequence(parent.request, 1, list(parent.token_ids), parent.num_prompt_tokens)
        self.bm.fork(parent, child)
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        seq = self.live.pop(i % len(self.live))
        self.bm.free(seq)
        assert seq.tables == [[]] * len(self.windows)

    @invariant()
    def ref_counts_match_tables(self):
        held = Counter(
            b for seq in self.live for table in seq.tables for b in table if b != self._null()
        )
        for block in self.bm.blocks:
            if block.block_id == self._null():
                assert block.ref_count == 1 and block.block_id not in self.bm._free
                continue
            assert block.ref_count == held[block.block_id]
            assert (block.ref_count == 0) == (block.block_id in self.bm._free)
        assert self.bm.num_free_blocks == NUM_BLOCKS - len(held)

    @invariant()
    def cache_index_is_consistent(self):
        for key, block_id in self.bm.cached.items():
            assert self.bm.blocks[block_id].key == key

    def _null(self) -> int | None:
        return NULL_BLOCK if self.windowed else None

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        """... at every position its next query sees in each group (all of them without a
        window); the blocks wholly before that were given back."""
        for seq in self.live:
            assert len({len(table) for table in seq.tables}) == 1, "tables grow together"
            for table, window in zip(seq.tables, self.windows, strict=True):
                first = 0 if window is None else max(0, seq.num_computed_tokens - window + 1)
                released = first // BLOCK_SIZE
                assert table[:released] == [self._null()] * released
                for pos in range(first, seq.num_computed_tokens):
                    slot = table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
                    assert self.slots.get(slot) == seq.token_ids[pos], (seq.seq_id, pos)

    def teardown(self):
        for seq in self.live:
            self.bm.free(seq)
        assert all(b.ref_count == 0 for b in self.bm.blocks if b.block_id != self._null())
        assert self.bm.num_free_blocks == NUM_BLOCKS


class WindowedBlockManagerMachine(BlockManagerMachine):
    """Every layer windowed (6 tokens, blocks of 4): blocks before the window go back."""

    windows = (6,)


class HybridBlockManagerMachine(BlockManagerMachine):
    """A full-attention group beside a windowed one (Gemma's local and global layers), from
    one pool: the windowed group's blocks before its window go back, and a prefix hit needs
    only the windowed group's blocks inside the window of its first token to compute."""

    windows = (None, 6)


TestBlockManager = BlockManagerMachine.TestCase
TestBlockManager.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestWindowedBlockManager = WindowedBlockManagerMachine.TestCase
TestWindowedBlockManager.settings = settings(max_examples=200, stateful_step_count=40,
                                             deadline=None)  # fmt: skip
TestHybridBlockManager = HybridBlockManagerMachine.TestCase
TestHybridBlockManager.settings = settings(max_examples=200, stateful_step_count=40,
                                           deadline=None)  # fmt: skip


def test_double_free_is_caught():
    bm = BlockManager(4, BLOCK_SIZE)
    seq = Sequence(Request("r", None, [1, 2], SamplingParams()), 0, [1, 2], 2)
    bm.admit(seq, [])
    assert bm.reserve(seq, 2)
    block = seq.block_table[0]
    bm.free(seq)
    try:
        bm._release(block)
    except AssertionError:
        pass
    else:
        raise AssertionError("releasing a free block must fail")


def test_lru_evicts_least_recently_freed_cached_block():
    bm = BlockManager(5, 2)
    seqs = []
    for first in (10, 20):
        seq = Sequence(Request("r", None, [first, 1, 2], SamplingParams()), 0, [first, 1, 2], 3)
        bm.admit(seq, [])
        assert bm.reserve(seq, 3)
        seq.num_computed_tokens = 3
        bm.register_computed_blocks(seq)
        seqs.append(seq)
    bm.free(seqs[0])  # freed first: its cached block is evicted first
    bm.free(seqs[1])
    probe = [
        Sequence(Request("p", None, t, SamplingParams()), 0, t, 3) for t in ([10, 1, 2], [20, 1, 2])
    ]
    assert bm.match_prefix(probe[0]) and bm.match_prefix(probe[1])
    taker = Sequence(Request("t", None, [7] * 8, SamplingParams()), 0, [7] * 8, 8)
    bm.admit(taker, [])
    assert bm.reserve(taker, 8)  # four blocks: the three uncached ones, then the LRU cached one
    assert not bm.match_prefix(probe[0])
    assert bm.match_prefix(probe[1])
