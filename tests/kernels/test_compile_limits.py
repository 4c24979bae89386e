"""A process that compiles the kernels for many models keeps them compiled: past dynamo's default
of 8 variants a function would run eagerly, in another order of summation."""

from __future__ import annotations

import logging

import torch

from conveyor.kernels.compile_limits import RECOMPILE_LIMIT, allow_model_variants


def test_a_function_compiled_for_a_dozen_shapes_never_falls_back_to_eager(caplog):
    allow_model_variants()
    assert torch._dynamo.config.recompile_limit >= RECOMPILE_LIMIT

    def scaled(x: torch.Tensor) -> torch.Tensor:
        return (x * 2).sum(-1)

    compiled = torch.compile(scaled, dynamic=False, backend="eager")
    with caplog.at_level(logging.WARNING, logger="torch._dynamo"):
        for width in range(1, 13):  # a static shape each: one variant per width
            compiled(torch.ones(2, width))
    assert not [r for r in caplog.records if "recompile_limit" in r.getMessage()]


def test_the_limit_is_never_lowered():
    config = torch._dynamo.config
    before = config.recompile_limit
    try:
        config.recompile_limit = RECOMPILE_LIMIT * 2
        allow_model_variants()
        assert config.recompile_limit == RECOMPILE_LIMIT * 2
    finally:
        config.recompile_limit = before
