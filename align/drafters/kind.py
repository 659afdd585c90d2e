"""The drafter a recipe trains, exports or measures, asked once: the stages (train, export, memory) and the building
blocks they call (checkpoint saving, the memory warning) ask this object what the drafter is, never the recipe's
`dflash` section, so that a new kind changes this file rather than a branch in each of them.

Two sources, by the recipe: a `dflash` section builds a new DFlash drafter on the verifier (its embeddings and head
are the verifier's, it has no base drafter); without one the drafter is `drafter.path`'s (a standalone diffusion LM,
or a DFlash drafter saved before). What its config says (standalone or dflash: its DrafterSpec) is preflight's
`drafter_kind`, which reads the config; this object reads the recipe alone, torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class TrainedDrafter:
    """The recipe's drafter. new_dflash: the recipe's DFlashSection (a new DFlash drafter), or None (drafter.path's).
    path: drafter.path; verifier_path: verifier.path."""

    new_dflash: Optional[Any]
    path: str
    verifier_path: str

    @classmethod
    def of(cls, recipe: Any) -> TrainedDrafter:
        return cls(recipe.dflash, recipe.drafter.path, recipe.verifier.path)

    @property
    def is_new_dflash(self) -> bool:
        """Built new on the verifier from the recipe's dflash section (its checks: loading.check_new_dflash)."""
        return self.new_dflash is not None

    @property
    def loads_from_path(self) -> bool:
        """Its weights are drafter.path's: a LoRA run adapts them, and remote code there is what it runs."""
        return self.new_dflash is None

    @property
    def base(self) -> Optional[str]:
        """meta.json's drafter_base, the drafter a run starts from: none for a new DFlash drafter (drafter.path is
        then only the recipe's default)."""
        return self.path if self.loads_from_path else None

    @property
    def card_base(self) -> str:
        """The model card's base model: a new DFlash drafter's is the verifier, whose embeddings and head it reads."""
        return self.verifier_path if self.is_new_dflash else self.path

    def saves_adapter_only(self, lora: bool) -> bool:
        """Whether a LoRA run's step folder is its adapter with a pointer to drafter.path (readers merge it); a new
        DFlash drafter has no base folder to point to, so its LoRA is saved merged."""
        return lora and self.loads_from_path

    @property
    def draft_vocab_size(self) -> Optional[int]:
        """The pruned draft vocabulary a new DFlash drafter is given from the trajectories, or None."""
        return self.new_dflash.draft_vocab_size if self.is_new_dflash else None

    @property
    def memory_modelled(self) -> bool:
        """Whether `align memory` models it: standalone drafters from their config or the known Hub drafters; a new
        DFlash drafter is not modelled yet."""
        return self.loads_from_path


def reads_verifier_states(recipe: Any) -> bool:
    """Whether the recipe's drafter is a DFlash drafter (a new one, the dflash section, or drafter.path's, from its
    config alone): it reads the verifier's hidden states in every step (or `align states`' precomputed ones), from
    which KD losses get the verifier's exact distributions too."""
    from align.preflight import drafter_kind

    return TrainedDrafter.of(recipe).is_new_dflash or drafter_kind(recipe) == "dflash"
