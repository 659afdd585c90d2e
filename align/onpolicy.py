"""On-policy windows for a DFlash drafter (train.data_mode=rejections, Draft-OPD): the anchors the runtime visits
when it decodes a training prompt, and there the positions greedy verification rejected.

Why no decoding loop: a DFlash draft at anchor s−1 is one block-parallel pass over the verifier's states of the
context before it, and a greedy trajectory is the verifier's own greedy answer. Decoding the prompt at temperature 0
with the drafter's chain (`specdiff_generate`) therefore verifies, at each visited anchor, the drafter's argmax block
against the trajectory's next tokens: it keeps the longest matching prefix (`num_accepted`), takes the verifier's
token after it, and drafts again from there, s + num_accepted + 1. The drafter's windows at every completion position
in one no-grad pass give every visited anchor's draft, and the walk over them is exact (tests/test_onpolicy.py checks
it against `specdiff_generate`'s accept counts). The windows kept are the visited ones that ended in a rejection;
their target mask marks the positions verification saw: the accepted drafts and the rejected one.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from align.drafters import drafter_for
from align.drafters.dflash import DraftVocab
from align.drafters.spec import DrafterSpec
from align.windows import WindowBatch


def num_accepted(drafts: torch.Tensor, targets: torch.Tensor, target_mask: torch.Tensor) -> torch.Tensor:
    """(B, W, γ) drafted ids, the trajectory's ids there and where there is one -> (B, W): how many leading drafts
    greedy verification keeps (a window running past the completion keeps at most what is left of it)."""
    matches = (drafts == targets) & target_mask
    return matches.long().cumprod(-1).sum(-1)


def visited_windows(completion_len: int, accepted: list[int]) -> list[tuple[int, int]]:
    """The walk of greedy chain decoding over one completion: (offset into the completion of the first drafted
    position, drafts kept there) at each anchor visited. accepted: drafts kept at every offset 0..completion_len−1.
    The first is offset 1: the prefill's forward gives the completion's first token, and the drafter drafts after it."""
    walk, offset = [], 1
    while offset < completion_len:
        kept = accepted[offset]
        walk.append((offset, kept))
        offset += kept + 1  # the kept drafts, then the verifier's own token after them
    return walk


def anchor_batch(clean_ids: torch.Tensor, prompt_lens: list[int], offsets: list[list[int]], gamma: int,
                 pad_id: int, verifier_states: Optional[torch.Tensor]) -> WindowBatch:
    """A DFlash window batch whose windows start at prompt_lens[b] + offsets[b] (the drafter reads clean_ids, the
    starts and the states; its mask and block inputs are built inside `dflash_window_logits`, so the batch carries
    none). Windows past a row's offsets are padding (target_mask False)."""
    B, L = clean_ids.shape
    W = max(1, max(len(o) for o in offsets))
    starts = torch.ones(B, W, dtype=torch.long)
    targets = torch.full((B, W, gamma), pad_id, dtype=torch.long)
    target_mask = torch.zeros(B, W, gamma, dtype=torch.bool)
    for b, (p, row_offsets) in enumerate(zip(prompt_lens, offsets)):
        for w, offset in enumerate(row_offsets):
            start = p + offset
            starts[b, w] = start
            label = clean_ids[b, start : start + gamma].cpu()
            targets[b, w, : len(label)] = label
            target_mask[b, w, : len(label)] = True
    empty = torch.zeros(B, 0, dtype=torch.long)
    device = clean_ids.device
    return WindowBatch(empty.to(device), empty.to(device), torch.zeros(B, 1, 0, 0, device=device), clean_ids,
                       starts.to(device), targets.to(device), target_mask.to(device), starts.to(device),
                       torch.arange(B, device=device), verifier_states)


@torch.no_grad()
def rejection_batch(model: Any, spec: DrafterSpec, verifier: Any, batch: WindowBatch, rows: list[dict[str, Any]],
                    gamma: int, windows: int, pad_id: int, rng: np.random.Generator) -> WindowBatch:
    """The windows to train on-policy for `batch`'s rows: up to `windows` a row of the anchors greedy decoding visits
    that ended in a rejection (drawn at random when there are more), each window's target mask the positions
    verification saw (the kept drafts and the rejected one). batch.verifier_states: the rows' states, with the final
    ones where a loss reads the verifier's distributions (the caller computes them once for both passes)."""
    clean = batch.clean_ids
    L = clean.shape[1]
    prompt_lens = [min(len(r["prompt_ids"]), L) for r in rows]
    lengths = [min(len(r["prompt_ids"]) + len(r["completion_ids"]), L) for r in rows]
    every = [list(range(n - p)) for p, n in zip(prompt_lens, lengths)]
    everywhere = anchor_batch(clean, prompt_lens, every, gamma, pad_id, batch.verifier_states)
    draft_logits, _ = drafter_for(model, spec).window_logits(everywhere, verifier)  # (B, W, γ, V)
    drafts = draft_logits.argmax(-1)
    vocab = DraftVocab.of(model)
    drafts = drafts if vocab is None else vocab.target_ids[drafts]  # draft ids -> the verifier's ids
    accepted = num_accepted(drafts, everywhere.targets, everywhere.target_mask).tolist()
    picked, seen = [], []
    for b, (p, n) in enumerate(zip(prompt_lens, lengths)):
        rejected = [(offset, kept) for offset, kept in visited_windows(n - p, accepted[b])
                    if kept < min(gamma, n - p - offset)]  # a draft wholly kept, or the completion's end: no rejection
        if len(rejected) > windows:
            rejected = [rejected[i] for i in sorted(rng.choice(len(rejected), size=windows, replace=False))]
        picked.append([offset for offset, _ in rejected])
        seen.append([kept + 1 for _, kept in rejected])
    out = anchor_batch(clean, prompt_lens, picked, gamma, pad_id, batch.verifier_states)
    positions = torch.arange(gamma, device=clean.device)
    for b, row_seen in enumerate(seen):
        for w, count in enumerate(row_seen):
            out.target_mask[b, w] &= positions < count
    return out
