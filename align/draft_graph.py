"""Spiffy draft graphs: token-agnostic guesses of a dLLM block's future states, calibrated offline.

A node is a *formula*: a set of (i, j) pairs, "the i-th masked position gets its j-th most likely token" (1-based
ranks), applied on top of the current block state. The ranks are read from the distribution that produced the current
state, the one known before the next forward, so all drafts can join that forward. With one token unmasked per step,
a node with d pairs guesses the state d steps ahead; A is a parent of B when B adds `tokens_per_step` pairs to A
(several parents are possible: the graph is a DAG, and the empty formula, the current state, is the root).

Masked positions are ranked in one of two orders, chosen at calibration by the forwards each saves on the traces:
- `confidence` (Spiffy's): most confident first. Right for a model whose confidence ranking is stable from one step
  to the next (LLaDA-8B).
- `nearest` (ours): closest to the position(s) the last step unmasked first, right side before left. A small dLLM
  tends to decode locally, next to what it just unmasked, and then confidence ranks guess its future poorly
  (docs/results/2026-11-30-spiffy-tiny.md: how often, on the tiny drafter-base).
Either order only shapes the guesses; the real state is always computed by the vanilla rule, so outputs are the same.

Calibration counts, on vanilla traces, which formulas describe the states 1, 2, ... steps later, and picks a
connected set of `budget` nodes by the forwards the graph saves when replayed on the traces (`simulated`: the quantity
Spiffy's objective stands in for, and cheap to compute exactly here), or by Spiffy's degree-1 accumulation objective
Σ_{q∈Q} [count(q) + Σ_{p∈parents(q)∩Q} count(p)] (`degree1`).
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal, Optional

import torch

from align.checkpoint import weights_sha256_of
from align.config import RecipeError
from align.decoding.dllm import BlockTrace, StepRanks
from align.disk import write_text_atomic

Pair = tuple[int, int]
Formula = frozenset  # of Pair
PositionOrder = Literal["confidence", "nearest"]
POSITION_ORDERS: tuple[PositionOrder, ...] = ("confidence", "nearest")
GRAPH_VERSION = 2  # 2: position_order


# --------------------------------------------------------------------------------------------------------------------
# formulas <-> states
# --------------------------------------------------------------------------------------------------------------------
def ranked_positions(block: torch.Tensor, ranks: StepRanks, mask_id: int, order: PositionOrder = "confidence",
                     previous: Optional[torch.Tensor] = None) -> list[int]:
    """Masked positions of `block` (b,) in the formulas' order; ties to the leftmost.

    confidence: most confident first under `ranks`. nearest: closest first to a position that `previous` (b,),
    the state before `block`, had masked and `block` has not; at equal distance the right side first.
    """
    masked = (block == mask_id).nonzero().flatten().tolist()
    if order == "confidence":
        confidence = ranks.confidence.masked_fill(block != mask_id, -1.0)
        return torch.sort(confidence, descending=True, stable=True).indices[: len(masked)].tolist()
    if previous is None:
        raise ValueError("the nearest position order needs the previous state")
    unmasked_last = (previous != block).nonzero().flatten().tolist()
    return sorted(masked, key=lambda p: min(2 * (p - q) if p > q else 2 * (q - p) + 1 for q in unmasked_last))


def apply_formula(block: torch.Tensor, ranks: StepRanks, formula: Iterable[Pair], mask_id: int,
                  positions: Optional[list[int]] = None) -> Optional[torch.Tensor]:
    """The state `formula` describes on top of `block`, positions in `positions`' order (default: confidence),
    tokens from `ranks`; None if a rank does not exist."""
    positions = positions if positions is not None else ranked_positions(block, ranks, mask_id)
    draft = block.clone()
    for i, j in formula:
        if i > len(positions) or j > ranks.top_tokens.shape[-1]:
            return None
        pos = positions[i - 1]
        draft[pos] = ranks.top_tokens[pos, j - 1]
    return draft


def formula_between(block: torch.Tensor, later: torch.Tensor, ranks: StepRanks, mask_id: int,
                    max_position_rank: int, max_token_rank: int, positions: Optional[list[int]] = None
                    ) -> Optional[Formula]:
    """The formula taking `block` to `later` under `positions`' order (default: confidence) and the token ranks of
    `ranks`; None when a rank exceeds the limits."""
    positions = positions if positions is not None else ranked_positions(block, ranks, mask_id)
    rank_of = {pos: r + 1 for r, pos in enumerate(positions)}
    pairs = []
    for pos in (block != later).nonzero().flatten().tolist():
        i = rank_of.get(pos)
        if i is None or i > max_position_rank:
            return None
        found = (ranks.top_tokens[pos, :max_token_rank] == later[pos]).nonzero()
        if len(found) == 0:
            return None
        pairs.append((i, int(found[0]) + 1))
    return frozenset(pairs)


# --------------------------------------------------------------------------------------------------------------------
# the graph
# --------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DraftGraph:
    nodes: tuple[Formula, ...]
    block_length: int
    tokens_per_step: int = 1
    position_order: PositionOrder = "confidence"
    counts: tuple[int, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def budget(self) -> int:
        return len(self.nodes)

    def prefix(self, budget: int) -> "DraftGraph":
        """The graph of the first `budget` nodes: connected, since each node had a parent among those before it."""
        if not 1 <= budget <= self.budget:
            raise RecipeError(f"eval.spiffy_budgets: {budget} is not in 1..{self.budget} (the calibrated budget)")
        return DraftGraph(self.nodes[:budget], self.block_length, self.tokens_per_step, self.position_order,
                          self.counts[:budget], self.meta)

    @property
    def max_token_rank(self) -> int:
        return max(j for node in self.nodes for _, j in node)

    def parents(self, index: int) -> list[int]:
        """Indices of the node's parents; -1 stands for the root (the current state)."""
        return parent_indices(self.nodes[index], self.nodes, self.tokens_per_step)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": GRAPH_VERSION,
            "block_length": self.block_length,
            "tokens_per_step": self.tokens_per_step,
            "position_order": self.position_order,
            "budget": self.budget,
            "nodes": [sorted(list(p) for p in node) for node in self.nodes],
            "parents": [self.parents(k) for k in range(self.budget)],
            "counts": list(self.counts),
            **self.meta,
        }

    def save(self, path: Path) -> None:
        write_text_atomic(path, json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: Path, block_length: Optional[int] = None, tokens_per_step: Optional[int] = None) -> "DraftGraph":
        """Read and check a draft_graph.json; any problem is a RecipeError naming the file."""
        def bad(why: str) -> RecipeError:
            return RecipeError(f"calibrate.graph: {path}: {why}")

        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise bad(f"not a readable JSON file ({type(e).__name__})") from None
        if not isinstance(raw, dict) or raw.get("version") != GRAPH_VERSION:
            raise bad(f"version {raw.get('version') if isinstance(raw, dict) else None!r}, expected {GRAPH_VERSION}")
        try:
            nodes = tuple(frozenset((int(i), int(j)) for i, j in node) for node in raw["nodes"])
            graph = cls(nodes, int(raw["block_length"]), int(raw["tokens_per_step"]), raw["position_order"],
                        tuple(int(c) for c in raw.get("counts", ())),
                        {k: v for k, v in raw.items() if k not in ("version", "block_length", "tokens_per_step",
                                                                   "position_order", "budget", "nodes", "parents",
                                                                   "counts")})
        except (KeyError, TypeError, ValueError):
            raise bad("malformed nodes (expected lists of [position rank, token rank] pairs)") from None
        if graph.position_order not in POSITION_ORDERS:
            raise bad(f"position_order {graph.position_order!r} is not one of {', '.join(POSITION_ORDERS)}")
        if raw.get("budget") != graph.budget:
            raise bad(f"budget {raw.get('budget')} does not match its {graph.budget} nodes")
        if any(not node or min(min(p) for p in node) < 1 for node in nodes) or len(set(nodes)) != len(nodes):
            raise bad("nodes must be distinct, non-empty, with ranks >= 1")
        for k in range(graph.budget):
            if not graph.parents(k):
                raise bad(f"node {k} has no parent in the graph (it must be reachable from the root)")
        if block_length is not None and graph.block_length != block_length:
            raise bad(f"calibrated for block length {graph.block_length}, decoding uses {block_length}")
        if tokens_per_step is not None and graph.tokens_per_step != tokens_per_step:
            raise bad(f"calibrated for {graph.tokens_per_step} tokens per step, decoding uses {tokens_per_step}")
        return graph


