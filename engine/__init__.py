"""The paged-KV inference engine.

Its names are imported on first use (PEP 562), so that the torch-free modules `engine.config`,
`engine.sampling_params` and `engine.outputs` can be imported without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers see of the names below
    from engine.config import EngineConfig as EngineConfig
    from engine.llm import LLM as LLM
    from engine.llm_engine import EngineStats as EngineStats
    from engine.llm_engine import LLMEngine as LLMEngine
    from engine.outputs import CompletionOutput as CompletionOutput
    from engine.outputs import RequestMetrics as RequestMetrics
    from engine.outputs import RequestOutput as RequestOutput
    from engine.sampling_params import SamplingParams as SamplingParams

_MODULE_OF = {
    "LLM": "engine.llm",
    "CompletionOutput": "engine.outputs",
    "EngineConfig": "engine.config",
    "EngineStats": "engine.llm_engine",
    "LLMEngine": "engine.llm_engine",
    "RequestMetrics": "engine.outputs",
    "RequestOutput": "engine.outputs",
    "SamplingParams": "engine.sampling_params",
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
