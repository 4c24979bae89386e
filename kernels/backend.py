"""What the engine asks of a paged attention backend."""

from __future__ import annotations

from typing import Protocol

import torch

from conveyor.kernels.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        query: torch.Tensor,  # [T, heads, head_dim]
        key: torch.Tensor,  # [T, kv_heads, head_dim]
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Write this step's K/V into the caches, then attend, each query to the keys at its
        position and before (the last `window` of them, where the layer has a sliding window;
        each scaled score s as softcap * tanh(s / softcap) where the layer caps them);
        returns [T, heads, head_dim]."""
        ...
