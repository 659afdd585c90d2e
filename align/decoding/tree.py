"""Draft trees from one diffusion drafter pass (DDTree, TAPS), verified in one verifier forward.

The drafter's one pass over `context ⊕ MASK×γ` gives a distribution q_d for every draft depth d = 1..γ. Instead of
one path (its argmax), a tree of the most likely continuations is drafted: best-first by cumulative drafter
log-probability, a child's score being its parent's + log q_depth(token), under a node budget. The root is the newest
token (the verifier has not seen it yet). The verifier scores every node in one forward over its cached prefix: each
node attends to the prefix and to its ancestors only, at position cached length + depth, so its logits are exactly
those of a plain forward over its path (tests/decoding/test_tree.py checks this per verifier family). The longest
accepted path is kept (`accept_tree`), the cache keeps that path's keys and values only, and the bonus token goes on as
usual.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from align.config import RecipeError
from align.decoding.acceptance import accept_tree
from align.decoding.generation import GenerationStats, Sampling
from align.decoding.ngram import NgramLookup
from align.decoding.path_search import PathSearch, TrigramModel
from align.decoding.sizing import CostAwareSize, DrafterGate
from align.decoding.speculative import Decoding, Draft, Step, speculative_generate
from align.decoding.suffix import SuffixIndex
from align.drafters import drafter_for
from align.drafters.base import HiddenTap, aux_hidden
from align.drafters.spec import DrafterSpec
from align.masks import attention_masks, check_mask_layer_types, full_mask_kwargs
from align.remote_code import honours_attention_masks


@dataclass(frozen=True)
class DraftTree:
    """Nodes in best-first order, so a parent always precedes its children. Node i is row i + 1 of the verifier's
    tree forward; row 0 is the root (the newest token), whose children have parent -1."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]  # 1 for the root's children
    scores: list[float]  # cumulative drafter log-probability of each node's path

    def __len__(self) -> int:
        return len(self.tokens)

    def prefix(self, num_nodes: int) -> "DraftTree":
        """The first `num_nodes` nodes: a tree too, since parents come first."""
        return DraftTree(self.tokens[:num_nodes], self.parents[:num_nodes], self.depths[:num_nodes],
                         self.scores[:num_nodes])

    def children(self) -> list[list[int]]:
        """Per row (0: the root, i + 1: node i), its child nodes in best-first order."""
        rows: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for node, parent in enumerate(self.parents):
            rows[parent + 1].append(node)
        return rows

    def ancestors_allowed(self, device: torch.device) -> torch.Tensor:
        """bool (N + 1, N + 1): row r may attend to column c iff c is r or one of r's ancestors (rows as above)."""
        allowed = [[False] * (len(self) + 1) for _ in range(len(self) + 1)]
        allowed[0][0] = True
        for node, parent in enumerate(self.parents):
            allowed[node + 1] = list(allowed[parent + 1])
            allowed[node + 1][node + 1] = True
        return torch.tensor(allowed, dtype=torch.bool, device=device)


# A node's children, best first, given its depth index and the last two tokens of its path (the context's for the
# root's): (ranking scores, tokens, drafter log-probabilities), every score ≤ 0.
ChildRanking = Callable[[int, list[int]], tuple[list[float], list[int], list[float]]]


def best_first_tree(depth_limit: int, num_nodes: int, rank_children: ChildRanking, context_tail: list[int],
                    eos_ids: frozenset[int] = frozenset()) -> DraftTree:
    """The `num_nodes` best nodes, at most `depth_limit` deep, by the cumulative score `rank_children` gives.

    A priority queue over expansions: popping a node pushes its next sibling (the next of its parent's ranked
    children) and its first child (the best of its own); since every score is ≤ 0 a node never scores above its
    parent, so popping order is best-first and parents come before their children. An end-of-sequence node gets no
    children: tokens after it would be thrown away. Ties are broken by (depth, rank, parent), so the tree is
    deterministic. `scores` are the cumulative drafter log-probabilities, whatever ranked the nodes.
    """
    tree = DraftTree([], [], [], [])
    tails = {-1: context_tail[-2:]}  # node -> the last two tokens of its path (-1: the root)
    children = {-1: rank_children(0, tails[-1])}
    # Entries: (-score, depth index, rank, parent node, parent score).
    frontier = [(-children[-1][0][0], 0, 0, -1, 0.0)]
    while frontier and len(tree) < num_nodes:
        negative, depth, rank, parent, parent_score = heapq.heappop(frontier)
        ranking, tokens, drafter_log_probs = children[parent]
        node, token = len(tree), tokens[rank]
        tree.tokens.append(token)
        tree.parents.append(parent)
        tree.depths.append(depth + 1)
        tree.scores.append((tree.scores[parent] if parent >= 0 else 0.0) + drafter_log_probs[rank])
        if rank + 1 < len(tokens):
            sibling = parent_score + ranking[rank + 1]
            heapq.heappush(frontier, (-sibling, depth, rank + 1, parent, parent_score))
        if depth + 1 < depth_limit and token not in eos_ids:
            tails[node] = (tails[parent] + [token])[-2:]
            children[node] = rank_children(depth + 1, tails[node])
            heapq.heappush(frontier, (negative - children[node][0][0], depth + 1, 0, node, -negative))
    return tree


