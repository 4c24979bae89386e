"""What a request asks to change in its logits before a token is drawn, applied to the whole
batch at once: tokens banned until `min_tokens`, `allowed_token_ids`, `logit_bias`, and the
repetition, frequency and presence penalties (in vLLM's order).

Each adjustment gathers the rows that use it into flat index tensors and changes the logits
with a few gathers and scatters over the (row, token) pairs involved, never a per-row tensor
op, and never a pass over the whole [rows, vocab] logits for a few tokens.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from conveyor.engine.sampling_params import SamplingParams
from conveyor.kernels.upload import to_device


@dataclass
class SampleRequest:
    """One row of logits: the request's settings and the sequence's tokens so far."""

    params: SamplingParams
    generator: torch.Generator | None
    banned_token_ids: list[int]  # EOS / stop ids while fewer than min_tokens were generated
    token_ids: Seq[int] = ()  # prompt and generated tokens
    num_prompt_tokens: int = 0
    prompt_token_set: torch.Tensor | None = None  # the prompt's distinct ids, for repetition

    def distinct_prompt_ids(self) -> torch.Tensor:
        if self.prompt_token_set is None:
            prompt = torch.tensor(self.token_ids[: self.num_prompt_tokens], device="cpu")
            self.prompt_token_set = prompt.unique()
        return self.prompt_token_set

    @property
    def output_token_ids(self) -> Seq[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @functools.cached_property
    def plain_greedy(self) -> bool:
        """A greedy row that asks for no logprobs and whose logits nothing adjusts (asked
        every step of a row the engine keeps: worked out once)."""
        params = self.params
        return params.greedy and params.logprobs is None and not changes_logits(self)


def changes_logits(row: SampleRequest) -> bool:
    """Whether `apply_logits_processors` changes this row."""
    params = row.params
    return bool(
        params.allowed_token_ids is not None
        or row.banned_token_ids
        or params.logit_bias
        or params.has_penalties
    )


def apply_logits_processors(logits: torch.Tensor, rows: list[SampleRequest]) -> None:
    """Change `logits` (one row per request, float32) in place."""
    _apply_allowed(logits, rows)
    _add_at(logits, [(i, t, float("-inf")) for i, r in enumerate(rows) for t in r.banned_token_ids])
    _add_at(
        logits,
        [
            (i, token, bias)
            for i, r in enumerate(rows)
            if r.params.logit_bias
            for token, bias in r.params.logit_bias.items()
        ],
    )
    _apply_penalties(logits, rows)


def _add_at(logits: torch.Tensor, entries: list[tuple[int, int, float]]) -> None:
    if not entries:
        return
    rows, tokens, values = zip(*entries, strict=True)
    device = logits.device
    logits.index_put_(
        (to_device(rows, device), to_device(tokens, device)),
        to_device(values, device, logits.dtype),
        accumulate=True,
    )


def _apply_allowed(logits: torch.Tensor, rows: list[SampleRequest]) -> None:
    limited = [(i, r.params.allowed_token_ids) for i, r in enumerate(rows)]
    limited = [(i, ids) for i, ids in limited if ids is not None]
    if not limited:
        return
    keep = torch.zeros_like(logits, dtype=torch.bool)
    keep[flat_pairs(limited, logits.device)] = True
    index = to_device([i for i, _ in limited], logits.device)
    logits[index] = logits[index].masked_fill(~keep[index], float("-inf"))


def flat_pairs(
    lists: list[tuple[int, Seq[int]]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) index tensors of the ids in each (row, ids) pair."""
    row = to_device([r for r, ids in lists for _ in ids], device)
    flat = list(itertools.chain.from_iterable(ids for _, ids in lists))
    return row, to_device(flat, device)


def unique_pairs(
    row: torch.Tensor, column: torch.Tensor, vocab: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct (row, column) pairs and how often each occurs."""
    keys, counts = torch.unique(row * vocab + column, return_counts=True)
    return keys // vocab, keys % vocab, counts


def _apply_penalties(logits: torch.Tensor, rows: list[SampleRequest]) -> None:
    """Only the (row, token) pairs a sequence has seen change: gathered, changed, scattered."""
    penalised = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not penalised:
        return
    device, vocab = logits.device, logits.shape[1]

    def per_row(name: str) -> torch.Tensor:
        values = [getattr(r.params, name) for r in rows]
        return to_device(values, device, logits.dtype)

    output_rows, output_ids = flat_pairs([(i, rows[i].output_token_ids) for i in penalised], device)
    if any(rows[i].params.repetition_penalty != 1.0 for i in penalised):
        # rows with a penalty of 1 are divided or multiplied by 1.0: left exactly as they are
        prompts = [rows[i].distinct_prompt_ids().to(device) for i in penalised]
        sizes = [len(p) for p in prompts]
        prompt_rows = to_device(
            [i for i, n in zip(penalised, sizes, strict=True) for _ in range(n)], device
        )
        row, token, _ = unique_pairs(
            torch.cat([prompt_rows, output_rows]), torch.cat([*prompts, output_ids]), vocab
        )
        penalty = per_row("repetition_penalty")[row]
        values = logits[row, token]
        logits[row, token] = torch.where(values > 0, values / penalty, values * penalty)
    row, token, count = unique_pairs(output_rows, output_ids, vocab)
    if row.numel():
        values = logits[row, token] - per_row("frequency_penalty")[row] * count.to(logits.dtype)
        logits[row, token] = values - per_row("presence_penalty")[row]
