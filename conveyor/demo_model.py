"""Write a tiny random-weight checkpoint (config, safetensors, tokenizer) for offline use.

The weights are initialised with a larger std than transformers' default so the top logits are
well separated: greedy decoding then has no near-ties and is reproducible across implementations.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

# a MoE router's weights: spread widely, so that the experts' scores rarely tie and rounding
# (bfloat16, another summation order) seldom changes which experts a token gets
ROUTER_INIT_STD = 0.5

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = """
Conveyor runs large offline evaluation jobs. Upload a file of prompts, poll its status, and
download the results. The engine keeps the key and value cache in fixed-size blocks, shares the
blocks of a common system prompt between requests, and batches requests continuously so that a
finished sequence makes room for a waiting one at once. You are a helpful assistant. Answer the
question briefly and precisely. What is the capital of France? Paris is the capital of France.
Translate the sentence into German. Summarise the following paragraph in one sentence. Write a
short poem about the sea. The quick brown fox jumps over the lazy dog. 0123456789 + - * / = ( )
"""


def build_tokenizer(vocab_size: int = 512, texts: Iterable[str] | None = None) -> Any:
    """A byte-level BPE tokenizer trained on a small built-in text (or on `texts`), with a
    ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4 if texts is None else texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


# each family's tiny shape: its transformers config class and what differs from `SIZES`
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=True, head_dim=32)),
    "mixtral": ("MixtralConfig", dict(tie_word_embeddings=False, sliding_window=None,
                                      num_local_experts=4, num_experts_per_tok=2)),
    "olmo2": ("Olmo2Config", dict(tie_word_embeddings=False, pad_token_id=0, bos_token_id=None,
                                  eos_token_id=0)),
    "phi3": ("Phi3Config", dict(tie_word_embeddings=False, sliding_window=None, pad_token_id=0,
                                bos_token_id=None, eos_token_id=0)),
    # a local (windowed) layer, then a global one; a cap low enough to change the scores
    "gemma2": ("Gemma2Config", dict(
        tie_word_embeddings=True, head_dim=32, query_pre_attn_scalar=24, sliding_window=16,
        attn_logit_softcapping=2.0, final_logit_softcapping=30.0, pad_token_id=0,
        bos_token_id=None, eos_token_id=0)),
    # a local (windowed) layer, then a global one with scaled rope of another base
    "gemma3": ("Gemma3TextConfig", dict(
        tie_word_embeddings=True, head_dim=32, query_pre_attn_scalar=24, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        },
        final_logit_softcapping=30.0, pad_token_id=0, bos_token_id=None, eos_token_id=0)),
    # the first layer dense, the second with experts
    "qwen2_moe": ("Qwen2MoeConfig", dict(
        tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=96, mlp_only_layers=[0])),
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        tie_word_embeddings=True, head_dim=32, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True)),
}  # fmt: skip
ARCHITECTURES = tuple(sorted(FAMILIES))

SIZES: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
)


def model_config(arch: str, vocab_size: int, **overrides: Any) -> Any:
    import transformers

    if arch not in FAMILIES:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {ARCHITECTURES}")
    class_name, family = FAMILIES[arch]
    return getattr(transformers, class_name)(
        **{**SIZES, "vocab_size": vocab_size, **family, **overrides}
    )


def write_tiny_model(
    path: str | Path,
    arch: str = "llama",
    *,
    with_tokenizer: bool = True,
    init_std: float = 0.08,
    seed: int = 0,
    dtype: str = "float32",
    **config_overrides: Any,
) -> Path:
    """Save a random-weight `arch` model (and tokenizer) under `path` and return the path; its
    weights drawn in float32 and saved in `dtype` (real checkpoints ship in bfloat16)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer() if with_tokenizer else None
    default_vocab = len(tokenizer) if tokenizer is not None else 512
    vocab_size = config_overrides.pop("vocab_size", default_vocab)
    if tokenizer is not None and vocab_size < len(tokenizer):
        raise ValueError(
            f"vocab_size {vocab_size} is smaller than the tokenizer's {len(tokenizer)}"
        )
    config = model_config(arch, vocab_size, **config_overrides)
    eos = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]) if tokenizer else [1]
    config.eos_token_id = eos[0]
    config.bos_token_id = None
    config.pad_token_id = eos[-1]

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # a MoE router: rare near-ties between experts
                param.normal_(0.0, ROUTER_INIT_STD)
            elif param.dim() >= 2 or name.endswith("bias"):
                param.normal_(0.0, init_std)
            else:  # norm weights: keep near one, but not exactly, so a wrong norm shows
                param.uniform_(0.8, 1.2)
    model.generation_config = GenerationConfig(
        eos_token_id=eos, pad_token_id=eos[-1], do_sample=False
    )
    model.to(getattr(torch, dtype)).save_pretrained(path, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path
