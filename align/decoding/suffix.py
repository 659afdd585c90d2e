"""Model-free drafts from the verifier's own past outputs: SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975) over
the trajectories a run already has.

A suffix array over the trajectories' tokens (each row's prompt and the verifier's answer to it) finds every place
where the context's longest suffix of up to `max_match` tokens occurs; what followed those occurrences, up to γ tokens,
is counted into a tree of continuations, each node scored by the share of the occurrences that run through it
(SuffixDecoding's frequency score). The most frequent nodes are the draft: a tree, verified alone (`suffix`) or merged
with the drafter's tree and the prompt's n-gram continuation (`specdiff_ngram_suffix_tree`), in one verifier forward.

Why a suffix array and not a suffix tree: numpy builds one over 400k tokens in about a second (prefix doubling) and
it is two flat integer arrays, which save and load as they are; a lookup is a binary search per match length.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

SEPARATOR = -1  # after every document: no match or continuation runs from one document into the next
FILE = "suffix_index.npz"


def suffix_array(text: np.ndarray) -> np.ndarray:
    """The start positions of `text`'s suffixes in lexicographic order (a shorter suffix before a longer one it
    begins), by prefix doubling: rank by the first k tokens, then by the pair (rank at i, rank at i + k)."""
    count = len(text)
    rank = np.unique(text, return_inverse=True)[1].astype(np.int64) + 1  # 0 is kept for "past the end"
    order = np.argsort(rank, kind="stable")
    width = 1
    while True:
        second = np.zeros(count, dtype=np.int64)
        second[:count - width] = rank[width:]
        order = np.lexsort((second, rank))
        changed = np.r_[True, (rank[order][1:] != rank[order][:-1]) | (second[order][1:] != second[order][:-1])]
        rank[order] = np.cumsum(changed)
        if rank.max() == count or width >= count:
            return order
        width *= 2


@dataclass
class SuffixIndex:
    """The documents' tokens, each followed by SEPARATOR, and their suffix array."""

    tokens: np.ndarray  # (N,) int64
    suffixes: np.ndarray  # (N,) int64

    @classmethod
    def build(cls, documents: Iterable[Sequence[int]]) -> "SuffixIndex":
        parts = [np.append(np.asarray(doc, dtype=np.int64), SEPARATOR) for doc in documents]
        tokens = np.concatenate(parts) if parts else np.array([SEPARATOR], dtype=np.int64)
        return cls(tokens, suffix_array(tokens))

    def save(self, folder: Path) -> None:
        """folder/suffix_index.npz: the two arrays as they are (an export carries it beside the drafter)."""
        np.savez(folder / FILE, tokens=self.tokens, suffixes=self.suffixes)

    @classmethod
    def load(cls, folder: Path) -> "SuffixIndex":
        """The index `save` wrote in `folder`. ValueError, in one line, when the file is not one (truncated, edited,
        another npz): a wrong suffix array would not be caught later, only draft worse."""
        try:
            with np.load(folder / FILE) as saved:
                tokens, suffixes = saved["tokens"], saved["suffixes"]
        except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as e:  # np.load reads a zip
            raise ValueError(f"{folder / FILE} is not a suffix index ({type(e).__name__})") from None
        if (tokens.ndim != 1 or suffixes.shape != tokens.shape or tokens.dtype != np.int64
                or suffixes.dtype != np.int64 or not len(tokens) or tokens[-1] != SEPARATOR
                or not np.array_equal(np.sort(suffixes), np.arange(len(tokens)))):
            raise ValueError(f"{folder / FILE} is not a suffix index (its arrays do not make one)")
        return cls(tokens, suffixes)

    def _bound(self, pattern: tuple[int, ...], low: int, high: int, above: bool) -> int:
        """The first suffix in [low, high) whose first len(pattern) tokens are ≥ pattern (> pattern when `above`)."""
        size = len(pattern)
        while low < high:
            middle = (low + high) // 2
            start = int(self.suffixes[middle])
            head = tuple(self.tokens[start:start + size].tolist())
            if head < pattern or (above and head == pattern):
                low = middle + 1
            else:
                high = middle
        return low

    def longest_match(self, context: np.ndarray, max_match: int) -> tuple[int, int, int]:
        """The longest suffix of `context` (up to max_match tokens) that occurs: (its length, and the range of the
        suffix array whose suffixes begin with it); (0, 0, 0) when not even its last token occurs. A suffix that does
        not occur has no longer one that does, so the search stops at the first miss."""
        found = (0, 0, 0)
        for size in range(1, min(max_match, len(context)) + 1):
            pattern = tuple(context[-size:].tolist())
            low = self._bound(pattern, 0, len(self.suffixes), above=False)
            high = self._bound(pattern, low, len(self.suffixes), above=True)
            if low >= high:
                break
            found = (size, low, high)
        return found

    def continuations(self, context: np.ndarray, depth: int, num_nodes: int, max_match: int = 8,
                      max_occurrences: int = 256, min_share: float = 0.1) -> tuple[list[int], list[int], list[float]]:
        """A tree of what followed the context's longest matching suffix: (tokens, parents, shares), parents first,
        -1 for the root's children; a node's share is the fraction of the occurrences that continue through it
        (at most `max_occurrences`, spread evenly over the match's range), at least `min_share`, best `num_nodes`."""
        size, low, high = self.longest_match(context, max_match)
        if size == 0:
            return [], [], []
        picked = np.unique(np.linspace(low, high - 1, min(high - low, max_occurrences)).astype(np.int64))
        counts: dict[tuple[int, ...], int] = {}
        for start in self.suffixes[picked].tolist():
            following = self.tokens[start + size:start + size + depth].tolist()
            path: tuple[int, ...] = ()
            for token in following:
                if token == SEPARATOR:
                    break
                path += (token,)
                counts[path] = counts.get(path, 0) + 1
        total = len(picked)
        # A node's count is at most its parent's: by (share, depth) parents come first.
        ranked = sorted((path for path, n in counts.items() if n >= min_share * total),
                        key=lambda path: (-counts[path], len(path), path))[:num_nodes]
        node_of = {path: node for node, path in enumerate(ranked)}
        parents = [node_of[path[:-1]] if len(path) > 1 else -1 for path in ranked]
        return [path[-1] for path in ranked], parents, [counts[path] / total for path in ranked]
