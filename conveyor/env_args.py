"""Defaults for a command's options from environment variables (`--max-num-seqs` from
`CONVEYOR_MAX_NUM_SEQS`), so a container's settings can all live in an `.env` file."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable

ENV_PREFIX = "CONVEYOR_"
TRUE = {"1", "true", "yes", "on"}
FALSE = {"0", "false", "no", "off", ""}


def env_name(action: argparse.Action) -> str:
    return ENV_PREFIX + action.dest.upper()


def option_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a
        for a in parser._actions  # argparse has no public accessor for its options
        if a.option_strings and not isinstance(a, argparse._HelpAction)
    ]


def apply_env_defaults(
    parser: argparse.ArgumentParser, dests: Iterable[str] | None = None
) -> list[str]:
    """Every option of `parser` (or those of `dests`) takes its default from
    `CONVEYOR_<DEST>` when that is set; an option given on the command line still wins.
    Returns what is wrong with the values that could not be used, for the command to report
    when it runs."""
    errors = []
    wanted = None if dests is None else set(dests)
    for action in option_actions(parser):
        if wanted is not None and action.dest not in wanted:
            continue
        raw = os.environ.get(env_name(action))
        if raw is None:
            continue
        try:
            value = _convert(action, raw)
        except ValueError as err:
            errors.append(f"{env_name(action)}: {err}")
            continue
        action.default = value
        action.required = False
        if action.help and action.help is not argparse.SUPPRESS:
            action.help += f" [set by {env_name(action)}]"
    return errors


def _convert(action: argparse.Action, raw: str) -> object:
    if isinstance(action, argparse._StoreTrueAction):
        if raw.strip().lower() not in TRUE | FALSE:
            raise ValueError(f"must be true or false, got {raw!r}")
        return raw.strip().lower() in TRUE
    if action.nargs in ("+", "*"):
        return [_convert_one(action, v) for v in raw.replace(",", " ").split()]
    return _convert_one(action, raw)


def _convert_one(action: argparse.Action, raw: str) -> object:
    value: object = raw
    if action.type is not None:
        try:
            value = action.type(raw)  # type: ignore[operator]
        except (TypeError, argparse.ArgumentTypeError) as err:
            raise ValueError(str(err)) from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(repr, action.choices))
        raise ValueError(f"must be one of {choices}, got {raw!r}")
    return value