def check_graph_drafter(graph: DraftGraph, path: str | Path, drafter_path: str) -> None:
    """Refuse (RecipeError, one line) a graph calibrated on other weights than the drafter at `drafter_path`, which it
    is to decode or ship with: its nodes are that drafter's likely replays, not this one's. A graph from before
    calibrate recorded the weights is not compared."""
    recorded = graph.meta.get("drafter_weights_sha256")
    weights_sha256 = weights_sha256_of(drafter_path) if recorded else None
    if recorded and weights_sha256 and recorded != weights_sha256:
        raise RecipeError(f"calibrate.graph: {path} was calibrated on the drafter {graph.meta.get('model')} (weights "
                          f"sha256 {recorded[:12]}…), not on drafter.path {drafter_path} ({weights_sha256[:12]}…); "
                          "calibrate a graph for this drafter (align calibrate)")


def is_parent(parent: Formula, child: Formula, tokens_per_step: int) -> bool:
    """One step leads from `parent` to `child`: the child adds `tokens_per_step` pairs to it."""
    return parent < child and len(child) - len(parent) == tokens_per_step


def parent_indices(node: Formula, nodes: Iterable[Formula], tokens_per_step: int) -> list[int]:
    found = [k for k, other in enumerate(nodes) if is_parent(other, node, tokens_per_step)]
    return ([-1] if len(node) == tokens_per_step else []) + found


