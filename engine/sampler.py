"""Turn one row of logits per sequence into the next token.

The rows' own adjustments come first (a structured output's token mask, then
`engine.logits_processors`); then each row's temperature, top-k, top-p, min-p. A row's draw
is the inverse of its distribution's cumulative sum at one uniform number (summed in float64):
one random number a row, where a race of exponential noise (argmax p / q, q ~ Exp(1)) takes one
a token of the vocabulary, ~50 ms a step of 96 rows of 32,000 on a 2-core CPU against ~6. A
row with a seed draws its number from its own generator, so a seeded request samples the same
tokens whatever else is in the batch.

On the CPU, top-k looks among each row's k most likely tokens (k up to 1,024), sorting the
whole vocabulary only for a larger k: a full sort of 96 x 32,000 takes ~85 ms there (~675 for
151,936), the 64 most likely ~3. With AVX2 the draw itself is one kernel call for the step's
sampled rows (`native_layers.draw`, chosen by the device plan's `sampling`): 256 rows of
32,000 in ~7 ms, where softmax, a float64 copy of it, its cumulative sum and a search take
~23 (~70 where each step's large tensors are new memory). A row that top-k settles among its
most likely tokens draws among those alone; top-p (after top-k) and min_p are applied inside
the draw, the nucleus found from a histogram of the row's weights, with no sort (~0.05-0.1 ms
more a row of 32,000 on one thread, ~0.25-0.45 of 151,936, where a sort takes ~3 and ~17). Torch's
draw (other CPUs, GPUs) sorts: on the CPU after a look among each row's 64 most likely
tokens, which hold the nucleus of a peaked row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from conveyor.engine.logits_processors import SampleRequest, apply_logits_processors
from conveyor.engine.outputs import TokenLogprobs
from conveyor.kernels import native_layers
from conveyor.kernels.upload import to_device, upload

__all__ = ["SampleRequest", "SampleResult", "Sampler", "draw_label"]

# how a sampled row's token is drawn, in the model's fingerprint: a seeded request's tokens
# change with it (until 2026-11-28: "exponential race", noise for every token)
DRAW = "inverse cdf, float64, one float32 uniform a row"
# the native draw's top-p (until 2026-11-30 it found the nucleus as torch's draw does: by a
# sort, its sums in float32, one of the tokens tied at its edge)
NATIVE_TOP_P = "top-p in the draw: float64 sums, ties at the edge kept"


def draw_label(sampling: str) -> str:
    """What the fingerprint says of the draw of a device plan's `sampling` (native, torch)."""
    return f"{DRAW}; {NATIVE_TOP_P}" if sampling == "native" else DRAW


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # per row: {sampled: lp, top-k...} when asked for


