"""How each piece of the engine runs on this device, decided once from the device and what it
can do (CUDA, or the CPU's instructions and a C++ compiler), logged once at start, each piece
overridable, and reported with the worker (`/v1/workers`). Nothing else chooses between the
implementations of a piece:

- attention: `kernels.selector` (Triton on CUDA; on the CPU the compiled C++ path, or the torch
  reference without a compiler);
- elementwise (norms, rope, the activation): `kernels.triton_layers` on CUDA,
  `kernels.native_layers` in bfloat16 on a CPU with AVX512-BF16 and in float32 on one with AVX2,
  loops compiled by inductor on other CPUs with a compiler, torch's eager ops where nothing can
  be built;
- projections: oneDNN's prepacked weights on the CPU where oneDNN runs the dtype (its bfloat16
  path needs avx512bw/vl/dq or avx_ne_convert), the plain product (cuBLAS, MKL) elsewhere;
- experts (mixture-of-experts models): `kernels.triton_moe` on CUDA, `kernels.native_experts`
  on an x86 CPU it covers (float32 with AVX2, on AVX-512's lanes where the CPU has them;
  bfloat16 with AMX or AVX512-BF16), torch's grouped products elsewhere;
- sampling (a sampled row's draw): `kernels.native_layers.draw` on a CPU with AVX2, torch's
  softmax and cumulative sum elsewhere. The two sum in float64 in different orders, so a
  seeded request's tokens may differ between them where a draw falls within rounding of a
  token's edge: the plan is part of the model's fingerprint.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

import torch

from conveyor.engine.models.layers import COMPILED, EAGER, GROUPED, NATIVE, TRITON, onednn_runs
from conveyor.kernels import native_experts, native_layers
from conveyor.kernels.cpu_build import cpu_flags
from conveyor.kernels.selector import triton_available

log = logging.getLogger(__name__)

ELEMENTWISE = ("auto", TRITON, NATIVE, COMPILED, EAGER)
EXPERTS = ("auto", TRITON, NATIVE, GROUPED)
TORCH = "torch"
SAMPLING = ("auto", NATIVE, TORCH)


@dataclass(frozen=True)
class DevicePlan:
    device: str
    capability: str  # "cuda sm_90" or the CPU's instruction sets
    dtype: str  # what the engine computes in ("auto" resolved: `engine.dtypes`)
    attention: str  # a kernels.selector backend name
    elementwise: str  # triton, native, compiled or eager
    projections: str  # onednn or plain
    # CUDA graphs for decode steps: "none" on a CPU, else what was recorded or "off (why)",
    # set after warm-up
    graphs: str = "none"
    # a mixture-of-experts model's experts: triton, native or grouped ("none": a dense model)
    experts: str = "none"
    sampling: str = TORCH  # native or torch
    reasons: dict[str, str] = field(default_factory=dict)  # piece -> why it is not the fastest

    def describe(self) -> str:
        pieces = [f"dtype {self.dtype}", f"attention {self.attention}",
                  f"elementwise {self.elementwise}", f"projections {self.projections}",
                  f"graphs {self.graphs}"]  # fmt: skip
        if self.experts != "none":
            pieces.append(f"experts {self.experts}")
        pieces.append(f"sampling {self.sampling}")
        text = f"{self.device} ({self.capability}): " + ", ".join(pieces)
        if self.reasons:
            text += "; " + "; ".join(f"{k}: {v}" for k, v in self.reasons.items())
        return text

    def as_dict(self) -> dict:
        return asdict(self)


def plan_device(
    device: torch.device,
    dtype: torch.dtype,
    attention: str,
    *,
    hidden: int,
    head_dim: int,
    intermediate: int,
    elementwise: str = "auto",
    expert_inter: int | None = None,
    experts: str = "auto",
    sampling: str = "auto",
) -> DevicePlan:
    """The plan for a model of these sizes in `dtype` on `device` (`expert_inter`: the
    intermediate size of its experts, None for a dense model); `attention`, `elementwise`,
    `experts` and `sampling` are the user's choices ("auto": the fastest this device runs)."""
    if elementwise not in ELEMENTWISE:
        choices = ", ".join(ELEMENTWISE)
        raise ValueError(f"elementwise must be one of {choices}, got {elementwise!r}")
    reasons: dict[str, str] = {}
    if elementwise == "auto":
        elementwise = _fastest_elementwise(device, dtype, hidden, head_dim, intermediate, reasons)
    elif elementwise == NATIVE and not (
        device.type == "cpu" and native_layers.covers(hidden, head_dim, intermediate, dtype)
    ):
        raise ValueError(
            "elementwise native: the native kernels run bfloat16 on a CPU with AVX512-BF16 (hidden "
            "and intermediate sizes multiples of 16, head sizes of 16) and float32 on a CPU with "
            "AVX2 and FMA (multiples of 8, head sizes of 16)"
        )
    elif elementwise == TRITON and not triton_available(device):
        raise ValueError(
            "elementwise triton: the Triton kernels run on CUDA with the triton package "
            "installed (on a CPU only through Triton's interpreter, TRITON_INTERPRET=1)"
        )
    if device.type == "cpu" and onednn_runs(dtype):
        projections = "onednn"
    else:
        projections = "plain"
        if device.type == "cpu":
            reasons["projections"] = f"oneDNN does not run {_name(dtype)} on this CPU"
    if expert_inter is not None:
        experts = _experts(device, dtype, hidden, expert_inter, experts, reasons)
    else:
        experts = "none"
    sampling = _sampling(device, sampling, reasons)
    return DevicePlan(str(device), _capability(device), _name(dtype), attention, elementwise,
                      projections, experts=experts, sampling=sampling,
                      reasons=reasons)  # fmt: skip


