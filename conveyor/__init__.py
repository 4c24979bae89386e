"""Conveyor: batch LLM inference, one import name.

`from conveyor import LLM, SamplingParams` is the engine's library API (as vLLM's); the service's
parts live under it: `conveyor.api`, `conveyor.ledger`, `conveyor.worker`, `conveyor.engine`,
`conveyor.kernels`, `conveyor.migrations`. Importing `conveyor` loads no torch: the engine's
names are loaded when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from conveyor.engine import LLM as LLM
    from conveyor.engine import CompletionOutput as CompletionOutput
    from conveyor.engine import EngineConfig as EngineConfig
    from conveyor.engine import RequestOutput as RequestOutput
    from conveyor.engine import SamplingParams as SamplingParams

from conveyor.version import __version__

_ENGINE_NAMES = ("LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineConfig")
__all__ = [*_ENGINE_NAMES, "__version__"]


def __getattr__(name: str) -> Any:
    if name not in _ENGINE_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from conveyor import engine

    value = getattr(engine, name)
    globals()[name] = value  # later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
