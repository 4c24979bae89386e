"""The prompt logprobs a sequence gathers and a cached block keeps: plain data, apart from
the code that computes them (`prompt_logprobs`), so that the sequence and the block manager
hold them without importing it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.engine.outputs import TokenLogprobs


@dataclass(frozen=True)
class LogprobEntry:
    """One prompt position: its token's logprob and the most likely tokens there."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token, logprob), most likely first

    def as_dict(self, k: int) -> TokenLogprobs:
        """{token: its logprob} plus the `k` most likely tokens, as the outputs give them."""
        result = {self.token: self.logprob}
        for t, v in self.top[:k]:
            result.setdefault(t, v)
        return result


@dataclass
class BlockLogprobs:
    """What a cached prompt block keeps: the logprobs of its positions and its boundary."""

    k: int  # alternatives kept per position
    entries: list[LogprobEntry | None]  # one per position; None only for a prompt's first
    boundary: torch.Tensor  # final hidden state at its last position: [hidden]
