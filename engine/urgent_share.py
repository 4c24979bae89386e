"""How much of the engine's work more urgent requests may take while less urgent work is present.

Online requests (priority 0) go before batch work (priority 1): right for one request, wrong
for a flood. Fifty clients that open streams in a loop would otherwise hold the engine for as
long as they keep at it, and a batch behind them would crawl. So while less urgent work is
present, urgent sequences are admitted only while their bucket holds credit, counted in tokens:
every step adds `share` of the tokens it computes, and every token computed for an urgent
sequence (its prompt, drawn at admission, and each one generated) takes one away. When nothing
less urgent is present the bucket only fills, up to `share` of a step's token budget, so a few
urgent requests start at once however long a batch has run.

Counted in tokens rather than seconds, the order of admission depends on the requests alone,
never on the machine's timing.
"""

from __future__ import annotations


class UrgentShare:
    def __init__(self, share: float, step_tokens: int) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"the urgent share must be in (0, 1], got {share}")
        self.share = share
        self.burst = share * step_tokens
        self.credit = self.burst

    @property
    def bounded(self) -> bool:
        return self.share < 1

    def has_credit(self) -> bool:
        return self.credit > 0

    def admit(self, tokens: int) -> None:
        """An urgent sequence starts with `tokens` tokens to compute."""
        self.credit -= tokens

    def step_done(self, tokens: int, urgent_tokens: int, bounded: bool) -> None:
        """A step computed `tokens` tokens, `urgent_tokens` of them for urgent sequences and
        not drawn at their admission; `bounded`: less urgent work was present."""
        if bounded:
            self.credit = min(self.burst, self.credit + self.share * tokens - urgent_tokens)
        else:
            self.credit = min(self.burst, self.credit + tokens)