def build_draft_tree(draft_log_probs: torch.Tensor, num_nodes: int, eos_ids: frozenset[int] = frozenset()) -> DraftTree:
    """The `num_nodes` best nodes by cumulative drafter log-probability. draft_log_probs: (γ, V), depth d + 1 in row d.
    Every node's children are its depth's ranking (the marginals do not see the path)."""
    depth_limit, vocab = draft_log_probs.shape
    top_log_probs, top_tokens = draft_log_probs.float().topk(min(num_nodes, vocab), dim=-1)  # (γ, k)
    log_probs, ranked = top_log_probs.tolist(), top_tokens.tolist()
    return best_first_tree(depth_limit, num_nodes, lambda depth, _: (log_probs[depth], ranked[depth], log_probs[depth]),
                           [], eos_ids)


def build_consistent_draft_tree(
    draft_log_probs: torch.Tensor, num_nodes: int, context_tail: list[int],
    path_search: tuple[PathSearch, TrigramModel],
    eos_ids: frozenset[int] = frozenset(),
) -> DraftTree:
    """CPS's causal consistency in a tree: the `num_nodes` best nodes by DiffuSpec's path score,
    Σ λ·log q_d(v) + (1−λ)·log p_proxy(v | the two tokens before v), instead of the drafter's marginals alone, which
    cannot see whether a token fits the branch it would extend. draft_log_probs: (γ, V); context_tail: the tokens
    before the draft (≥ 1).

    A node's children are its depth's `max_candidates` most likely drafter tokens, ranked for that node (the proxy
    reads its path) when it is popped; both terms are ≤ 0, so parents still come before their children."""
    search, proxy = path_search
    depth_limit, vocab = draft_log_probs.shape
    top_log_probs, top_tokens = draft_log_probs.float().topk(min(search.max_candidates, vocab), dim=-1)
    log_probs, ranked = top_log_probs.double().cpu().numpy(), top_tokens.cpu().numpy()  # (γ, M) each, one host copy

    def rank_children(depth: int, tail: list[int]) -> tuple[list[float], list[int], list[float]]:
        previous = tail[-2] if len(tail) > 1 else -1
        combined = (search.weight * log_probs[depth]
                    + (1 - search.weight) * proxy.log_probs(previous, tail[-1], ranked[depth]))
        order = np.argsort(-combined, kind="stable")
        return combined[order].tolist(), ranked[depth][order].tolist(), log_probs[depth][order].tolist()

    return best_first_tree(depth_limit, num_nodes, rank_children, context_tail, eos_ids)


def add_tree(tree: DraftTree, candidates: DraftTree, eos_ids: frozenset[int] = frozenset()
             ) -> tuple[DraftTree, list[int]]:
    """`tree` with another tree of candidates from the same root merged in (the union tree: model-free candidates
    joining the drafter's tree): a candidate whose token its parent already has as a child is that child, the others
    are new nodes, appended, so parents still come first; nothing is added below an end-of-sequence token. A new
    node's score is -inf (the drafter gave it no probability). Returns the tree and, per candidate, its node (-1: not
    added, below an end token)."""
    merged = DraftTree(list(tree.tokens), list(tree.parents), list(tree.depths), list(tree.scores))
    child = {(parent, token): node for node, (parent, token) in enumerate(zip(tree.parents, tree.tokens))}
    ended = {node for node, token in enumerate(tree.tokens) if token in eos_ids}
    nodes: list[int] = []
    for token, candidate_parent in zip(candidates.tokens, candidates.parents):
        parent = nodes[candidate_parent] if candidate_parent >= 0 else -1
        if (candidate_parent >= 0 and parent < 0) or parent in ended:
            nodes.append(-1)
            continue
        node = child.get((parent, token))
        if node is None:
            node = child[(parent, token)] = len(merged)
            merged.tokens.append(token)
            merged.parents.append(parent)
            merged.depths.append(merged.depths[parent] + 1 if parent >= 0 else 1)
            merged.scores.append(float("-inf"))
            if token in eos_ids:
                ended.add(node)
        nodes.append(node)
    return merged, nodes


