"""Llama (and Mistral, which has its layout): the shared decoder as it is."""

from conveyor.engine.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """The shared decoder as it is: RMSNorm before attention and MLP, rope (default, linear,
    llama3 or yarn scaling), grouped-query attention, SwiGLU, tied or untied embeddings."""
