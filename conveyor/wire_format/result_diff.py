"""What changed between two runs of the same lines: result lines matched by `custom_id`, each
reduced to what the model answered (text, tool calls, finish reasons, the error's code), and
for lines with prompt logprobs (lm-eval's loglikelihood requests) the summed log-probability,
so that a score that moved is seen even where the text did not. Beside them, what ran the two
runs, where both are known (`what_ran_changes`): the model fingerprints, Conveyor's version,
the engine's settings and the sampling defaults that differ, the first places to look when
answers changed.

Ids, timestamps, token counts and the model's name differ on every run and are not compared.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class LineDiff:
    custom_id: str
    before: Any
    after: Any


@dataclass
class ScoreChange:
    custom_id: str
    before: float
    after: float

    @property
    def delta(self) -> float:
        return self.after - self.before


@dataclass
class SettingChange:
    """A part of what ran two runs that differs between them: `name` is `fingerprint`,
    `conveyor` (the version), `engine.<setting>` or `default_sampling.<field>`; `before` and
    `after` each run's values (one where all its workers agreed, none where its record lacks
    the part)."""

    name: str
    before: list[Any]
    after: list[Any]


@dataclass
class RunDiff:
    same: int = 0
    changed: list[LineDiff] = field(default_factory=list)
    new: list[str] = field(default_factory=list)  # in the second run only
    gone: list[str] = field(default_factory=list)  # in the first run only
    scores: list[ScoreChange] = field(default_factory=list)  # largest change first
    # what ran them, where it differs; None where what ran either run is not known
    what_ran: list[SettingChange] | None = None

    @property
    def differs(self) -> bool:
        return bool(self.changed or self.new or self.gone or self.scores)

    def as_dict(self, top: int) -> dict[str, Any]:
        return {
            "same": self.same,
            "changed": [vars(c) for c in self.changed],
            "new": self.new,
            "gone": self.gone,
            "score_changes": [{**vars(s), "delta": s.delta} for s in self.scores[:top]],
            "score_changes_total": len(self.scores),
            "what_ran_changed": None if self.what_ran is None else [vars(c) for c in self.what_ran],
        }


def answer_of(line: dict[str, Any]) -> Any:
    """What a result line says the model answered, without what differs on every run."""
    if line.get("error"):
        return {"error": (line["error"] or {}).get("code")}
    response = line.get("response") or {}
    body = response.get("body") or {}
    if response.get("status_code", 200) >= 400:
        return {
            "status": response.get("status_code"),
            "error": (body.get("error") or {}).get("code"),
        }
    if "output" in body:  # a Response object
        return {"output": [_output_item(item) for item in body["output"]],
                "status": body.get("status")}  # fmt: skip
    return [_choice(choice) for choice in body.get("choices", [])]


def _choice(choice: dict[str, Any]) -> dict[str, Any]:
    message = choice.get("message") or {}
    answer = {
        "text": choice["text"] if "text" in choice else message.get("content"),
        "finish_reason": choice.get("finish_reason"),
    }
    if message.get("tool_calls"):
        answer["tool_calls"] = [
            (c.get("function") or {}).get("name", "")
            + (c.get("function") or {}).get("arguments", "")
            for c in message["tool_calls"]
        ]
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        answer["reasoning"] = reasoning
    tokens = (choice.get("logprobs") or {}).get("tokens")
    if tokens is not None:
        answer["tokens"] = tokens
    return answer


def _output_item(item: dict[str, Any]) -> Any:
    if item.get("type") == "function_call":
        return {"call": item.get("name"), "arguments": item.get("arguments")}
    parts = item.get("content") or item.get("summary") or []
    return {"type": item.get("type"), "text": [p.get("text") for p in parts]}


def score_of(line: dict[str, Any]) -> float | None:
    """The summed log-probabilities of a completion line's tokens (a loglikelihood request
    echoes its prompt with `logprobs`), None for a line without them."""
    body = (line.get("response") or {}).get("body") or {}
    choices = body.get("choices") or []
    if not choices:
        return None
    values = (choices[0].get("logprobs") or {}).get("token_logprobs")
    if not values:
        return None
    return math.fsum(v for v in values if v is not None)


def by_custom_id(lines: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {str(line.get("custom_id")): line for line in lines}


def diff_runs(
    first: Iterable[dict[str, Any]],
    second: Iterable[dict[str, Any]],
    tolerance: float = 0.0,
    first_ran: Sequence[dict[str, Any]] | None = None,
    second_ran: Sequence[dict[str, Any]] | None = None,
) -> RunDiff:
    """Line by line (by `custom_id`), what the second run answered differently; a score counts
    as changed when it moved by more than `tolerance`. With the records of what ran each run
    (none recorded: not known), also what differs between them (`what_ran_changes`)."""
    a, b = by_custom_id(first), by_custom_id(second)
    found = RunDiff(new=sorted(b.keys() - a.keys()), gone=sorted(a.keys() - b.keys()))
    if first_ran and second_ran:
        found.what_ran = what_ran_changes(first_ran, second_ran)
    for custom_id in sorted(a.keys() & b.keys()):
        before, after = answer_of(a[custom_id]), answer_of(b[custom_id])
        old, now = score_of(a[custom_id]), score_of(b[custom_id])
        moved = old is not None and now is not None and abs(now - old) > tolerance
        if moved:
            found.scores.append(ScoreChange(custom_id, old, now))
        if before != after:
            found.changed.append(LineDiff(custom_id, before, after))
        elif not moved:
            found.same += 1
    found.scores.sort(key=lambda s: abs(s.delta), reverse=True)
    return found


def _what_ran(runs: Sequence[dict[str, Any]]) -> dict[str, list[Any]]:
    """Each part of a run record (`ledger.batch_runs.runs_of`, a batch's `reproducibility`) and
    the values its runs had, in a stable order; the worker and the time, which differ on every
    run, left out."""
    values: dict[str, dict[str, Any]] = {}
    for run in runs:
        parts = {name: run[name] for name in ("fingerprint", "conveyor") if name in run}
        for group in ("engine", "default_sampling"):
            for name, value in (run.get(group) or {}).items():
                parts[f"{group}.{name}"] = value
        for name, value in parts.items():
            values.setdefault(name, {})[json.dumps(value, sort_keys=True)] = value
    return {name: [seen[key] for key in sorted(seen)] for name, seen in values.items()}


def what_ran_changes(
    first: Sequence[dict[str, Any]], second: Sequence[dict[str, Any]]
) -> list[SettingChange]:
    """What differs between what ran two runs, given each run's records (a batch's
    `reproducibility`), by name."""
    a, b = _what_ran(first), _what_ran(second)
    return [
        SettingChange(name, a.get(name, []), b.get(name, []))
        for name in sorted(a.keys() | b.keys())
        if a.get(name, []) != b.get(name, [])
    ]
