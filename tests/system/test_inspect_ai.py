"""inspect-ai, unchanged, against the service through both of its OpenAI providers:
`openai-api/conveyor/MODEL` (chat completions; it has no batch mode: `batch` is ignored) and
`openai/MODEL` (the Responses API), online and in inspect's batch mode (files and batches on the
server). Three tasks: generate and match, multiple choice, and a tool forced by `tool_choice`
whose result goes back to the model. Greedy on a tiny random model: every way gets the same
answers, whatever they score."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import httpx
import pytest
from inspect_ai import Task, eval
from inspect_ai.dataset import Sample
from inspect_ai.model import GenerateConfig
from inspect_ai.scorer import choice, match
from inspect_ai.solver import generate, multiple_choice, use_tools
from inspect_ai.tool import ToolFunction, tool

from tests.system.test_online import MODEL
from tests.system.test_tool_calls_online import tools_serve

SHORT = GenerateConfig(max_tokens=8)
# room for the forced call's arguments (one of two cities): cut, they would not be JSON
LONG = GenerateConfig(max_tokens=32)
# inspect's batcher: send what has queued after a second, look again every second
BATCH = {"size": 10, "send_delay": 1, "tick": 1}
WAYS = {  # name -> (inspect's model, its batch config)
    "chat": (f"openai-api/conveyor/{MODEL}", None),
    "chat, batch ignored": (f"openai-api/conveyor/{MODEL}", BATCH),
    "responses": (f"openai/{MODEL}", None),
    "responses, batch": (f"openai/{MODEL}", BATCH),
}


@tool
def weather():
    async def execute(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city.

        Args:
            city: The city.
        """
        return "18 C" if city == "Paris" else "25 C"

    return execute


def tasks() -> list[Task]:
    matched = Task(
        name="match",
        dataset=[Sample(input="Say hi", target="hi"), Sample(input="Count to 3", target="1 2 3")],
        solver=generate(),
        scorer=match(),
        config=SHORT,
    )
    chosen = Task(
        name="choice",
        dataset=[Sample(input="Which is a colour?", choices=["red", "dog", "sun"], target="A")],
        solver=multiple_choice(),
        scorer=choice(),
        config=SHORT,
    )
    tools = Task(
        name="tool",
        dataset=[Sample(input="What is the weather in Paris?", target="18")],
        solver=[
            use_tools(weather(), tool_choice=ToolFunction("weather")),
            generate(tool_calls="single"),  # the forced call, run once
            use_tools(weather(), tool_choice="none"),
            generate(),  # the answer, after the tool's result
        ],
        scorer=match(),
        config=LONG,
    )
    return [matched, chosen, tools]


def said(message) -> tuple[str, str, list[tuple[str, dict]]]:
    """A message's role, text and tool calls (each a function and its arguments)."""
    calls = getattr(message, "tool_calls", None) or []
    return message.role, message.text, [(call.function, call.arguments) for call in calls]


def answers(logs) -> dict[str, list]:
    """Per task, each sample's messages and scores."""
    found = {}
    for log in logs:
        assert log.status == "success", (log.eval.model, log.error)
        found[log.eval.task] = [
            ([said(m) for m in sample.messages], {k: v.value for k, v in sample.scores.items()})
            for sample in sorted(log.samples or [], key=lambda s: str(s.id))
        ]
    return found


def batches_of(url: str) -> list[dict]:
    """The batches on the server, newest first."""
    return httpx.get(url + "/v1/batches", params={"limit": 100}).json()["data"]


def test_inspect_ai_gets_the_same_answers_all_ways(
    chat_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    with tools_serve(tmp_path, chat_model) as url:
        monkeypatch.setenv("CONVEYOR_BASE_URL", url + "/v1")
        monkeypatch.setenv("CONVEYOR_API_KEY", "unused")
        monkeypatch.setenv("OPENAI_BASE_URL", url + "/v1")
        monkeypatch.setenv("OPENAI_API_KEY", "unused")
        results = {}
        for name, (model, batch) in WAYS.items():
            before = batches_of(url)
            logs = eval(
                tasks(), model=model, batch=batch, log_dir=str(tmp_path / "logs"),
                display="none", max_retries=0, fail_on_error=True, temperature=0.0,
            )  # fmt: skip
            created = batches_of(url)[: len(batches_of(url)) - len(before)]
            if name == "responses, batch":  # batches of Responses API lines, all answered
                assert created and {b["endpoint"] for b in created} == {"/v1/responses"}
                assert {b["status"] for b in created} == {"completed"}
            else:
                assert created == [], name
            results[name] = answers(logs)
        for name, found in results.items():
            assert found == results["chat"], name
        ((messages, _),) = results["chat"]["tool"]
        called = [calls for role, _, calls in messages if role == "assistant" and calls]
        assert [name for ((name, _),) in called] == ["weather"]  # forced, and run once
