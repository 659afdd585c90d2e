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


DRAFT_PASSES_AVERAGED = 16  # a drafter pass's cost: the mean of the last this many
KEPT_CHOICES = 256  # a chooser kept from prompt to prompt (methods.Setup.learned) keeps its recent choices only


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
    chosen: list[int] = field(default_factory=list)  # per step: the nodes verified (the last KEPT_CHOICES)

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

    def best_size(self, gains: Sequence[float], draft_s: float, drafter_ran: bool = True) -> int:
        """How many of the nodes to verify (≥ 1), given each one's expected acceptance in the order they are
        verified (a prefix must be a valid draft) and what the drafter pass just made cost. drafter_ran: False when
        a union step skipped the drafter (`DrafterGate`): draft_s, the candidates' lookup, is then taken as it is
        and kept out of the drafter pass's running mean."""
        if drafter_ran:
            # the passes draft_estimate reads, no more: a chooser kept across prompts stays small
            self.measured_draft_s = [*self.measured_draft_s[-(DRAFT_PASSES_AVERAGED - 1):], draft_s]
            draft_s = self.draft_estimate()
        elif self.draft_s is not None:
            draft_s = 0.0  # fixed costs: the lookup (microseconds) is not timed, so that every size is reproducible
        best, best_rate, expected = 1, 0.0, 1.0
        for n, gain in enumerate(list(gains)[: len(self.verify_s) - 1], start=1):
            expected += gain
            rate = expected / (draft_s + self.verify_s[n])  # n nodes and the root: n + 1 tokens
            if rate > best_rate:
                best, best_rate = n, rate
        self.chosen = [*self.chosen[-(KEPT_CHOICES - 1):], best]
        return best

    def draft_estimate(self) -> float:
        """A drafter pass's seconds: the fixed cost, else the running mean of the last passes (one pass's time is
        noisy; the passes so far are a steadier estimate of the next one's), 0 before any."""
        if self.draft_s is not None:
            return self.draft_s
        return statistics.fmean(self.measured_draft_s[-DRAFT_PASSES_AVERAGED:]) if self.measured_draft_s else 0.0

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


@dataclass
class DrafterGate:
    """Whether a cost-sized union tree's step pays for the drafter pass, or verifies the model-free candidates alone.

    The model-free candidates (n-gram, SuffixDecoding) cost almost nothing and are known before the drafter runs;
    where they are long and likely, the drafter's nodes add little and its pass can cost more than they bring, and
    where they are absent the drafter may or may not beat a plain step. So the choice is learnt per bucket of the
    candidates' expected acceptance (Σ of their calibrated per-node acceptance: the expected accepted length of the
    candidates' tree), as a two-armed bandit on the modelled tokens per second of each step taken: (accepted + 1) ÷
    (the drafter pass's cost if it ran + the measured verify cost of the nodes verified). A step that ran the drafter
    also tells the other arm what the candidates alone would have made of it (TreeStep.record_gate), so the two
    arms are compared mostly on the same steps. The modelled costs, not the wall clock, so that fixed costs make the
    choices deterministic, as `CostAwareSize`'s. Each bucket starts with the drafter, tries without it once, then
    takes the better arm, trying the other every `explore_every`-th visit so that an arm's estimate follows the
    generation.

    Any choice is lossless: every node of a union tree is a fixed token chosen before the verifier's randomness, and
    the choice reads only earlier steps and this step's model-free candidates.
    """

    edges: tuple[float, ...] = (0.25, 1.0, 2.0)
    explore_every: int = 8
    decay: float = 0.9
    rates: dict[tuple[int, bool], list[float]] = field(default_factory=dict)  # (bucket, ran) -> [Σ w·rate, Σ w]
    visits: dict[int, int] = field(default_factory=dict)

    def bucket(self, expected: float) -> int:
        """The bucket of the candidates' expected acceptance (0: none or unlikely)."""
        return sum(expected >= edge for edge in self.edges)

    def rate(self, bucket: int, ran: bool) -> Optional[float]:
        total, weight = self.rates.get((bucket, ran), (0.0, 0.0))
        return total / weight if weight else None

    def run_drafter(self, bucket: int) -> bool:
        with_drafter, without = self.rate(bucket, True), self.rate(bucket, False)
        if with_drafter is None or without is None:
            return with_drafter is None  # the drafter first, then once without it
        visit = self.visits[bucket] = self.visits.get(bucket, 0) + 1
        better = with_drafter >= without
        return (not better) if visit % self.explore_every == 0 else better

    def record(self, bucket: int, ran: bool, tokens_per_s: float) -> None:
        """Fold in a step's modelled rate; older steps of the same arm and bucket count `decay` times less."""
        total, weight = self.rates.get((bucket, ran), (0.0, 0.0))
        self.rates[(bucket, ran)] = [total * self.decay + tokens_per_s, weight * self.decay + 1.0]
