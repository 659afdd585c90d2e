"""Training windows for a diffusion drafter, built from verifier trajectories (DESIGN §6).

A window at offset s of `prompt ⊕ completion` is the input `prompt ⊕ completion[:s] ⊕ MASK×γ` with labels
`completion[s:s+γ]`. A block-causal drafter trains many windows of one sequence in one forward: the clean sequence
(causal, as the cached context is at draft time) followed by W masked blocks, each attending to the clean tokens
before its start and to itself, at the positions it replaces. A bidirectional drafter takes one window per row.
DiffusionGemma (an encoder writes the context cache, a decoder reads the canvas) takes the block-causal windows and
reads them as it drafts. How each drafter reads its windows is align/drafters/'s (`Drafter.window_logits`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch

from align.drafters import drafter_for
from align.drafters.dflash import DraftVocab
from align.drafters.spec import DrafterSpec
from align.masks import additive_mask


@dataclass
class WindowBatch:
    input_ids: torch.Tensor  # (B, T)
    position_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor  # (B, 1, T, T) additive
    clean_ids: torch.Tensor  # (B, L) prompt ⊕ completion, right-padded: what the verifier reads
    starts: torch.Tensor  # (B, W) absolute position of each window's first masked token
    targets: torch.Tensor  # (B, W, γ) the verifier's tokens
    target_mask: torch.Tensor  # (B, W, γ) False where a window runs past the completion (or is padding)
    block_index: torch.Tensor  # (B, W) where each window's masked block sits in input_ids
    source_rows: torch.Tensor  # (B,) the trajectory (index into the builder's rows) each batch row comes from
    # (B, L, n_aux·H) a DFlash drafter's verifier states for clean_ids, where the trainer has them cached
    verifier_states: Optional[torch.Tensor] = None

    @property
    def num_windows(self) -> int:
        return int(self.target_mask[..., 0].sum())

    def to(self, device: torch.device, non_blocking: bool = False) -> "WindowBatch":
        """The batch on `device`. Builders work on the CPU (they are data loading); a step moves the batch to its
        rank's device before any model reads it. non_blocking: from pinned memory, a copy the host does not wait on."""
        return self._map(lambda tensor: tensor.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "WindowBatch":
        """The batch in page-locked host memory (align/batches.py), from which a GPU copies it asynchronously."""
        return self._map(torch.Tensor.pin_memory)

    def _map(self, move: Callable[[torch.Tensor], torch.Tensor]) -> "WindowBatch":
        return WindowBatch(**{name: None if getattr(self, name) is None else move(getattr(self, name))
                              for name in self.__dataclass_fields__})


def pick_starts(prompt_len: int, completion_len: int, gamma: int, windows: int, rng: np.random.Generator) -> list[int]:
    """Up to `windows` window offsets inside the completion, distinct, chosen at random, sorted."""
    offsets = np.arange(completion_len)
    chosen = rng.choice(offsets, size=min(windows, completion_len), replace=False)
    return sorted(int(prompt_len + s) for s in chosen)


def on_cpu(build: Callable[..., WindowBatch]) -> Callable[..., WindowBatch]:
    """Builders are data loading: they build on the CPU whatever the default device (a training step moves the batch
    to its rank's device), so that no tensor of theirs lands on a device by accident."""
    @functools.wraps(build)
    def on_the_cpu(*args: Any, **kwargs: Any) -> WindowBatch:
        with torch.device("cpu"):
            return build(*args, **kwargs)
    return on_the_cpu


@on_cpu
def block_causal_windows(rows: list[dict[str, Any]], spec: DrafterSpec, gamma: int, windows: int, pad_id: int,
                         rng: np.random.Generator, max_len: Optional[int] = None) -> WindowBatch:
    """Many windows per sequence, one row per trajectory (see the module docstring for the layout)."""
    seqs = [list(r["prompt_ids"]) + list(r["completion_ids"]) for r in rows]
    if max_len is not None:
        seqs = [s[:max_len] for s in seqs]
    L = max(len(s) for s in seqs)
    B, T = len(rows), L + windows * gamma
    clean = torch.full((B, L), pad_id, dtype=torch.long)
    input_ids = torch.full((B, T), spec.mask_token_id, dtype=torch.long)
    positions = torch.zeros(B, T, dtype=torch.long)
    allowed = torch.zeros(B, T, T, dtype=torch.bool)
    starts = torch.ones(B, windows, dtype=torch.long)
    block_index = (L + torch.arange(windows) * gamma).expand(B, -1).clone()
    targets = torch.full((B, windows, gamma), pad_id, dtype=torch.long)
    target_mask = torch.zeros(B, windows, gamma, dtype=torch.bool)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    for b, (seq, row) in enumerate(zip(seqs, rows)):
        n, p = len(seq), len(row["prompt_ids"])
        clean[b, :n] = torch.tensor(seq)
        input_ids[b, :L] = clean[b]
        positions[b, :L] = torch.arange(L)
        allowed[b, :L, :L] = causal
        for w, start in enumerate(pick_starts(p, max(0, n - p), gamma, windows, rng)):
            block = slice(L + w * gamma, L + (w + 1) * gamma)
            positions[b, block] = torch.arange(start, start + gamma)
            allowed[b, block, :start] = True  # the clean prefix before the window
            allowed[b, block, block] = True  # and the window itself
            starts[b, w] = start
            label = seq[start : start + gamma]
            targets[b, w, : len(label)] = torch.tensor(label)
            target_mask[b, w, : len(label)] = True
        # Unused window slots attend to themselves only, so that no row of the mask is empty (NaN in softmax).
        for w in range(windows):
            if not target_mask[b, w, 0]:
                block = slice(L + w * gamma, L + (w + 1) * gamma)
                allowed[b, block, block] = True
    return WindowBatch(input_ids, positions, additive_mask(allowed, torch.float32), clean, starts, targets,
                       target_mask, block_index, torch.arange(B))


@on_cpu
def bidirectional_windows(rows: list[dict[str, Any]], spec: DrafterSpec, gamma: int, windows: int, pad_id: int,
                          rng: np.random.Generator, max_len: Optional[int] = None) -> WindowBatch:
    """One window per row, `prefix ⊕ MASK×γ` right-padded; every real token sees every other (padding is hidden)."""
    seqs = [list(r["prompt_ids"]) + list(r["completion_ids"]) for r in rows]
    if max_len is not None:
        seqs = [s[:max_len] for s in seqs]
    picked = [(b, start) for b, (seq, row) in enumerate(zip(seqs, rows))
              for start in pick_starts(len(row["prompt_ids"]), max(0, len(seq) - len(row["prompt_ids"])), gamma,
                                       windows, rng)]
    L = max(len(s) for s in seqs)
    R, T = max(1, len(picked)), max(start for _, start in picked) + gamma if picked else gamma
    input_ids = torch.full((R, T), pad_id, dtype=torch.long)
    valid = torch.zeros(R, T, dtype=torch.bool)
    clean = torch.full((R, L), pad_id, dtype=torch.long)
    starts = torch.ones(R, 1, dtype=torch.long)
    targets = torch.full((R, 1, gamma), pad_id, dtype=torch.long)
    target_mask = torch.zeros(R, 1, gamma, dtype=torch.bool)
    for r, (b, start) in enumerate(picked):
        seq = seqs[b]
        input_ids[r, :start] = torch.tensor(seq[:start])
        input_ids[r, start : start + gamma] = spec.mask_token_id
        valid[r, : start + gamma] = True
        clean[r, : len(seq)] = torch.tensor(seq)
        starts[r, 0] = start
        label = seq[start : start + gamma]
        targets[r, 0, : len(label)] = torch.tensor(label)
        target_mask[r, 0, : len(label)] = True
    allowed = valid[:, None, :].expand(R, T, T) | torch.eye(T, dtype=torch.bool)  # padding rows see themselves
    positions = torch.arange(T).expand(R, -1).clone()
    source_rows = torch.tensor([b for b, _ in picked] or [0])
    return WindowBatch(input_ids, positions, additive_mask(allowed, torch.float32), clean, starts, targets,
                       target_mask, starts.clone(), source_rows)


WINDOW_BUILDERS = {"block_causal": block_causal_windows, "bidirectional": bidirectional_windows}


def window_forwards(model: Any, spec: DrafterSpec, batch: WindowBatch) -> int:
    """How many forwards `window_logits` makes of `model` for `batch`: one, but a canvas decoder's one per used window
    (each an encoder and a decoder forward) and a mask-dropping drafter's (LLaDA's) one per row. Under ZeRO-3 each is a collective, so ranks agree on the most of them
    (`forwards` of window_logits) before any runs."""
    return drafter_for(model, spec).window_forwards(batch)


def window_logits(model: Any, spec: DrafterSpec, batch: WindowBatch, verifier: Any = None,
                  forwards: int = 0) -> torch.Tensor:
    """(B, W, γ, V): the drafter's logits for every position of every window, read according to its spec
    (`Drafter.window_logits`, which a DFlash drafter's verifier logits come from too). verifier: a DFlash drafter's
    (it reads the verifier's hidden states). forwards: make at least this many forwards of `model` (see
    `window_forwards`; only a canvas decoder's and a mask-dropping drafter's counts depend on the batch). A pruned
    DFlash drafter's logits come over the verifier's vocabulary, its uncovered tokens at probability 0."""
    logits = drafter_for(model, spec).window_logits(batch, verifier, forwards)[0]
    vocab = DraftVocab.of(model)
    return logits if vocab is None else vocab.to_verifier(logits)


def verifier_window_logits(verifier: Any, batch: WindowBatch) -> torch.Tensor:
    """(B, W, γ, V): the verifier's logits at each window position given the true prefix (one forward per row)."""
    logits = verifier(input_ids=batch.clean_ids).logits  # (B, L, V)
    B, W, gamma = batch.targets.shape
    index = (batch.starts[..., None] - 1 + torch.arange(gamma, device=logits.device)).clamp(0, logits.shape[1] - 1)
    return logits.gather(1, index.view(B, -1, 1).expand(-1, -1, logits.shape[-1])).view(B, W, gamma, -1)


def topk_window_logits(rows: list[dict[str, Any]], batch: WindowBatch, vocab: int) -> torch.Tensor:
    """(B, W, γ, V) verifier logits rebuilt from stored top-k log-probs (−inf elsewhere): the top-k renormalised
    distribution, an approximation of the verifier's that KD losses use offline. `rows` are the rows the batch was
    built from (a bidirectional batch has a row per window, each pointing at its trajectory); their top-k (completion,
    k) may be lists or arrays of any numeric type (float16 as align trajectories stores them, float64 in older folders).
    One scatter of every window position's k log-probs, on the batch's device."""
    device = batch.targets.device
    B, W, gamma = batch.targets.shape
    # Every row's top-k as one table (Σ completion lengths, k), and where each row's first position sits in it.
    k = max(np.shape(row["topk_ids"])[-1] if len(row["topk_ids"]) else 0 for row in rows)
    ids = [np.asarray(row["topk_ids"], dtype=np.int64).reshape(-1, k) for row in rows]
    logprobs = [np.asarray(row["topk_logprobs"], dtype=np.float32).reshape(-1, k) for row in rows]
    table_ids = torch.as_tensor(np.concatenate(ids), device=device)
    table_logprobs = torch.as_tensor(np.concatenate(logprobs), device=device)
    first = torch.as_tensor(np.cumsum([0] + [len(i) for i in ids[:-1]]), device=device)
    prompt_len = torch.as_tensor([len(row["prompt_ids"]) for row in rows], device=device)
    b, w, i = batch.target_mask.nonzero(as_tuple=True)  # the positions a window labels
    source = batch.source_rows.to(device)[b]
    position = batch.starts[b, w] + i - prompt_len[source]  # completion position of each
    at = first[source] + position
    out = torch.full((B * W * gamma, vocab), float("-inf"), device=device)
    out[((b * W + w) * gamma + i)[:, None], table_ids[at]] = table_logprobs[at]
    out = out.view(B, W, gamma, vocab)
    out[~batch.target_mask] = 0.0  # padding: any finite row (masked out of every loss)
    return out


def verifier_path_logits(verifier: Any, batch: WindowBatch, drafts: torch.Tensor, pad_id: int) -> torch.Tensor:
    """(B, W, γ, V): the verifier's logits along each *drafted* window, p_i = p(· | prefix, draft_<i).

    On-policy training (DistillSpec's lesson): the drafter is taught on the states it will meet, its own drafts,
    labelled by the verifier. drafts: (B, W, γ). One row per window: prefix ⊕ draft, right-padded.
    """
    B, W, gamma = drafts.shape
    rows, where = [], []
    for b in range(B):
        for w in range(W):
            start = int(batch.starts[b, w])
            rows.append(torch.cat([batch.clean_ids[b, :start], drafts[b, w]]))
            where.append(start)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=drafts.device)
    for r, row in enumerate(rows):
        ids[r, : len(row)] = row  # right padding: causal attention never looks at it
    logits = verifier(input_ids=ids).logits  # (B·W, width, V)
    # position start+i is predicted at start+i-1
    index = (torch.tensor(where, device=ids.device)[:, None] - 1 + torch.arange(gamma, device=ids.device)).clamp_min(0)
    picked = logits.gather(1, index[..., None].expand(-1, -1, logits.shape[-1]))
    return picked.view(B, W, gamma, -1)
