"""`align derive` (issue 26, item 3): a standalone block-diffusion drafter cut from the verifier's own weights, MDLM-
adapted on its trajectories. On a tiny random Llama built here (fast tier): the kept layers are the verifier's, the
spec is right, adaptation lowers the held-out loss, a killed run resumes where it was, bad recipes are refused in one
line before any work, and every decoding method's greedy output with the derived drafter is the verifier's own. One
slow test derives a 2-layer drafter from the real SmolLM2-135M-Instruct."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from align.cli import main
from align.config import ArDrafterSection, DecodeSection, DrafterSection
from align.decoding.ar import ar_generate
from align.decoding.generation import Sampling
from align.decoding.path_search import TrigramModel
from align.decoding.suffix import SuffixIndex
from align.drafters.loading import load_drafter
from align.drafters.spec import DrafterSpec
from align.methods import METHODS, Setup, eos_token_ids
from align.models import load_ar_drafter
from align.recipe_files import load_recipe
from align.stages.derive import build_drafter, kept_layers

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "smollm2" / "diffusion.yaml"
TOKENIZER = ROOT / "checkpoints" / "tiny" / "verifier"  # the shipped tiny family's tokenizer (it has a mask token)
NEW_TOKENS = 12

pytestmark = pytest.mark.usefixtures("one_thread")


def one_line_refusal(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("align derive: error: ") and err.count("\n") == 1, err
    return err


@pytest.fixture(scope="module")
def family(tmp_path_factory) -> dict[str, Path]:
    """A random 6-layer Llama verifier with the tiny tokenizer, and its greedy trajectories of 24 prompts (by the
    real `align trajectories`)."""
    root = tmp_path_factory.mktemp("derive")
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    verifier = LlamaForCausalLM(config)
    verifier.save_pretrained(root / "verifier")
    tokenizer.save_pretrained(root / "verifier")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}(x):\n    return x + {i}"}) + "\n" for i in range(24)))
    assert main(["trajectories", "recipes/tiny/align.yaml", f"verifier.path={root / 'verifier'}",
                 f"data.dir={root / 'data'}", f"data.train_prompts={prompts}", f"trajectories.out={root / 'traj'}",
                 "trajectories.num_prompts=24", "trajectories.max_new_tokens=16", "trajectories.batch_size=12"]) == 0
    return {"root": root, "verifier": root / "verifier", "traj": root / "traj", "prompts": prompts}


def derive_args(family, out: Path, *extra: str) -> list[str]:
    # The tiny random family has no chat template (the SmolLM2 recipe's data.chat_template is on) and its trajectories
    # were made with transformers (the recipe's backend is vLLM).
    return ["derive", str(RECIPE), f"verifier.path={family['verifier']}", f"trajectories.out={family['traj']}",
            "data.chat_template=auto", "trajectories.backend=hf", "trajectories.batch_size=12",
            "trajectories.max_new_tokens=16", f"derive.out={out}", "derive.num_layers=3", "derive.seq_len=32",
            "derive.block_sizes=[4, 8]", "derive.batch_size=2", "derive.max_steps=8", "derive.lr=1e-2",
            "derive.warmup_steps=1", "derive.eval_tokens=64", "derive.precision=fp32", *extra]


@pytest.fixture(scope="module")
def derived(family) -> Path:
    out = family["root"] / "drafter"
    assert main(derive_args(family, out)) == 0
    return out


def test_the_drafter_keeps_the_verifiers_chosen_layers_and_weights(family):
    verifier = AutoModelForCausalLM.from_pretrained(family["verifier"])
    spec = DrafterSpec(7, 1, "block_causal")
    for layers in ([0, 1, 5], [5, 2]):
        drafter = build_drafter(verifier, layers, spec)
        assert drafter.config.num_hidden_layers == len(layers) and drafter.config.drafter_spec == spec.to_dict()
        theirs, ours = verifier.state_dict(), drafter.state_dict()
        for new, old in enumerate(layers):
            prefix = f"model.layers.{new}."
            names = [n for n in ours if n.startswith(prefix)]
            assert names
            for name in names:
                assert torch.equal(ours[name], theirs[name.replace(prefix, f"model.layers.{old}.")]), name
        for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            assert torch.equal(ours[name], theirs[name]), name
        assert drafter.lm_head.weight.data_ptr() == drafter.model.embed_tokens.weight.data_ptr()  # tied, as its verifier
        # each attention layer caches at its own new index
        assert [layer.self_attn.layer_idx for layer in drafter.model.layers] == list(range(len(layers)))
    d = load_recipe(None, ["derive.num_layers=3"]).derive
    assert kept_layers(d, 30) == [0, 14, 29] and kept_layers(d.model_copy(update={"num_layers": 4}), 30) == [0, 10, 19, 29] and kept_layers(d.model_copy(update={"layers": [4, 2]}), 30) == [4, 2]


def test_the_derived_folder_is_a_drafter_align_loads_unchanged(family, derived):
    config = json.loads((derived / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(derived)
    spec = DrafterSpec(tokenizer.mask_token_id, 1, "block_causal")  # the tiny tokenizer has its own mask token
    assert config["num_hidden_layers"] == 3 and DrafterSpec(**config["drafter_spec"]) == spec
    manifest = json.loads((derived / "manifest.json").read_text())
    assert manifest["stage"] == "derive" and manifest["layers_kept"] == [0, 2, 5]
    assert manifest["mask_token"]["id"] == tokenizer.mask_token_id and "mask token" in manifest["mask_token"]["chosen"]
    assert manifest["steps"] == 8 and manifest["text"]["held_out_rows"] == 2  # prompts 0 and 20, as align train's
    # Frozen by default (derive.train_embeddings): the embeddings, which are also the LM head, stay the verifier's.
    ours, theirs = load_file(derived / "model.safetensors"), load_file(family["verifier"] / "model.safetensors")
    assert torch.equal(ours["model.embed_tokens.weight"], theirs["model.embed_tokens.weight"])
    assert not torch.equal(ours["model.layers.2.mlp.up_proj.weight"], theirs["model.layers.5.mlp.up_proj.weight"])
    # What align train and align eval run before they start, then the runtime's own loader.
    from align.preflight import check_models

    recipe = load_recipe(ROOT / "recipes" / "tiny" / "eval.yaml", [f"verifier.path={family['verifier']}",
                                                                   f"drafter.path={derived}"])
    check_models(recipe, ["verifier.path", "drafter.path"])
    model, loaded = load_drafter(DrafterSection(path=str(derived)), tokenizer)
    assert loaded == spec and model.config.num_hidden_layers == 3


def test_the_mdlm_step_lowers_the_loss(family, derived, tmp_path):
    from align.data import load_trajectories
    from align.stages.derive import token_stream
    from align.pretraining import Schedule, mdlm_step, mean_loss, train_loop

    tokenizer = AutoTokenizer.from_pretrained(family["verifier"])
    verifier = AutoModelForCausalLM.from_pretrained(family["verifier"])
    spec = DrafterSpec(tokenizer.mask_token_id, 1, "block_causal")
    # Every weight trained (derive.train_embeddings=true): a random model's embeddings, which are also its head, are
    # too small for peaked logits (a real verifier's are not), and frozen they would hold the loss up.
    drafter = build_drafter(verifier, [0, 1, 5], spec)
    rows = load_trajectories(family["traj"])
    window = torch.from_numpy(token_stream(rows, [1, 2, 3])[:33].astype(np.int64))[None]

    def step(model, w, gen, k):
        return mdlm_step(model, w, gen, spec.mask_token_id, 8, spec.logits_shift)

    before = mean_loss(drafter, step, [window], bf16=False)
    stats = train_loop("test", drafter, step, lambda rng: window, Schedule(1e-2, 0, 1.0, 0.0, 1000.0, max_steps=10),
                       tmp_path, "hash", 0, bf16=False)
    after = mean_loss(drafter, step, [window], bf16=False)
    assert stats["steps"] == 10 and after < before - 0.5, (before, after)
    # The stage measured its held-out loss before and after, on the same fixed masks.
    manifest = json.loads((derived / "manifest.json").read_text())
    assert np.isfinite(manifest["held_out_loss_before"]) and np.isfinite(manifest["held_out_loss_after"])
    assert manifest["steps_per_s"] > 0 and manifest["tokens_seen"] == 8 * 2 * 32


def test_a_second_run_does_nothing(family, derived, capsys):
    before = (derived / "model.safetensors").stat().st_mtime_ns
    capsys.readouterr()
    assert main(derive_args(family, derived)) == 0
    assert "is up to date" in capsys.readouterr().out
    assert (derived / "model.safetensors").stat().st_mtime_ns == before


def test_a_killed_run_resumes_where_it_was_and_ends_where_an_unbroken_one_does(family, derived, tmp_path,
                                                                            monkeypatch, capsys):
    import align.pretraining

    out = tmp_path / "killed"
    args = derive_args(family, out, "derive.save_every_minutes=1e-6")  # a state at every step
    real, calls = align.pretraining.mdlm_step, []

    def killed_at_step_3(*a, **k):
        if torch.is_grad_enabled():  # a training step (the held-out loss runs without gradients)
            calls.append(1)
            if len(calls) == 4:
                raise KeyboardInterrupt  # as Ctrl-C, or a kill after the state of step 3 was saved
        return real(*a, **k)

    monkeypatch.setattr(align.pretraining, "mdlm_step", killed_at_step_3)
    assert main(args) == 130
    assert torch.load(out / ".work" / "state.pt", weights_only=False)["step"] == 3
    assert not (out / "model.safetensors").exists()  # nothing published half-way
    monkeypatch.setattr(align.pretraining, "mdlm_step", real)
    capsys.readouterr()
    assert main(args) == 0
    assert "resuming at step 3" in capsys.readouterr().out
    assert not (out / ".work").exists()
    resumed, unbroken = load_file(out / "model.safetensors"), load_file(derived / "model.safetensors")
    assert resumed.keys() == unbroken.keys()
    for name in resumed:
        assert torch.equal(resumed[name], unbroken[name]), name


def test_a_damaged_state_or_one_of_other_settings_is_set_aside_and_said(tmp_path, capsys):
    # Issue 35: a killed derive whose settings then changed restarted from step 0 without a word (and overwrote the
    # state), and a torn state.pt failed every rerun with torch's own error.
    from align.pretraining import saved_state

    path = tmp_path / "state.pt"
    torch.save({"config_hash": "settings-a", "step": 3}, path)
    assert saved_state("derive", path, "settings-a")["step"] == 3
    capsys.readouterr()
    assert saved_state("derive", path, "settings-b") is None
    assert "was saved by a run with other settings (step 3); kept as state-settings-a.pt" in capsys.readouterr().out
    assert not path.exists() and torch.load(tmp_path / "state-settings-a.pt", weights_only=False)["step"] == 3
    path.write_bytes(b"PK\x03\x04 torn")
    assert saved_state("derive", path, "settings-b") is None
    assert "cannot be read" in capsys.readouterr().out and (tmp_path / "state.damaged.pt").is_file()


@pytest.mark.parametrize("override, expected", [
    ("derive.layers=[0, 9]", "derive.layers: [9] are not layers of the verifier, which has 6"),
    ("derive.num_layers=6", "derive.num_layers: 6 keeps every one of the verifier's 6 layers"),
    ("derive.layers=[1, 1]", "derive.layers: each layer is kept once"),
    ("derive.block_sizes=[5]", "derive.block_sizes: each block size divides derive.seq_len (32)"),
    ("derive.seq_len=512", "derive.seq_len: 512 exceeds the verifier's context (256 tokens)"),
    ("derive.mask_token_id=99999", "derive.mask_token_id: 99999 is outside the verifier's vocabulary"),
    ("trajectories.max_new_tokens=64", "trajectories.max_new_tokens: the trajectories in"),
    ("derive.attention=bidirectional", "derive.attention: Input should be 'block_causal'"),
])
def test_a_bad_recipe_is_refused_in_one_line_before_any_work(family, tmp_path, capsys, override, expected):
    out = tmp_path / "out"
    assert main([*derive_args(family, out), override]) == 2
    assert expected in one_line_refusal(capsys)
    assert not out.exists()


def test_missing_or_benchmark_trajectories_and_foreign_folders_are_refused(family, tmp_path, capsys):
    out = tmp_path / "out"
    assert main([*derive_args(family, out), f"trajectories.out={tmp_path / 'none'}"]) == 2
    assert "has no readable manifest.json (run align trajectories)" in one_line_refusal(capsys)
    # trajectories of the prompts the eval measures on
    assert main([*derive_args(family, out), f"eval.prompts={family['prompts']}"]) == 2
    assert "are of eval.prompts" in one_line_refusal(capsys)
    assert not out.exists()
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(derive_args(family, out)) == 2
    assert "align did not write it" in one_line_refusal(capsys)


def every_method_is_greedy_identical_to_ar(verifier, drafter, spec, tokenizer, prompts: list[torch.Tensor],
                                           new_tokens: int) -> dict[tuple[str, int], float]:
    """Each method's greedy tokens with `drafter` equal AR greedy's, on every prompt; returns each τ."""
    eos = eos_token_ids(verifier, tokenizer)
    expected = [ar_generate(verifier, ids, new_tokens, eos_ids=eos)[0] for ids in prompts]
    stream = np.array([t for ids, answer in zip(prompts, expected) for t in ids[0].tolist() + answer])
    proxy = TrigramModel.fit(stream, len(tokenizer))
    decode = DecodeSection(gamma=4, max_new_tokens=new_tokens, num_candidates=2, tree_nodes=4)
    # A cost curve of the measured shape fixed in advance: the test asserts outputs, not timings.
    setup = Setup(verifier, drafter, spec, verifier, tokenizer, eos, decode, proxy,
                  verify_costs=[1.0] * 3 + [1.25, 1.5], draft_cost=1.0,
                  suffix=SuffixIndex.build(ids[0].tolist() + answer for ids, answer in zip(prompts, expected)))
    taus = {}
    for name, method in METHODS.items():
        for k, (ids, wanted) in enumerate(zip(prompts, expected)):
            tokens, stats = method(setup, ids, Sampling(), None)
            assert tokens == wanted, (name, k, tokenizer.decode(tokens), tokenizer.decode(wanted))
            taus[name, k] = stats.tau
    return taus


def test_every_method_is_greedy_identical_to_ar_with_the_derived_drafter(family, derived):
    tokenizer = AutoTokenizer.from_pretrained(derived)
    verifier = AutoModelForCausalLM.from_pretrained(family["verifier"]).eval()
    drafter, spec = load_drafter(DrafterSection(path=str(derived)), tokenizer)
    prompts = [torch.tensor([tokenizer(text).input_ids]) for text in ("def add(a, b):", "class Stack:\n    def")]
    every_method_is_greedy_identical_to_ar(verifier, drafter, spec, tokenizer, prompts, NEW_TOKENS)


def test_an_ar_drafter_is_cut_and_adapted_for_the_ar_baselines(family, tmp_path, capsys):
    """derive.drafter=ar: the same cut without a mask token or drafter spec, adapted with next-token cross-entropy; the
    AR baselines (sd_ar, HF assisted generation) run with it and stay the verifier's own greedy output."""
    out = tmp_path / "ar-drafter"
    capsys.readouterr()
    assert main(derive_args(family, out, "derive.drafter=ar", "derive.lr=1e-3")) == 0
    said = capsys.readouterr().out
    assert "an AR drafter" in said and "mask token" not in said
    config = json.loads((out / "config.json").read_text())
    assert "drafter_spec" not in config and config["num_hidden_layers"] == 3
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["drafter"] == "ar" and manifest["mask_token"] is None and manifest["drafter_spec"] is None
    assert manifest["loss_kind"].startswith("next-token") and manifest["layers_kept"] == [0, 2, 5]
    assert manifest["held_out_loss_after"] < manifest["held_out_loss_before"]
    # a block-diffusion drafter of the same recipe is a different drafter: not taken for this one
    assert json.loads((out / "manifest.json").read_text())["config_hash"] != plan_hash(family, tmp_path)

    tokenizer = AutoTokenizer.from_pretrained(out)
    verifier = AutoModelForCausalLM.from_pretrained(family["verifier"]).eval()
    ar_drafter = load_ar_drafter(ArDrafterSection(path=str(out)))
    eos = eos_token_ids(verifier, tokenizer)
    decode = DecodeSection(gamma=4, max_new_tokens=NEW_TOKENS)
    setup = Setup(verifier, None, None, ar_drafter, tokenizer, eos, decode)
    for text in ("def add(a, b):", "class Stack:\n    def"):
        ids = torch.tensor([tokenizer(text).input_ids])
        wanted = ar_generate(verifier, ids, NEW_TOKENS, eos_ids=eos)[0]
        for name in ("sd_ar", "hf_assisted"):
            assert METHODS[name](setup, ids, Sampling(), None)[0] == wanted, name

    capsys.readouterr()
    assert main(derive_args(family, tmp_path / "refused", "derive.drafter=ar", "derive.mask_token_id=7")) == 2
    assert "derive.mask_token_id: an AR drafter (derive.drafter=ar) has no mask token" in one_line_refusal(capsys)
    assert not (tmp_path / "refused").exists()


