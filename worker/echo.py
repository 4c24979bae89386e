"""A null engine that answers every request with its own prompt.

`conveyor worker --model echo` serves it: it measures everything around the engine (API,
broker, ledger, writer) without spending time on a model. By default it answers everything at
once. With CONVEYOR_ECHO_STEP_SECONDS set, each step instead waits that long without using the
CPU, as an engine waits on its GPU, and answers at most `max_num_seqs` requests: a stand-in for
a real model's pace on other hardware.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from conveyor.engine.outputs import CompletionOutput, RequestOutput
from conveyor.engine.protocol import Prompt, TokenizedPrompt

ECHO_MODEL = "echo"


@dataclass
class EchoStats:
    num_running: int = 0
    num_waiting: int = 0
    generation_tokens: int = 0


class EchoTokenizer:
    eos_token_id = None

    def decode(self, ids: list[int], **_: Any) -> str:
        return " ".join(map(str, ids))

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [str(i) for i in ids]


class EchoEngine:
    def __init__(self, step_seconds: float = 0.0, max_num_seqs: int = 256) -> None:
        self.tokenizer = EchoTokenizer()
        self.pending: deque[RequestOutput] = deque()
        self.generated = 0
        self.step_seconds, self.max_num_seqs = step_seconds, max_num_seqs
        self.max_model_len: int | None = None  # no context of its own
        self.vocab_size: int | None = None
        self.plan = None
        self.default_sampling: dict[str, Any] = {}  # no checkpoint, no defaults of its own
        self.reasoning_parser: str | None = None
        self.tool_call_parser: str | None = None

    def render_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The messages as lines, then the template variables and the tools' names asked for
        (so a test sees them arrive)."""
        lines = [f"{m.get('role')}: {m.get('content') or ''}" for m in messages]
        lines += [f"{k}={v}" for k, v in sorted((chat_template_kwargs or {}).items())]
        if tools:
            lines.append("tools: " + ", ".join(t["function"]["name"] for t in tools))
        return "\n".join(lines)

    apply_chat_template = render_chat_template  # its prompts are text

    def served_chat_template(self) -> None:
        return None  # no template: the lines above

    def prepare_prompt(self, prompt: str | list[int]) -> Prompt:
        return prompt  # nothing to tokenize: the echo is the prompt's words

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: Any,
        *,
        priority: int = 0,
        stream: bool = False,
    ) -> None:
        """Answers in the next step, whatever the priority; a streamed request gets its one
        final output."""
        if isinstance(prompt, TokenizedPrompt):
            prompt = prompt.as_given
        text = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
        ids = list(range(len(text.split())))
        out = CompletionOutput(0, text, ids, None, None, "stop")
        self.generated += len(ids)
        self.pending.append(
            RequestOutput(request_id, text, ids, None, [out], finished=True, num_cached_tokens=0)
        )

    def step(self) -> list[RequestOutput]:
        if not self.step_seconds:
            done = list(self.pending)
            self.pending.clear()
            return done
        time.sleep(self.step_seconds)
        return [self.pending.popleft() for _ in range(min(self.max_num_seqs, len(self.pending)))]

    def abort(self, request_id: str) -> None:
        self.pending = deque(o for o in self.pending if o.request_id != request_id)

    def has_unfinished(self) -> bool:
        return bool(self.pending)

    def running_request_ids(self) -> set[str]:
        return {output.request_id for output in self.pending}

    def stats(self) -> EchoStats:
        return EchoStats(generation_tokens=self.generated)
