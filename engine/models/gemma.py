"""Gemma 2 and Gemma 3 (text): the same layer of four (1 + w) norms; Gemma 3 adds per-head q/k
norms and a rope base of its own for the local layers, Gemma 2 caps the attention scores."""

from __future__ import annotations

import torch
from torch import nn

from conveyor.engine.models.decoder import QK_NORM_PER_HEAD, Attention, DecoderForCausalLM
from conveyor.engine.models.layers import RMSNorm, triton_layers


class GemmaRMSNorm(RMSNorm):
    """RMSNorm that scales by (1 + weight) and rounds once, at the end, from float32 (Gemma's;
    Llama's rounds before its scale). Always eager: the fused kernels are Llama's."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        total = x + residual
        return self._norm(total), total

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class Gemma2Attention(Attention):
    """Attention scaled by `query_pre_attn_scalar`^-1/2 (its scores capped where the config
    has `attn_logit_softcapping`, as `Attention` reads it)."""

    def __init__(self, config, qk_norm, qkv_bias):
        super().__init__(config, qk_norm, qkv_bias)
        self.scale = config.query_pre_attn_scalar**-0.5


class Gemma3Attention(Gemma2Attention):
    """Gemma 2's attention with Gemma's (1 + w) norms on each head's queries and keys."""

    def __init__(self, config, qk_norm, qkv_bias):
        super().__init__(config, qk_norm, qkv_bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)

    def _norm_rope_in_place(self, rope, q, k):
        fused = triton_layers()
        return fused.norm_rope_(self.q_norm(q), *rope), fused.norm_rope_(self.k_norm(k), *rope)


class GemmaDecoderLayer(nn.Module):
    """Four norms: before and after attention, before and after the MLP, each output norm on
    what the sublayer adds to the residual stream."""

    attention_class: type[Attention] = Gemma2Attention

    def __init__(self, config, qk_norm, qkv_bias, mlp):
        super().__init__()
        self.self_attn = self.attention_class(config, qk_norm, qkv_bias)
        self.mlp = mlp
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, rope, x, residual, kv_cache, meta, backend, keep_rows=None):
        """As `DecoderLayer.forward`: (what this layer adds to the stream, the stream before
        it), the stream being `x + residual` (x alone on the first layer)."""
        if residual is None:
            h, stream = self.input_layernorm(x), x
        else:
            h, stream = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(rope, h, kv_cache, meta, backend))
        if keep_rows is not None:
            h, stream = h.index_select(0, keep_rows), stream.index_select(0, keep_rows)
        h, stream = self.pre_feedforward_layernorm(h, stream)
        return self.post_feedforward_layernorm(self.mlp(h)), stream


class Gemma3DecoderLayer(GemmaDecoderLayer):
    attention_class = Gemma3Attention


class Gemma2ForCausalLM(DecoderForCausalLM):
    """Gemma 2: sliding-window layers between global ones (`layer_types`), attention scaled by
    `query_pre_attn_scalar` with its scores soft-capped (`attn_logit_softcapping`), (1 + w)
    RMSNorms before and after each sublayer, embeddings scaled by the square root of the
    width, GeGLU (tanh), and the logits soft-capped (`final_logit_softcapping`)."""

    layer_class = GemmaDecoderLayer
    norm_class = GemmaRMSNorm

    @classmethod
    def embed_scale(cls, config) -> float:
        return config.hidden_size**0.5


class Gemma3ForCausalLM(DecoderForCausalLM):
    """Gemma 3's text decoder: sliding-window layers with their own rope base between global
    ones (`layer_types`), per-head q/k norms, attention scaled by `query_pre_attn_scalar`,
    (1 + w) RMSNorms before and after each sublayer, embeddings scaled by the square root of
    the width, GeGLU (tanh), and the logits soft-capped where the config says."""

    qk_norm = QK_NORM_PER_HEAD
    layer_class = Gemma3DecoderLayer
    norm_class = GemmaRMSNorm

    @classmethod
    def embed_scale(cls, config) -> float:
        return config.hidden_size**0.5
