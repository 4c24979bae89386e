"""Paged attention backends. `torch` is the reference (CPU path, test oracle); `triton` is CUDA."""

from __future__ import annotations

from typing import Protocol

import torch

from kernels import torch_paged
from kernels.metadata import AttentionMetadata

BACKENDS = ("auto", "torch", "triton")


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
    ) -> torch.Tensor:
        """Write this step's K/V into the caches, then attend; returns [T, heads, head_dim]."""
        ...


class TorchPagedAttention:
    name = "torch"

    def forward(self, query, key, value, k_cache, v_cache, meta, scale):  # noqa: D102
        torch_paged.write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        d = meta.num_decode_tokens
        parts = []
        if d:
            parts.append(
                torch_paged.decode_attention(
                    query[:d],
                    k_cache,
                    v_cache,
                    meta.decode_block_tables,
                    meta.decode_context_lens,
                    scale,
                )
            )
        if meta.num_prefills:
            parts.append(
                torch_paged.prefill_attention(
                    query[d:],
                    k_cache,
                    v_cache,
                    meta.prefill_block_tables,
                    meta.prefill_query_start,
                    meta.prefill_context_lens,
                    scale,
                )
            )
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "triton":
        raise NotImplementedError(
            "the Triton paged-attention backend is not available in this version; "
            "use attention_backend='torch'"
        )
    return TorchPagedAttention()


__all__ = ["AttentionBackend", "AttentionMetadata", "TorchPagedAttention", "get_attention_backend"]
