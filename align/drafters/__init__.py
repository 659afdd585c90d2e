"""Diffusion drafters behind one interface (`Drafter`, align/drafters/base.py), and the one place that picks an
implementation from the DrafterSpec and the model (`drafter_for`)."""

from __future__ import annotations

from transformers import PreTrainedModel

from align.drafters.base import BATCHED_ROWS_MATCH, Drafter, VerifiedRows, Windows
from align.drafters.canvas import CanvasDecoder
from align.drafters.conditioned import ConditionedDrafter
from align.drafters.loading import is_canvas_decoder
from align.drafters.masked import DrafterContext, MaskedDrafter
from align.families import DrafterSpec

__all__ = ["BATCHED_ROWS_MATCH", "CanvasDecoder", "ConditionedDrafter", "Drafter", "DrafterContext", "MaskedDrafter",
           "VerifiedRows", "Windows", "drafter_for"]


def drafter_for(model: PreTrainedModel, spec: DrafterSpec) -> Drafter:
    """The implementation that reads `model` as `spec` describes it: the kind is read here and nowhere else. Cheap
    (no forward, no cache: a generation's state starts at `begin`), so a training step may ask for one each time."""
    if spec.kind == "dflash":
        return ConditionedDrafter(model, spec)
    if is_canvas_decoder(model):
        return CanvasDecoder(model, spec)
    return MaskedDrafter(model, spec)
