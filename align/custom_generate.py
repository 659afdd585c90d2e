"""SpecDiff decoding from transformers alone: `align export` ships this file as `custom_generate/generate.py`.

    drafter = AutoModelForCausalLM.from_pretrained(folder)           # the Auto class the card names
    verifier = AutoModelForCausalLM.from_pretrained(verifier_id)
    out = verifier.generate(ids, assistant_model=drafter, custom_generate=folder, trust_remote_code=True,
                            max_new_tokens=64, return_dict_in_generate=True)
    out.sequences, out.tau                                           # tokens per verifier forward

A diffusion drafter proposes γ tokens in one forward (`context ⊕ [MASK]×γ`); the verifier scores them in one cached
forward and keeps the longest prefix the acceptance rule allows, plus one token of its own. The generation config is
prepared and the tokens chosen by generate()'s own code (`_prepare_generation_config`, `_get_logits_processor`: its
defaults, such as top_k=50 and 20 new tokens, and every logits processor and warper), applied at each draft position
after its own prefix: greedy output is `generate()`'s greedy output token for token; with do_sample=True drafts are
accepted by speculative sampling against those processed distributions, so the output is distributed exactly as
`generate(do_sample=True)`'s. What it cannot reproduce (beams, stop strings, guidance, ...) it refuses by name. It is
align's runtime (align/decoding/specdiff.py,
acceptance.py, align/drafters `block_logits`) restated in one file that imports torch and transformers only, because
transformers copies this file alone into its module cache: it must not import align (which may not be installed).

With `union=True` each step verifies one tree instead: the drafter's best-first tree, the n-gram continuation of the
prompt and output so far and, when the export ships `suffix_index.npz`, SuffixDecoding's candidates over the verifier's
own trajectories (align's union tree, `specdiff_ngram_suffix_tree`, at a fixed size): copied numbers, names and code
are kept where the drafter is weak. Greedy it is still generate()'s output; sampled, every node is a point mass, which
keeps the verifier's distribution (`walk`).

The drafter's `config.drafter_spec` says how to read it: `mask_token_id`, `logits_shift` (0: position t's prediction
is at logits[t]; 1: at logits[t-1]) and `attention` (`block_causal`: the context is causal, so its KV cache is exact
and only grows; `bidirectional`: the context is re-encoded for every draft). A block-causal drafter's forwards take
an explicit block mask, per layer type and through each sliding layer's window as the model's own masks would be
(`block_masks`, masks.py `attention_masks` restated): its sliding cache layers hand back only the window's keys.
"""

from __future__ import annotations

import heapq
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.generation import GenerationMode, LogitsProcessorList
from transformers.generation.utils import GenerateDecoderOnlyOutput


@dataclass
class SpecDiffOutput(GenerateDecoderOnlyOutput):
    """generate()'s output with what speculation achieved. tau: tokens emitted per verifier forward after the
    prefill (accepted drafts + 1, averaged over iterations); accept_counts: draft tokens kept, per iteration."""

    tau: Optional[float] = None
    accept_counts: Optional[list[int]] = None
    verifier_forwards: Optional[int] = None


