"""The one interface a diffusion drafter offers, whatever its kind: the runtime asks it for a block's logits after a
context and tells it which rows the verifier kept; the training windows ask it for the logits a loss reads.

`align.drafters.drafter_for` picks the implementation once, from the DrafterSpec and the model: the standalone masked
drafter (`MaskedDrafter`: Dream, LLaDA, the tiny drafters; bidirectional or block-causal), the canvas decoder
(`CanvasDecoder`: DiffusionGemma's encoder and decoder) and the target-conditioned DFlash drafter
(`ConditionedDrafter`, which reads the verifier's hidden states). Nothing outside this package asks which it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Union

import torch
from transformers import PreTrainedModel

from align.drafters.spec import Attention, DrafterSpec

# Why the rows of a batched forward over several blocks after one context (Spiffy's draft states) give what a forward
# over each block alone gives, by attention (the DrafterSpec's): what `align eval` says of Spiffy's outputs.
BATCHED_ROWS_MATCH: dict[Attention, str] = {
    "block_causal": "the model is block-causal, so each draft state sees exactly the context the real state sees; the "
                    "rows of the batched forward can still differ from a single forward in the last float bits",
    "bidirectional": "bidirectional model: drafts are batched rows of the same computation; float differences between "
                     "batched and single forwards could flip a near-tie",
}

# --------------------------------------------------------------------------------------------------------------------
# the verifier's side: which of its hidden states a drafter reads (a DFlash drafter's), filled by the runtime's
# verifier forwards
# --------------------------------------------------------------------------------------------------------------------
def aux_hidden(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
    """transformers' `hidden_states` (embeddings, then each layer's output) -> (B, T, n_aux·H): the residual stream
    entering each of `layer_ids`, concatenated in that order (vLLM's aux hidden states)."""
    return torch.cat([hidden_states[k] for k in layer_ids], dim=-1)


@dataclass
class HiddenTap:
    """Asks the runtime's verifier forwards for the drafter's hidden states: after each forward over k tokens,
    `last` holds their (1, k, n_aux·H). No extra verifier pass: the same forward gives logits and these."""

    layer_ids: list[int]
    last: Optional[torch.Tensor] = None


# Rows of the verifier's last forward (its input positions) that the verifier kept: the newest token and the
# accepted drafts, as a slice of a path forward or as the row indices of a tree forward.
VerifiedRows = Union[slice, list[int]]


class Windows(Protocol):
    """What a drafter reads of a batch of training windows (align/windows.py's WindowBatch)."""

    input_ids: torch.Tensor  # (B, T)
    position_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor  # (B, 1, T, T) additive
    clean_ids: torch.Tensor  # (B, L) prompt ⊕ completion, right-padded
    starts: torch.Tensor  # (B, W) each window's first masked position
    targets: torch.Tensor  # (B, W, γ)
    target_mask: torch.Tensor  # (B, W, γ) False where a window is padding or runs past the completion
    block_index: torch.Tensor  # (B, W) where each window's masked block sits in input_ids
    verifier_states: Optional[torch.Tensor]  # (B, L, n_aux·H) a DFlash drafter's, when cached; else None

    @property
    def num_windows(self) -> int: ...


def with_padding_forwards(logits: torch.Tensor, count: int, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`logits` with `count` more forwards' logits (`forward()`, on a one-token input) added times zero. Under ZeRO-3
    every forward of a module, and its backward, gathers the module's parameters from every rank: a rank with less
    work in a step must still make as many forwards as the others, and these stay in the graph so that their
    backwards run too."""
    for _ in range(count):
        logits = logits + 0.0 * forward().sum().to(logits.dtype)
    return logits


class Drafter(Protocol):
    """A diffusion drafter across one generation (`begin`, then `propose` / `verified` per step), or across one
    training step (`window_forwards`, `window_logits`)."""

    model: PreTrainedModel
    spec: DrafterSpec
    #: what the drafter reads of every verifier forward (a DFlash drafter's hidden states), None when nothing: the
    #: runtime's verifier forwards fill it
    verifier_states: Optional[HiddenTap]
    #: the methods that cannot run this drafter (config.METHOD_NAMES)
    refused_methods: tuple[str, ...]

    def begin(self) -> None:
        """A new generation, after the verifier's prefill (which filled `verifier_states`): an empty context."""

    def propose(self, verifier: PreTrainedModel, context_ids: torch.Tensor, length: int) -> torch.Tensor:
        """The drafter's logits for the `length` masked tokens after context_ids (1, n): (length, V)."""

    def verified(self, rows: VerifiedRows) -> None:
        """After a verifier forward: which of its input rows the verifier kept (the drafter's context grows by
        them where it reads the verifier)."""

    def encode(self, context_ids: torch.Tensor) -> int:
        """dLLM decoding: bring the context cache up to context_ids (1, n) where it takes a forward of its own (an
        encoder's); returns the forwards made (0 where a block's forward encodes the context as it goes)."""

    def block_logits(self, context_ids: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """dLLM decoding: K partly masked blocks after one context, one forward. (1, n), (K, b) -> (K, b, V)."""

    def window_forwards(self, batch: Windows) -> int:
        """How many forwards `window_logits` makes of the model for `batch` (under ZeRO-3 ranks agree on the most)."""

    def window_logits(self, batch: Windows, verifier: Any = None,
                      forwards: int = 0) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(B, W, γ, V) logits for every position of every window, with gradients, read as the drafter drafts; and
        the verifier's (B, W, γ, V) where the same forward gives them (a DFlash drafter's), else None. forwards: make
        at least this many forwards (see `window_forwards`)."""