def plan_hash(family, tmp_path: Path) -> str:
    from align.stages.derive import plan

    return plan(load_recipe(RECIPE, derive_args(family, tmp_path / "x")[2:])).config_hash


# --------------------------------------------------------------------------------------------------------------------
# the real verifier
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_two_layer_drafter_from_the_real_smollm2(smollm2, tmp_path, capsys):
    from test_smollm2 import PROMPTS, rendered

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": p}) + "\n" for p in PROMPTS))
    assert main(["trajectories", str(RECIPE), f"verifier.path={smollm2}", f"data.train_prompts={prompts}",
                 "data.prompt_column=messages", f"trajectories.out={tmp_path / 'traj'}", "trajectories.num_prompts=2",
                 "trajectories.max_new_tokens=16", "trajectories.batch_size=2", "trajectories.backend=hf"]) == 0
    out = tmp_path / "drafter"
    capsys.readouterr()
    assert main(["derive", str(RECIPE), f"verifier.path={smollm2}", f"trajectories.out={tmp_path / 'traj'}",
                 "trajectories.max_new_tokens=16", "trajectories.batch_size=2", "trajectories.backend=hf",
                 f"derive.out={out}", "derive.num_layers=2", "derive.seq_len=32",
                 "derive.block_sizes=[4, 8]", "derive.batch_size=1", "derive.max_steps=2", "derive.eval_tokens=32"]) == 0
    said = capsys.readouterr().out
    assert "'<empty_output>' (id 16)" in said  # the mask token chosen for a tokenizer without one, said
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["layers_kept"] == [0, 29] and manifest["mask_token"]["id"] == 16
    assert manifest["drafter_spec"] == DrafterSpec(16, 1, "block_causal").to_dict()
    assert (out / "LICENSE").is_file()
    tokenizer = AutoTokenizer.from_pretrained(out)
    verifier = AutoModelForCausalLM.from_pretrained(smollm2).eval()
    drafter, spec = load_drafter(DrafterSection(path=str(out)), tokenizer)
    taus = every_method_is_greedy_identical_to_ar(verifier, drafter, spec, tokenizer, rendered(tokenizer), 8)
    assert all(t >= 1.0 for t in taus.values()), taus
