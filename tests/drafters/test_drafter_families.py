"""Diffusion drafters as the Hub ships them: Dream/DiffuCoder-style (shifted, `model_type: Dream`, AutoModel only)
and LLaDA-style (unshifted, OLMo-style config, 4-D masks as `attention_bias`, no position ids), each with its own
modelling code loaded with `trust_remote_code` from a local folder (tests/remote_code_families.py), tiny and random.

Through align's own loader: every evaluation method's greedy output is token-identical to AR greedy with a tiny Qwen2
verifier; the real train stage trains one step and saves a merged folder that still loads with its remote code; the
export keeps `auto_map` and the code files and reloads to identical logits in the run's dtype; Spiffy decodes exactly
as vanilla dLLM decoding does."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModel

from conftest import checkout_env

from align.cli import main as align
from align.config import DecodeSection, DrafterSection, ModelSection
from align.decoding.ar import ar_generate
from align.decoding.dllm import dllm_generate
from align.decoding.generation import Sampling
from align.decoding.path_search import TrigramModel
from align.decoding.spiffy import spiffy_generate
from align.decoding.suffix import SuffixIndex
from align.draft_graph import calibrate
from align.drafters.loading import load_drafter
from align.drafters.masked import block_logits
from align.drafters.spec import DrafterSpec
from align.methods import METHODS, Setup
from align.models import load_ar_drafter, load_tokenizer, load_verifier
from remote_code_families import write_family, write_prompts, write_qwen2

pytestmark = pytest.mark.slow  # the fast tier (-m 'not slow') leaves this file out; CI runs it

ROOT = Path(__file__).resolve().parents[2]
# What the real configs imply (align/drafters/spec.py KNOWN_DLLMS): Dream/DiffuCoder are adapted from Qwen2.5, hence shifted.
EXPECTED = {"dream": (1, "bidirectional"), "llada": (0, "bidirectional")}
NEW_TOKENS = 24
FAVOURED = range(100, 104)
TRAJECTORIES = ["trajectories.completions_per_prompt=1", "trajectories.temperature=0.0",
                "trajectories.max_new_tokens=12", "trajectories.num_prompts=24", "trajectories.batch_size=8"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    # Every model favours the same few tokens, so that random drafters and verifier agree now and then.
    return {"root": root, "dream": write_family("dream", root / "dream", seed=1, favoured=FAVOURED),
            "llada": write_family("llada", root / "llada", seed=7, favoured=FAVOURED),
            "verifier": write_qwen2(root / "verifier", seed=3, favoured=FAVOURED),
            "ar_drafter": write_qwen2(root / "ar", seed=4, layers=1, favoured=FAVOURED),
            "prompts": write_prompts(root / "prompts.jsonl", 40)}


def drafter(folder, dtype="auto"):
    section = DrafterSection(path=str(folder), trust_remote_code=True, device="cpu", dtype=dtype)
    return load_drafter(section, load_tokenizer(str(folder), True))


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_the_loader_reads_each_familys_spec_from_its_remote_code_config(folders, family):
    model, spec = drafter(folders[family])
    tokenizer = load_tokenizer(str(folders[family]))
    assert type(model).__module__.startswith("transformers_modules.")  # its own code, not a transformers class
    assert spec == DrafterSpec(tokenizer.mask_token_id, *EXPECTED[family])
    # The same function as the model built from its config and weights (transformers 5 leaves buffers that
    # transformers-4 remote code computes in __init__, Dream's rotary frequencies, as uninitialised memory)
    reference = AutoModel.from_config(AutoConfig.from_pretrained(folders[family], trust_remote_code=True),
                                      trust_remote_code=True)
    reference.load_state_dict(load_file(folders[family] / "model.safetensors"))
    ids = torch.tensor([[5, 6, 7, 8, spec.mask_token_id]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference.eval()(input_ids=ids).logits)
    # block_logits reads position i of the block at logits[n + i - shift] of the model's own forward
    context, block = torch.tensor([[5, 6, 7, 8]]), torch.full((1, 3), spec.mask_token_id)
    full = model(input_ids=torch.cat([context, block], 1)).logits
    shift = EXPECTED[family][0]
    assert torch.equal(block_logits(model, spec, context, block), full[:, 4 - shift: 7 - shift])


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_every_method_is_token_identical_to_ar_greedy(folders, family):
    model, spec = drafter(folders[family])
    tokenizer = load_tokenizer(str(folders["verifier"]))
    verifier = load_verifier(ModelSection(path=str(folders["verifier"]), device="cpu"))
    ar_drafter = load_ar_drafter(ModelSection(path=str(folders["ar_drafter"]), device="cpu"))
    proxy = TrigramModel.fit(np.random.default_rng(0).integers(0, len(tokenizer), 4000), len(tokenizer))
    decode = DecodeSection(gamma=4, max_new_tokens=NEW_TOKENS, num_candidates=3)
    suffix = SuffixIndex.build(np.random.default_rng(1).integers(0, len(tokenizer), (40, 50)).tolist())
    setup = Setup(verifier, model, spec, ar_drafter, tokenizer, frozenset(), decode, proxy, suffix=suffix)
    accepted = 0
    for prompt in (torch.tensor([[11, 12, 13, 14, 15]]), torch.tensor([[300, 301, 302]])):
        expected = ar_generate(verifier, prompt, NEW_TOKENS)[0]
        for name in METHODS:
            tokens, stats = METHODS[name](setup, prompt, Sampling(), None)
            assert tokens == expected, (family, name)
            accepted += sum(getattr(stats, "accept_counts", []) or [])
    assert accepted > 0  # some drafts were accepted: the comparison exercised verification, not only corrections


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_spiffy_decodes_exactly_as_vanilla(folders, family):
    model, spec = drafter(folders[family])
    traces = []
    prompts = [torch.tensor([[21, 22, 23]]), torch.tensor([[40, 41, 42, 43]])]
    vanilla = [dllm_generate(model, spec, p, 16, 8, trace=traces) for p in prompts]
    graph = calibrate(traces, spec.mask_token_id, block_length=8, budget=4)
    forwards = 0
    for prompt, (expected, stats) in zip(prompts, vanilla):
        tokens, spiffy_stats = spiffy_generate(model, spec, prompt, graph, 16)
        assert tokens == expected
        forwards += spiffy_stats.nfe
    assert forwards <= sum(stats.nfe for _, stats in vanilla)


@pytest.fixture(scope="module")
def trajectories(folders):
    out = folders["root"] / "trajectories"
    assert align(["trajectories", "recipes/tiny/align.yaml", f"verifier.path={folders['verifier']}",
                  f"data.train_prompts={folders['prompts']}", f"trajectories.out={out}", *TRAJECTORIES]) == 0
    return out


def train(folders, trajectories, family, out, *extra):
    """One step of the real train stage (the script DeepSpeed runs), in a fresh process."""
    args = ["recipes/tiny/align.yaml", f"drafter.path={folders[family]}", "drafter.trust_remote_code=true",
            f"verifier.path={folders['verifier']}", f"trajectories.out={trajectories}", *TRAJECTORIES,
            f"train.out={out}", "train.max_steps=1", "train.gamma=4", "train.windows_per_sequence=2",
            "train.micro_batch_size=2", "train.lr=1e-2", "train.warmup_steps=0", "train.final_eval_prompts=1", *extra]
    env = checkout_env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "align/train.py", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


TRANSFORMERS_ALONE = """
import json, sys
import torch
from transformers import AutoModel
model = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True, dtype=torch.load(sys.argv[2]).dtype)
with torch.no_grad():
    logits = model(input_ids=torch.tensor(json.loads(sys.argv[3]))).logits
