"""The target-conditioned DFlash drafter (align/drafters/dflash.py) as a `Drafter`: it reads the verifier's hidden
states, which every runtime verifier forward hands over through `verifier_states`, and its context is those states for
the tokens the verifier has kept (all but the newest, the anchor of the next block)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from transformers import PreTrainedModel

from align.config import RecipeError
from align.drafters.base import HiddenTap, VerifiedRows, Windows
from align.drafters.dflash import DFlashContext, dflash_block_logits, dflash_window_logits
from align.drafters.spec import REFUSED_METHODS, DrafterSpec


class ConditionedDrafter:
    """A DFlash drafter (the `Drafter` interface). Its context only ever grows by the states of verified rows, so it
    is exact and never cropped."""

    refused_methods: tuple[str, ...] = REFUSED_METHODS["dflash"]

    def __init__(self, model: PreTrainedModel, spec: DrafterSpec) -> None:
        self.model, self.spec = model, spec
        self.verifier_states: Optional[HiddenTap] = HiddenTap(model.config.aux_hidden_state_layer_ids)
        self.context = DFlashContext()

    def begin(self) -> None:
        """The prompt's states (the verifier's prefill filled `verifier_states`) are the context."""
        self.context = DFlashContext()
        self.context.extend(self.model, self.verifier_states.last)

    def propose(self, verifier: PreTrainedModel, context_ids: torch.Tensor, length: int) -> torch.Tensor:
        """The block is anchored at the newest token, the one the verifier has not run yet: (length, V)."""
        return dflash_block_logits(self.model, verifier, context_ids[:, -1:], length, self.context)[0]

    def verified(self, rows: VerifiedRows) -> None:
        """The kept rows' states join the context."""
        states = self.verifier_states.last
        index = rows if isinstance(rows, slice) else torch.tensor(rows, device=states.device)
        self.context.extend(self.model, states[:, index])

    def encode(self, context_ids: torch.Tensor) -> int:
        raise RecipeError("a DFlash drafter drafts for a verifier; it does not decode on its own (eval.mode=dllm)")

    def block_logits(self, context_ids: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        raise RecipeError("a DFlash drafter drafts for a verifier; it does not decode on its own (eval.mode=dllm)")

    def window_forwards(self, batch: Windows) -> int:
        return 1

    def window_logits(self, batch: Windows, verifier: Any = None,
                      forwards: int = 0) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """One verifier forward over the windows' rows gives the drafter its hidden states and KD losses their
        distributions (exact, not the stored top-k): both (B, W, γ, V). With the states cached on the batch, the
        verifier does not run, and there are no verifier distributions (None)."""
        return dflash_window_logits(self.model, verifier, batch.clean_ids, batch.starts, batch.targets.shape[-1],
                                    batch.verifier_states)
