"""Mixture-of-experts layers: each family's MoE block equals transformers' on the same input,
the experts' grouped products equal one product per expert, and the checkpoints' per-expert
weights load into the stacked ones. (Greedy equality of whole models runs with the other
families in test_engine_matches_hf.py, bfloat16 in test_bfloat16.py.)"""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.loader import load_config, load_model
from conveyor.engine.models import moe
from conveyor.engine.models.decoder import MLP
from conveyor.engine.models.layers import GROUPED, NATIVE
from conveyor.kernels import native_experts
from tests.hf_reference import hf_greedy, hf_model, random_prompts

MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")


def moe_layers(llm: LLM, hf) -> list[tuple[torch.nn.Module, torch.nn.Module]]:
    ours = [layer.mlp for layer in llm.runner.model.model.layers]
    theirs = [layer.mlp for layer in hf.model.layers]
    return [(a, b) for a, b in zip(ours, theirs, strict=True) if isinstance(a, moe.SparseMoe)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_each_moe_block_equals_transformers(checkpoints, arch, dtype, monkeypatch):
    """Routing (softmax, top-k, renormalising or not, the weights' dtype), the shared expert
    and the experts' products as transformers computes them: the same numbers, bit for bit in
    bfloat16 as grouped products (in float32, the router's oneDNN product rounds in its own
    order). On an x86 CPU the experts run in `native_experts`' kernel, steps of few tokens and
    of many alike: in float32 (AVX2 or AVX-512) its sums in k order; in bfloat16 (AMX or
    AVX512-BF16) its float32 sums in another order than oneDNN's (a bfloat16 rounding apart at
    most, here and there)."""
    from transformers import AutoModelForCausalLM

    llm = LLM(str(checkpoints[arch]), device="cpu", dtype=str(dtype).removeprefix("torch."))
    hf = AutoModelForCausalLM.from_pretrained(str(checkpoints[arch]), dtype=dtype)
    pairs = moe_layers(llm, hf)
    assert pairs, "the checkpoint has experts"
    native = llm.plan.experts == "native"
    assert native == native_experts.covers(dtype, hf.config.hidden_size, pairs[0][0].experts.inter)
    calls = []
    kernel = native_experts.routed_experts
    monkeypatch.setattr(native_experts, "routed_experts", lambda *a: calls.append(1) or kernel(*a))
    for tokens in (300, 12):  # a prompt chunk's many rows an expert, and a decode's few
        x = torch.randn(tokens, hf.config.hidden_size, generator=torch.Generator().manual_seed(0))
        x = x.to(dtype)
        calls.clear()
        for ours, theirs in pairs:
            assert ours.experts.grouped  # this torch has grouped_mm on the CPU
            with torch.no_grad():
                got, want = ours(x), theirs(x[None])[0]
            if dtype == torch.float32:
                assert torch.allclose(got, want, rtol=0, atol=1e-6)
            elif native:
                torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
                assert (got == want).float().mean() > 0.9
            else:
                assert torch.equal(got, want)
        assert len(calls) == (len(pairs) if native else 0)


def test_a_bfloat16_checkpoint_computing_in_float32_keeps_its_experts_in_bfloat16(
    checkpoints, tmp_path
):
    """A checkpoint saved in bfloat16 (as they ship) run in float32: on an x86 CPU the experts'
    weights stay in bfloat16, half the bytes, widened to their float32 values as the kernel
    reads them, and greedy output equals transformers' from the same checkpoint in float32. A
    float32 checkpoint's experts stay float32."""
    path = shutil.copytree(checkpoints["qwen3_moe"], tmp_path / "m")
    weights = load_file(path / "model.safetensors")
    save_file({n: w.bfloat16() for n, w in weights.items()}, path / "model.safetensors")
    prompts = random_prompts(3, 5, 60, seed=4)
    for checkpoint, kept in ((path, torch.bfloat16), (checkpoints["qwen3_moe"], torch.float32)):
        llm = LLM(str(checkpoint), device="cpu", dtype="float32", max_num_batched_tokens=32)
        params = SamplingParams(temperature=0, max_tokens=6)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, out in zip(prompts, outputs, strict=True):
            assert out.outputs[0].token_ids == hf_greedy(checkpoint, prompt, 6)
        experts = [layer.mlp.experts for layer in llm.runner.model.model.layers]
        if llm.plan.experts == "native":
            assert {(e.gate_up.dtype, e.down.dtype) for e in experts} == {(kept, kept)}
        else:  # where the kernel does not run, the weights are float32 as loaded
            assert {e.gate_up.dtype for e in experts} == {torch.float32}


def test_a_bfloat16_checkpoints_experts_are_never_held_in_float32(checkpoints, tmp_path):
    """Loading a bfloat16 checkpoint to compute in float32, the experts are read into bfloat16
    (the files' headers say so before any tensor is read), not into float32 first; once the
    plan is known they are laid out for the native kernel still in bfloat16, or widened to
    float32 with the checkpoint's values where another kernel runs them."""
    path = shutil.copytree(checkpoints["qwen3_moe"], tmp_path / "m")
    weights = {n: w.bfloat16() for n, w in load_file(path / "model.safetensors").items()}
    save_file(weights, path / "model.safetensors")
    config = load_config(path)
    native = native_experts.covers(torch.float32, config.hidden_size, config.moe_intermediate_size)
    kernels = [GROUPED] + [NATIVE] * native
    for kernel in kernels:
        model = load_model(path, config, torch.float32, torch.device("cpu"), 128)
        layers = model.model.layers
        held = [(x.gate_up.dtype, x.down.dtype) for x in (layer.mlp.experts for layer in layers)]
        assert set(held) == {(torch.bfloat16, torch.bfloat16)}
        assert model.model.embed_tokens.weight.dtype == torch.float32  # the rest as asked
        model.use_experts(kernel)
        experts = layers[1].mlp.experts
        gate = weights["model.layers.1.mlp.experts.3.gate_proj.weight"]
        down = weights["model.layers.1.mlp.experts.3.down_proj.weight"]
        if kernel == NATIVE:
            assert experts.native_layout and experts.gate_up.dtype == torch.bfloat16
            want = native_experts.layout(gate[None, :16].float())[0, 0]  # its first strip
            assert torch.equal(experts.gate_up[3, 0].float(), want)
        else:
            assert experts.gate_up.dtype == experts.down.dtype == torch.float32
            assert torch.equal(experts.gate_up[3, : experts.inter], gate.float())
            assert torch.equal(experts.down[3], down.float())


def test_grouped_products_equal_one_product_per_expert():
    """Experts that get no token, one token, or most of them."""
    experts = moe.Experts(num_experts=6, hidden=32, inter=24)
    with torch.no_grad():
        experts.gate_up.normal_(0, 0.2)
        experts.down.normal_(0, 0.2)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 32, generator=g)
    index = torch.randint(0, 3, (40, 2), generator=g)
    index[:, 1] = torch.where(index[:, 1] == index[:, 0], 5, index[:, 1])
    index[0, 1] = 4  # expert 4 gets one token, expert 3 none
    weights = torch.rand(40, 2, generator=g)
    with torch.no_grad():
        grouped = experts(x, index, weights)
        experts.grouped = False
        looped = experts(x, index, weights)
    assert torch.allclose(grouped, looped, atol=1e-6)
    # and each token is the weighted sum of its experts' SwiGLU outputs
    with torch.no_grad():
        want = torch.stack([
            sum(w * swiglu(x[t], experts.gate_up[e], experts.down[e])
                for e, w in zip(index[t].tolist(), weights[t], strict=True))
            for t in range(40)
        ])  # fmt: skip
    assert torch.allclose(grouped, want, atol=1e-5)