assert torch.equal(logits, torch.load(sys.argv[2])), (logits - torch.load(sys.argv[2])).abs().max()
assert not [m for m in sys.modules if m == "align" or m.startswith("align.")]
print("equal, align never imported")
"""


@pytest.mark.parametrize("family, extra, dtype", [
    # as the DiffuCoder recipe trains, with the activation checkpointing its header offers for less memory
    ("dream", ["train.lora_r=4", "train.bf16=true", "train.activation_checkpointing=true"], torch.bfloat16),
    ("llada", ["train.bf16=false", "train.losses={ce_streak: 1.0, fkl: 0.5}", "train.data_mode=online"],
     torch.float32),
])
def test_a_training_step_and_the_export_keep_the_remote_code(folders, trajectories, tmp_path, family, extra, dtype):
    run = tmp_path / "run"
    train(folders, trajectories, family, run, *extra)
    step = run / "step_1"
    config = json.loads((step / "config.json").read_text())
    source = json.loads((folders[family] / "config.json").read_text())
    assert config["auto_map"] == source["auto_map"] and config["model_type"] == source["model_type"]
    for module in source["auto_map"].values():
        assert (step / f"{module.split('.')[0]}.py").is_file()
    dtype_name = str(dtype).removeprefix("torch.")
    lora = (step / "adapter_config.json").is_file()  # a LoRA run's checkpoint holds its adapter, merged on load
    assert lora == any(e.startswith("train.lora_r=") for e in extra)
    saved = load_file(step / ("adapter_model.safetensors" if lora else "model.safetensors"))
    assert {t.dtype for t in saved.values()} == {dtype}  # the run's dtype
    assert lora or config["dtype"] == dtype_name
    trained, _ = drafter(step, dtype_name)
    base, _ = drafter(folders[family], dtype_name)
    assert set(trained.state_dict()) == set(base.state_dict())  # LoRA merged: no adapter keys
    assert any(not torch.equal(p.float(), base.state_dict()[n].float()) for n, p in trained.named_parameters())
    assert json.loads((step / "meta.json").read_text())["final_tau"] >= 1.0  # the runtime decoded with it

    out = tmp_path / "export"
    assert align(["export", "recipes/tiny/align.yaml", f"drafter.path={step}", "drafter.trust_remote_code=true",
                  f"verifier.path={folders['verifier']}", f"export.out={out}"]) == 0
    exported = json.loads((out / "config.json").read_text())
    # Each class through the loader the export writes, the upstream files beside it as they were shipped
    assert exported["auto_map"] == {auto: f"align_loader.{ref.rsplit('.', 1)[1]}"
                                    for auto, ref in source["auto_map"].items()}
    for module in {ref.split(".")[0] for ref in source["auto_map"].values()}:
        assert (out / f"{module}.py").read_bytes() == (folders[family] / f"{module}.py").read_bytes()
    assert "`align_loader.py`" in (out / "README.md").read_text()  # the card says how it loads
    assert exported["drafter_spec"]["logits_shift"] == EXPECTED[family][0]
    assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {dtype}
    reloaded, spec = drafter(out, dtype_name)
    ids = torch.tensor([[5, 6, 7, 8, spec.mask_token_id]])
    with torch.no_grad():
        logits = reloaded(input_ids=ids).logits
        assert torch.equal(logits, trained(input_ids=ids).logits)
    # ... and with transformers alone, in a fresh interpreter that never imports align (under transformers 5 the
    # upstream code fails there on its own: KeyError 'default' for Dream, all_tied_weights_keys for LLaDA)
    torch.save(logits, tmp_path / "align_logits.pt")
    proc = subprocess.run([sys.executable, "-c", TRANSFORMERS_ALONE, str(out), str(tmp_path / "align_logits.pt"),
                           json.dumps(ids.tolist())], cwd=tmp_path, env=checkout_env(HF_HUB_OFFLINE="1"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == "equal, align never imported"


def test_the_fixtures_take_the_masks_their_real_code_takes(folders):
    """What each family's forward accepts, as its real code does (align passes a 4-D additive float mask or None)."""
    dream, spec = drafter(folders["dream"])
    ids = torch.tensor([[5, 6, 7, 8, spec.mask_token_id]])
    with torch.no_grad():
        expected = dream(input_ids=ids).logits
        # Dream: None, "full", or a 4-D tensor handed to scaled_dot_product_attention as it is (bool or additive)
        for mask in ("full", torch.ones(1, 1, 5, 5, dtype=torch.bool), torch.zeros(1, 1, 5, 5)):
            assert torch.equal(dream(input_ids=ids, attention_mask=mask).logits, expected)
        llada, _ = drafter(folders["llada"])
        expected = llada(input_ids=ids).logits
        # LLaDA: `attention_mask` is a 2-D padding mask, 4-D masks go in `attention_bias`; no position ids, no cache
        assert torch.equal(llada(input_ids=ids, attention_mask=torch.ones(1, 5)).logits, expected)
        assert torch.equal(llada(input_ids=ids, attention_bias=torch.zeros(1, 1, 5, 5)).logits, expected)
        with pytest.raises(TypeError):
            llada(input_ids=ids, position_ids=torch.arange(5)[None])
        with pytest.raises(AssertionError):
            llada(input_ids=ids, use_cache=True)
