"""The names a model is served under: what requests put in `body.model`.

A model given as a local directory is served under the directory's name, not its path: the
path says where the files lie on one machine, which is nothing a client should need to know
(or see in `GET /v1/models`). `--served-model-name` chooses the names instead; a path is
served only when asked for that way.
"""

from __future__ import annotations

from pathlib import Path


def served_model_names(model: str, served: list[str] | None = None) -> list[str]:
    """`served` if given, else `model`'s default name."""
    if served:
        return list(dict.fromkeys(served))
    path = Path(model).expanduser()
    if path.is_dir():
        return [path.resolve().name]
    return [model]  # a hub id (`Qwen/Qwen3-0.6B`) or a null engine (`echo`): already a name