def prune(graph: DraftGraph, ranks: StepRanks, positions: list[int], active: int) -> list[Formula]:
    """Spiffy v4's dynamic pruning: of the graph's nodes, keep `active`, greedily the most likely by the geometric
    mean of their tokens' probabilities under `ranks`, each reachable from the root through kept nodes (a draft whose
    parent is not evaluated can never be matched). v4 also mixes in the children's scores; this keeps the local one.
    """
    def score(node: Formula) -> float:
        if any(i > len(positions) or j > ranks.top_probs.shape[-1] for i, j in node):
            return float("-inf")
        return sum(float(ranks.top_probs[positions[i - 1], j - 1].clamp_min(1e-30).log()) for i, j in node) / len(node)

    scores = {node: score(node) for node in graph.nodes}
    kept: list[Formula] = []
    while len(kept) < active:
        reachable = [n for n in graph.nodes if n not in kept and scores[n] > float("-inf")
                     and _reachable(n, kept, graph.tokens_per_step)]
        if not reachable:
            break
        kept.append(max(reachable, key=scores.__getitem__))
    return kept


# --------------------------------------------------------------------------------------------------------------------
# calibration
# --------------------------------------------------------------------------------------------------------------------
Chains = list[list[list[Formula]]]  # [block][state k][d - 1]: the formula of state k + d relative to state k


def trace_chains(traces: list[BlockTrace], mask_id: int, max_depth: int, max_position_rank: int,
                 max_token_rank: int, order: PositionOrder) -> Chains:
    """For every state with a known previous distribution (every state of a block but the first), the formulas that
    describe the states d = 1..max_depth steps later, up to the first one out of reach (which makes every later one
    out of reach too)."""
    chains: Chains = []
    for trace in traces:
        block_chains = [[]]  # the first state has no previous distribution, hence no drafts
        for k in range(1, len(trace.states) - 1):
            state, prev_ranks = trace.states[k], trace.ranks[k - 1]
            positions = ranked_positions(state, prev_ranks, mask_id, order, trace.states[k - 1])
            chain = []
            for later in trace.states[k + 1 : k + 1 + max_depth]:
                formula = formula_between(state, later, prev_ranks, mask_id, max_position_rank, max_token_rank,
                                          positions)
                if formula is None:
                    break
                chain.append(formula)
            block_chains.append(chain)
        chains.append(block_chains)
    return chains


def count_formulas(chains: Chains) -> Counter:
    """How often each formula describes a later state."""
    return Counter(formula for block in chains for chain in block for formula in chain)


