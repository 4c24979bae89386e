"""One place chooses how each piece of the engine runs on this device (engine.device_plan):
the attention backend chosen does not change how norms, rope and the activation run, each
piece can be overridden, a piece that is not the fastest kind says why, and workers report the
plan."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from conveyor.engine import device_plan
from conveyor.engine.device_plan import plan_device
from conveyor.kernels import compiled_paged, native_layers

DIMS = dict(hidden=64, head_dim=32, intermediate=128)
CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def compiler(monkeypatch):
    monkeypatch.setattr(compiled_paged, "compiler_missing", lambda: None)


def test_the_attention_backend_does_not_decide_the_elementwise_ops(compiler, monkeypatch):
    monkeypatch.setattr(native_layers, "covers", lambda *_: False)
    for attention in ("torch", "compiled"):
        plan = plan_device(CPU, torch.float32, attention, **DIMS)
        assert (plan.attention, plan.elementwise) == (attention, "compiled")


def test_a_dtype_whose_native_kernels_run_here_takes_them(compiler, monkeypatch):
    """bfloat16 where the CPU has AVX512-BF16, float32 where it has AVX2: each dtype's kernel
    decides for itself."""
    monkeypatch.setattr(native_layers, "covers", lambda *args: args[-1] == torch.bfloat16)
    assert plan_device(CPU, torch.bfloat16, "torch", **DIMS).elementwise == "native"
    assert plan_device(CPU, torch.float32, "torch", **DIMS).elementwise == "compiled"
    monkeypatch.setattr(native_layers, "covers", lambda *args: args[-1] == torch.float32)
    assert plan_device(CPU, torch.float32, "torch", **DIMS).elementwise == "native"
    assert plan_device(CPU, torch.bfloat16, "torch", **DIMS).elementwise == "compiled"
    forced = plan_device(CPU, torch.bfloat16, "torch", elementwise="eager", **DIMS)
    assert forced.elementwise == "eager" and "elementwise" not in forced.reasons  # as asked


def test_the_native_kernels_cover_what_they_take():
    """Sizes a kernel's vectors cannot take, and dtypes with no kernel, are never native."""
    for dtype in (torch.float16, torch.float64):
        assert not native_layers.covers(512, 64, 1408, dtype)
    assert not native_layers.covers(512, 24, 1408, torch.float32)  # half a head: 12 lanes
    assert not native_layers.covers(516, 64, 1408, torch.float32)
    assert not native_layers.covers(512, 24, 1408, torch.bfloat16)  # half a head: 12 lanes
    assert native_layers.covers(512, 16, 1408, torch.bfloat16) == native_layers.available(
        torch.bfloat16
    )
    assert native_layers.covers(512, 16, 1400, torch.float32) == native_layers.available(
        torch.float32
    )


def test_a_model_the_native_kernels_do_not_take_says_why(compiler):
    """Sizes the kernels' vectors cannot take: compiled loops, and the reason in words."""
    plan = plan_device(CPU, torch.float32, "torch", hidden=64, head_dim=24, intermediate=128)
    assert plan.elementwise == "compiled"
    assert plan.reasons["elementwise"] == (
        "the native float32 kernels take hidden and intermediate sizes of multiples of 8 and "
        "head sizes of 16; this model's are 64, 128 and 24"
    )
    plan = plan_device(CPU, torch.float16, "torch", **DIMS)
    assert plan.reasons["elementwise"] == "no native kernels for float16"


def test_what_cannot_run_here_is_refused_or_said(monkeypatch):
    monkeypatch.setattr(native_layers, "covers", lambda *_: False)
    with pytest.raises(ValueError, match="elementwise native"):
        plan_device(CPU, torch.bfloat16, "torch", elementwise="native", **DIMS)
    with pytest.raises(ValueError, match="elementwise must be one of"):
        plan_device(CPU, torch.float32, "torch", elementwise="fused", **DIMS)
    monkeypatch.setattr(compiled_paged, "compiler_missing", lambda: "no C++ compiler (g++)")
    plan = plan_device(CPU, torch.float32, "torch", **DIMS)
    assert plan.elementwise == "eager" and "no C++ compiler" in plan.reasons["elementwise"]
    monkeypatch.setattr(device_plan, "onednn_runs", lambda dtype: dtype == torch.float32)
    plan = plan_device(CPU, torch.bfloat16, "torch", **DIMS)
    assert plan.projections == "plain" and "bfloat16" in plan.reasons["projections"]
    assert "projections: oneDNN does not run bfloat16" in plan.describe()


def test_on_cuda_every_piece_is_a_cuda_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _: (9, 0))
    cuda = torch.device("cuda", 0)
    plan = plan_device(cuda, torch.bfloat16, "triton", **DIMS)
    assert (plan.capability, plan.attention, plan.elementwise, plan.projections) == (
        "cuda sm_90", "triton", "triton", "plain"
    )  # fmt: skip
    assert plan.reasons == {}
    monkeypatch.setattr(device_plan, "triton_available", lambda device: False)  # no triton
    plan = plan_device(cuda, torch.bfloat16, "torch", **DIMS)
    assert plan.elementwise == "eager" and "Triton" in plan.reasons["elementwise"]
    with pytest.raises(ValueError, match="elementwise triton"):
        plan_device(cuda, torch.bfloat16, "torch", elementwise="triton", **DIMS)


def test_triton_elementwise_on_a_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        plan_device(CPU, torch.float32, "torch", elementwise="triton", **DIMS)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert plan_device(CPU, torch.float32, "torch", elementwise="triton", **DIMS).elementwise == (
        "triton"
    )


