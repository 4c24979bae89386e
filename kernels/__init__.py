"""Paged attention backends. `torch` is the reference (CPU path, test oracle); `compiled` is
the same on the CPU with its decode compiled by torch.compile; `triton` is CUDA."""

from __future__ import annotations

import os
from typing import Protocol

import torch

from kernels import cascade, torch_paged
from kernels.metadata import AttentionMetadata

BACKENDS = ("auto", "torch", "compiled", "triton")


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
    cascade = True  # reads a prefix shared by many sequences once for all (kernels.cascade)
    decode_attention = staticmethod(torch_paged.decode_attention)

    def forward(self, query, key, value, k_cache, v_cache, meta, scale):  # noqa: D102
        torch_paged.write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        plan = meta.cascade
        if plan is None:
            return self._attend(query, key, value, k_cache, v_cache, meta, scale, False)[0]
        out, lse = self._attend(query, key, value, k_cache, v_cache, plan.suffix, scale, True)
        for prefix in plan.prefixes:
            cascade.merge_prefix(out, lse, query, k_cache, v_cache, prefix, scale)
        return out

    def _attend(self, query, key, value, k_cache, v_cache, meta, scale, return_lse):
        """Attention of every query over the cache `meta` describes, and with `return_lse`
        the log-sum-exp of its scores (else None)."""
        d = meta.num_decode_tokens
        parts = []
        if d:
            parts.append(
                self.decode_attention(
                    query[:d],
                    k_cache,
                    v_cache,
                    meta.decode_block_tables,
                    meta.decode_context_lens,
                    scale,
                    return_lse=return_lse,
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
                    key[d:],  # a prompt with nothing cached attends to these, no gather
                    value[d:],
                    return_lse=return_lse,
                )
            )
        if not return_lse:
            return (parts[0] if len(parts) == 1 else torch.cat(parts)), None
        if len(parts) == 1:
            return parts[0]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


class CompiledPagedAttention(TorchPagedAttention):
    """The torch path with its decode attention compiled (CPU): no gathered K/V copies."""

    name = "compiled"

    def __init__(self) -> None:
        from kernels import compiled_paged

        if problem := compiled_paged.compiler_missing():
            raise ValueError(f"attention_backend='compiled' needs inductor's C++ build: {problem}")
        self.decode_attention = compiled_paged.decode_attention


class TritonPagedAttention:
    """The CUDA path: Triton kernels that read and write the KV pages in place."""

    name = "triton"

    def __init__(self) -> None:
        from kernels import triton_paged

        self.kernels = triton_paged

    def forward(self, query, key, value, k_cache, v_cache, meta, scale):  # noqa: D102
        tk = self.kernels
        tk.store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        d = meta.num_decode_tokens
        out = torch.empty_like(query)
        if d:
            tk.paged_decode_attention(
                query[:d],
                k_cache,
                v_cache,
                meta.decode_block_tables,
                meta.decode_context_lens,
                scale,
                max_context_len=meta.decode_max_context_len or None,
                out=out[:d],
            )
        if meta.num_prefills:
            query_start, context_lens = (
                meta.prefill_query_start_tensor,
                meta.prefill_context_lens_tensor,
            )
            if query_start is None or context_lens is None:
                query_start = torch.tensor(meta.prefill_query_start, device=query.device)
                context_lens = torch.tensor(meta.prefill_context_lens, device=query.device)
            tk.paged_prefill_attention(
                query[d:],
                k_cache,
                v_cache,
                meta.prefill_block_tables,
                query_start,
                context_lens,
                scale,
                max_query_len=meta.prefill_max_query_len or None,
                out=out[d:],
            )
        return out


def triton_available(device: torch.device) -> bool:
    """Whether the Triton kernels can run on `device` (CUDA, or the CPU interpreter)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "auto":
        name = "triton" if device.type == "cuda" and triton_available(device) else "torch"
    if name == "torch":
        return TorchPagedAttention()
    if name == "compiled":
        if device.type != "cpu":
            raise ValueError("attention_backend='compiled' is for the CPU; on CUDA use 'triton'")
        return CompiledPagedAttention()
    try:
        import triton  # noqa: F401
    except ImportError:
        raise ValueError(
            "attention_backend='triton' needs the triton package: pip install 'conveyor[gpu]'"
        ) from None
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"attention_backend='triton' runs on CUDA devices; on {device.type} it needs Triton's "
            "interpreter: set TRITON_INTERPRET=1 before starting (slow, for testing), or use "
            "attention_backend='torch'"
        )
    return TritonPagedAttention()


__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "CompiledPagedAttention",
    "TorchPagedAttention",
    "TritonPagedAttention",
    "get_attention_backend",
    "triton_available",
]
