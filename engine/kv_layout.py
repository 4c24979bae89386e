"""Which KV cache tensor and which block table each layer uses: one group of layers per
attention kind, so that a model mixing sliding-window and global layers (Gemma 2 and 3, Qwen2
with `max_window_layers`) gives back the blocks its windowed layers no longer read.

As vLLM's hybrid KV cache manager does: the layers of each kind (a window size, or full
attention) are cut into groups of `num_slots` layers, `num_slots` being the size of the
smallest kind; a block id stands for one block of `num_slots` layers, and layer j of every
group reads and writes cache tensor j. Each group has a block table of its own per sequence,
drawn from one pool, so a group's blocks are ids that no other group holds at the same time,
and the windowed groups hold only about a window of blocks however long a sequence grows.

Gemma 3 (5 local layers to 1 global, window 512-1024) then costs about a sixth of a full cache
per token of a long context. A model with one kind of attention is one group of all its layers,
as without groups; so is every model when the hybrid layout is turned off.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVLayout:
    windows: tuple[int | None, ...]  # each group's sliding window, None for full attention
    layer_group: tuple[int, ...]  # each layer's group
    layer_slot: tuple[int, ...]  # each layer's cache tensor
    num_slots: int  # cache tensors: the layers one block id holds

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def hybrid(self) -> bool:
        return self.num_groups > 1

    @classmethod
    def single(cls, layer_windows: list[int | None]) -> KVLayout:
        """Every layer in one group, under the largest window when every layer has one."""
        window = None if None in layer_windows else max(layer_windows)
        n = len(layer_windows)
        return cls((window,), (0,) * n, tuple(range(n)), n)

    @classmethod
    def of(cls, layer_windows: list[int | None], hybrid: bool = True) -> KVLayout:
        """The layout for layers with these windows: grouped by kind where kinds mix (and
        `hybrid`), else one group."""
        kinds = sorted(set(layer_windows), key=lambda w: (w is not None, w or 0))  # full first
        if not hybrid or len(kinds) == 1:
            return cls.single(layer_windows)
        members = {kind: [i for i, w in enumerate(layer_windows) if w == kind] for kind in kinds}
        size = min(len(layers) for layers in members.values())
        windows: list[int | None] = []
        group = [0] * len(layer_windows)
        slot = [0] * len(layer_windows)
        for kind in kinds:
            layers = members[kind]
            for start in range(0, len(layers), size):
                for j, layer in enumerate(layers[start : start + size]):
                    group[layer], slot[layer] = len(windows), j
                windows.append(kind)
        return cls(tuple(windows), tuple(group), tuple(slot), size)

    def block_bytes(self, layer_block_bytes: int) -> int:
        """What one block id holds, given what one layer's block holds."""
        return self.num_slots * layer_block_bytes

    def context_token_bytes(self, layer_token_bytes: int) -> int:
        """What one more token of a long context holds: in a hybrid layout, only in the
        full-attention groups' layers (the windowed ones keep a window's worth); else in every
        layer."""
        full = sum(1 for w in self.windows if w is None)
        layers = full * self.num_slots if self.hybrid and full else len(self.layer_slot)
        return layers * layer_token_bytes
