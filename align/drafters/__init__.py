"""The drafter kinds' home: the DrafterSpec and the methods each kind runs (align/drafters/spec.py, torch-free),
loading (loading.py), the kinds behind one interface (`Drafter`, base.py: masked.py, canvas.py, conditioned.py with
dflash.py's model), and the one place that picks an implementation from the DrafterSpec and the model
(`drafter_for`).

Importing the package imports no torch: the CLI and preflight read the torch-free spec (align.drafters.spec) before
any stage decides to load a model; the torch-side names below load on first use (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from align.drafters.base import Drafter
    from align.drafters.spec import DrafterSpec

# name -> the module that defines it, imported when the name is first read
_LAZY = {"BATCHED_ROWS_MATCH": "align.drafters.base", "Drafter": "align.drafters.base",
         "VerifiedRows": "align.drafters.base", "Windows": "align.drafters.base",
         "CanvasDecoder": "align.drafters.canvas", "ConditionedDrafter": "align.drafters.conditioned",
         "DrafterContext": "align.drafters.masked", "MaskedDrafter": "align.drafters.masked"}

__all__ = [*_LAZY, "drafter_for"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'align.drafters' has no attribute {name!r}")


def drafter_for(model: PreTrainedModel, spec: DrafterSpec) -> Drafter:
    """The implementation that reads `model` as `spec` describes it: the kind is read here and nowhere else. Cheap
    (no forward, no cache: a generation's state starts at `begin`), so a training step may ask for one each time."""
    from align.drafters.canvas import CanvasDecoder
    from align.drafters.conditioned import ConditionedDrafter
    from align.drafters.loading import is_canvas_decoder
    from align.drafters.masked import MaskedDrafter

    if spec.kind == "dflash":
        return ConditionedDrafter(model, spec)
    if is_canvas_decoder(model):
        return CanvasDecoder(model, spec)
    return MaskedDrafter(model, spec)
