"""DiffuSpec's causal-consistency path search (CPS) and its causal proxy, a token trigram model.

A one-pass diffusion draft gives independent per-position marginals, so its argmax path can be incoherent left to
right ("the the"). CPS keeps, per position, the few tokens that carry most of the drafter's mass and beam-searches the
path that both the drafter and a cheap causal model like:  score = Σ_i λ·log q_i(v_i) + (1−λ)·log p_proxy(v_i | prefix).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch


class TrigramModel:
    """Interpolated token trigram model fitted on a token stream: the causal proxy of CPS.

    DiffuSpec uses a 3-gram KenLM; KenLM needs a C++ build, and a few numpy arrays do the same job at these sizes.
    Fixed interpolation weights (no held-out tuning) keep it dependency-free and deterministic:
    p(c | a, b) = 0.6·f(c | a, b) + 0.3·f(c | b) + 0.1·(count(c) + 1) / (N + V).
    """

    WEIGHTS = (0.6, 0.3, 0.1)

    def __init__(self, vocab_size: int, unigram: np.ndarray, bigram: tuple[np.ndarray, np.ndarray],
                 trigram: tuple[np.ndarray, np.ndarray]) -> None:
        self.vocab_size = vocab_size
        self.unigram = unigram  # (V,) counts
        self.bigram_keys, self.bigram_counts = bigram  # sorted keys b*V + c, counts
        self.trigram_keys, self.trigram_counts = trigram  # sorted keys (a*V + b)*V + c, counts
        # Context totals, precomputed: a draft tree asks for one context per node, and summing a context's key range
        # on every call was half of each call's time.
        self.unigram_probs = (unigram + 1) / (unigram.sum() + vocab_size)  # add-one smoothed
        self.bigram_context = np.bincount(self.bigram_keys // vocab_size, weights=self.bigram_counts,
                                          minlength=vocab_size)  # (V,) occurrences of b as a bigram's first token
        self.trigram_prefixes, starts = np.unique(self.trigram_keys // vocab_size, return_index=True)  # a*V + b
        self.trigram_context = np.add.reduceat(self.trigram_counts, starts) if len(starts) else starts

    @classmethod
    def fit(cls, tokens: np.ndarray, vocab_size: int) -> "TrigramModel":
        t = tokens.astype(np.int64)
        unigram = np.bincount(t, minlength=vocab_size).astype(np.int64)
        bigram = np.unique(t[:-1] * vocab_size + t[1:], return_counts=True)
        trigram = np.unique((t[:-2] * vocab_size + t[1:-1]) * vocab_size + t[2:], return_counts=True)
        return cls(vocab_size, unigram, bigram, trigram)

    def save(self, folder: Path, **provenance: Any) -> None:
        """Write trigram.npz and manifest.json into `folder` (the caller makes it appear atomically)."""
        with open(folder / "trigram.npz", "wb") as f:
            np.savez(f, unigram=self.unigram, bigram_keys=self.bigram_keys, bigram_counts=self.bigram_counts,
                     trigram_keys=self.trigram_keys, trigram_counts=self.trigram_counts)
        (folder / "manifest.json").write_text(json.dumps({"vocab_size": self.vocab_size,
                                                          "tokens": int(self.unigram.sum()), **provenance}))

    @classmethod
    def load(cls, folder: Path) -> "TrigramModel":
        vocab_size = json.loads((folder / "manifest.json").read_text())["vocab_size"]
        z = np.load(folder / "trigram.npz")
        return cls(vocab_size, z["unigram"], (z["bigram_keys"], z["bigram_counts"]),
                   (z["trigram_keys"], z["trigram_counts"]))

    @staticmethod
    def _count(keys: np.ndarray, counts: np.ndarray, query: np.ndarray) -> np.ndarray:
        idx = np.searchsorted(keys, query).clip(max=len(keys) - 1)
        return np.where(keys[idx] == query, counts[idx], 0)

    def log_probs(self, prev2: int, prev1: int, candidates: np.ndarray) -> np.ndarray:
        """log p(c | prev2, prev1) for each candidate token c; prev2 = -1 when the context has one token.

        A candidate past the tokenizer's vocabulary (a model's padded vocabulary rows: Qwen2.5's logits are wider than
        its tokenizer) was never seen: it gets the smoothed probability of an unseen token; such a token in the context
        (a tree node's parent) is an unseen context."""
        V = self.vocab_size
        w3, w2, w1 = self.WEIGHTS
        seen = candidates < V
        if not seen.all():  # a wider id would index past the counts, or alias another context's key
            out = np.full(len(candidates), np.log(w1 / (self.unigram.sum() + V)))
            out[seen] = self.log_probs(prev2, prev1, candidates[seen])
            return out
        mix = w1 * self.unigram_probs[candidates]
        if prev1 >= V:  # would index past the counts, or alias another context's keys
            return np.log(mix)
        bigram_context = self.bigram_context[prev1]
        if bigram_context:  # an unseen context contributes nothing (its relative frequencies are all 0)
            mix += w2 / bigram_context * self._count(self.bigram_keys, self.bigram_counts, prev1 * V + candidates)
        if 0 <= prev2 < V:
            prefix = prev2 * V + prev1
            i = int(np.searchsorted(self.trigram_prefixes, prefix))
            if i < len(self.trigram_prefixes) and self.trigram_prefixes[i] == prefix:
                mix += w3 / self.trigram_context[i] * self._count(self.trigram_keys, self.trigram_counts,
                                                                  prefix * V + candidates)
        return np.log(mix)


@dataclass(frozen=True)
class PathSearch:
    """CPS settings (DiffuSpec defaults: B=3, τ=0.8, M_max=15, λ=0.5)."""

    beam_width: int = 3
    threshold: float = 0.8
    max_candidates: int = 15
    weight: float = 0.5


def candidate_sets(draft_probs: torch.Tensor, threshold: float, max_candidates: int,
                   eos_ids: frozenset[int]) -> list[list[int]]:
    """Per position, the smallest top-m set with mass ≥ threshold (m ≤ max_candidates), plus every EOS token.

    draft_probs: (γ, V). Entropy-adaptive: a confident position keeps one token, an unsure one up to max_candidates.
    """
    top_probs, top_tokens = draft_probs.topk(min(max_candidates, draft_probs.shape[-1]), dim=-1)
    sizes = ((top_probs.cumsum(-1) - top_probs) < threshold).sum(-1)  # tokens needed to reach the threshold
    top_tokens, sizes = top_tokens.tolist(), sizes.tolist()  # one copy to the host, not one per position
    sets = []
    for i in range(draft_probs.shape[0]):
        tokens = top_tokens[i][: sizes[i]]
        sets.append(tokens + [e for e in sorted(eos_ids) if e not in tokens])
    return sets


def causal_path_search(
    draft_log_probs: torch.Tensor, context_tail: list[int], proxy: TrigramModel, settings: PathSearch,
    eos_ids: frozenset[int],
) -> list[int]:
    """Beam search over the candidate sets for the path with the best combined score. Stops a beam at EOS.

    draft_log_probs: (γ, V) the drafter's log-marginals; context_tail: the last tokens before the draft (≥ 1).
    Returns the best path (length ≤ γ; shorter when it ends with EOS).
    """
    sets = candidate_sets(draft_log_probs.exp(), settings.threshold, settings.max_candidates, eos_ids)
    lam = settings.weight
    # Every candidate's drafter score in one copy to the host (the search itself is small numpy work there).
    rows = [position for position, candidates in enumerate(sets) for _ in candidates]
    flat_scores = draft_log_probs[rows, [token for candidates in sets for token in candidates]].double().cpu().numpy()
    scores_by_position = np.split(flat_scores, np.cumsum([len(candidates) for candidates in sets])[:-1])
    beams: list[tuple[float, list[int]]] = [(0.0, [])]
    for candidates, drafter_scores in zip(sets, scores_by_position):
        cand = np.array(candidates)
        expanded = []
        for score, path in beams:
            if path and path[-1] in eos_ids:
                expanded.append((score, path))  # finished: carried over unchanged
                continue
            history = (context_tail + path)[-2:]
            prev2 = history[0] if len(history) == 2 else -1
            proxy_scores = proxy.log_probs(prev2, history[-1], cand)
            total = score + lam * drafter_scores + (1 - lam) * proxy_scores
            expanded += [(float(s), path + [int(c)]) for s, c in zip(total, cand)]
        # Ties are broken by the path itself, so the search is deterministic.
        beams = sorted(expanded, key=lambda b: (-b[0], b[1]))[: settings.beam_width]
    return beams[0][1]