class Sampler:
    def __init__(self, generator: torch.Generator, draw: str = "torch"):
        """`draw`: how a sampled row's token is drawn (the device plan's `sampling`): "native"
        (`native_layers.draw`, on the CPU) or "torch"."""
        self.generator = generator  # for rows without a seed
        self.native_draw = draw == "native"

    @torch.inference_mode()
    def __call__(
        self,
        logits: torch.Tensor,
        rows: list[SampleRequest],
        token_mask: Callable[[torch.Tensor], None] | None = None,
    ) -> SampleResult:
        """`token_mask`, when given, masks the logits in place (structured outputs). `logits`
        may be in the model's dtype: they are widened to float32 before anything but a plain
        greedy pick, which reads them as they are (widening changes no value or order).

        Only the rows that need more than a plain greedy pick go through the full path: one
        sampled online request in a step of 255 greedy batch rows must not cost a softmax and
        a noise draw over all 256 rows."""
        if token_mask is None:
            plain = [r.plain_greedy for r in rows]
            if all(plain):
                return SampleResult(first_max_index(logits).tolist(), [None] * len(rows))
            if any(plain):
                rest = [i for i, p in enumerate(plain) if not p]
                at = to_device(rest, logits.device)
                tokens = first_max_index(logits)
                picked, top_rest = self._pick(logits[at], [rows[i] for i in rest], None)
                tokens[at] = picked
                top: list[TokenLogprobs | None] = [None] * len(rows)
                for j, i in enumerate(rest):
                    top[i] = top_rest[j]
                return SampleResult(tokens.tolist(), top)
        tokens, top = self._pick(logits, rows, token_mask)
        return SampleResult(tokens.tolist(), top)

    def _pick(
        self,
        logits: torch.Tensor,
        rows: list[SampleRequest],
        token_mask: Callable[[torch.Tensor], None] | None,
    ) -> tuple[torch.Tensor, list[TokenLogprobs | None]]:
        """The full path: float32, logprobs, mask, processors, then greedy or sampled."""
        logits = logits.float()
        # raw model logprobs, before any sampling transform, and only if a row asks for them
        want_logprobs = any(r.params.logprobs is not None for r in rows)
        logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        if token_mask is not None:
            token_mask(logits)
        apply_logits_processors(logits, rows)

        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if len(sampled) == len(rows):
            tokens = self._sample(logits, rows)
        else:
            tokens = first_max_index(logits)
            if sampled:
                at = to_device(sampled, logits.device)
                tokens[at] = self._sample(logits[at], [rows[i] for i in sampled])

        if logprobs is None:
            return tokens, [None] * len(rows)
        token_list = tokens.tolist()
        top = [
            top_logprobs(logprobs[i], token_list[i], r.params.logprobs)
            if r.params.logprobs is not None
            else None
            for i, r in enumerate(rows)
        ]
        return tokens, top

    def _sample(self, logits: torch.Tensor, rows: list[SampleRequest]) -> torch.Tensor:
        """The rows' draws. Their settings go to the device in one copy that does not wait,
        and what to apply is decided from the settings on the host: no step waits for the
        device before its one read of the sampled ids."""
        vocab = logits.shape[1]
        settings = upload(
            torch.tensor(
                [
                    [
                        r.params.temperature if r.params.temperature > 0 else 1.0,
                        r.params.top_k if r.params.top_k > 0 else vocab,
                        r.params.top_p,
                        r.params.min_p,
                    ]
                    for r in rows
                ],
                dtype=torch.float32,
                device="cpu",
            ),
            logits.device,
        )
        with_k = any(0 < r.params.top_k < vocab for r in rows)
        filtered = with_k or any(r.params.top_p < 1.0 for r in rows)
        if self.native_draw and logits.device.type == "cpu":
            u = self._uniforms(rows, logits.device)
            if not with_k:  # top-p, where a row has one, is the draw's own
                t, p, min_p = settings[:, 0], settings[:, 2], settings[:, 3]
                return native_layers.draw(logits, t, min_p, u, p if filtered else None)
            return _draw_kept(logits, settings, rows, u)
        logits = logits / settings[:, 0:1]
        if filtered:
            logits = _top_k_top_p(logits, settings[:, 1], settings[:, 2], rows)
        probs = torch.softmax(logits, dim=-1)
        if any(r.params.min_p > 0 for r in rows):
            threshold = probs.max(dim=-1, keepdim=True).values * settings[:, 3:4]
            probs = probs.masked_fill(probs < threshold, 0.0)
        return _inverse_cdf(probs, self._uniforms(rows, probs.device))

    def _uniforms(self, rows: list[SampleRequest], device: torch.device) -> torch.Tensor:
        """One float32 number in [0, 1) a row: a seeded row's from its own generator, the
        others' from the sampler's."""
        unseeded = [i for i, r in enumerate(rows) if r.generator is None]
        if len(unseeded) == len(rows):
            return torch.empty(len(rows), device=device).uniform_(generator=self.generator)
        u = torch.empty(len(rows), device=device)
        if unseeded:
            u[to_device(unseeded, device)] = torch.empty(len(unseeded), device=device).uniform_(
                generator=self.generator
            )
        for i, r in enumerate(rows):
            if r.generator is not None:
                u[i : i + 1].uniform_(generator=r.generator)
        return u


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Each row's token: the first whose cumulative sum (float64) passes u times the row's
    total. A token of probability 0 adds nothing to the sum, so it is never the first to pass;
    u < 1 keeps the last draw at or before the last token with any weight."""
    cdf = probs.double().cumsum(dim=-1)
    at = u.double()[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, at, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


# on the CPU: how many of its most likely tokens a row without a k looks among for its nucleus
# before a full sort (torch's draw: the native one finds it without a sort), and the largest k
# whose row looks among its k most likely instead of one
NUCLEUS_GUESS = 64
MAX_K_LOOKUP = 1024


def _top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, rows: list[SampleRequest]
) -> torch.Tensor:
    """`top_k`: each row's k (the vocabulary for none), `top_p` its p, as float32 tensors.
    Drops each row's tokens past its k most likely, then those whose more likely tokens
    already reach p (keeping at least one): the tokens dropped get -inf.

    On the CPU, where a sort of the whole vocabulary is slow (~100 ms for 96 rows of 32,000),
    a row with a k of at most 1,024 keeps only tokens among its k most likely, so it looks
    only at those (~10 ms); a row without a k looks at its 64 most likely first, which hold
    the nucleus of a peaked row; the rest are sorted whole."""
    if logits.device.type != "cpu":
        return _sorted_top_k_top_p(logits, top_k, top_p)
    out = logits.clone()
    settled, pending = _settle_among_most_likely(logits, top_k, top_p, rows)
    for at, values, index in settled:
        out[at] = torch.full_like(logits[at], float("-inf")).scatter_(1, index, values)
    if pending:
        at = torch.tensor(pending)
        out[at] = _sorted_top_k_top_p(logits[at], top_k[at], top_p[at])
    return out


def _draw_kept(
    logits: torch.Tensor, settings: torch.Tensor, rows: list[SampleRequest], u: torch.Tensor
) -> torch.Tensor:
    """The native draw after top-k (`settings` the rows' [temperature, k, p, min_p]), its
    top-p and min_p applied in the draw itself: a row with a k of at most 1,024 draws among its
    k most likely tokens alone, in vocabulary order, without a row of the vocabulary's size
    being made; a row with a larger k over its whole row, the tokens past its k at -inf; a row
    without a k over its whole row, its temperature applied in the draw (only the rows with a
    k are divided by theirs here: the same weights, one pass fewer over the others)."""
    tokens = torch.empty(len(rows), dtype=torch.int64)
    t, top_k, top_p, min_p = settings[:, 0], settings[:, 1], settings[:, 2], settings[:, 3]
    vocab = logits.shape[1]
    ks = top_k.long().tolist()
    if small := [i for i, k in enumerate(ks) if k < vocab and k <= MAX_K_LOOKUP]:
        at = torch.tensor(small)
        scaled = logits[at] / t[at, None]
        values, index = scaled.topk(max(ks[i] for i in small), dim=-1)
        # each row among its own k candidates, so that where its kept tokens sit, and so the
        # order of its sums, is the row's own whatever else the step samples
        for width in sorted({ks[i] for i in small}):
            rows_of = torch.tensor([j for j, i in enumerate(small) if ks[i] == width])
            ids, order = index[rows_of, :width].sort(dim=-1)
            kept = values[rows_of, :width].gather(1, order)
            of = at[rows_of]
            picked = native_layers.draw(kept, torch.ones(len(of)), min_p[of], u[of], top_p[of])
            tokens[of] = ids.gather(1, picked[:, None])[:, 0]
    if large := [i for i, k in enumerate(ks) if MAX_K_LOOKUP < k < vocab]:
        at = torch.tensor(large)
        whole = _sorted_top_k_top_p(logits[at] / t[at, None], top_k[at], torch.ones(len(at)))
        tokens[at] = native_layers.draw(whole, torch.ones(len(at)), min_p[at], u[at], top_p[at])
    if rest := [i for i, k in enumerate(ks) if k >= vocab]:
        at = torch.tensor(rest)
        tokens[at] = native_layers.draw(logits[at], t[at], min_p[at], u[at], top_p[at])
    return tokens


def _settle_among_most_likely(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, rows: list[SampleRequest]
) -> tuple[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], list[int]]:
    """The rows with a top-k or top-p that their most likely tokens settle, in groups: each
    group's rows, the logits of their candidates (those dropped at -inf) and the candidates'
    token ids; and the rows left to a sort of the whole vocabulary."""
    vocab = logits.shape[1]
    ks = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
    pending = [i for i, r in enumerate(rows) if ks[i] < vocab or r.params.top_p < 1.0]
    with_k = [i for i in pending if ks[i] < vocab and ks[i] <= MAX_K_LOOKUP]
    without = [i for i in pending if ks[i] == vocab and vocab > NUCLEUS_GUESS]
    settled = []
    for group, n in ((with_k, max((ks[i] for i in with_k), default=0)), (without, NUCLEUS_GUESS)):
        if not group:
            continue
        at = torch.tensor(group)
        done, values, index = _among_most_likely(logits[at], top_k[at], top_p[at], n)
        if bool(done.any()):
            settled.append((at[done], values[done], index[done]))
        finished = set(at[done].tolist())
        pending = [i for i in pending if i not in finished]
    return settled, pending


def _among_most_likely(logits, top_k, top_p, n):
    """Each row's drops from its `n` most likely tokens: which rows that settles (those with k
    <= n, which keep only tokens among them, and those whose candidates already reach p, each
    weighed against its whole row's sum), the candidates' logits with their drops at -inf, and
    the candidates' token ids."""
    vocab = logits.shape[1]
    values, index = logits.topk(n, dim=-1)
    drop = torch.arange(n)[None, :] >= top_k[:, None]
    kept = values.masked_fill(drop, float("-inf"))
    whole = top_k >= vocab
    # each row's log of the sum it is normalised by: its k candidates', or all its tokens'
    # (a group of rows is most often all of one kind: only the sums it reads are made)
    if bool(whole.all()):
        norm = torch.logsumexp(logits, dim=-1)
    elif not bool(whole.any()):
        norm = torch.logsumexp(kept, dim=-1)
    else:
        norm = torch.where(whole, torch.logsumexp(logits, dim=-1), torch.logsumexp(kept, dim=-1))
    probs = (kept - norm[:, None]).exp()
    reached = probs.cumsum(dim=-1)
    settled = ~whole | (reached[:, -1] >= top_p)
    drop |= _past_nucleus(probs, reached, top_p)
    return settled, values.masked_fill(drop, float("-inf")), index


def _sorted_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """`_top_k_top_p` by a sort of the whole vocabulary (and no read of the device's data)."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    drop = ranks[None, :] >= top_k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    drop |= _past_nucleus(probs, probs.cumsum(dim=-1), top_p)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _past_nucleus(probs: torch.Tensor, reached: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Which of each row's tokens, most likely first (`probs`, and `reached` their cumulative
    sums), top-p drops: those whose more likely tokens already reach p, so that at least one
    stays. A top_p of 1 drops none (a float32 sum can round up to 1 before the last token)."""
    return ((reached - probs) >= top_p[:, None]) & (top_p[:, None] < 1.0)


def first_max_index(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, the first index on ties. `max(dim).indices` gives the same answer
    and on the CPU runs several times faster than `argmax` (2 vs 9 ms for 256 x 32,000);
    on a CPU where `native_layers` runs the rows' dtype (bfloat16 with AVX512-BF16, float32
    with AVX2) its one pass is faster again: 5-8x in bfloat16, ~5x in float32."""
    if x.device.type == "cpu" and native_layers.available(x.dtype):
        return native_layers.first_max_index(x)
    return x.max(dim=-1).indices


def top_logprobs(row: torch.Tensor, token_id: int, k: int) -> TokenLogprobs:
    """{token_id: its logprob} plus the `k` most likely tokens of one row of logprobs."""
    result = {token_id: float(row[token_id])}
    if k > 0:
        values, ids = row.topk(k)
        for v, t in zip(values.tolist(), ids.tolist(), strict=True):
            result.setdefault(t, v)
    return result