def test_the_engine_runs_its_plan_and_the_worker_reports_it(checkpoints):
    from conveyor.api.workers_view import _worker
    from conveyor.engine import LLM
    from conveyor.ledger.models import WorkerRow
    from conveyor.worker.engine_service import EngineService

    llm = LLM(str(checkpoints["llama"]), device="cpu", attention_backend="torch")
    layer = llm.runner.model.model.layers[0]
    assert layer.input_layernorm.impl == layer.self_attn.impl == llm.plan.elementwise
    stats = EngineService(llm).snapshot()
    row = WorkerRow(id="w", models=["m"], queues=[], started_at=0.0, last_seen=0.0, stats=stats)
    shown = _worker(row, running_shards=0)
    assert shown.plan is not None and shown.plan.elementwise == llm.plan.elementwise
    assert shown.plan.attention == "torch"
    assert shown.plan.dtype == str(llm.dtype).removeprefix("torch.")
    assert f"dtype {shown.plan.dtype}, attention torch" in llm.plan.describe()


def test_nothing_else_branches_on_a_backend_name():
    pattern = re.compile(r"\.name\s*[!=]=\s*[\"'](torch|compiled|triton)[\"']")
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for folder in ("engine", "kernels", "worker", "conveyor")
        for path in (ROOT / folder).rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []


def test_the_plan_chooses_how_experts_run(monkeypatch, checkpoints):
    """A dense model has none; on a CPU the native kernel where it covers the dtype and sizes
    (else grouped products, saying why); on CUDA Triton's; each overridable, and an engine
    runs what its plan says in every MoE layer."""
    from conveyor.engine import LLM
    from conveyor.engine.models.moe import Experts
    from conveyor.kernels import native_experts

    assert plan_device(CPU, torch.float32, "torch", **DIMS).experts == "none"
    monkeypatch.setattr(native_experts, "covers", lambda *_: True)
    plan = plan_device(CPU, torch.bfloat16, "torch", expert_inter=32, **DIMS)
    assert plan.experts == "native" and "experts native" in plan.describe()
    forced = plan_device(CPU, torch.bfloat16, "torch", expert_inter=32, experts="grouped", **DIMS)
    assert forced.experts == "grouped" and "experts" not in forced.reasons
    monkeypatch.setattr(native_experts, "covers", lambda *_: False)
    plan = plan_device(CPU, torch.float16, "torch", expert_inter=32, **DIMS)
    assert plan.experts == "grouped" and "float16" in plan.reasons["experts"]
    with pytest.raises(ValueError, match="experts native"):
        plan_device(CPU, torch.float16, "torch", expert_inter=32, experts="native", **DIMS)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="experts triton"):
        plan_device(CPU, torch.float32, "torch", expert_inter=32, experts="triton", **DIMS)
    with pytest.raises(ValueError, match="experts must be one of"):
        plan_device(CPU, torch.float32, "torch", expert_inter=32, experts="fused", **DIMS)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _: (9, 0))
    monkeypatch.setattr(device_plan, "triton_available", lambda device: True)
    cuda = torch.device("cuda", 0)
    assert plan_device(cuda, torch.bfloat16, "triton", expert_inter=32, **DIMS).experts == "triton"
    monkeypatch.undo()
    llm = LLM(str(checkpoints["qwen3_moe"]), device="cpu", dtype="float32", experts="grouped")
    kernels = {m.kernel for m in llm.runner.model.modules() if isinstance(m, Experts)}
    assert llm.plan.experts == "grouped" and kernels == {"grouped"}


def test_the_plan_chooses_how_tokens_are_drawn(monkeypatch, checkpoints):
    """On a CPU the native draw where the float32 kernels run (else torch's, saying why); on
    CUDA torch's; overridable; the engine's sampler draws as its plan says, and the choice is
    part of the model's fingerprint."""
    from conveyor.engine import LLM

    monkeypatch.setattr(native_layers, "available", lambda dtype: dtype == torch.float32)
    plan = plan_device(CPU, torch.bfloat16, "torch", **DIMS)
    assert plan.sampling == "native" and "sampling native" in plan.describe()
    forced = plan_device(CPU, torch.bfloat16, "torch", sampling="torch", **DIMS)
    assert forced.sampling == "torch" and "sampling" not in forced.reasons
    with pytest.raises(ValueError, match="sampling must be one of"):
        plan_device(CPU, torch.float32, "torch", sampling="fast", **DIMS)
    monkeypatch.setattr(native_layers, "available", lambda dtype: False)
    plan = plan_device(CPU, torch.float32, "torch", **DIMS)
    assert plan.sampling == "torch" and "native draw" in plan.reasons["sampling"]
    with pytest.raises(ValueError, match="sampling native"):
        plan_device(CPU, torch.float32, "torch", sampling="native", **DIMS)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _: (9, 0))
    assert plan_device(torch.device("cuda", 0), torch.bfloat16, "triton", **DIMS).sampling == (
        "torch"
    )
    monkeypatch.undo()

    engines = {
        draw: LLM(str(checkpoints["llama"]), device="cpu", dtype="float32", sampling=draw)
        for draw in ("torch", "native" if native_layers.available(torch.float32) else "torch")
    }
    for draw, llm in engines.items():
        assert llm.plan.sampling == draw and llm.sampler.native_draw == (draw == "native")
    if len(engines) == 2:
        assert engines["torch"].fingerprint != engines["native"].fingerprint