def replayed_forwards(chains: Chains, nodes: Iterable[Formula]) -> int:
    """The forwards Spiffy with these nodes needs to decode the traced blocks, replayed without the model: a forward
    at state k, then every following state that equals a draft of that forward comes with its distribution for free."""
    nodes = set(nodes)
    forwards = 0
    for block in chains:
        k = 0
        while k < len(block):
            forwards += 1
            matched = 0
            for formula in block[k]:
                if formula not in nodes:
                    break
                matched += 1
            k += 1 + matched
    return forwards


def objective(selected: list[Formula], counts: Counter, tokens_per_step: int) -> int:
    """Degree-1 accumulation: Σ_q [count(q) + Σ_{p ∈ parents(q) ∩ selected} count(p)]."""
    chosen = set(selected)
    return sum(counts[q] + sum(counts[p] for p in chosen if is_parent(p, q, tokens_per_step))
               for q in selected)


def _reachable(node: Formula, selected: list[Formula], tokens_per_step: int) -> bool:
    return len(node) == tokens_per_step or any(is_parent(p, node, tokens_per_step) for p in selected)


def select_nodes(counts: Counter, budget: int, tokens_per_step: int = 1, chains: Optional[Chains] = None
                 ) -> list[Formula]:
    """Greedy: repeatedly add the reachable formula that raises the objective most: degree-1 accumulation, or, given
    `chains`, the forwards saved on them (ties: more frequent, then lexicographic). Exhaustive search is exponential
    in the candidates; on small cases the greedy choice is checked against it in the tests."""
    selected: list[Formula] = []
    candidates = sorted(counts, key=lambda f: (-counts[f], sorted(f)))
    while len(selected) < budget:
        reachable = [f for f in candidates if f not in selected and _reachable(f, selected, tokens_per_step)]
        if not reachable:
            break
        if chains is None:
            selected.append(max(reachable, key=lambda f: objective(selected + [f], counts, tokens_per_step)))
        else:
            selected.append(min(reachable, key=lambda f: replayed_forwards(chains, selected + [f])))
    return selected


def exhaustive_select(counts: Counter, budget: int, tokens_per_step: int = 1) -> int:
    """The best objective over every connected node set of the budget's size (small cases only)."""
    best = 0
    for combo in itertools.combinations(list(counts), min(budget, len(counts))):
        if all(_reachable(f, list(combo), tokens_per_step) for f in combo):
            best = max(best, objective(list(combo), counts, tokens_per_step))
    return best


def calibrate(traces: list[BlockTrace], mask_id: int, block_length: int, budget: int, tokens_per_step: int = 1,
              max_position_rank: int = 8, max_token_rank: int = 3,
              orders: tuple[PositionOrder, ...] = POSITION_ORDERS, objective_name: str = "simulated",
              meta: Optional[dict[str, Any]] = None, context_forwards: int = 0) -> DraftGraph:
    """Count formulas on vanilla traces and select `budget` nodes under each position order; keep the order whose
    graph needs the fewest forwards replayed on the traces (the first listed on a tie). The nodes stay in the
    greedy's order, so the first D of them are the greedy selection for budget D (`DraftGraph.prefix`).

    context_forwards: the forwards that tracing spent outside the blocks' steps (an encoder-decoder's context
    encoding per block); Spiffy spends them too, so they count on both sides of the replayed NFE reduction."""
    vanilla_forwards = sum(len(trace.states) - 1 for trace in traces) + context_forwards
    graphs: dict[str, tuple[int, DraftGraph]] = {}
    for order in orders:
        chains = trace_chains(traces, mask_id, budget, max_position_rank, max_token_rank, order)
        counts = count_formulas(chains)
        nodes = select_nodes(counts, budget, tokens_per_step, chains if objective_name == "simulated" else None)
        graphs[order] = (replayed_forwards(chains, nodes) + context_forwards,
                         DraftGraph(tuple(nodes), block_length, tokens_per_step, order, tuple(counts[f] for f in nodes)))
    forwards, best = min(graphs.values(), key=lambda fg: fg[0])
    info = {"objective": objective_name,
            "replayed_nfe_reduction": {order: round(vanilla_forwards / f, 3) for order, (f, _) in graphs.items()}}
    return DraftGraph(best.nodes, block_length, tokens_per_step, best.position_order, best.counts,
                      {**(meta or {}), **info})
