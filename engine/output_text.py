"""A sequence's output text as its tokens come, and the stop strings looked for in it: only
in the text the last token added (and the characters before it that a stop string ending in
it would start in), so a stop string costs the same at every length of output."""

from __future__ import annotations

from conveyor.engine.detokenizer import Detokenizer
from conveyor.engine.sampling_params import SamplingParams


class OutputText:
    def __init__(self, detokenizer: Detokenizer, params: SamplingParams) -> None:
        self._detokenizer = detokenizer
        self._stop = params.stop
        self._min_tokens = params.min_tokens
        self._include_stop = params.include_stop_str_in_output
        self.text = ""  # what no later token can change
        self._ended = False

    def append(self, token_id: int, num_output_tokens: int, ended: bool = False) -> str | None:
        """Add the text of the sequence's `num_output_tokens`-th token. The stop string it
        completes, if any, unless the sequence `ended` by another rule: the text then ends
        before it (with it, where the request includes stop strings in the output)."""
        start = len(self.text)
        self.text += self._detokenizer.step(token_id)
        if ended or not self._stop or num_output_tokens < self._min_tokens:
            return None
        held = self._detokenizer.held
        text = self.text + held if held else self.text
        hit = first_stop(text, start, self._stop)
        if hit is None:
            return None
        pos, stop = hit
        self.text = text[: pos + len(stop) if self._include_stop else pos]
        self._ended = True
        return stop

    def final(self) -> str:
        """The whole text, once the sequence has ended (the text held back comes out)."""
        if not self._ended:
            self.text += self._detokenizer.flush()
            self._ended = True
        return self.text


def first_stop(text: str, start: int, stops: list[str]) -> tuple[int, str] | None:
    """The first of `stops` in `text` that ends past `start`, and where it begins."""
    hits = [(text.find(stop, max(0, start - len(stop) + 1)), stop) for stop in stops]
    return min(((pos, stop) for pos, stop in hits if pos >= 0), default=None)
