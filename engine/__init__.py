"""The paged-KV inference engine.

Its names are imported on first use (PEP 562), so that the torch-free modules `engine.config`,
`engine.sampling_params` and `engine.outputs` can be imported without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers see of the names below
    from conveyor.engine.config import EngineConfig as EngineConfig
    from conveyor.engine.llm import LLM as LLM
    from conveyor.engine.llm_engine import EngineStats as EngineStats
    from conveyor.engine.llm_engine import LLMEngine as LLMEngine
    from conveyor.engine.outputs import CompletionOutput as CompletionOutput
    from conveyor.engine.outputs import RequestMetrics as RequestMetrics
    from conveyor.engine.outputs import RequestOutput as RequestOutput
    from conveyor.engine.sampling_params import SamplingParams as SamplingParams

_MODULE_OF = {
    "LLM": "conveyor.engine.llm",
    "CompletionOutput": "conveyor.engine.outputs",
    "EngineConfig": "conveyor.engine.config",
    "EngineStats": "conveyor.engine.llm_engine",
    "LLMEngine": "conveyor.engine.llm_engine",
    "RequestMetrics": "conveyor.engine.outputs",
    "RequestOutput": "conveyor.engine.outputs",
    "SamplingParams": "conveyor.engine.sampling_params",
}

__all__ = list(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
