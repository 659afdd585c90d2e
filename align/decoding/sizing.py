"""Cost-aware draft size: each step, verify as many draft tokens (or tree nodes) as maximise expected tokens per second.

One drafter pass proposes a path of γ tokens or a best-first tree; any prefix of either is a valid draft (a tree's
best-first order puts parents before children). Verifying the first n nodes emits, in expectation,

    1 + Σ_{j ≤ n} P(node j accepted)         tokens, at a cost of   t_draft + t_verify(n + 1)  seconds,

so the step takes the n with the best ratio. t_verify is this hardware's measured cost curve (a verifier forward over
n new tokens, measured once at start-up: flat on a GPU until it is compute-bound, rising from the first token on a
CPU); t_draft is the running mean of the drafter passes so far. P(node j accepted) is the drafter's own probability
of the node's path, exp(cumulative log-probability), times a per-depth calibration factor learnt as the generation
goes: the accepted paths' lengths against the probability the verified nodes of each depth predicted. The calibration
is a running per-position acceptance estimate, sharpened per step by the drafter's confidence in this very draft; a
drafter whose confidence is its acceptance rate needs none.

A sampled draft's size is chosen from the drafter's distributions alone (the scores of its most likely tokens), before
the draft is drawn: choosing it from the tokens drawn would keep a position more often when it drew a likely token, and
the kept tokens would no longer be draws from the q they are accepted against (not lossless). `update` may read
anything the verified step produced: it only informs later steps' choices, each still made before its own draft.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from align.decoding.timers import verifier_latency


def measure_verify_costs(verifier: Any, context_len: int, max_tokens: int, rounds: int = 5) -> list[float]:
    """Seconds of one cached verifier forward over n = 1..max_tokens new tokens after `context_len` tokens.

    Measured at every n up to 17 and on a ×1.5 grid beyond (linearly interpolated between), in `rounds` rounds that
    each visit every n once, so a burst of load elsewhere on the machine lands on all sizes alike; each size's median
    is kept, then made non-decreasing (a larger forward never costs less; the pool-adjacent-violators fit averages
    out what noise says otherwise, where a running maximum would spread one outlier over all larger sizes)."""
    grid = set(range(1, min(max_tokens, 17) + 1)) | {max_tokens}
    n = 17
    while n < max_tokens:
        n = math.ceil(n * 1.5)
        grid.add(min(n, max_tokens))
    sizes = sorted(grid)
    verifier_latency(verifier, context_len, sizes[-1], repeats=1)  # warm-up: allocator, kernels
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(rounds):
        for n in sizes:
            times[n].append(verifier_latency(verifier, context_len, n, repeats=1))
    fitted = dict(zip(sizes, non_decreasing([statistics.median(times[n]) for n in sizes])))
    costs = []
    for n in range(1, max_tokens + 1):
        below = max(g for g in sizes if g <= n)
        above = min(g for g in sizes if g >= n)
        share = 0.0 if above == below else (n - below) / (above - below)
        costs.append(fitted[below] + share * (fitted[above] - fitted[below]))
    return costs


def non_decreasing(values: Sequence[float]) -> list[float]:
    """The least-squares non-decreasing fit (pool adjacent violators): runs that fall are replaced by their mean."""
    blocks: list[list[float]] = []  # [mean, count]
    for value in values:
        blocks.append([value, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (mean_a, count_a), (mean_b, count_b) = blocks.pop(-2), blocks.pop()
            blocks.append([(mean_a * count_a + mean_b * count_b) / (count_a + count_b), count_a + count_b])
    return [mean for mean, count in blocks for _ in range(int(count))]


@dataclass
class CostAwareSize:
    """Chooses each step's draft size from the measured verifier costs and calibrated drafter confidences.

    verify_s[n - 1]: seconds of a verifier forward over n new tokens (measure_verify_costs), n = 1..len(verify_s);
    a draft of n nodes is verified with its root, so at most len(verify_s) - 1 nodes are drafted.
    draft_s: a drafter pass's seconds, when known in advance (tests fix it, making choices deterministic); None:
    a running mean of the passes measured, the one just made included.
    decay: how fast old steps are forgotten (per step); prior: pseudo-tokens of predicted acceptance pulling a depth's
    calibration toward the pooled one while that depth has little data of its own.
    """

    verify_s: list[float]
    draft_s: Optional[float] = None
    decay: float = 0.9
    prior: float = 2.0
    measured_draft_s: list[float] = field(default_factory=list)
    predicted: list[float] = field(default_factory=list)  # per depth: Σ drafter probability of the verified nodes
    observed: list[float] = field(default_factory=list)  # per depth: Σ 1[accepted path reached that depth]
    chosen: list[int] = field(default_factory=list)  # per step: the nodes verified

    def calibration(self, depth: int) -> float:
        """Accepted ÷ predicted at `depth` (1-based), shrunk toward all depths' ratio (1 before any data)."""
        pooled = (sum(self.observed) + self.prior) / (sum(self.predicted) + self.prior)
        if depth > len(self.predicted):
            return pooled
        return (self.observed[depth - 1] + self.prior * pooled) / (self.predicted[depth - 1] + self.prior)

    def gains(self, scores: Sequence[float], depths: Sequence[int]) -> list[float]:
        """Expected acceptance of each node: calibrated exp(cumulative drafter log-probability), at most 1."""
        return [min(1.0, self.calibration(d) * math.exp(s)) for s, d in zip(scores, depths)]

    def choose(self, scores: Sequence[float], depths: Sequence[int], draft_s: float) -> int:
        """How many of the best-first nodes to verify (≥ 1). scores: each node's cumulative drafter log-probability;
        depths: 1 for the root's children; draft_s: what the drafter pass just made cost."""
        return self.best_size(self.gains(scores, depths), draft_s)

    def best_size(self, gains: Sequence[float], draft_s: float) -> int:
        """How many of the nodes to verify (≥ 1), given each one's expected acceptance in the order they are
        verified (a prefix must be a valid draft) and what the drafter pass just made cost."""
        self.measured_draft_s.append(draft_s)
        if self.draft_s is not None:
            draft_s = self.draft_s
        else:  # one pass's time is noisy; the passes so far are a steadier estimate of the next one's
            draft_s = statistics.fmean(self.measured_draft_s[-16:])
        best, best_rate, expected = 1, 0.0, 1.0
        for n, gain in enumerate(list(gains)[: len(self.verify_s) - 1], start=1):
            expected += gain
            rate = expected / (draft_s + self.verify_s[n])  # n nodes and the root: n + 1 tokens
            if rate > best_rate:
                best, best_rate = n, rate
        self.chosen.append(best)
        return best

    def update(self, scores: Sequence[float], depths: Sequence[int], num_accepted: int) -> None:
        """Fold in one verified draft: the nodes verified (as passed to choose, cut to the chosen size) and how many
        tokens of it the verifier accepted."""
        deepest = max(depths, default=0)
        if deepest > len(self.predicted):
            grow = deepest - len(self.predicted)
            self.predicted += [0.0] * grow
            self.observed += [0.0] * grow
        self.predicted = [p * self.decay for p in self.predicted]
        self.observed = [o * self.decay for o in self.observed]
        for score, depth in zip(scores, depths):
            self.predicted[depth - 1] += math.exp(score)
        for depth in range(1, num_accepted + 1):
            self.observed[depth - 1] += 1.0