def chain(tokens: list[int]) -> DraftTree:
    """A path as a tree: each token the child of the one before, scored 0 (a continuation has no probabilities)."""
    return DraftTree(list(tokens), list(range(-1, len(tokens) - 1)), list(range(1, len(tokens) + 1)),
                     [0.0] * len(tokens))


# A model-free source of draft candidates: (the context's token ids (n,), the depth limit) -> a tree of candidates
# from the root, parents first, each scored by the log of the source's own estimate of its chance (0: none).
CandidateSource = Callable[[np.ndarray, int], DraftTree]


def ngram_source(lookup: NgramLookup) -> CandidateSource:
    """The n-gram continuation of the context (align/decoding/ngram.py), a path."""
    return lambda context, depth_limit: chain(lookup.continuation(context, depth_limit))


def suffix_source(index: SuffixIndex, num_nodes: int, max_match: int, min_share: float) -> CandidateSource:
    """SuffixDecoding's tree over the verifier's trajectories (align/decoding/suffix.py), scored by log share."""
    def candidates(context: np.ndarray, depth_limit: int) -> DraftTree:
        tokens, parents, shares = index.continuations(context, depth_limit, num_nodes, max_match,
                                                      min_share=min_share)
        depths: list[int] = []
        for parent in parents:
            depths.append(depths[parent] + 1 if parent >= 0 else 1)
        return DraftTree(tokens, parents, depths, [math.log(share) for share in shares])
    return candidates


def order_by_gain(tree: DraftTree, gains: list[float]) -> tuple[DraftTree, list[float], list[int]]:
    """The nodes by expected acceptance, best first, so that the cost-aware size can keep any prefix: a node's gain
    is capped at its parent's (it is accepted only after its parent), and ties go to the shallower node, so parents
    still come first. Returns the tree, its nodes' capped gains, and each old node's new index."""
    capped: list[float] = []
    for node, parent in enumerate(tree.parents):
        capped.append(min(gains[node], capped[parent]) if parent >= 0 else gains[node])
    order = sorted(range(len(tree)), key=lambda node: (-capped[node], tree.depths[node], node))
    where = [0] * len(tree)
    for new, old in enumerate(order):
        where[old] = new
    ordered = DraftTree([tree.tokens[old] for old in order],
                        [where[tree.parents[old]] if tree.parents[old] >= 0 else -1 for old in order],
                        [tree.depths[old] for old in order], [tree.scores[old] for old in order])
    return ordered, [capped[old] for old in order], where


def leading(path: list[int], nodes: set[int]) -> int:
    """How many of an accepted path's first nodes (root down) are among `nodes`: what one source got accepted."""
    count = 0
    while count < len(path) and path[count] in nodes:
        count += 1
    return count


# Set (True) on a verifier once a forward has shown that it reads the 4-D mask it is handed (check_tree_verifier).
TREE_MASK_READ = "_align_reads_tree_masks"


def check_tree_verifier(verifier: PreTrainedModel) -> None:
    """Refuse, with a one-line RecipeError, a verifier whose tree forward this module cannot make exact: an attention
    that takes no 4-D float mask, or a forward that drops the mask it is handed (remote code that builds its own
    causal mask would score every node as if the nodes before it in the forward were its ancestors). The second is
    asked of the model itself, once per verifier: two forwards over 4 tokens, with the last one's view of the others
    hidden and not (`honours_attention_masks`)."""
    implementation = getattr(verifier.config, "_attn_implementation", None)
    if implementation not in ("sdpa", "eager"):
        raise RecipeError(f"specdiff_tree: the verifier's attention ({implementation}) does not take the tree's 4-D "
                          "float mask; use verifier.attn_implementation=sdpa or eager")
    check_mask_layer_types(verifier, "specdiff_tree")
    if getattr(verifier, TREE_MASK_READ, False):
        return
    if not honours_attention_masks(verifier, full_mask_kwargs, verifier.config.get_text_config().vocab_size):
        raise RecipeError(f"specdiff_tree: the verifier ({type(verifier).__name__}) ignores the 4-D attention mask it "
                          "is handed, so a tree's nodes cannot be scored apart; use a chain method (specdiff, "
                          "specdiff_cps, specdiff_cost)")
    setattr(verifier, TREE_MASK_READ, True)


