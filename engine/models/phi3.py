"""Phi-3 and Phi-4 (their dense checkpoints name `Phi3ForCausalLM`)."""

from conveyor.engine.models.decoder import DecoderForCausalLM


class Phi3ForCausalLM(DecoderForCausalLM):
    """Llama's decoder whose checkpoint stores q, k and v as one `qkv_proj` and gate and up as
    one `gate_up_proj`, in the order our packed projections use. The long-context checkpoints
    (Phi-3-*-128k, Phi-3.5, Phi-4-mini) use LongRoPE (`layers.LongRope`), and Phi-4-mini
    turns only part of each head (`partial_rotary_factor`)."""

    fused_checkpoint = True
