"""Qwen2 and Qwen2.5."""

from conveyor.engine.models.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Llama's decoder with biases on the q, k and v projections."""

    qkv_bias = True
