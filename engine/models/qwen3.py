"""Qwen3 (dense)."""

from conveyor.engine.models.decoder import QK_NORM_PER_HEAD, DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Llama's decoder with an RMSNorm on each head's queries and keys before rope."""

    qk_norm = QK_NORM_PER_HEAD
