"""Phi-3 and Phi-4 (their dense checkpoints name `Phi3ForCausalLM`)."""

from conveyor.engine.models.decoder import DecoderForCausalLM


class Phi3ForCausalLM(DecoderForCausalLM):
    """Llama's decoder whose checkpoint stores q, k and v as one `qkv_proj` and gate and up as
    one `gate_up_proj`, in the order our packed projections use; rope over whole heads (a
    `partial_rotary_factor` below 1, as Phi-4-mini's, and LongRoPE are refused at load)."""

    fused_checkpoint = True