def tree_attention_mask(
    verifier: PreTrainedModel, cache: DynamicCache, tree: DraftTree, device: torch.device
) -> Union[torch.Tensor, dict[str, torch.Tensor]]:
    """The additive (1, 1, N + 1, kv) mask(s) of a tree forward over the cached prefix, in the form the verifier reads.

    Each row sees the cached prefix and its own ancestors, at position cached + depth (not its slot in the forward):
    a sliding-window layer's (Gemma's, Mistral's) hides the keys a plain forward over the row's path would leave out
    of its window (`attention_masks`).
    """
    positions = cache.get_seq_length() + torch.tensor([0, *tree.depths], device=device)  # (N + 1,)
    return attention_masks(verifier, tree.ancestors_allowed(device), positions, cache)


def tree_forward(
    verifier: PreTrainedModel, root: torch.Tensor, tree: DraftTree, cache: DynamicCache,
    tap: Optional[HiddenTap] = None,
) -> torch.Tensor:
    """Score every node of `tree` in one forward over the cached prefix; the cache grows by N + 1 tokens (the root
    and the nodes, in row order). root: (1, 1) the newest token. Returns (N + 1, V) logits, row r predicting the token
    after row r's path. tap: a DFlash drafter's request for hidden states (rows as the logits)."""
    device = root.device
    cached = cache.get_seq_length()
    ids = torch.cat([root, torch.tensor([tree.tokens], dtype=root.dtype, device=device)], dim=1)  # (1, N + 1)
    positions = cached + torch.tensor([[0, *tree.depths]], device=device)
    mask = tree_attention_mask(verifier, cache, tree, device)
    out = verifier(input_ids=ids, position_ids=positions, attention_mask=mask, cache=cache, use_cache=True,
                   output_hidden_states=tap is not None)
    if tap is not None:
        tap.last = aux_hidden(out.hidden_states, tap.layer_ids)
    return out.logits[0]


def keep_path(cache: DynamicCache, tree: DraftTree, path: list[int]) -> None:
    """After a tree forward: keep the root's and the accepted path's keys and values, in path order, drop the rest.

    The tree's N + 1 entries are the last of every layer (a sliding layer recording its past keeps them all until it
    is cropped): the path's entries are moved to just after the root, then the cache is cropped by the others. Path
    nodes are in increasing order, so each destination slot is at or before its source."""
    if path:
        for layer in cache.layers:
            if not getattr(layer, "is_initialized", False) or layer.keys.numel() == 0:
                continue  # a layer that shares another's keys and values (Gemma 4) holds none
            first = layer.keys.shape[-2] - len(tree)  # node 0's slot
            source = torch.tensor(path, device=layer.keys.device) + first
            target = torch.arange(first, first + len(path), device=layer.keys.device)
            layer.keys[:, :, target] = layer.keys[:, :, source]
            layer.values[:, :, target] = layer.values[:, :, source]
    if len(tree) > len(path):
        cache.crop(-(len(tree) - len(path)))


def check_tree_cache(cache: DynamicCache) -> None:
    """A tree's unaccepted branches leave the cache by moving keys: only key/value layers can do that."""
    kinds = {type(layer).__name__ for layer in cache.layers if not isinstance(layer, DynamicLayer)}
    if kinds:
        raise RecipeError(f"specdiff_tree: the verifier's cache has {', '.join(sorted(kinds))} layers, whose state "
                          "cannot keep one branch of a tree")


