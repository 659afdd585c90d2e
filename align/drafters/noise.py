"""Noise: what a diffusion drafter reads at a noised position (its DrafterSpec's `noise`): the mask token, or a token
drawn uniformly from the vocabulary (DiffusionGemma). align marks noised positions with `mask_token_id` everywhere, and
`noise_fill` swaps in the family's fill where the model reads a block.
"""

from __future__ import annotations

import functools

import torch
from transformers import PreTrainedModel

from align.drafters.spec import DrafterSpec
from align.models import config_vocab_size


@functools.lru_cache(maxsize=64)
def _uniform_fill(vocab: int, seed: int, length: int, device: torch.device) -> torch.Tensor:
    # Drawn on the CPU, whatever the model's device: the fill is a constant of the spec, like a mask token id, and a
    # CUDA generator draws other numbers from the same seed. So windows (built on the CPU) train on exactly the
    # canvas that drafts on a GPU read, and a draft is reproducible across machines. A CPU draw of `length` tokens is
    # the prefix of any longer draw from the same seed, so drafts of different lengths (ADL) share their fill.
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=generator, device="cpu").to(device)


def noise_fill(spec: DrafterSpec, vocab: int, block_ids: torch.Tensor) -> torch.Tensor:
    """What the model reads for a block: (..., L) with `spec.mask_token_id` at noised positions -> (..., L).

    noise "mask": the block as it is. noise "uniform" (DiffusionGemma, whose generate() initialises and renoises its
    canvas with torch.randint over the vocabulary): block position i, when noised, reads token i of one fixed uniform
    draw (seed `spec.noise_seed`). Fixed, so that drafts are deterministic and training noises exactly as drafting
    does; uniform, so that it is a sample of the noise the model was trained to denoise.
    """
    if spec.noise == "mask":
        return block_ids
    fill = _uniform_fill(vocab, spec.noise_seed, block_ids.shape[-1], block_ids.device)
    return torch.where(block_ids == spec.mask_token_id, fill, block_ids)


def model_input(model: PreTrainedModel, spec: DrafterSpec, block_ids: torch.Tensor) -> torch.Tensor:
    """`noise_fill` for `model`'s vocabulary (read only for uniform noise: remote-code configs may not name it)."""
    return block_ids if spec.noise == "mask" else noise_fill(spec, config_vocab_size(model), block_ids)
