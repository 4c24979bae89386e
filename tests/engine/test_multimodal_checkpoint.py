"""A multimodal checkpoint whose language model the engine runs (Gemma 3's 4B and larger ship
as `Gemma3ForConditionalGeneration`) is served text-only: its language model's weights load
from under their prefix, the vision tower's are left, and greedy output equals transformers'
on text prompts."""

from __future__ import annotations

import logging

import torch

from conveyor.demo_model import SPECIAL_TOKENS, build_tokenizer
from conveyor.engine import LLM, SamplingParams
from tests.hf_reference import random_prompts


def write_gemma3_multimodal(path):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tokenizer = build_tokenizer()
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                eos_token_id=tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS[2]))  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=32, patch_size=8)  # fmt: skip
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          image_token_index=len(tokenizer) - 1)  # fmt: skip
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.08)
            else:
                param.uniform_(-0.2, 0.2)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model.eval()


def test_gemma3_conditional_generation_serves_its_language_model(tmp_path, caplog):
    hf = write_gemma3_multimodal(tmp_path / "gemma3-mm")
    with caplog.at_level(logging.WARNING, logger="conveyor.engine.loader"):
        llm = LLM(str(tmp_path / "gemma3-mm"), device="cpu", dtype="float32")
    assert "requests with images are not served" in caplog.text
    assert type(llm.runner.model).__name__ == "Gemma3ForCausalLM"
    prompts = random_prompts(5, 4, 60, seed=12)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
        assert out.outputs[0].token_ids == want[0, len(prompt) :].tolist()
