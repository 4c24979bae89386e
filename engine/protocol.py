"""What a service needs of an engine, typed: the paged-KV engine (`LLM`) is one, and so is the
worker's null engine (`conveyor worker --model echo`). The worker, the online server and the
offline runner hold an `Engine`, never `Any`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from conveyor.engine.outputs import RequestOutput
from conveyor.engine.sampling_params import SamplingParams


@dataclass(frozen=True, eq=False)
class TokenizedPrompt:
    """A prompt tokenized, its ids checked against the vocabulary, by `Engine.prepare_prompt`
    on the caller's thread: the engine's thread then takes it as it is. `text`: the prompt as
    given, where it was text."""

    token_ids: list[int]
    text: str | None = None

    @property
    def as_given(self) -> str | list[int]:
        """The prompt as its request gave it: its text, else its ids."""
        return self.text if self.text is not None else self.token_ids


Prompt = str | list[int] | TokenizedPrompt


@runtime_checkable
class Engine(Protocol):
    tokenizer: Any  # a Hugging Face tokenizer, or an object with its `decode`; None: ids only
    max_model_len: int | None  # None: no limit of its own
    vocab_size: int | None
    plan: Any  # how each piece of a step runs (`device_plan.DevicePlan`), None where none
    # the sampling a request that omits a field gets (the checkpoint's generation_config.json)
    default_sampling: dict[str, Any]
    reasoning_parser: str | None  # the markers of its thinking (`--reasoning-parser`)
    tool_call_parser: str | None  # how it writes tool calls (`--tool-call-parser`)

    def prepare_prompt(self, prompt: str | list[int]) -> Prompt:
        """What of `add_request`'s work on `prompt` can be done before the engine's thread
        (tokenizing it, checking its ids); raises the engine's `InvalidPromptError`."""
        ...

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        stream: bool = False,
    ) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def abort(self, request_id: str) -> None: ...

    def has_unfinished(self) -> bool: ...

    def running_request_ids(self) -> set[str]: ...

    def stats(self) -> Any: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> str | list[int]: ...

    def served_chat_template(self) -> str | dict[str, str] | None:
        """The template chats are rendered with (`/tokenizer_info` tells it)."""
        ...

    def render_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The text `apply_chat_template` tokenizes."""
        ...