class TreeStep(Step):
    """A draft tree of `num_nodes` nodes, at most γ deep, from one drafter pass, verified in one tree forward.
    sizing (cost-aware node budget): `num_nodes` is the largest tree, and `sizing` picks how many of its best-first
    nodes to verify each step. path_search: rank the tree's nodes by CPS's score (`build_consistent_draft_tree`).

    sources: the union tree. Each model-free source's candidates (the n-gram continuation, SuffixDecoding's tree)
    join the drafter's tree (`add_tree`), with the source's own cost-aware chooser when sizing: the nodes are then
    verified in order of expected acceptance, the drafter's from its calibrated probabilities and each source's from
    its own scores calibrated by its measured per-depth acceptance, and each chooser learns from its own nodes; a
    `DrafterGate` then also learns on which steps to skip the drafter pass (where the candidates alone do better). No
    drafter (None): the sources' candidates alone. Every node is a fixed token chosen before the verifier's
    randomness, so `accept_tree`'s point-mass rule is lossless for nodes of any source.
    Stats: draft_lengths hold the tree's depth limit (positions drafted), tree_nodes its size."""

    def __init__(self, verifier: PreTrainedModel, drafter: Optional[PreTrainedModel], spec: Optional[DrafterSpec],
                 decoding: Decoding, num_nodes: int, generator: Optional[torch.Generator] = None,
                 sizing: Optional[CostAwareSize] = None,
                 path_search: Optional[tuple[PathSearch, TrigramModel]] = None,
                 sources: Sequence[tuple[CandidateSource, Optional[CostAwareSize]]] = (),
                 gate: Optional[DrafterGate] = None) -> None:
        check_tree_verifier(verifier)
        # A DFlash drafter reads the verifier's hidden states: the tree forward hands over those of every node, and
        # the accepted path's join its context (they equal a plain forward's over that path, as the logits do).
        self.verifier, self.decoding = verifier, decoding
        self.drafter = drafter_for(drafter, spec) if drafter is not None else None
        self.num_nodes, self.generator, self.sizing, self.path_search = num_nodes, generator, sizing, path_search
        self.verifier_states = self.drafter.verifier_states if self.drafter is not None else None
        self.sources = list(sources)
        # A cost-sized union with a drafter learns on which steps the drafter pass pays (`DrafterGate`): `gate`, as
        # earlier generations left it, or a new one.
        union = sizing is not None and self.sources and self.drafter is not None
        self.gate = (gate if gate is not None else DrafterGate()) if union else None
        self.ran, self.bucket = self.drafter is not None, 0
        self.tree, self.accepted = DraftTree([], [], [], []), []
        # per source, its verified candidates: (the source's score, depth, tree node)
        self.kept: list[list[tuple[float, int, int]]] = []

    def begin(self, cache: DynamicCache) -> None:
        check_tree_cache(cache)
        if self.drafter is not None:
            self.drafter.begin()

    def propose(self, context: torch.Tensor, room: int) -> Draft:
        started = time.perf_counter()
        depth_limit = min(self.decoding.gamma, room)
        # The model-free candidates first: a cost-sized union asks them whether this step pays for the drafter pass.
        context_ids = context[0].cpu().numpy() if self.sources else None
        found = [(source(context_ids, depth_limit), chooser) for source, chooser in self.sources]
        self.ran = self.drafter is not None
        if self.gate is not None:
            self.bucket = self.gate.bucket(max(sum(chooser.gains(candidates.scores, candidates.depths))
                                               for candidates, chooser in found))
            self.ran = self.gate.run_drafter(self.bucket)
        tree = self.drafter_tree(context, depth_limit) if self.ran else DraftTree([], [], [], [])
        if self.sources:
            tree = self.add_candidates(tree, found, started)
        elif self.sizing is not None:
            tree = tree.prefix(self.sizing.choose(tree.scores, tree.depths, time.perf_counter() - started))
        self.tree = tree
        return Draft(tree, None, depth_limit, forwards=int(self.ran), nodes=len(tree))

    def drafter_tree(self, context: torch.Tensor, depth_limit: int) -> DraftTree:
        """The drafter's best-first tree (or CPS's) from one pass."""
        draft_logits = self.drafter.propose(self.verifier, context, depth_limit)  # (γ, V)
        draft_log_probs = torch.log_softmax(draft_logits.float(), -1)
        eos_ids = self.decoding.eos_ids
        if self.path_search is None:
            return build_draft_tree(draft_log_probs, self.num_nodes, eos_ids)
        tail = context[0, -2:].tolist()
        return build_consistent_draft_tree(draft_log_probs, self.num_nodes, tail, self.path_search, eos_ids)

    def add_candidates(self, tree: DraftTree, found: list[tuple[DraftTree, Optional[CostAwareSize]]],
                       started: float) -> DraftTree:
        """The drafter's tree with every source's candidates merged in, cut to the cost-aware size when sizing."""
        placed = []
        for candidates, _ in found:
            tree, nodes = add_tree(tree, candidates, self.decoding.eos_ids)
            placed.append((candidates, nodes))
        size, where = len(tree), list(range(len(tree)))
        if self.sizing is not None:
            gains = self.sizing.gains(tree.scores, tree.depths)  # a candidate-only node's score is -inf: 0
            for (candidates, nodes), (_, chooser) in zip(placed, found):
                assert chooser is not None, "a sized union tree sizes every source"
                for node, gain in zip(nodes, chooser.gains(candidates.scores, candidates.depths)):
                    if node >= 0:
                        gains[node] = max(gains[node], gain)
            tree, gains, where = order_by_gain(tree, gains)
            size = self.sizing.best_size(gains, time.perf_counter() - started, drafter_ran=self.ran)
            tree = tree.prefix(size)
        self.kept = [[(candidates.scores[i], candidates.depths[i], where[node]) for i, node in enumerate(nodes)
                      if node >= 0 and where[node] < size] for candidates, nodes in placed]
        return tree

    def verify(self, draft: Draft, context: torch.Tensor, cache: DynamicCache) -> tuple[list[int], int]:
        tree = draft.tokens
        verify_logits = tree_forward(self.verifier, context[:, -1:], tree, cache, self.verifier_states)  # (N + 1, V)
        path, next_token = accept_tree(tree.tokens, tree.children(), verify_logits, self.decoding.sampling,
                                       self.generator)
        keep_path(cache, tree, path)
        if self.drafter is not None:
            self.drafter.verified([0, *[node + 1 for node in path]])  # the root and the accepted path
        self.accepted = path
        return [tree.tokens[node] for node in path], next_token

    def record_gate(self, num_accepted: int) -> None:
        """Tell the gate what this step's modelled rate was, and, where the drafter ran, what the candidates alone
        would have made of it: the accepted path's leading run through candidate nodes (under greedy verification
        exactly what a tree of those nodes alone would have accepted, the verifier's choice at a node not depending
        on the other branches), at the cost of verifying those nodes alone. The pair measures the drafter's share
        of one and the same step, far less noisy than two arms' rates from different steps."""
        def verify(nodes: int) -> float:  # seconds to verify `nodes` nodes and the root
            return self.sizing.verify_s[min(nodes, len(self.sizing.verify_s) - 1)]

        if not self.ran:
            self.gate.record(self.bucket, False, (num_accepted + 1) / verify(len(self.tree)))
            return
        draft_s = self.sizing.draft_estimate()
        self.gate.record(self.bucket, True, (num_accepted + 1) / (draft_s + verify(len(self.tree))))
        candidates = {node for kept in self.kept for _, _, node in kept}
        self.gate.record(self.bucket, False, (leading(self.accepted, candidates) + 1) / verify(len(candidates)))

    def update(self, num_accepted: int) -> None:
        if self.sizing is None:
            return
        tree = self.tree
        if not self.sources:
            self.sizing.update(tree.scores, tree.depths, num_accepted)
            return
        # Each chooser learns from its own nodes: how deep the accepted path ran through them.
        if self.gate is not None:
            self.record_gate(num_accepted)
        drafted = [node for node, score in enumerate(tree.scores) if score > float("-inf")]
        if self.ran:
            self.sizing.update([tree.scores[n] for n in drafted], [tree.depths[n] for n in drafted],
                               leading(self.accepted, set(drafted)))
        for kept, (_, chooser) in zip(self.kept, self.sources):
            if kept and chooser is not None:
                scores, depths, nodes = zip(*kept)
                chooser.update(scores, depths, leading(self.accepted, set(nodes)))


def specdiff_tree_generate(
    verifier: PreTrainedModel,
    drafter: PreTrainedModel,
    spec: DrafterSpec,
    prompt_ids: torch.Tensor,
    gamma: int,
    num_nodes: int,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    eos_ids: frozenset[int] = frozenset(),
    generator: Optional[torch.Generator] = None,
    sizing: Optional[CostAwareSize] = None,
    path_search: Optional[tuple[PathSearch, TrigramModel]] = None,
) -> tuple[list[int], GenerationStats]:
    """Speculative decoding with a draft tree (`TreeStep`). prompt_ids: (1, n). Lossless: greedy outputs equal AR
    greedy's; sampled ones follow the verifier's distribution (`accept_tree`)."""
    decoding = Decoding(gamma, max_new_tokens, sampling, eos_ids)
    step = TreeStep(verifier, drafter, spec, decoding, num_nodes, generator, sizing, path_search)
    return speculative_generate(verifier, prompt_ids, step, decoding, generator)
