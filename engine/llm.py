"""`LLM`: offline generation over the step-level engine, shaped like vLLM's `LLM`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.outputs import RequestOutput
from conveyor.engine.protocol import Prompt
from conveyor.engine.sampling_params import SamplingParams

Message = dict[str, Any]


class LLM(LLMEngine):
    _ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of `prompts`."""
        prompt_list = _as_prompt_list(prompts)
        if params is None or isinstance(params, SamplingParams):
            param_list = [params or self.get_default_sampling_params()] * len(prompt_list)
        else:
            param_list = list(params)
            if len(param_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(prompt_list)} prompts but {len(param_list)} sampling params"
                )
        ids = [f"gen-{next(self._ids)}" for _ in prompt_list]
        try:
            for request_id, prompt, p in zip(ids, prompt_list, param_list, strict=True):
                self.add_request(request_id, prompt, p)
        except ValueError:
            for request_id in ids:
                self.abort(request_id)
            raise

        wanted = set(ids)
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm) as bar:
            while wanted - results.keys():
                start_tokens = self.generation_tokens
                for output in self.step():
                    if output.request_id in wanted:
                        results[output.request_id] = output
                        bar.update(1)
                bar.set_postfix(tokens=self.generation_tokens - start_tokens, refresh=False)
        return [results[i] for i in ids]

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Apply the chat template to each conversation (offering it `tools`, OpenAI's
        function tools, where given) and generate replies; `continue_final_message`: the
        model continues each conversation's last message rather than starting a new one."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.apply_chat_template(
                c, add_generation_prompt, chat_template_kwargs, tools, continue_final_message
            )
            for c in conversations
        ]
        return self.generate(prompts, params, use_tqdm)

    def render_chat_template(
        self,
        conversation: list[Message],
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The conversation rendered by the chat template (`--chat-template`, else the
        checkpoint's), with `chat_template_kwargs` over the server's defaults and the `tools`
        the model may call (OpenAI's `{"type": "function", "function": {...}}`)."""
        return self.chat_template.render(
            self.tokenizer,
            conversation,
            add_generation_prompt,
            chat_template_kwargs,
            tools,
            continue_final_message,
        )

    def apply_chat_template(
        self,
        conversation: list[Message],
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        """`render_chat_template`'s text, tokenized (the template writes the special tokens
        it wants)."""
        text = self.render_chat_template(
            conversation, add_generation_prompt, chat_template_kwargs, tools, continue_final_message
        )
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts
