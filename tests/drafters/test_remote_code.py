"""align.remote_code: remote modelling code written for transformers 4 (Dream/DiffuCoder, LLaDA) loads and runs under
transformers 5 through named shims, one per transformers change, and a drafter whose attention drops masks (LLaDA)
is never handed a batch that needs one.

The family folders are tests/remote_code_families.py's: the stand-ins in tests/fixtures, which carry the real files'
defects, or with $ALIGN_REMOTE_CODE the real files as the Hub ships them (tests/fixtures/README.md). Each shim is
checked both ways: with it the family loads and runs; without it the defect it bridges is there.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import align.remote_code as remote_code
from align.config import DrafterSection, RecipeError
from align.drafters.loading import load_drafter
from align.drafters.masked import block_logits
from align.masks import full_mask_kwargs
from align.models import load_tokenizer
from align.remote_code import masks_ignored, shims_applied
from align.windows import bidirectional_windows, window_logits
from conftest import checkout_env
from remote_code_families import write_family

ROOT = Path(__file__).resolve().parents[2]

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


# For each (folder, shim) pair: load the family folder through align's loader with that shim left out and run a
# forward, in a child forked from one interpreter that imported torch and align once (a fresh interpreter per case
# cost 6-10 s each): the real LLaDA code registers its config class with AutoConfig when it is imported, so within one
# process every later LLaDA folder would get the class (already shimmed) that was loaded first, and a forked child
# starts from the parent, which imported no family code. Prints one JSON line per pair: [shim, what it ended with].
WITHOUT_EACH_SHIM = """
import json, os, sys, traceback
import torch
import align.remote_code as remote_code
from align.config import DrafterSection
from align.drafters.loading import load_drafter
from align.models import load_tokenizer
for folder, shim in zip(sys.argv[1::2], sys.argv[2::2]):
    pid = os.fork()
    if pid:
        os.waitpid(pid, 0)
        continue
    left_out = "shim_" + shim
    remote_code.CLASS_SHIMS = tuple(s for s in remote_code.CLASS_SHIMS if s.__name__ != left_out)
    remote_code.MODULE_SHIMS = tuple(s for s in remote_code.MODULE_SHIMS if s.__name__ != left_out)
    try:
        section = DrafterSection(path=folder, trust_remote_code=True, device="cpu", dtype="float32")
        model, spec = load_drafter(section, load_tokenizer(folder, True))
        model(input_ids=torch.tensor([[5, 6, 7, spec.mask_token_id]]))
        ended = "no error"
    except Exception as e:  # the traceback's last line, as an uncaught error would end the interpreter's output
        ended = "".join(traceback.format_exception_only(type(e), e)).strip().splitlines()[-1]
    print(json.dumps([shim, ended]), flush=True)
    os._exit(0)