# --------------------------------------------------------------------------------------------------------------------
# choosing a token: generate()'s own logits processors, and the distribution acceptance is computed against
# --------------------------------------------------------------------------------------------------------------------
class TokenChoice:
    """How `generate()` picks the next token: the logits processors its own `_get_logits_processor` builds from the
    prepared generation config (so that every setting, default and warper means here what it means there), then the
    argmax (greedy) or a draw from the softmax of the processed scores (do_sample). A processor reads the tokens
    before the position it scores, so each draft position is processed after its own prefix, the draft tokens before
    it included, as generate() would have processed it had it decoded those tokens one by one."""

    def __init__(self, processors: LogitsProcessorList, do_sample: bool) -> None:
        self.processors, self.do_sample = processors, do_sample

    def scores(self, prefix: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """prefix: (1, L) the tokens before the position; logits: (V,) -> (V,) processed float32 scores (a copy:
        generate() processes a float32 copy of the logits, and some processors write in place)."""
        scores = logits.to(dtype=torch.float32, copy=True)[None]
        return self.processors(prefix, scores)[0] if self.processors else scores[0]

    def probs(self, prefix: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """(V,) the distribution the token after `prefix` is drawn from: one-hot at the argmax when greedy."""
        scores = self.scores(prefix, logits)
        if not self.do_sample:
            return torch.nn.functional.one_hot(scores.argmax(-1), scores.shape[-1]).float()
        return torch.softmax(scores, dim=-1)

    def positions(self, context: torch.Tensor, tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """(k + 1, V) distributions of the positions after context, context + tokens[:1], ..., context + tokens:
        logits (k + 1, V) are the model's predictions there. context: (1, n); tokens: (k,)."""
        ids = torch.cat([context, tokens[None]], dim=1)
        n = context.shape[1]
        return torch.stack([self.probs(ids[:, : n + i], logits[i]) for i in range(logits.shape[0])])

    def pick(self, prefix: torch.Tensor, logits: torch.Tensor) -> int:
        """One token after `prefix` from its (V,) logits."""
        probs = self.probs(prefix, logits)
        return int(probs.argmax()) if not self.do_sample else int(torch.multinomial(probs, 1))

    def draft(self, context: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(γ,) draft tokens from the drafter's (γ, V) logits after context (1, n), each position processed after
        the draft tokens before it; and, sampled, the (γ, V) distributions they were drawn from (acceptance must be
        computed against those), None for an argmax draft."""
        tokens: list[int] = []
        probs = []
        for i in range(logits.shape[0]):
            prefix = torch.cat([context, context.new_tensor([tokens])], dim=1) if tokens else context
            q = self.probs(prefix, logits[i])
            probs.append(q)
            tokens.append(int(torch.multinomial(q, 1)) if self.do_sample else int(q.argmax()))
        draft = context.new_tensor(tokens)
        return draft, torch.stack(probs) if self.do_sample else None


def accept(draft: torch.Tensor, draft_probs: Optional[torch.Tensor], verifier_probs: torch.Tensor,
           do_sample: bool) -> tuple[int, int]:
    """(num_accepted, next_token): keep the first num_accepted draft tokens, then next_token (the correction at the
    first rejection, or the bonus token). draft: (γ,); draft_probs: (γ, V) the draft was sampled from, or None for
    an argmax draft; verifier_probs: (γ + 1, V), TokenChoice.positions of the verifier's logits."""
    if not do_sample:  # keep draft tokens while they equal the verifier's argmax: AR greedy exactly
        verifier_tokens = verifier_probs.argmax(-1)
        num_accepted = int((draft == verifier_tokens[:-1]).int().cumprod(0).sum())
        return num_accepted, int(verifier_tokens[num_accepted])
    if draft_probs is None:  # a deterministic draft is a point mass, never the drafter's softmax
        draft_probs = torch.nn.functional.one_hot(draft, verifier_probs.shape[-1]).to(verifier_probs.dtype)
    # Speculative sampling: keep x_i with probability min(1, p_i(x_i) / q_i(x_i)) (u * q < p needs no division by a
    # q that underflowed to 0); at the first rejection sample norm(max(p - q, 0)).
    gamma = draft.shape[0]
    positions = torch.arange(gamma, device=draft.device)
    u = torch.rand(gamma, device=draft.device)
    kept = (u * draft_probs[positions, draft] < verifier_probs[positions, draft]).int().cumprod(0)
    num_accepted = int(kept.sum())
    if num_accepted == gamma:
        return gamma, int(torch.multinomial(verifier_probs[gamma], 1))
    diff = (verifier_probs[num_accepted] - draft_probs[num_accepted]).clamp_min(0)
    # Equal distributions leave no residual, but then a rejection has probability 0: never divide 0 by 0.
    residual = diff / diff.sum() if diff.sum() > 0 else verifier_probs[num_accepted]
    return num_accepted, int(torch.multinomial(residual, 1))


# --------------------------------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------------------------------
def rollback_cache(model) -> DynamicCache:
    """A KV cache that can be cropped back after a rejection: sliding-window layers otherwise drop what leaves the
    window and refuse to crop once it is full."""
    with torch.device(model.device):  # sliding layers make a tensor of their window size at construction
        cache = DynamicCache(config=model.config)
    cache.activate_past_recording()
    return cache


def forward(model, ids: torch.Tensor, cache: DynamicCache, mask=None,
            positions: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Run (1, k) new tokens through `model`, extending its cache. positions: (k,), by default the next k after the
    cache. Returns (1, k, V) logits."""
    if positions is None:
        start = cache.get_seq_length()
        positions = torch.arange(start, start + ids.shape[1], device=ids.device)
    return model(input_ids=ids, position_ids=positions[None], attention_mask=mask, cache=cache, use_cache=True).logits


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool (q, k) -> float (1, 1, q, k): 0 where allowed, the dtype's minimum elsewhere (4-D bool masks are not
    handled alike by every attention kernel)."""
    blocked = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=allowed.device)
    return torch.where(allowed, torch.zeros((), dtype=dtype, device=allowed.device), blocked)[None, None]


# The layer types a block-causal drafter's block mask is built for (as align's models.MASK_LAYER_TYPES).
MASK_LAYER_TYPES = ("full_attention", "sliding_attention")


def mask_layer_types(model, role: str = "drafter") -> list[str]:
    """Each layer's attention type, as transformers' cache and masks read the config (`get_layer_types_and_kwargs`):
    its `layer_types`, or for a config without them (Mistral, Phi-3) sliding for every layer when `sliding_window` is
    set, chunked when `attention_chunk_size` is. Refuses layers whose masks block_masks cannot build (chunked, linear
    attention, ...), before any work. role: whose masks (the block-causal drafter's, or the verifier's tree's)."""
    config = model.config.get_text_config(decoder=True)
    declared = getattr(config, "layer_types", None)
    if declared:
        types = list(declared)
    elif getattr(config, "sliding_window", None) is not None:
        types = ["sliding_attention"] * config.num_hidden_layers
    elif getattr(config, "attention_chunk_size", None) is not None:
        types = ["chunked_attention"] * config.num_hidden_layers
    else:
        types = ["full_attention"] * config.num_hidden_layers
    unknown = set(types) - set(MASK_LAYER_TYPES)
    if unknown:
        raise ValueError(f"this custom_generate builds masks for {' and '.join(MASK_LAYER_TYPES)} layers only; "
                         f"the {role} has {', '.join(sorted(unknown))} layers")
    return types


def block_masks(model, cache: DynamicCache, layer_types: list[str], allowed: torch.Tensor,
                positions: torch.Tensor):
    """The additive masks of a forward of q new tokens over what `cache` holds. allowed: bool (q, q), which new
    tokens each new token attends to; positions: (q,) theirs. Every new token also sees the cached keys its layer's
    cache hands back (`get_mask_sizes`: all of a full layer's, the last window−1 of a sliding layer's), and a sliding
    layer's mask hides every key `sliding_window` or more positions before the query, as the model's own mask would.
    Returns (1, 1, q, kv) additive masks: one tensor for a config without `layer_types` (Llama, Mistral), else a
    dict per layer type, which such models take (Qwen2, Gemma)."""
    q = allowed.shape[0]
    window = model.config.get_text_config(decoder=True).sliding_window if "sliding_attention" in layer_types else None

    def mask_for(layer_type: str) -> torch.Tensor:
        sliding = layer_type == "sliding_attention"
        layer_idx = cache.is_sliding.index(sliding) if sliding in cache.is_sliding else 0
        kv_length, offset = cache.get_mask_sizes(q, layer_idx)
        cached_keys = kv_length - q
        key_positions = torch.cat([torch.arange(offset, offset + cached_keys, device=positions.device), positions])
        sees = torch.cat([allowed.new_ones(q, cached_keys), allowed], dim=1)  # (q, kv)
        if sliding:
            sees = sees & (key_positions[None, :] > positions[:, None] - window)
        return additive_mask(sees, model.dtype)

    if getattr(model.config.get_text_config(decoder=True), "layer_types", None):
        return {layer_type: mask_for(layer_type) for layer_type in set(layer_types)}
    return mask_for(layer_types[0])  # without `layer_types`, every layer is of one type (mask_layer_types)


class Drafter:
    """Reads a diffusion drafter the way its DrafterSpec says; `propose` gives the logits of a block after a context.
    A block-causal drafter keeps an exact context cache that only grows: drafts never enter it."""

    def __init__(self, model):
        spec = getattr(model.config, "drafter_spec", None)
        if not spec:
            raise ValueError("assistant_model has no config.drafter_spec: pass the diffusion drafter exported by "
                             "align (its config.json carries the spec)")
        if spec.get("kind", "standalone") != "standalone" or spec.get("noise", "mask") != "mask" or \
                getattr(model.config, "is_encoder_decoder", False) or model.config.model_type == "diffusion_gemma":
            raise ValueError(f"this custom_generate decodes standalone masked drafters; drafter_spec kind "
                             f"{spec.get('kind')!r} with noise {spec.get('noise', 'mask')!r} (DFlash, DiffusionGemma) "
                             "needs align's runtime: align.decoding.specdiff.specdiff_generate")
        if spec["attention"] not in ("block_causal", "bidirectional") or spec["logits_shift"] not in (0, 1):
            raise ValueError(f"unknown drafter_spec {spec}")
        self.model, self.mask_token_id = model, spec["mask_token_id"]
        self.shift, self.cached = spec["logits_shift"], spec["attention"] == "block_causal"
        # Checked now, before any work: the block mask is built here for these layer types only.
        self.layer_types = mask_layer_types(model) if self.cached else None
        self.cache = rollback_cache(model) if self.cached else None
        self.last_logits: Optional[torch.Tensor] = None  # (V,): a shifted drafter's prediction for block position 0

    def propose(self, context: torch.Tensor, gamma: int) -> torch.Tensor:
        """context: (1, n) clean tokens -> (γ, V) logits for the γ positions after it."""
        context = context.to(self.model.device)  # the drafter may sit on another device than the verifier
        block = context.new_full((1, gamma), self.mask_token_id)
        if not self.cached:  # bidirectional: every position sees every other, so the context is re-encoded
            n = context.shape[1]
            logits = self.model(input_ids=torch.cat([context, block], dim=1)).logits[0]
            return logits[n - self.shift: n + gamma - self.shift]
        return self._cached_propose(context, block)

    def _cached_propose(self, context: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        # One forward for the context tokens not cached yet and the block (a draft costs one drafter call): the new
        # context tokens are causal, the block sees the whole context and itself (the cached context through each
        # sliding layer's window: its cache hands back only the window's keys).
        cached, n, gamma = self.cache.get_seq_length(), context.shape[1], block.shape[1]
        ids = torch.cat([context[:, cached:], block], dim=1)
        positions = torch.arange(cached, n + gamma, device=ids.device)
        allowed = torch.ones(n - cached + gamma, n - cached + gamma, dtype=torch.bool, device=ids.device).tril()
        allowed[n - cached:] = True
        mask = block_masks(self.model, self.cache, self.layer_types, allowed, positions)
        logits = forward(self.model, ids, self.cache, mask)[0]
        self.cache.crop(-gamma)  # the block is a guess: it never stays in the context cache
        if n > cached:
            self.last_logits = logits[n - cached - 1]
        block_logits = logits[n - cached:]  # (γ, V)
        if not self.shift:
            return block_logits
        # Shifted: block position 0 is predicted by the last context position, position i by block position i-1.
        return torch.cat([self.last_logits[None], block_logits[:-1]], dim=0)


# --------------------------------------------------------------------------------------------------------------------
# the loop
# --------------------------------------------------------------------------------------------------------------------
@torch.inference_mode()
def specdiff(verifier, drafter: Drafter, prompt: torch.Tensor, gamma: int, max_new_tokens: int, choice: TokenChoice,
             eos_ids: frozenset[int]) -> tuple[list[int], list[int]]:
    """prompt: (1, n). Returns (new tokens, accepted draft tokens per iteration)."""
    # Invariant: the verifier's cache covers every token but the newest one.
    cache = rollback_cache(verifier)
    tokens = [choice.pick(prompt, forward(verifier, prompt, cache)[0, -1])]
    accept_counts: list[int] = []
    while len(tokens) < max_new_tokens and eos_ids.isdisjoint(tokens):
        draft_len = min(gamma, max_new_tokens - len(tokens))  # never draft past the end: it would be thrown away
        context = torch.cat([prompt, prompt.new_tensor([tokens])], dim=1)
        draft_logits = drafter.propose(context, draft_len).to(prompt.device)  # (γ, V)
        # Drawn (or the argmax taken) after the verifier's processors applied to the drafter, and accepted against
        # exactly those distributions.
        draft, draft_probs = choice.draft(context, draft_logits)
        verifier_logits = forward(verifier, torch.cat([context[:, -1:], draft[None]], dim=1), cache)[0]
        num_accepted, next_token = accept(draft, draft_probs, choice.positions(context, draft, verifier_logits),
                                          choice.do_sample)
        cache.crop(-(draft_len - num_accepted))  # rejected drafts leave the cache; the kept ones are exact
        accept_counts.append(num_accepted)
        tokens += [*draft[:num_accepted].tolist(), next_token]
    return truncated(tokens, max_new_tokens, eos_ids), accept_counts


def truncated(tokens: list[int], max_new_tokens: int, eos_ids: frozenset[int]) -> list[int]:
    """AR decoding's stopping rule: at max_new_tokens, and just after the first end-of-sequence token (a step may
    emit several tokens past either)."""
    tokens = tokens[:max_new_tokens]
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: i + 1]
    return tokens


# --------------------------------------------------------------------------------------------------------------------
# the union tree: the drafter's best-first tree and model-free candidates, verified in one verifier forward
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class Tree:
    """Draft nodes, parents first: node i is row i + 1 of the verifier's tree forward; row 0 is the newest token (the
    root, whose children have parent -1)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]  # 1 for the root's children

    def add(self, token: int, parent: int) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1 if parent >= 0 else 1)
        return len(self.tokens) - 1

    def children(self) -> list[list[int]]:
        """Per row (0: the root, i + 1: node i), its child nodes in the order they were added."""
        rows: list[list[int]] = [[] for _ in range(len(self.tokens) + 1)]
        for node, parent in enumerate(self.parents):
            rows[parent + 1].append(node)
        return rows

    def ancestors_allowed(self, device: torch.device) -> torch.Tensor:
        """bool (N + 1, N + 1): row r attends to column c iff c is r or one of r's ancestors."""
        allowed = torch.eye(len(self.tokens) + 1, dtype=torch.bool, device=device)
        for node, parent in enumerate(self.parents):
            allowed[node + 1] |= allowed[parent + 1]  # a parent's row is complete before its children's
        return allowed


def drafter_tree(log_probs: torch.Tensor, num_nodes: int, eos_ids: frozenset[int]) -> Tree:
    """The `num_nodes` best nodes by cumulative drafter log-probability, at most γ deep (align's build_draft_tree, tie
    for tie). log_probs: (γ, V), depth d + 1 in row d; a node's children are its depth's ranking (the drafter's
    marginals do not see the path). A priority queue over expansions: popping a node pushes its next sibling and its
    first child, and every score is ≤ 0, so parents pop before their children. No children below an end token."""
    depth_limit = log_probs.shape[0]
    top, ranked = (t.tolist() for t in log_probs.float().topk(min(num_nodes, log_probs.shape[-1]), dim=-1))
    tree = Tree([], [], [])
    frontier = [(-top[0][0], 0, 0, -1, 0.0)]  # (-score, depth index, rank among its siblings, parent, parent's score)
    while frontier and len(tree.tokens) < num_nodes:
        negative, depth, rank, parent, parent_score = heapq.heappop(frontier)
        token = ranked[depth][rank]
        node = tree.add(token, parent)
        if rank + 1 < len(ranked[depth]):
            sibling = parent_score + top[depth][rank + 1]
            heapq.heappush(frontier, (-sibling, depth, rank + 1, parent, parent_score))
        if depth + 1 < depth_limit and token not in eos_ids:
            heapq.heappush(frontier, (negative - top[depth + 1][0], depth + 1, 0, node, -negative))
    return tree


def merge(tree: Tree, tokens: list[int], parents: list[int], eos_ids: frozenset[int]) -> None:
    """Merge candidates from the same root into `tree` (parents first, -1 for the root's children; align's add_tree):
    a candidate whose parent already has a child of its token is that child, the others are appended, so parents
    still come first; nothing is added below an end token."""
    child = {(parent, token): node for node, (parent, token) in enumerate(zip(tree.parents, tree.tokens))}
    ended = {node for node, token in enumerate(tree.tokens) if token in eos_ids}
    placed: list[int] = []  # per candidate, its node (-1: left out)
    for token, candidate_parent in zip(tokens, parents):
        parent = placed[candidate_parent] if candidate_parent >= 0 else -1
        if (candidate_parent >= 0 and parent < 0) or parent in ended:
            placed.append(-1)
            continue
        node = child.get((parent, token))
        if node is None:
            node = child[(parent, token)] = tree.add(token, parent)
            if token in eos_ids:
                ended.add(node)
        placed.append(node)


def ngram_continuation(context: np.ndarray, num_tokens: int, max_match: int = 4, min_match: int = 1) -> list[int]:
    """vLLM's n-gram rule (align's NgramLookup): up to `num_tokens` tokens after the most recent earlier occurrence of
    the longest suffix of `context` (1-D ids) of max_match..min_match tokens; [] when none occurs."""
    for n in range(min(max_match, len(context) - 1), min_match - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(context[:-1], n)  # every occurrence but the suffix itself
        hits = np.flatnonzero((windows == context[-n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n  # the most recent occurrence: nearby text predicts best
            return context[start:start + num_tokens].tolist()
    return []


class SuffixCandidates:
    """SuffixDecoding's candidates from `suffix_index.npz`, which `align export` ships beside the drafter: a suffix
    array over the verifier's own trajectories, each document followed by -1 (align's SuffixIndex.continuations).
    A node's share is the fraction of the longest match's occurrences (at most 256, spread evenly) that continue
    through it; the `num_nodes` most frequent with a share of at least `min_share` are the candidates."""

    def __init__(self, file: str, num_nodes: int = 16, max_match: int = 8, min_share: float = 0.1) -> None:
        with np.load(file) as saved:
            self.tokens, self.suffixes = saved["tokens"], saved["suffixes"]
        if self.tokens.ndim != 1 or self.suffixes.shape != self.tokens.shape or not len(self.tokens) \
                or self.tokens[-1] != -1:
            raise ValueError(f"{file} is not a suffix index (export the drafter again)")
        self.num_nodes, self.max_match, self.min_share = num_nodes, max_match, min_share

    def _bound(self, pattern: tuple[int, ...], low: int, high: int, above: bool) -> int:
        """The first suffix in [low, high) whose first len(pattern) tokens are ≥ pattern (> pattern when `above`)."""
        while low < high:
            middle = (low + high) // 2
            start = int(self.suffixes[middle])
            head = tuple(self.tokens[start:start + len(pattern)].tolist())
            if head < pattern or (above and head == pattern):
                low = middle + 1
            else:
                high = middle
        return low

    def __call__(self, context: np.ndarray, depth: int) -> tuple[list[int], list[int]]:
        """(tokens, parents) of the candidates after `context` (1-D ids), at most `depth` deep, parents first."""
        size, low, high = 0, 0, 0
        for length in range(1, min(self.max_match, len(context)) + 1):  # the longest suffix of the context that occurs
            pattern = tuple(context[-length:].tolist())
            first = self._bound(pattern, 0, len(self.suffixes), above=False)
            last = self._bound(pattern, first, len(self.suffixes), above=True)
            if first >= last:
                break
            size, low, high = length, first, last
        if size == 0:
            return [], []
        picked = np.unique(np.linspace(low, high - 1, min(high - low, 256)).astype(np.int64))
        counts: dict[tuple[int, ...], int] = {}
        for start in self.suffixes[picked].tolist():
            path: tuple[int, ...] = ()
            for token in self.tokens[start + size:start + size + depth].tolist():
                if token == -1:  # a document's end: nothing runs into the next one
                    break
                path += (token,)
                counts[path] = counts.get(path, 0) + 1
        ranked = sorted((path for path, n in counts.items() if n >= self.min_share * len(picked)),
                        key=lambda path: (-counts[path], len(path), path))[:self.num_nodes]
        node_of = {path: node for node, path in enumerate(ranked)}
        return [path[-1] for path in ranked], [node_of[path[:-1]] if len(path) > 1 else -1 for path in ranked]


def tree_forward(verifier, layer_types: list[str], root: torch.Tensor, tree: Tree, cache: DynamicCache
                 ) -> torch.Tensor:
    """Score the root (1, 1) and every node in one forward over the cached prefix: row r at position cached + its
    depth, seeing the prefix and its own ancestors only, so its logits are a plain forward's over its path. The cache
    grows by N + 1 entries, in row order. Returns (N + 1, V) logits."""
    positions = cache.get_seq_length() + torch.tensor([0, *tree.depths], device=root.device)
    ids = torch.cat([root, root.new_tensor([tree.tokens])], dim=1)
    mask = block_masks(verifier, cache, layer_types, tree.ancestors_allowed(root.device), positions)
    return forward(verifier, ids, cache, mask, positions)[0]


def keep_path(cache: DynamicCache, num_nodes: int, path: list[int]) -> None:
    """After a tree forward: the root's and the accepted path's keys and values stay, in path order; the others go.
    The path's entries move to just after the root (path nodes increase, so each moves back or stays), then the cache
    is cropped by the rest."""
    if path:
        for layer in cache.layers:
            if not getattr(layer, "is_initialized", False) or layer.keys.numel() == 0:
                continue  # a layer that shares another's keys and values (Gemma 4) holds none
            first = layer.keys.shape[-2] - num_nodes  # node 0's slot
            source = torch.tensor(path, device=layer.keys.device) + first
            target = torch.arange(first, first + len(path), device=layer.keys.device)
            layer.keys[:, :, target] = layer.keys[:, :, source]
            layer.values[:, :, target] = layer.values[:, :, source]
    if num_nodes > len(path):
        cache.crop(-(num_nodes - len(path)))


def walk(tree: Tree, logits: torch.Tensor, context: torch.Tensor, choice: TokenChoice) -> tuple[list[int], int]:
    """(the accepted nodes from the root down, the verifier's token after them): at each row, its children are tried
    in order against the verifier's distribution there, processed after the row's own path (TokenChoice).

    Greedy: the child whose token is the argmax, while there is one: generate()'s greedy output. Sampled: every node
    is a fixed token (the drafter's top tokens and the copied candidates, all chosen before the verifier's randomness),
    a point mass, never a sample of the drafter's q: child x is accepted with probability p(x); on rejection x's mass
    is removed and p renormalised for the next child; when all fail, the token is drawn from what is left. One trial
    emits y with probability p(x)·[y = x] + (1 − p(x))·p(y)/(1 − p(x))·[y ≠ x] = p(y), so the token leaving a row is
    distributed as the verifier's, whatever the candidates; an accepted child's row repeats this with the verifier's
    distribution after that child. Sibling tokens differ, so a removed token is never tried again."""
    children = tree.children()
    path: list[int] = []
    while True:
        row = path[-1] + 1 if path else 0
        prefix = torch.cat([context, context.new_tensor([[tree.tokens[n] for n in path]])], dim=1)
        target = choice.probs(prefix, logits[row])
        best = int(target.argmax())  # greedy: the one token that can be kept here
        chosen = None
        for node in children[row]:
            token = tree.tokens[node]
            if not choice.do_sample:
                if token == best:
                    chosen = node
                    break
                continue
            if float(torch.rand((), device=target.device)) < float(target[token]):
                chosen = node
                break
            target = target.clone()
            target[token] = 0
            target = target / target.sum()  # a rejection means p(x) < 1: mass is left elsewhere
        if chosen is None:
            return path, best if not choice.do_sample else int(torch.multinomial(target, 1))
        path.append(chosen)


@torch.inference_mode()
def union_tree(verifier, drafter: Drafter, prompt: torch.Tensor, gamma: int, num_nodes: int, max_new_tokens: int,
          choice: TokenChoice, eos_ids: frozenset[int], suffix: Optional[SuffixCandidates]
          ) -> tuple[list[int], list[int]]:
    """The union tree: each step, the drafter's `num_nodes`-node best-first tree from one pass, the n-gram
    continuation of the prompt and output so far, and (with a suffix index) SuffixDecoding's candidates, merged into
    one tree (shared prefixes merged) and verified in one verifier forward. prompt: (1, n). Returns (new tokens,
    accepted nodes per iteration)."""
    # Invariant: the verifier's cache covers every token but the newest one.
    layer_types = mask_layer_types(verifier, "verifier")
    cache = rollback_cache(verifier)
    tokens = [choice.pick(prompt, forward(verifier, prompt, cache)[0, -1])]
    accept_counts: list[int] = []
    while len(tokens) < max_new_tokens and eos_ids.isdisjoint(tokens):
        depth_limit = min(gamma, max_new_tokens - len(tokens))
        context = torch.cat([prompt, prompt.new_tensor([tokens])], dim=1)
        draft_log_probs = torch.log_softmax(drafter.propose(context, depth_limit).float(), dim=-1)  # (γ, V)
        tree = drafter_tree(draft_log_probs, num_nodes, eos_ids)
        context_ids = context[0].cpu().numpy()
        copied = ngram_continuation(context_ids, depth_limit)  # a path: each token the child of the one before
        merge(tree, copied, list(range(-1, len(copied) - 1)), eos_ids)
        if suffix is not None:
            merge(tree, *suffix(context_ids, depth_limit), eos_ids)
        logits = tree_forward(verifier, layer_types, context[:, -1:], tree, cache)  # (N + 1, V)
        path, next_token = walk(tree, logits, context, choice)
        keep_path(cache, len(tree.tokens), path)
        accept_counts.append(len(path))
        tokens += [*(tree.tokens[node] for node in path), next_token]
    return truncated(tokens, max_new_tokens, eos_ids), accept_counts


# Set on a verifier once check_tree_verifier has passed it.
TREE_MASK_READ = "_custom_generate_reads_tree_masks"


def check_tree_verifier(verifier) -> None:
    """Refuse, before any work, a verifier whose tree forward would not be exact: an attention that takes no 4-D float
    mask, layers whose masks block_masks cannot build, a cache whose layers cannot keep one branch (not key/value
    layers), or a forward that drops the mask it is handed (remote code building its own causal mask would score
    each node as if the nodes before it in the forward were its ancestors): asked of the model itself, with the
    last of 4 tokens seeing the others and not."""
    implementation = getattr(verifier.config, "_attn_implementation", None)
    if implementation not in ("sdpa", "eager"):
        raise ValueError(f"union=True verifies a tree through a 4-D float mask, which the verifier's attention "
                         f"({implementation}) does not take: load it with attn_implementation='sdpa' or 'eager'")
    layer_types = mask_layer_types(verifier, "verifier")
    if getattr(verifier, TREE_MASK_READ, False):  # the forwards below asked once per verifier, as align's runtime
        return
    ids = torch.arange(4, device=verifier.device)[None]
    last = []
    for hide in (False, True):
        cache = rollback_cache(verifier)
        others = {type(layer).__name__ for layer in cache.layers if not isinstance(layer, DynamicLayer)}
        if others:
            raise ValueError("union=True keeps one branch of a tree by moving keys and values; the verifier's cache "
                             f"has {', '.join(sorted(others))} layers")
        allowed = torch.ones(4, 4, dtype=torch.bool, device=ids.device).tril()
        allowed[3, :3] = not hide
        mask = block_masks(verifier, cache, layer_types, allowed, ids[0])
        with torch.inference_mode():
            last.append(forward(verifier, ids, cache, mask)[0, 3].float())
    if torch.equal(*last):
        raise ValueError(f"the verifier ({type(verifier).__name__}) ignores the 4-D attention mask it is handed, so a "
                         "tree's nodes cannot be scored apart: decode without union=True")
    setattr(verifier, TREE_MASK_READ, True)  # asked once per verifier, not at every generate() call


SUFFIX_FILE = "suffix_index.npz"  # what `align export` writes beside the drafter when decode.suffix_corpus is set


def find_suffix_index(drafter_model, given: Optional[str]) -> Optional[str]:
    """The suffix index the union reads: `given` (the file, or a folder holding it), else the one beside the drafter
    (its local folder, or its Hub repository through transformers' own `cached_file`); None when it ships none."""
    if given is not None:
        file = os.path.join(given, SUFFIX_FILE) if os.path.isdir(given) else str(given)
        if not os.path.isfile(file):
            raise ValueError(f"suffix_index: {file} does not exist")
        return file
    source = str(getattr(drafter_model, "name_or_path", "") or "")
    if not source or os.path.isdir(source):
        file = os.path.join(source, SUFFIX_FILE)
        return file if source and os.path.isfile(file) else None
    from transformers.utils import cached_file

    return cached_file(source, SUFFIX_FILE, _raise_exceptions_for_missing_entries=False,
                       _raise_exceptions_for_connection_errors=False)


def suffix_candidates(drafter_model, given: Optional[str]) -> Optional[SuffixCandidates]:
    """find_suffix_index's index, loaded once per drafter and `given` (kept on the drafter): not found and read again
    (for a Hub drafter, asked of the Hub again) at every generate() call."""
    cached = getattr(drafter_model, "_custom_generate_suffix", None)
    if cached is None or cached[0] != given:
        file = find_suffix_index(drafter_model, given)
        cached = (given, SuffixCandidates(file) if file is not None else None)
        drafter_model._custom_generate_suffix = cached
    return cached[1]


# Settings of generate() this loop refuses, each with its plain value(s) and why (every other setting is generate()'s
# own: its logits processors and warpers are built by generate's code, see TokenChoice). Decoding modes other than
# greedy and sampling (beams, contrastive search, DoLa, constraints) are refused by their GenerationMode.
REFUSED = {
    "num_return_sequences": ((None, 1), "decodes one sequence per prompt"),
    "guidance_scale": ((None, 1, 1.0), "classifier-free guidance runs the verifier again on its own cache"),
    "watermarking_config": ((None,), "SynthID watermarking keeps state across calls, which drafts would enter"),
    "stop_strings": ((None,), "stops at end tokens and at the length only"),
    "max_time": ((None,), "stops at end tokens and at the length only"),
    "token_healing": ((None, False), "does not rewrite the prompt"),
    "prompt_lookup_num_tokens": ((None,), "drafts with assistant_model, the diffusion drafter"),
    "num_assistant_tokens_schedule": ((None, "constant"), "drafts gamma (num_assistant_tokens) tokens every step"),
    "assistant_early_exit": ((None,), "drafts with assistant_model, the diffusion drafter"),
    "use_mtp": ((None, False), "drafts with assistant_model, the diffusion drafter"),
    "output_scores": ((None, False), "returns sequences and τ, no scores"),
    "output_logits": ((None, False), "returns sequences and τ, no logits"),
    "output_attentions": ((None, False), "returns sequences and τ, no attentions"),
    "output_hidden_states": ((None, False), "returns sequences and τ, no hidden states"),
}


def refuse(what: str, why: str) -> None:
    raise ValueError(f"SpecDiff's custom_generate does not support {what}: it {why}")


DEFAULT_GAMMA = 8  # draft tokens per verifier forward when neither gamma nor num_assistant_tokens is given


def generate(model, inputs: Optional[torch.Tensor] = None, generation_config=None, logits_processor=None,
             stopping_criteria=None, prefix_allowed_tokens_fn=None, synced_gpus=None, assistant_model=None,
             streamer=None, negative_prompt_ids=None, negative_prompt_attention_mask=None,
             gamma: Optional[int] = None, union: bool = False, tree_nodes: int = 32,
             suffix_index: Optional[str] = None, **kwargs):
    """What `model.generate(..., custom_generate=<this repo>)` runs. model: the verifier (any causal LM);
    assistant_model: the diffusion drafter; inputs: (1, n) prompt ids. gamma: draft tokens per verifier forward; None:
    `num_assistant_tokens` when the call or its generation config gives it (assisted generation's name for it), else 8.
    union: verify the drafter's `tree_nodes`-node best-first tree, the n-gram continuation of the prompt and output
    (vLLM's rule) and SuffixDecoding's candidates over the verifier's own trajectories (`suffix_index`: the
    suffix_index.npz file or its folder; by default the one `align export` ships beside the drafter, when it does)
    in one tree, verified in one forward (`union_tree`): align's `specdiff_ngram_suffix_tree` at a fixed size. Its nodes
    are accepted as point masses, so sampled decoding keeps the verifier's distribution (`walk`).

    The generation config is prepared by generate()'s own steps (model's generation_config, the library's defaults:
    top_k 50, 20 new tokens..., then the arguments), and tokens are chosen through generate()'s own logits processors
    (temperature, top_k, top_p, min_p, typical_p, epsilon/eta cutoffs, repetition_penalty, no_repeat_ngram_size,
    bad_words_ids, min_new_tokens, suppress_tokens, sequence_bias, prefix_allowed_tokens_fn...): greedy output is
    generate()'s token for token, sampled output is distributed as generate()'s. What it cannot reproduce it refuses
    by name (REFUSED, other decoding modes, logits_processor/stopping_criteria lists, streamer).

    Returns (1, n + new) ids like generate(), or with return_dict_in_generate=True a SpecDiffOutput whose `tau` is
    the tokens per verifier forward. One prompt at a time: speculation accepts different lengths per sequence.
    """
    if assistant_model is None:
        raise ValueError("pass the diffusion drafter as assistant_model=")
    # Arbitrary processors and criteria may keep state across calls, and drafts that are then rejected would enter it.
    for name, given in (("logits_processor", logits_processor), ("stopping_criteria", stopping_criteria)):
        if given:
            refuse(f"a {name} list", "applies generate()'s own processors after each draft position's prefix, "
                   "which is exact only for functions of that prefix")
    for name, given in (("streamer", streamer), ("negative_prompt_ids", negative_prompt_ids),
                        ("negative_prompt_attention_mask", negative_prompt_attention_mask)):
        if given is not None:
            refuse(name, "emits accepted blocks at once and runs no guidance")
    if synced_gpus:
        refuse("synced_gpus", "decodes on one process")
    prompt = inputs if inputs is not None else kwargs.pop("input_ids", None)
    if prompt is None or prompt.dim() != 2 or prompt.shape[0] != 1:
        raise ValueError("SpecDiff's custom_generate decodes one prompt at a time: input ids of shape (1, n)")
    mask = kwargs.pop("attention_mask", None)
    if mask is not None and not bool(mask.all()):
        raise ValueError("SpecDiff's custom_generate takes an unpadded prompt (attention_mask all ones)")
    kwargs.pop("tokenizer", None)  # generate() reads it for stop strings and token healing only, both refused
    if kwargs.get("assistant_tokenizer") is not None:
        refuse("assistant_tokenizer", "drafts in the verifier's vocabulary")
    kwargs.pop("assistant_tokenizer", None)
    # Assisted generation's draft length, honoured under that name too; its other schedule (a length that grows and
    # shrinks with acceptance) is not this loop's.
    asked = kwargs.get("num_assistant_tokens",
                       getattr(generation_config, "num_assistant_tokens", None) if generation_config else None)
    if gamma is not None and asked is not None and asked != gamma:
        raise ValueError(f"gamma={gamma} and num_assistant_tokens={asked} both set the draft length: give one")
    gamma = gamma if gamma is not None else asked if asked is not None else DEFAULT_GAMMA
    if not isinstance(gamma, int) or gamma < 1:
        raise ValueError(f"the draft length (gamma, num_assistant_tokens) is a positive integer, got {gamma!r}")
    if isinstance(tree_nodes, bool) or not isinstance(tree_nodes, int) or not 1 <= tree_nodes <= 1024:
        raise ValueError(f"tree_nodes (the drafter's tree in the union) is an integer from 1 to 1024, got "
                         f"{tree_nodes!r}")
    if suffix_index is not None and not union:
        raise ValueError("suffix_index is read by the union tree: pass union=True with it")

    # generate()'s own preparation, step by step (transformers/generation/utils.py `generate`, steps 1, 3 and 6):
    # the defaults, the model's generation_config and the arguments merged as there, the end tokens as tensors, and
    # max_length from max_new_tokens or the default of 20 new tokens.
    has_default_max_length = (kwargs.get("max_length") is None
                              and (generation_config is None or generation_config.max_length is None)
                              and model.generation_config.max_length is None)
    has_default_min_length = (kwargs.get("min_length") is None
                              and (generation_config is None or generation_config.min_length is None)
                              and model.generation_config.min_length is None)
    config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    if model_kwargs:
        raise ValueError(f"SpecDiff's custom_generate takes no model inputs besides input_ids and attention_mask, and "
                         f"{sorted(model_kwargs)} are no generation settings")
    for name, (plain, why) in REFUSED.items():
        value = getattr(config, name, None)
        if value not in plain:
            refuse(f"{name}={value!r}", why)
    mode = config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        refuse(f"{mode.value.replace('_', ' ')} (num_beams={config.num_beams}, penalty_alpha={config.penalty_alpha}, "
               f"dola_layers={config.dola_layers})", "decodes greedily or samples, one sequence")
    prompt = prompt.to(model.device)
    n = prompt.shape[1]
    model._prepare_special_tokens(config, mask is not None, device=prompt.device, batch_size=1)
    config = model._prepare_generated_length(config, has_default_max_length, has_default_min_length,
                                             model_input_name="input_ids", input_ids_length=n, inputs_tensor=prompt)
    model._validate_generated_length(config, n, has_default_max_length)
    processors = model._get_logits_processor(generation_config=config, input_ids_seq_length=n,
                                             encoder_input_ids=prompt, prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
                                             logits_processor=LogitsProcessorList(), device=prompt.device,
                                             model_kwargs={})
    eos = config.eos_token_id
    eos_ids = frozenset([] if eos is None else [eos] if isinstance(eos, int) else list(eos))
    drafter, choice = Drafter(assistant_model), TokenChoice(processors, bool(config.do_sample))
    if union:
        check_tree_verifier(model)
        suffix = suffix_candidates(assistant_model, suffix_index)
        tokens, accept_counts = union_tree(model, drafter, prompt, gamma, tree_nodes, config.max_length - n, choice,
                                           eos_ids, suffix)
    else:
        tokens, accept_counts = specdiff(model, drafter, prompt, gamma, config.max_length - n, choice, eos_ids)
    sequences = torch.cat([prompt, prompt.new_tensor([tokens])], dim=1)
    if not config.return_dict_in_generate:
        return sequences
    tau = sum(k + 1 for k in accept_counts) / len(accept_counts) if accept_counts else 1.0
    return SpecDiffOutput(sequences=sequences, tau=tau, accept_counts=accept_counts,
                          verifier_forwards=len(accept_counts))
