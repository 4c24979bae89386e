"""Checkpoint loading: clear errors for what cannot be loaded."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conveyor.engine import LLM


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_weight_is_named(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints["llama"], tmp_path / "m")
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ValueError, match="lacks weights: model.layers.1.self_attn.k_proj.weight"):
        LLM(str(path), dtype="float32", device="cpu")


def test_wrong_shape_is_named(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints["qwen2"], tmp_path / "m")
    weights = load_file(path / "model.safetensors")
    weights["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ValueError, match="'model.layers.0.mlp.up_proj.weight' has shape"):
        LLM(str(path), dtype="float32", device="cpu")


def test_unsupported_architecture(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints["llama"], tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        LLM(str(path), dtype="float32", device="cpu")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"architectures": ["FooForCausalLM"], "model_type": "foo"},
         "unsupported architecture 'FooForCausalLM' (model type 'foo') in .*; supported: "
         ".*LlamaForCausalLM"),
        ({"architectures": ["LlamaForCausalLM"], "model_type": "llama_next"},
         "cannot read .* (model type 'llama_next', architecture 'LlamaForCausalLM'); a newer "
         "transformers may"),
        ("{not json", "config.json cannot be read as a model's config"),
    ],
)  # fmt: skip
def test_a_config_transformers_cannot_read_is_refused_in_our_words(tmp_path, config, message):
    """A model type transformers does not know is refused as an architecture this engine does
    not run (with the list it does), or, for one it runs, as needing a newer transformers."""
    path = tmp_path / "m"
    path.mkdir()
    (path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LLM(str(path), dtype="float32", device="cpu")


def test_unknown_model_name_fails_clearly(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="neither a local directory nor a reachable hub"):
        LLM("nobody-at-all/no-such-model", dtype="float32", device="cpu")


@pytest.mark.parametrize("name", ["/abs/no-such-model", "./no-such-model", "a/b/no-such-model"])
def test_a_missing_directory_is_not_looked_up_on_the_hub(monkeypatch, tmp_path, name):
    """A path no hub id can be ("owner/name" at most) names a missing directory in so many
    words, not with the hub client's complaint about repository ids."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=f"^model directory '{name}' does not exist$"):
        LLM(name, dtype="float32", device="cpu")


def test_rope_scaling_from_the_config_is_applied(tmp_path):
    """A llama3-style rope_scaling changes outputs, and still matches transformers."""
    from conveyor.demo_model import write_tiny_model
    from conveyor.engine import SamplingParams
    from tests.hf_reference import hf_greedy

    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    path = write_tiny_model(tmp_path / "m", "llama", rope_parameters=rope)
    prompt = list(range(3, 200))
    out = LLM(str(path), dtype="float32", device="cpu").generate(
        [prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
    )[0]
    assert out.outputs[0].token_ids == hf_greedy(path, prompt, 8)


def edited_config(src, dst, **changes):
    path = copy_checkpoint(src, dst)
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("method", ["awq", "gptq", "fp8", "bitsandbytes"])
def test_a_quantized_checkpoint_is_refused_not_loaded_as_garbage(checkpoints, tmp_path, method):
    quantization = {"quant_method": method, "bits": 4}
    path = edited_config(checkpoints["llama"], tmp_path / "m", quantization_config=quantization)
    with pytest.raises(ValueError, match=f"is a quantized checkpoint \\({method}\\)"):
        LLM(str(path), dtype="float32", device="cpu")


def test_a_rope_that_changes_with_every_length_is_refused(checkpoints, tmp_path):
    rope = {"rope_type": "dynamic", "factor": 2.0}
    path = edited_config(
        checkpoints["llama"], tmp_path / "m", rope_scaling=rope, rope_parameters=None
    )
    with pytest.raises(ValueError, match="rope type 'dynamic' .* is not implemented"):
        LLM(str(path), dtype="float32", device="cpu")


def test_a_sharded_checkpoint_loads_by_its_index_beside_other_weights(checkpoints, tmp_path):
    """Shards named by `model.safetensors.index.json` load as the one file does, and a
    `consolidated.safetensors` in Mistral's own format beside them is not read."""
    from transformers import AutoModelForCausalLM

    from conveyor.engine import SamplingParams

    src = checkpoints["llama"]
    sharded = copy_checkpoint(src, tmp_path / "sharded")
    (sharded / "model.safetensors").unlink()
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.save_pretrained(sharded, max_shard_size="100KB", safe_serialization=True)
    shards = sorted(sharded.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and (sharded / "model.safetensors.index.json").exists()
    save_file(
        {"layers.0.attention.wk.weight": torch.zeros(2, 2)}, sharded / "consolidated.safetensors"
    )

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = [[5, 9, 13, 2, 7]]
    want = LLM(str(src), dtype="float32", device="cpu").generate(prompt, params, use_tqdm=False)
    got = LLM(str(sharded), dtype="float32", device="cpu").generate(prompt, params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids


def test_a_fused_checkpoint_loads_its_packed_weights_and_names_a_missing_one(checkpoints, tmp_path):
    """Phi-3 stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`."""
    path = copy_checkpoint(checkpoints["phi3"], tmp_path / "m")
    weights = load_file(path / "model.safetensors")
    assert "model.layers.0.self_attn.qkv_proj.weight" in weights
    del weights["model.layers.1.mlp.gate_up_proj.weight"]
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ValueError, match="lacks weights: model.layers.1.mlp.gate_up_proj.weight"):
        LLM(str(path), dtype="float32", device="cpu")


def test_rope_over_an_odd_number_of_channels_is_refused(checkpoints, tmp_path):
    """Rope turns channel pairs: a `partial_rotary_factor` that leaves an odd count of a head's
    channels (9 of 16 here) names no model transformers can run either."""
    path = copy_checkpoint(checkpoints["phi3"], tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["partial_rotary_factor"] = 9 / 16
    config.get("rope_parameters", {}).pop("partial_rotary_factor", None)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="leaves 9 of each head's 16 channels to rope"):
        LLM(str(path), dtype="float32", device="cpu")


def test_a_multimodal_checkpoint_is_refused_as_one(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints["llama"], tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    text = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    config = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
              "text_config": {**text, "model_type": "llama"},
              "vision_config": {"model_type": "clip_vision_model"}}  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="multimodal checkpoint .* text-only models: "):
        LLM(str(path), dtype="float32", device="cpu")


def test_bidirectional_attention_is_refused(checkpoints, tmp_path):
    """A Gemma 3 config may ask for it (embedding models); the engine runs causal decoders."""
    path = copy_checkpoint(checkpoints["gemma3"], tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["use_bidirectional_attention"] = True
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="causal decoders only"):
        LLM(str(path), dtype="float32", device="cpu")
