"""The service holds an `Engine`: the paged-KV engine and the worker's null engine are both
one, with every member the service reads (no `getattr` with a default at the seam)."""

from __future__ import annotations

from pathlib import Path

from conveyor.engine import LLM
from conveyor.engine.protocol import Engine
from conveyor.worker.echo import EchoEngine


def test_both_engines_are_an_engine(checkpoints: dict[str, Path]) -> None:
    llm = LLM(str(checkpoints["llama"]), device="cpu", dtype="float32", num_kv_blocks=16)
    echo = EchoEngine()
    for engine in (llm, echo):
        assert isinstance(engine, Engine), type(engine)
    assert llm.vocab_size > 0 and llm.max_model_len > 0 and llm.plan is not None
    assert (echo.vocab_size, echo.max_model_len, echo.plan) == (None, None, None)


def test_an_object_missing_a_member_is_not_one() -> None:
    assert not isinstance(object(), Engine)
    echo = EchoEngine()
    del echo.plan
    assert not isinstance(echo, Engine)
