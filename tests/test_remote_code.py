"""align.remote_code: remote modelling code written for transformers 4 (Dream/DiffuCoder, LLaDA) loads and runs under
transformers 5 through named shims, one per transformers change, and a drafter whose attention drops masks (LLaDA)
is never handed a batch that needs one.

The family folders are tests/remote_code_families.py's: the stand-ins in tests/fixtures, which carry the real files'
defects, or with $ALIGN_REMOTE_CODE the real files as the Hub ships them (tests/fixtures/README.md). Each shim is
checked both ways: with it the family loads and runs; without it the defect it bridges is there.
"""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import align.remote_code as remote_code
from align.config import DrafterSection, RecipeError
from align.drafters.masked import block_logits
from align.models import full_mask_kwargs, load_drafter, load_tokenizer
from align.remote_code import masks_ignored, shims_applied
from align.windows import bidirectional_windows, window_logits
from conftest import checkout_env
from remote_code_families import write_family

ROOT = Path(__file__).resolve().parents[1]

# Which shims each family's code needs under transformers 5, and what it fails with without each.
FAMILY_SHIMS = {"dream": {"rope_default", "generation_config_validate"},
                "llada": {"post_init", "tie_weights", "config_use_cache"}}
WITHOUT = {
    "rope_default": (KeyError, "default"),
    "generation_config_validate": (TypeError, "user_set_attributes"),
    "post_init": (AttributeError, "all_tied_weights_keys"),
    "tie_weights": (TypeError, "tie_weights.* unexpected keyword argument"),
    "config_use_cache": (AttributeError, "use_cache"),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote")
    return {name: write_family(name, root / name, seed=3) for name in FAMILY_SHIMS}


def drafter(folder, attention=None):
    section = DrafterSection(path=str(folder), trust_remote_code=True, device="cpu", dtype="float32",
                             attention=attention)
    return load_drafter(section, load_tokenizer(str(folder), True))


# Loads a family folder through align's loader with one shim left out, and runs a forward, in a fresh interpreter:
# the real LLaDA code registers its config class with AutoConfig when it is imported, so within one process every
# later LLaDA folder gets the class (already shimmed) that was loaded first.
WITHOUT_ONE_SHIM = """
import sys
import torch
import align.remote_code as remote_code
folder, left_out = sys.argv[1], "shim_" + sys.argv[2]
remote_code.CLASS_SHIMS = tuple(s for s in remote_code.CLASS_SHIMS if s.__name__ != left_out)
remote_code.MODULE_SHIMS = tuple(s for s in remote_code.MODULE_SHIMS if s.__name__ != left_out)
from align.config import DrafterSection
from align.models import load_drafter, load_tokenizer
section = DrafterSection(path=folder, trust_remote_code=True, device="cpu", dtype="float32")
model, spec = load_drafter(section, load_tokenizer(folder, True))
model(input_ids=torch.tensor([[5, 6, 7, spec.mask_token_id]]))
"""


@pytest.mark.parametrize("family", sorted(FAMILY_SHIMS))
def test_each_family_loads_through_its_shims_and_runs(folders, family):
    model, spec = drafter(folders[family])
    assert type(model).__module__.startswith("transformers_modules.")
    assert shims_applied(model) == FAMILY_SHIMS[family]
    ids = torch.tensor([[5, 6, 7, 8, spec.mask_token_id]])
    logits = model(input_ids=ids).logits
    assert logits.shape[:2] == (1, 5) and torch.isfinite(logits).all()


@pytest.mark.parametrize("family, shim", [(f, s) for f in sorted(FAMILY_SHIMS) for s in sorted(FAMILY_SHIMS[f])])
def test_without_a_shim_its_defect_is_there(folders, family, shim):
    proc = subprocess.run([sys.executable, "-c", WITHOUT_ONE_SHIM, str(folders[family]), shim], cwd=ROOT,
                          env=checkout_env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"), capture_output=True, text=True,
                          timeout=600)
    error, words = WITHOUT[shim]
    last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
    assert proc.returncode != 0 and re.match(rf"{error.__name__}: .*{words}", last), proc.stderr[-2000:]


def test_the_default_rope_is_transformers_4s():
    """What `rope_default` hands Dream: θ^(−2i/d) over the head dimension, attention factor 1, as transformers 4."""
    from transformers import Qwen2Config

    config = Qwen2Config(hidden_size=64, num_attention_heads=4, rope_theta=10000.0)
    inv_freq, factor = remote_code.default_rope_parameters(config)
    assert factor == 1.0
    assert torch.allclose(inv_freq, 1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16))


def test_a_drafter_that_drops_masks_is_marked_and_never_handed_one(folders):
    llada, _ = drafter(folders["llada"])
    dream, _ = drafter(folders["dream"])
    assert masks_ignored(llada) and not masks_ignored(dream)
    hiding = torch.zeros(1, 1, 4, 4)
    hiding[..., 3, :3] = torch.finfo(torch.float32).min
    with pytest.raises(ValueError, match="ignores attention masks"):
        full_mask_kwargs(llada, hiding)
    assert full_mask_kwargs(llada, torch.zeros(1, 1, 4, 4))  # a mask that hides nothing changes nothing
    with pytest.raises(RecipeError, match="drafter.attention: .* ignores attention masks"):
        drafter(folders["llada"], attention="block_causal")


@pytest.mark.parametrize("family", sorted(FAMILY_SHIMS))
def test_padded_bidirectional_windows_read_as_each_window_alone(folders, family):
    """Training windows of different lengths share a right-padded batch: each window's logits must be those of its
    `context ⊕ MASK×γ` alone, as `block_logits` drafts it, whether or not the model reads the padding mask."""
    model, spec = drafter(folders[family])
    tokenizer = load_tokenizer(str(folders[family]))
    rows = [{"prompt_ids": list(range(20, 26)), "completion_ids": list(range(40, 52))},
            {"prompt_ids": list(range(30, 33)), "completion_ids": list(range(60, 64))}]
    gamma = 3
    batch = bidirectional_windows(rows, spec, gamma, 2, tokenizer.pad_token_id, np.random.default_rng(0))
    starts = batch.starts[:, 0]
    assert len(set(starts.tolist())) > 1  # windows of different lengths: the batch is padded
    with torch.no_grad():
        got = window_logits(model, spec, batch)[:, 0]  # (R, γ, V)
        for r, start in enumerate(starts.tolist()):
            alone = block_logits(model, spec, batch.clean_ids[r : r + 1, :start],
                                 torch.full((1, gamma), spec.mask_token_id))[0]
            assert torch.allclose(got[r], alone, atol=1e-5), (family, r)
        if masks_ignored(model):
            # the padded batch read in one forward, its mask handed over, would not be: the mask is dropped
            short = int(starts.argmin())
            whole = model(input_ids=batch.input_ids, attention_bias=batch.attention_mask).logits
            index = int(starts[short]) - spec.logits_shift
            assert not torch.allclose(whole[short, index : index + gamma], got[short], atol=1e-5)
