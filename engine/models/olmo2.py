"""OLMo 2."""

from __future__ import annotations

from torch import nn

from conveyor.engine.models.decoder import QK_NORM_FULL_WIDTH, Attention, DecoderForCausalLM
from conveyor.engine.models.layers import RMSNorm


class Olmo2DecoderLayer(nn.Module):
    """Norms after attention and after the MLP, on their outputs, before each joins the
    residual stream; none before them."""

    def __init__(self, config, qk_norm, qkv_bias, mlp):
        super().__init__()
        self.self_attn = Attention(config, qk_norm, qkv_bias)
        self.mlp = mlp
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope, x, residual, kv_cache, meta, backend, keep_rows=None):
        """As `DecoderLayer.forward`: (what this layer adds to the stream, the stream before
        it), the stream being `x + residual` (x alone on the first layer)."""
        stream = x if residual is None else x + residual
        h = self.post_attention_layernorm(self.self_attn(rope, stream, kv_cache, meta, backend))
        if keep_rows is not None:
            h, stream = h.index_select(0, keep_rows), stream.index_select(0, keep_rows)
        stream = stream + h
        return self.post_feedforward_layernorm(self.mlp(stream)), stream


class Olmo2ForCausalLM(DecoderForCausalLM):
    """Llama's attention and SwiGLU with RMSNorm over the whole q and k projections before
    rope, and each sublayer's norm on its output (after attention, after the MLP) instead of
    its input."""

    qk_norm = QK_NORM_FULL_WIDTH
    layer_class = Olmo2DecoderLayer
