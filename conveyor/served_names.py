"""The names a model is served under: what requests put in `body.model`.

A model given as a local directory is served under the directory's name: the path says where
the files lie on one machine, which is nothing a client should need to know (or see in
`GET /v1/models`). `--served-model-name` chooses the names instead. The path as given to
`--model` is accepted too, as an alias that `GET /v1/models` does not list: it is the name
vLLM serves such a model under, so a client set up for vLLM (`model=/models/qwen3`) runs
unchanged.
"""

from __future__ import annotations

import os
from pathlib import Path


def served_model_names(model: str, served: list[str] | None = None) -> list[str]:
    """`served` if given, else `model`'s default name; then, for a local directory, the path as
    given (and without a trailing slash) as aliases."""
    path = Path(model).expanduser()
    if served:
        names = list(served)
    elif path.is_dir():
        names = [path.resolve().name]
    else:
        names = [model]  # a hub id (`Qwen/Qwen3-0.6B`) or a null engine (`echo`): already a name
    if path.is_dir():
        names += [model, model.rstrip("/") or model]
    return list(dict.fromkeys(names))


def listed_names(names: list[str]) -> list[str]:
    """The names of `names` that `GET /v1/models` lists: all but the path aliases."""
    return [name for name in names if not is_path_alias(name, names)]


def is_path_alias(name: str, names: list[str]) -> bool:
    """Whether `name`, one of a worker's `names`, is a directory path served beside another
    name (so not listed as a model of its own)."""
    is_path = os.path.isabs(name) or name.startswith(("./", "../", "~"))
    return is_path and any(other != name and not os.path.isabs(other) for other in names)
