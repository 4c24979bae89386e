"""A reasoning model's thinking, split from its answer: `--reasoning-parser` names the markers
its output uses, and a chat's `message.content` then holds the answer alone, its thinking in
`reasoning_content` (the field SGLang and older vLLM use) and `reasoning` (vLLM's newest), the
same in streamed deltas, and `usage.completion_tokens_details.reasoning_tokens` counts it.

    qwen3        thinking only where the output opens a `<think>` block (Qwen3 with
                 `enable_thinking`); an output without one is all answer
    deepseek_r1  the output starts inside the thinking (the template opened the block, as
                 DeepSeek-R1's distills and Qwen3's thinking-only models do): everything before
                 `</think>` is thinking
    markers:START,END
                 a model's own markers: thinking where the output opens a block with START,
                 up to END (as qwen3 with other markers)

An output cut (by `max_tokens`) inside its thinking has an empty answer. A request that turns
thinking off (`chat_template_kwargs: {"enable_thinking": false}`) is not split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    opens_itself: bool = True  # False: the output starts inside the thinking

    def split(self, text: str, finished: bool = True) -> tuple[str | None, str]:
        """(thinking or None, answer) of an output; of one still growing (`finished` False),
        the parts no later token can change: a marker not yet whole waits."""
        head = text.lstrip()
        if head.startswith(self.start):
            body = head[len(self.start) :]
        elif not finished and self.start.startswith(head):
            return None, ""  # it may still open a block
        elif self.opens_itself:
            return None, text
        else:
            body = text
        cut = body.find(self.end)
        if cut >= 0:
            return body[:cut], body[cut + len(self.end) :]
        if not finished:
            body = _without_partial(body, self.end)
        return body, ""


PARSERS = {
    "qwen3": ReasoningParser("qwen3"),
    "deepseek_r1": ReasoningParser("deepseek_r1", opens_itself=False),
}
MARKERS_PREFIX = "markers:"


def reasoning_parser(name: str) -> ReasoningParser:
    """The parser a --reasoning-parser value names: one of `PARSERS`, or `markers:START,END`."""
    if name.startswith(MARKERS_PREFIX):
        start, end = name[len(MARKERS_PREFIX) :].split(",")
        return ReasoningParser(name, start.strip(), end.strip())
    return PARSERS[name]


def _without_partial(text: str, marker: str) -> str:
    """`text` less a tail that is the beginning of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return text[:-n]
    return text


def reasoning_tokens(
    parser: ReasoningParser, token_ids: Sequence[int], tokenizer: Any, thinking: str | None
) -> int:
    """How many of the output's tokens its thinking took, up to its end marker: the fewest
    leading tokens whose text holds the marker (all of them when it never came)."""
    if thinking is None:
        return 0
    if tokenizer is None:
        return len(token_ids)
    low, high = 1, len(token_ids)
    if parser.end not in tokenizer.decode(list(token_ids)):
        return len(token_ids)
    while low < high:  # the text of a prefix holds the marker from some length on
        mid = (low + high) // 2
        if parser.end in tokenizer.decode(list(token_ids[:mid])):
            high = mid
        else:
            low = mid + 1
    return low
