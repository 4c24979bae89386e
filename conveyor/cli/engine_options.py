"""The options of the commands that load a model (`run-batch`, `worker`): which model, and a flag
for each of `EngineConfig`'s fields (`max_num_seqs` is `--max-num-seqs`)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import Field, fields

from conveyor.engine.config import EngineConfig

_ARGPARSE_SETTINGS = ("type", "metavar", "choices", "action")


def add_engine_arguments(
    parser: argparse.ArgumentParser, model_help: str | None = None
) -> list[str]:
    """Engine options shared by every command that loads a model; returns their dests. With
    `model_help`, `--model` may be left out (it says what happens then)."""
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        required=model_help is None,
        help=model_help
        or "model directory or Hugging Face model id (config, safetensors weights, tokenizer)",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="name(s) the model answers to; the first is reported in each response's `model`. "
        "When given, requests whose body.model is neither one of them nor the --model path "
        "are rejected (model_not_found). Default: the model directory's name (or the Hugging "
        "Face id), with the --model path accepted too, as vLLM names it; run-batch then does "
        "not check body.model",
    )
    for f in _flagged_fields():
        meta = f.metadata
        if "off_switch" in meta:
            g.add_argument(meta["off_switch"], action="store_true", help=meta["help"])
            continue
        settings = {key: meta[key] for key in _ARGPARSE_SETTINGS if key in meta}
        # no default here: an option not given keeps the engine's (see engine_config)
        g.add_argument("--" + f.name.replace("_", "-"), help=meta["help"], **settings)
    return [a.dest for a in g._group_actions]  # argparse has no public accessor for them


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The config of the engine options given (on the command line or, for `conveyor worker`,
    by `CONVEYOR_<OPTION>`); the others keep their defaults."""
    given = {}
    for f in _flagged_fields():
        if "off_switch" in f.metadata:
            if getattr(args, _dest(f.metadata["off_switch"])):
                given[f.name] = False
        elif (value := getattr(args, f.name)) is not None:
            given[f.name] = value
    return EngineConfig(**given)


def _flagged_fields() -> Iterator[Field]:
    return (f for f in fields(EngineConfig) if f.metadata["cli"])


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")