"""


@pytest.mark.parametrize("family", sorted(FAMILY_SHIMS))
def test_each_family_loads_through_its_shims_and_runs(folders, family):
    model, spec = drafter(folders[family])
    assert type(model).__module__.startswith("transformers_modules.")
    assert shims_applied(model) == FAMILY_SHIMS[family]
    ids = torch.tensor([[5, 6, 7, 8, spec.mask_token_id]])
    logits = model(input_ids=ids).logits
    assert logits.shape[:2] == (1, 5) and torch.isfinite(logits).all()


@pytest.fixture(scope="module")
def without_each_shim(folders) -> dict[str, str]:
    """{shim: the last line of what loading and running its family without it ended with}."""
    pairs = [str(part) for f in sorted(FAMILY_SHIMS) for s in sorted(FAMILY_SHIMS[f]) for part in (folders[f], s)]
    proc = subprocess.run([sys.executable, "-c", WITHOUT_EACH_SHIM, *pairs], cwd=ROOT,
                          env=checkout_env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return dict(json.loads(line) for line in proc.stdout.splitlines() if line.startswith("["))


@pytest.mark.parametrize("family, shim", [(f, s) for f in sorted(FAMILY_SHIMS) for s in sorted(FAMILY_SHIMS[f])])
def test_without_a_shim_its_defect_is_there(without_each_shim, family, shim):
    error, words = WITHOUT[shim]
    assert re.match(rf"{error.__name__}: .*{words}", without_each_shim[shim]), without_each_shim


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


@pytest.mark.parametrize("family", sorted(FAMILY_SHIMS))
def test_the_forwards_a_batch_makes_are_the_ones_ranks_agree_on(folders, family):
    """Under ZeRO-3 every forward is a collective, so ranks agree on `window_forwards` before any runs and the ones
    with fewer rows make padding forwards: the count must be the forwards `window_logits` really makes (one per row for
    LLaDA, which reads rows alone; one for Dream), and asking for more makes exactly that many, the logits unchanged.
    (A count of 1 for LLaDA hung 2 ranks in an all-gather against an all-reduce, issue 34.)"""
    from align.windows import window_forwards

    model, spec = drafter(folders[family])
    rows = [{"prompt_ids": list(range(20, 26)), "completion_ids": list(range(40, 52))},
            {"prompt_ids": list(range(30, 33)), "completion_ids": list(range(60, 64))}]
    batch = bidirectional_windows(rows, spec, 3, 2, load_tokenizer(str(folders[family])).pad_token_id,
                                  np.random.default_rng(0))
    calls = []  # a forward of the model embeds its input once
    model.get_input_embeddings().register_forward_pre_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        plain = window_logits(model, spec, batch)
        counted = len(calls)
        assert window_forwards(model, spec, batch) == counted == (batch.input_ids.shape[0] if family == "llada" else 1)
        if family == "dream":
            return  # one forward whatever the batch: ranks never ask it for more
        calls.clear()
        padded = window_logits(model, spec, batch, forwards=counted + 3)
    assert len(calls) == counted + 3 and torch.equal(padded, plain)


def test_a_config_read_first_in_a_fresh_process_is_shimmed(folders):
    """Every stage reads the models' configs (preflight) before it loads a model, in a fresh process: the shims must
    be in place by then. LLaDA's configuration module registers its class with AutoConfig on import, so a config read
    before them kept the unshimmed class (and a config without `use_cache`) for the whole process (issue 34)."""
    read = ("import sys; from align.config import DrafterSection; from align.preflight import load_model_config; "
            "config = load_model_config('drafter.path', DrafterSection(path=sys.argv[1], trust_remote_code=True)); "
            "from align.remote_code import shims_applied; print(config.use_cache, sorted(shims_applied(type(config))))")
    proc = subprocess.run([sys.executable, "-c", read, str(folders["llada"])], cwd=ROOT, capture_output=True,
                          text=True, env=checkout_env(HF_HUB_OFFLINE="1"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[-2] == "False ['config_use_cache']"



REAL_CODE = ROOT.parent / "shared" / "realcode"  # the upstream files, beside a clone of align here; a user's has none
# The stand-in's and the real configuration module, imported in one fresh interpreter (importing registers a class
# with transformers for the whole process): what each registers, and each config field the stand-in declares with its
# default (what a config.json that leaves it out gets).
CONFIG_DEFAULTS = """
import importlib.util, inspect, json, sys
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
out, fields = {}, None
for name, folder in (("stand-in", sys.argv[1]), ("real", sys.argv[2])):
    spec = importlib.util.spec_from_file_location("llada_" + name.replace("-", "_"), folder + "/configuration_llada.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fields = fields or [k for k in inspect.signature(module.LLaDAConfig.__init__).parameters
                        if k not in ("self", "kwargs", "use_cache")]
    config = module.LLaDAConfig()
    out[name] = {"registered": CONFIG_MAPPING["llada"] is module.LLaDAConfig,
                 "defaults": {k: str(getattr(config, k, "absent")) for k in fields}}
print(json.dumps(out))
"""


@pytest.mark.skipif(not (REAL_CODE / "llada").is_dir(), reason="the upstream LLaDA files (../shared/realcode) are not here")
def test_the_llada_stand_in_has_the_real_configs_defaults_and_registers_on_import():
    """A config.json that leaves a field out gets the real class's default (its GPT-2-style ModelConfig's, not the
    8B model's: `rope=False`, `weight_tying=True`, `mask_token_id=50256`), so the stand-in builds what the real code
    would from the same file; and importing either module registers its class with AutoConfig (why align installs
    its shims before any config is read)."""
    proc = subprocess.run([sys.executable, "-c", CONFIG_DEFAULTS, str(ROOT / "tests/fixtures/llada"),
                           str(REAL_CODE / "llada")], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=checkout_env(HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = json.loads(proc.stdout.splitlines()[-1])
    assert found["stand-in"]["registered"] and found["real"]["registered"]
    assert found["stand-in"]["defaults"] == found["real"]["defaults"]
    assert found["real"]["defaults"]["rope"] == "False" and found["real"]["defaults"]["mask_token_id"] == "50256"


@pytest.mark.parametrize("family", sorted(FAMILY_SHIMS))
def test_activation_checkpointing_takes_on_the_family_as_transformers_5_sets_it(folders, family):
    """align's `train.activation_checkpointing` calls transformers' `gradient_checkpointing_enable`, which needs a
    `gradient_checkpointing` attribute on some module of the model: Dream's real code has one (its base model's), so
    a training step recomputes each layer; LLaDA's declares no support, and align refuses it in one line."""
    from align.config import RecipeError
    from align.stages.train import apply_activation_checkpointing

    model, spec = drafter(folders[family])
    if family == "llada":
        with pytest.raises(RecipeError, match="train.activation_checkpointing: .* does not support"):
            apply_activation_checkpointing(model, True)
        return
    apply_activation_checkpointing(model, True)
    assert model.get_decoder().gradient_checkpointing
    model.train()
    ids = torch.tensor([[5, 6, 7, 8, spec.mask_token_id]])
    model(input_ids=ids).logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
