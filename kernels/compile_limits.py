"""How many variants of one compiled function torch.compile keeps before it gives up on it.

Each model shape and dtype a process loads compiles the CPU kernels again (their head counts,
head size and dtype are static: inductor unrolls over them), and past dynamo's default of 8
variants a function silently runs eagerly from then on: in another order of summation, so the
same request would get other bits from one engine than from the one before it, and
batch-invariant mode would hold only until the ninth model. A process that loads several models
(a notebook, a test session) gets room for them instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

RECOMPILE_LIMIT = 256


def allow_model_variants() -> None:
    """Raise dynamo's per-function recompile limit to `RECOMPILE_LIMIT` (never lower it)."""
    from torch._dynamo import config  # imported here: dynamo's import takes ~1.6 s

    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    config.accumulated_recompile_limit = max(
        config.accumulated_recompile_limit, 4 * RECOMPILE_LIMIT
    )


def compile_kernel(fn: Callable[..., Any], *, dynamic: bool) -> Callable[..., Any]:
    """`torch.compile(fn)` with room for every model the process loads: where Conveyor
    compiles its CPU kernels."""
    allow_model_variants()
    import torch._inductor.config as inductor

    # rounded to bfloat16 where eager rounds (after each op), not once at the end of a fused
    # loop: transformers computes eagerly, and a model's answers must match its (seen: Gemma 3's
    # GeGLU in bfloat16, logprobs 0.14 apart where eager rounding is 0.03 apart); older torch
    # versions have no such option
    emulate = hasattr(inductor, "emulate_precision_casts")
    options = {"emulate_precision_casts": True} if emulate else {}
    return torch.compile(fn, dynamic=dynamic, options=options)
