"""The chat template conversations are rendered with: the checkpoint's, or one the server is
given as a Jinja file or as text (`--chat-template`), with the server's default variables
(`--default-chat-template-kwargs`) under each request's own (`chat_template_kwargs`, e.g.
Qwen3's `{"enable_thinking": false}`). transformers renders it, in its sandbox."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conveyor.engine.errors import ChatTemplateError, InvalidPromptError

# what `apply_chat_template` passes the template or reads as its own options: a request's
# variables may not set them
RESERVED_VARIABLES = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})  # fmt: skip


# what a chat template writes a tool call with, and the --tool-call-parser that reads it
TOOL_CALL_MARKERS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"),
                     ("<|python_tag|>", "llama3_json"))  # fmt: skip


def tool_call_parser_of(template: str | None) -> str | None:
    """The tool-call parser a chat template's markers call for (Qwen's and Hermes'
    `<tool_call>`, Mistral's `[TOOL_CALLS]`, Llama 3's `<|python_tag|>`), None when it names
    none of them or more than one."""
    found = {parser for marker, parser in TOOL_CALL_MARKERS if marker in (template or "")}
    return found.pop() if len(found) == 1 else None


@dataclass(frozen=True)
class ChatTemplate:
    text: str | None  # None: the tokenizer's own
    name: str  # how a message names it
    defaults: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(
        cls, given: str | None, defaults: dict[str, Any] | None, model_path: Path
    ) -> ChatTemplate:
        """`given` (a file, or the template's text), else the checkpoint's; a template that
        does not parse, or defaults that set a reserved name, are refused here, at start."""
        _check_variables(defaults or {}, "--default-chat-template-kwargs")
        if given is None:
            return cls(None, f"the chat template of {model_path}", dict(defaults or {}))
        path = Path(given).expanduser()
        if path.is_file():
            text, name = path.read_text(encoding="utf-8"), f"the chat template {path}"
        elif "{{" in given or "{%" in given:
            text, name = given, "the --chat-template text"
        else:
            raise ValueError(f"--chat-template {given!r} is neither a file nor a Jinja template")
        _check_syntax(text, name)
        return cls(text, name, dict(defaults or {}))

    def render(
        self,
        tokenizer: Any,
        conversation: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        variables: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The conversation as the prompt text; raises `ChatTemplateError` naming the
        template when it cannot."""
        if tokenizer is None:
            raise InvalidPromptError("this model has no tokenizer; pass prompts as token ids")
        if self.text is None and not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError(
                f"{self.name}: the tokenizer has none; give the server one with --chat-template"
            )
        _check_variables(variables or {}, "chat_template_kwargs")
        try:
            return tokenizer.apply_chat_template(
                conversation,
                chat_template=self.text,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **{**self.defaults, **(variables or {})},
            )
        except Exception as err:  # a template raises what its author wrote, and Jinja's errors
            raise ChatTemplateError(f"{self.name} could not render the messages: {err}") from None


def _check_variables(variables: dict[str, Any], where: str) -> None:
    taken = sorted(set(variables) & RESERVED_VARIABLES)
    if taken:
        raise ChatTemplateError(
            f"{where} may not set {taken[0]!r}: the server passes it to the template itself",
            "chat_template_kwargs",
        )


def _check_syntax(text: str, name: str) -> None:
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(
            f"{name} is not a valid Jinja template: line {err.lineno}: {err.message}"
        ) from None
