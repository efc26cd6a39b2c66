"""The content oracle: is a restored answer the answer a server that recomputes gives?

Equal greedy tokens, and the first answer tokens' top candidates with each logprob within a
tolerance (equal tokens alone are weak evidence; why: docs/operating.md, "Validating a
deployment"). Pure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# fp32 servers compute a restored request's new tokens with the same chunk
# shapes as a recompute; 1e-4 leaves room for summation-order noise, which is
# orders of magnitude below what a wrong page moves.
LOGPROB_TOLERANCE = 1e-4

TopLogprobs = Sequence[Sequence[tuple[int, float]]]


@dataclass(frozen=True)
class Verdict:
    tokens_equal: bool
    # Largest |logprob difference| over the compared tokens' top candidates;
    # inf when a token's candidates differ, nan when there was nothing to compare.
    max_logprob_delta: float
    compared_tokens: int
    tolerance: float

    @property
    def agrees(self) -> bool:
        return self.tokens_equal and self.max_logprob_delta <= self.tolerance

    def describe(self) -> str:
        delta = (
            f"{self.max_logprob_delta:.2e}"
            if math.isfinite(self.max_logprob_delta)
            else ("candidates differ" if math.isinf(self.max_logprob_delta) else "none compared")
        )
        tokens = "tokens equal" if self.tokens_equal else "tokens differ"
        return f"{tokens}, max top-logprob delta over {self.compared_tokens} tokens: {delta}"


def compare(
    restored_ids: Sequence[int],
    restored_top: TopLogprobs,
    reference_ids: Sequence[int],
    reference_top: TopLogprobs,
    tokens: int = 4,
    tolerance: float = LOGPROB_TOLERANCE,
) -> Verdict:
    """The greedy tokens, and the top candidates of the first ``tokens`` answer tokens."""
    delta, compared = float("nan"), 0
    for mine, theirs in list(zip(restored_top, reference_top, strict=False))[:tokens]:
        mine_map, their_map = dict(mine), dict(theirs)
        compared += 1
        if not mine_map or set(mine_map) != set(their_map):
            delta = float("inf")
            break
        worst = max(abs(mine_map[t] - their_map[t]) for t in mine_map)
        delta = worst if math.isnan(delta) else max(delta, worst)
    if not math.isinf(delta) and compared < min(tokens, len(reference_top)):
        delta = float("nan")  # an answer without logprobs agrees with nothing
    return Verdict(
        tokens_equal=tuple(restored_ids) == tuple(reference_ids),
        max_logprob_delta=delta,
        compared_tokens=compared,
        tolerance=tolerance,
    )
