"""Spiffy draft graphs: token-agnostic guesses of a dLLM block's future states, calibrated offline.

A node is a *formula*: a set of (i, j) pairs, "the i-th most confident masked position gets its j-th most likely
token" (1-based ranks), applied on top of the current block state. The ranks are read from the distribution that
produced the current state, the one known before the next forward, so all drafts can join that forward. With one
token unmasked per step, a node with d pairs guesses the state d steps ahead; A is a parent of B when B adds
`tokens_per_step` pairs to A (several parents are possible: the graph is a DAG, and the empty formula, the current
state, is the root).

Calibration counts, on vanilla traces, which formulas describe the states 1, 2, ... steps later, and picks a
connected set of `budget` nodes maximising Spiffy's degree-1 accumulation objective
Σ_{q∈Q} [count(q) + Σ_{p∈parents(q)∩Q} count(p)].
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

import torch

from align.config import RecipeError
from align.decoding.dllm import BlockTrace

Pair = tuple[int, int]
Formula = frozenset  # of Pair
GRAPH_VERSION = 1


# --------------------------------------------------------------------------------------------------------------------
# formulas <-> states
# --------------------------------------------------------------------------------------------------------------------
def ranked_positions(block: torch.Tensor, probs: torch.Tensor, mask_id: int) -> list[int]:
    """Masked positions of `block`, most confident first under probs (b, V); ties to the leftmost."""
    confidence = probs.max(-1).values.masked_fill(block != mask_id, -1.0)
    masked = int((block == mask_id).sum())
    return torch.sort(confidence, descending=True, stable=True).indices[:masked].tolist()


def apply_formula(block: torch.Tensor, probs: torch.Tensor, formula: Iterable[Pair], mask_id: int,
                  positions: Optional[list[int]] = None) -> Optional[torch.Tensor]:
    """The state `formula` describes on top of `block`, ranks read from probs; None if a rank does not exist."""
    positions = positions if positions is not None else ranked_positions(block, probs, mask_id)
    draft = block.clone()
    for i, j in formula:
        if i > len(positions) or j > probs.shape[-1]:
            return None
        pos = positions[i - 1]
        draft[pos] = probs[pos].topk(j).indices[j - 1]
    return draft


def formula_between(block: torch.Tensor, later: torch.Tensor, probs: torch.Tensor, mask_id: int,
                    max_position_rank: int, max_token_rank: int) -> Optional[Formula]:
    """The formula taking `block` to `later` under probs' ranks; None when a rank exceeds the limits."""
    positions = ranked_positions(block, probs, mask_id)
    rank_of = {pos: r + 1 for r, pos in enumerate(positions)}
    pairs = []
    for pos in (block != later).nonzero().flatten().tolist():
        i = rank_of.get(pos)
        if i is None or i > max_position_rank:
            return None
        j = int((probs[pos] > probs[pos, later[pos]]).sum()) + 1  # tokens strictly more likely, plus one
        if j > max_token_rank:
            return None
        pairs.append((i, j))
    return frozenset(pairs)


# --------------------------------------------------------------------------------------------------------------------
# the graph
# --------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DraftGraph:
    nodes: tuple[Formula, ...]
    block_length: int
    tokens_per_step: int = 1
    counts: tuple[int, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def budget(self) -> int:
        return len(self.nodes)

    def prefix(self, budget: int) -> "DraftGraph":
        """The graph of the first `budget` nodes: connected, since each node had a parent among those before it."""
        if not 1 <= budget <= self.budget:
            raise RecipeError(f"eval.spiffy_budgets: {budget} is not in 1..{self.budget} (the calibrated budget)")
        return DraftGraph(self.nodes[:budget], self.block_length, self.tokens_per_step, self.counts[:budget], self.meta)

    def parents(self, index: int) -> list[int]:
        """Indices of the node's parents; -1 stands for the root (the current state)."""
        return parent_indices(self.nodes[index], self.nodes, self.tokens_per_step)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": GRAPH_VERSION,
            "block_length": self.block_length,
            "tokens_per_step": self.tokens_per_step,
            "budget": self.budget,
            "nodes": [sorted(list(p) for p in node) for node in self.nodes],
            "parents": [self.parents(k) for k in range(self.budget)],
            "counts": list(self.counts),
            **self.meta,
        }

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        tmp.replace(path)

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
            graph = cls(nodes, int(raw["block_length"]), int(raw["tokens_per_step"]),
                        tuple(int(c) for c in raw.get("counts", ())),
                        {k: v for k, v in raw.items() if k not in ("version", "block_length", "tokens_per_step",
                                                                   "budget", "nodes", "parents", "counts")})
        except (KeyError, TypeError, ValueError):
            raise bad("malformed nodes (expected lists of [position rank, token rank] pairs)") from None
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