def _experts(
    device: torch.device, dtype: torch.dtype, hidden: int, inter: int, chosen: str,
    reasons: dict[str, str],
) -> str:  # fmt: skip
    """How the experts run: `chosen`, checked, or for "auto" the fastest kernel here."""
    if chosen not in EXPERTS:
        raise ValueError(f"experts must be one of {', '.join(EXPERTS)}, got {chosen!r}")
    native = device.type == "cpu" and native_experts.covers(dtype, hidden, inter)
    triton = triton_available(device)  # on a CPU only through Triton's interpreter
    if chosen == NATIVE and not native:
        raise ValueError(
            "experts native: the native experts kernels run on x86 CPUs, float32 with AVX2 or "
            "AVX-512 (hidden sizes multiples of 16, intermediate of 8) and bfloat16 with "
            "AVX512-BF16 or AMX (both multiples of 32)"
        )
    if chosen == TRITON and not triton:
        raise ValueError(
            "experts triton: the Triton experts kernel runs on CUDA with the triton package "
            "installed (on a CPU only through Triton's interpreter, TRITON_INTERPRET=1)"
        )
    if chosen != "auto":
        return chosen
    if triton and device.type == "cuda":
        return TRITON
    if native:
        return NATIVE
    if device.type == "cpu":
        reasons["experts"] = f"no native experts kernel for {_name(dtype)} here"
    return GROUPED


def _sampling(device: torch.device, chosen: str, reasons: dict[str, str]) -> str:
    """How a sampled row's token is drawn: `chosen`, checked, or for "auto" the fastest here."""
    if chosen not in SAMPLING:
        raise ValueError(f"sampling must be one of {', '.join(SAMPLING)}, got {chosen!r}")
    native = device.type == "cpu" and native_layers.available(torch.float32)
    if chosen == NATIVE and not native:
        raise ValueError("sampling native: the native draw runs on x86 CPUs with AVX2 and FMA")
    if chosen != "auto":
        return chosen
    if native:
        return NATIVE
    if device.type == "cpu":
        reasons["sampling"] = "the native draw does not run on this CPU (or did not build)"
    return TORCH


def _fastest_elementwise(
    device: torch.device, dtype: torch.dtype, hidden: int, head_dim: int, intermediate: int,
    reasons: dict[str, str],
) -> str:  # fmt: skip
    if device.type == "cuda" and triton_available(device):
        return TRITON
    if device.type != "cpu":
        reasons["elementwise"] = f"no fused kernels for {device.type} here (Triton): torch's ops"
        return EAGER
    if native_layers.covers(hidden, head_dim, intermediate, dtype):
        return NATIVE
    refused = native_layers.refusal(hidden, head_dim, intermediate, dtype) or (
        "the native kernels do not take this model here"
    )
    from conveyor.kernels import compiled_paged

    if problem := compiled_paged.compiler_missing():
        reasons["elementwise"] = f"{refused}; {problem}"
        return EAGER
    reasons["elementwise"] = refused
    return COMPILED


def _capability(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda sm_{major}{minor}"
    have = cpu_flags()
    found = [f for f in ("amx_bf16", "avx512_bf16", "avx512bw", "avx512f", "avx2") if f in have]
    return " ".join(found) or torch.backends.cpu.get_cpu_capability().lower()


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