def swiglu(x, gate_up, down):
    gate, up = (gate_up @ x).chunk(2)
    return down @ (F.silu(gate) * up)


def test_without_grouped_mm_experts_run_one_product_each_and_say_why(
    checkpoints, monkeypatch, caplog
):
    monkeypatch.delattr(F, "grouped_mm")
    moe._told.clear()
    with caplog.at_level(logging.INFO, logger=moe.__name__):
        llm = LLM(str(checkpoints["qwen3_moe"]), device="cpu", dtype="float32")
    assert "experts run one product per expert: torch" in caplog.text
    hf = hf_model(str(checkpoints["qwen3_moe"]))
    x = torch.randn(64, hf.config.hidden_size, generator=torch.Generator().manual_seed(2))
    for ours, theirs in moe_layers(llm, hf):
        assert not ours.experts.grouped
        with torch.no_grad():
            assert torch.allclose(ours(x), theirs(x[None])[0], rtol=0, atol=1e-6)


def test_dense_layers_of_a_qwen_moe_stay_dense(checkpoints):
    """`mlp_only_layers` (and `decoder_sparse_step`) keep a layer's MLP dense, as transformers
    builds it; the tiny Qwen2-MoE has its first layer dense."""
    llm = LLM(str(checkpoints["qwen2_moe"]), device="cpu", dtype="float32")
    first, second = (layer.mlp for layer in llm.runner.model.model.layers)
    assert isinstance(first, MLP) and isinstance(second, moe.SparseMoe)
    assert second.shared_expert is not None and second.shared_expert_gate is not None
    assert llm.runner.model.activation_widths() == {128, 32, 96}


def test_a_missing_expert_weight_is_named(checkpoints, tmp_path):
    """Each expert's projections load from the checkpoint's own names (Mixtral's
    `block_sparse_moe.experts.N.w1`), and one that is missing is named."""
    path = shutil.copytree(checkpoints["mixtral"], tmp_path / "m")
    weights = load_file(path / "model.safetensors")
    name = "model.layers.1.block_sparse_moe.experts.3.w3.weight"
    del weights[name]
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ValueError, match=f"lacks weights: {name}"):
        LLM(str(path), dtype="float32", device="cpu")


def test_an_activation_the_experts_do_not_implement_is_refused(checkpoints, tmp_path):
    import json

    path = shutil.copytree(checkpoints["qwen3_moe"], tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["hidden_act"] = "relu2"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="activation 'relu2' is not implemented"):
        LLM(str(path), dtype="float32", device="cpu")