def parent_indices(node: Formula, nodes: Iterable[Formula], tokens_per_step: int) -> list[int]:
    found = [k for k, other in enumerate(nodes) if other < node and len(node) - len(other) == tokens_per_step]
    return ([-1] if len(node) == tokens_per_step else []) + found


# --------------------------------------------------------------------------------------------------------------------
# calibration
# --------------------------------------------------------------------------------------------------------------------
def count_formulas(traces: list[BlockTrace], mask_id: int, max_depth: int, max_position_rank: int,
                   max_token_rank: int) -> Counter:
    """How often each formula describes a state d = 1..max_depth steps ahead of a state with a known previous
    distribution (every state of a block but the first)."""
    counts: Counter = Counter()
    for trace in traces:
        for k in range(1, len(trace.states) - 1):
            state, prev_probs = trace.states[k], trace.probs[k - 1]
            for later in trace.states[k + 1 : k + 1 + max_depth]:
                formula = formula_between(state, later, prev_probs, mask_id, max_position_rank, max_token_rank)
                if formula is None:
                    break  # a state out of reach makes every later one out of reach too
                counts[formula] += 1
    return counts


def objective(selected: list[Formula], counts: Counter, tokens_per_step: int) -> int:
    """Degree-1 accumulation: Σ_q [count(q) + Σ_{p ∈ parents(q) ∩ selected} count(p)]."""
    chosen = set(selected)
    return sum(counts[q] + sum(counts[p] for p in chosen if p < q and len(q) - len(p) == tokens_per_step)
               for q in selected)


def _reachable(node: Formula, selected: list[Formula], tokens_per_step: int) -> bool:
    return len(node) == tokens_per_step or any(p < node and len(node) - len(p) == tokens_per_step for p in selected)


def select_nodes(counts: Counter, budget: int, tokens_per_step: int = 1) -> list[Formula]:
    """Greedy: repeatedly add the reachable formula that raises the objective most (ties: more frequent, then
    lexicographic). Exhaustive search is exponential in the candidates; on small cases the greedy choice is checked
    against it in the tests."""
    selected: list[Formula] = []
    candidates = sorted(counts, key=lambda f: (-counts[f], sorted(f)))
    while len(selected) < budget:
        best, best_gain = None, -1
        base = objective(selected, counts, tokens_per_step)
        for f in candidates:
            if f in selected or not _reachable(f, selected, tokens_per_step):
                continue
            gain = objective(selected + [f], counts, tokens_per_step) - base
            if gain > best_gain:
                best, best_gain = f, gain
        if best is None:
            break
        selected.append(best)
    return selected


def exhaustive_select(counts: Counter, budget: int, tokens_per_step: int = 1) -> int:
    """The best objective over every connected node set of the budget's size (small cases only)."""
    best = 0
    for combo in itertools.combinations(list(counts), min(budget, len(counts))):
        if all(_reachable(f, list(combo), tokens_per_step) for f in combo):
            best = max(best, objective(list(combo), counts, tokens_per_step))
    return best


def calibrate(traces: list[BlockTrace], mask_id: int, block_length: int, budget: int, tokens_per_step: int = 1,
              max_position_rank: int = 8, max_token_rank: int = 3, meta: Optional[dict[str, Any]] = None) -> DraftGraph:
    """Count formulas on vanilla traces and select `budget` nodes. The nodes stay in the greedy's order, so the
    first D of them are the greedy selection for budget D (`DraftGraph.prefix`)."""
    counts = count_formulas(traces, mask_id, budget, max_position_rank, max_token_rank)
    nodes = select_nodes(counts, budget, tokens_per_step)
    return DraftGraph(tuple(nodes), block_length, tokens_per_step, tuple(counts[f] for f in nodes), dict(meta or {}))
