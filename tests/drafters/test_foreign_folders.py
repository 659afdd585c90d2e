"""A speculators-format DFlash folder is not align's: it is checked against its format before any model is built
(align/drafters/dflash.py, `check_speculators_folder`; against the verifier, `check_dflash_verifier`), by every stage
(preflight.check_models) and by `align.load`. Each edit of a tiny folder below, key by key and weight by weight, is
refused in one line naming what is wrong, exit 2, before a model is built (issue 52)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from align.cli import main
from align.config import RecipeError

ROOT = Path(__file__).resolve().parents[2]
VERIFIER = ROOT / "checkpoints" / "tiny" / "verifier"


def tiny_speculators_folder(folder: Path, draft_vocab_size: int | None = None) -> Path:
    """A DFlash drafter (random weights, one layer) on the shipped tiny verifier, written as speculators saves one:
    config.json and model.safetensors without the verifier's embeddings and head (speculators leaves them out)."""
    from align.drafters.dflash import DFlashDrafter, config_for_verifier
    from align.drafters.speculators_format import speculators_config
    from transformers import AutoConfig

    torch.manual_seed(0)
    config = config_for_verifier(AutoConfig.from_pretrained(VERIFIER), mask_token_id=3, intermediate_size=64,
                                 aux_layer_ids=[1, 3, 5], block_size=5, draft_vocab_size=draft_vocab_size)
    drafter = DFlashDrafter(config)
    if draft_vocab_size is not None:
        ids = torch.arange(10, 10 + 2 * draft_vocab_size, 2)  # ascending verifier ids, as speculators orders them
        drafter.d2t.copy_(ids - torch.arange(draft_vocab_size))
        drafter.t2d[ids] = True
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(speculators_config(config, str(VERIFIER), ["LlamaForCausalLM"],
                                                                      torch.float32), indent=2))
    save_file({k: v.contiguous() for k, v in drafter.state_dict().items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("speculators")
    return {"full": tiny_speculators_folder(root / "full"), "pruned": tiny_speculators_folder(root / "pruned", 64)}


def edited(source: Path, dest: Path, config: Callable[[dict], Any] | None = None,
           weights: Callable[[dict], Any] | None = None) -> Path:
    """A copy of `source` with its config.json and/or weights edited in place by the given functions."""
    shutil.copytree(source, dest)
    if config is not None:
        raw = json.loads((dest / "config.json").read_text())
        config(raw)
        (dest / "config.json").write_text(json.dumps(raw))
    if weights is not None:
        tensors = load_file(str(dest / "model.safetensors"))
        weights(tensors)
        save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def layer(edit: Callable[[dict], Any]) -> Callable[[dict], Any]:
    return lambda raw: edit(raw["transformer_layer_config"])


def rename(old: str, new: str) -> Callable[[dict], Any]:
    return lambda t: t.__setitem__(new, t.pop(old))


CONFIG_EDITS = [
    ("no transformer_layer_config", lambda r: r.pop("transformer_layer_config"), "transformer_layer_config is missing"),
    ("transformer_layer_config a string", lambda r: r.__setitem__("transformer_layer_config", "qwen3"),
     "transformer_layer_config is str"),
    ("no hidden_size", layer(lambda c: c.pop("hidden_size")), "transformer_layer_config.hidden_size is missing"),
    ("hidden_size a string", layer(lambda c: c.__setitem__("hidden_size", "512")),
     "transformer_layer_config.hidden_size is '512'"),
    ("no vocab_size", layer(lambda c: c.pop("vocab_size")), "transformer_layer_config.vocab_size"),
    ("zero layers", layer(lambda c: c.__setitem__("num_hidden_layers", 0)),
     "transformer_layer_config.num_hidden_layers is 0"),
    ("kv heads not dividing heads", layer(lambda c: c.__setitem__("num_key_value_heads", 3)),
     "num_key_value_heads is 3, which does not divide"),
    ("a boolean rms_norm_eps", layer(lambda c: c.__setitem__("rms_norm_eps", True)), "rms_norm_eps"),
    ("a gelu MLP", layer(lambda c: c.__setitem__("hidden_act", "gelu")), "hidden_act is 'gelu'"),
    ("attention bias", layer(lambda c: c.__setitem__("attention_bias", True)), "attention_bias"),
    ("sliding layers without a window", layer(lambda c: c.__setitem__("layer_types", ["sliding_attention"])),
     "sliding_window is None"),
    ("an unknown layer type", layer(lambda c: c.__setitem__("layer_types", ["chunked_attention"])),
     "holds 'chunked_attention'"),
    ("a layer type for each of two layers", layer(lambda c: c.__setitem__("layer_types", ["full_attention"] * 2)),
     "expected a list of 1 layer types"),
    ("scaled RoPE", layer(lambda c: c.__setitem__("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4})),
     "rope_type is 'yarn'"),
    ("no aux_hidden_state_layer_ids", lambda r: r.pop("aux_hidden_state_layer_ids"),
     "aux_hidden_state_layer_ids is missing"),
    ("empty aux_hidden_state_layer_ids", lambda r: r.__setitem__("aux_hidden_state_layer_ids", []),
     "aux_hidden_state_layer_ids is []"),
    ("a negative layer id", lambda r: r.__setitem__("aux_hidden_state_layer_ids", [1, -3, 5]),
     "aux_hidden_state_layer_ids is [1, -3, 5]"),
    ("layer ids past the verifier's depth", lambda r: r.__setitem__("aux_hidden_state_layer_ids", [1, 3, 99]),
     "must be below the verifier's 7 layers"),
    ("no mask_token_id", lambda r: r.pop("mask_token_id"), "mask_token_id is missing"),
    ("mask_token_id past the vocabulary", lambda r: r.__setitem__("mask_token_id", 10 ** 6),
     "mask_token_id is 1000000"),
    ("block_size 1", lambda r: r.__setitem__("block_size", 1), "block_size is 1"),
    ("draft_vocab_size past the vocabulary", lambda r: r.__setitem__("draft_vocab_size", 10 ** 6),
     "draft_vocab_size is 1000000"),
    ("a narrower target_hidden_size", lambda r: r.__setitem__("target_hidden_size", 256), "fc.weight is [512, 1536]"),
    ("a narrower draft layer", layer(lambda c: c.__setitem__("hidden_size", 256)), "fc.weight is [512, 1536]"),
    ("a second layer named", layer(lambda c: c.__setitem__("num_hidden_layers", 2)), "layers.1."),
    ("another vocabulary", lambda r: (r["transformer_layer_config"].__setitem__("vocab_size", 4096),
                                      r.__setitem__("draft_vocab_size", 4096)), "vocabulary size 4096 differs"),
    ("a draft vocabulary past the layer's", layer(lambda c: c.__setitem__("vocab_size", 4096)),
     "draft_vocab_size is 8192 (expected an integer in [1, vocab_size 4096])"),
    ("an EAGLE-3 config", lambda r: r.__setitem__("speculators_model_type", "eagle3"), "speculators eagle3 drafter"),
    ("no speculators_model_type", lambda r: r.pop("speculators_model_type"), "drafter.path"),
    ("an empty config", lambda r: r.clear(), "model_type"),
]

WEIGHT_EDITS = [
    ("no fc", "full", lambda t: t.pop("fc.weight"), "fc.weight is missing"),
    ("fc reshaped", "full", lambda t: t.__setitem__("fc.weight", t["fc.weight"][:, :1024].contiguous()),
     "fc.weight is [512, 1024]; config.json gives [512, 1536] (aux_hidden_state_layer_ids names 3 layers"),
    ("a projection renamed", "full", rename("layers.0.mlp.up_proj.weight", "layers.0.mlp.upproj.weight"),
     "layers.0.mlp.up_proj.weight is missing"),
    ("a layer norm removed", "full", lambda t: t.pop("layers.0.input_layernorm.weight"), "input_layernorm.weight"),
    ("an extra layer", "full", lambda t: t.__setitem__("layers.1.mlp.up_proj.weight", t["layers.0.mlp.up_proj.weight"].clone()),
     "layers.1.mlp.up_proj.weight is no weight of a DFlash drafter"),
    ("an integer weight", "full", lambda t: t.__setitem__("norm.weight", t["norm.weight"].long()), "norm.weight is I64"),
    ("a wrong verifier embedding copy", "full", lambda t: t.__setitem__("embed_tokens.weight", torch.zeros(4, 512)),
     "embed_tokens.weight is [4, 512]"),
    ("no d2t", "pruned", lambda t: t.pop("d2t"), "d2t is missing"),
    ("d2t a float", "pruned", lambda t: t.__setitem__("d2t", t["d2t"].float()), "d2t is F32"),
    ("d2t outside the vocabulary", "pruned", lambda t: t.__setitem__("d2t", t["d2t"] + 10 ** 5),
     "maps a draft id outside the verifier's vocabulary"),
    ("d2t not ascending", "pruned", lambda t: t.__setitem__("d2t", t["d2t"].flip(0).contiguous()), "ascending"),
    ("t2d not matching d2t", "pruned", lambda t: t.__setitem__("t2d", torch.zeros_like(t["t2d"])), "t2d does not mark"),
    ("no pruned head", "pruned", lambda t: t.pop("lm_head.weight"), "lm_head.weight is missing"),
]


def refused_by_eval(capsys, started, folder: Path, tmp_path: Path) -> str:
    code = main(["eval", "recipes/tiny/eval.yaml", f"drafter.path={folder}", "eval.methods=[specdiff]",
                 f"eval.out={tmp_path / 'eval'}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert not started, f"the stage started before refusing: {err}"
    assert err.count("\n") == 1 and err.startswith("align eval: error: drafter.path: "), err
    assert not (tmp_path / "eval").exists()
    return err.strip()


@pytest.fixture
def built(monkeypatch) -> list[str]:
    """Every transformers model built (PreTrainedModel.__init__)."""
    from transformers import PreTrainedModel

    models: list[str] = []
    original = PreTrainedModel.__init__

    def init(self, *args, **kwargs):
        models.append(type(self).__name__)
        original(self, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "__init__", init)
    return models


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(ROOT)  # the shipped recipes name checkpoints/tiny relative to the repository


@pytest.mark.parametrize("what, edit, expect", CONFIG_EDITS, ids=[c[0] for c in CONFIG_EDITS])
def test_each_config_edit_is_refused_in_one_line_before_any_model(capsys, started, built, folders, tmp_path, what,
                                                                   edit, expect):
    folder = edited(folders["full"], tmp_path / "edited", config=edit)
    line = refused_by_eval(capsys, started, folder, tmp_path)
    assert expect in line, line
    assert not built, built


@pytest.mark.parametrize("what, base, edit, expect", WEIGHT_EDITS, ids=[c[0] for c in WEIGHT_EDITS])
def test_each_weights_edit_is_refused_in_one_line_before_any_model(capsys, started, built, folders, tmp_path, what,
                                                                    base, edit, expect):
    folder = edited(folders[base], tmp_path / "edited", weights=edit)
    line = refused_by_eval(capsys, started, folder, tmp_path)
    assert expect in line, line
    assert not built, built


def test_the_api_refuses_an_edited_folder_before_loading_the_verifier(built, folders, tmp_path):
    import align

    folder = edited(folders["full"], tmp_path / "edited",
                    config=lambda r: r.__setitem__("aux_hidden_state_layer_ids", [1, 3, 7]))
    with pytest.raises(RecipeError) as refused:
        align.load(verifier=str(VERIFIER), drafter=str(folder), device="cpu")
    assert str(refused.value).startswith(f"drafter.path: {folder}: aux_hidden_state_layer_ids [1, 3, 7] must be below")
    assert "\n" not in str(refused.value) and not built, built


def test_a_folder_without_weights_and_one_torn_are_refused(capsys, started, folders, tmp_path):
    empty = edited(folders["full"], tmp_path / "empty")
    (empty / "model.safetensors").unlink()
    assert "has no weights" in refused_by_eval(capsys, started, empty, tmp_path)
    torn = edited(folders["full"], tmp_path / "torn")
    data = (torn / "model.safetensors").read_bytes()
    (torn / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert "truncated or corrupt" in refused_by_eval(capsys, started, torn, tmp_path)


def test_a_speculators_folder_is_no_verifier(capsys, started, folders, tmp_path):
    code = main(["eval", "recipes/tiny/eval.yaml", f"verifier.path={folders['full']}", "eval.methods=[ar]",
                 f"eval.out={tmp_path / 'eval'}"])
    err = capsys.readouterr().err
    assert code == 2 and not started and err.count("\n") == 1, err
    assert "verifier.path: " in err and "is a diffusion drafter" in err, err


@pytest.mark.parametrize("kind", ["full", "pruned"])
def test_an_unedited_folder_passes_and_loads_with_the_shapes_the_check_expects(folders, kind):
    from align.drafters.dflash import DFlashDrafter
    from align.drafters.speculators_format import check_speculators_folder, load_speculators_dflash
    from align.drafters.speculators_format import speculators_weight_shapes
    from align.models import resolve_dtype
    from align.preflight import check_models
    from align.recipe_files import load_recipe

    recipe = load_recipe("recipes/tiny/eval.yaml", [f"drafter.path={folders[kind]}"])
    check_models(recipe, ["verifier.path", "drafter.path"])
    config = check_speculators_folder(str(folders[kind]))
    # the expected names and shapes are the model's own, so the check cannot drift from the loader
    model = DFlashDrafter(config)
    assert speculators_weight_shapes(config) == {k: tuple(v.shape) for k, v in model.state_dict().items()}
    loaded = load_speculators_dflash(str(folders[kind]))
    assert loaded.config.aux_hidden_state_layer_ids == [1, 3, 5]
    # dtype "auto" reads a speculators config.json's own dtype (AutoConfig cannot: it has no model_type)
    assert resolve_dtype("auto", torch.device("cpu"), str(folders[kind])) == torch.float32


@pytest.mark.parametrize("argv, where", [
    (["calibrate", "recipes/tiny/spiffy.yaml", "calibrate.graph=null"], "align calibrate needs a standalone"),
    (["eval", "recipes/tiny/spiffy.yaml", "eval.mode=dllm"], "eval.mode=dllm needs a standalone"),
])
def test_a_dflash_folder_where_the_drafter_decodes_alone_is_refused_from_its_config(capsys, started, built, folders,
                                                                                    tmp_path, argv, where):
    from align.models import load_tokenizer

    folder = edited(folders["full"], tmp_path / "dflash")
    load_tokenizer(str(VERIFIER)).save_pretrained(folder)  # as an export carries it: the prompts are read with it
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n')
    code = main([*argv, f"drafter.path={folder}", f"calibrate.prompts={prompts}", f"eval.prompts={prompts}",
                 f"calibrate.out={tmp_path / 'out'}", f"eval.out={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    assert code == 2 and not started and not built and err.count("\n") == 1, err
    assert f"drafter.path: {folder} is a DFlash drafter" in err and where in err, err


def test_serve_check_refuses_an_edited_folder_before_vllm_starts(capsys, started, folders, tmp_path, monkeypatch):
    monkeypatch.setenv("ALIGN_VLLM_PYTHON", str(tmp_path / "no-vllm" / "python"))  # the folder is refused first
    folder = edited(folders["full"], tmp_path / "edited", weights=lambda t: t.pop("fc.weight"))
    code = main(["serve-check", "recipes/tiny/dflash.yaml", f"serve_check.drafter={folder}", "decode.gamma=4",
                 f"serve_check.out={tmp_path / 'serve'}"])
    err = capsys.readouterr().err
    assert code == 2 and not started and err.count("\n") == 1, err
    assert f"serve_check.drafter: {folder}: model.safetensors's fc.weight is missing" in err, err


def test_train_checks_a_dflash_folder_against_the_verifier_it_reads_before_launching(capsys, started, built, folders,
                                                                                    tmp_path):
    """`align train` on a speculators folder (no dflash section) loads the verifier for its hidden states in every
    step, so the folder's layer ids are checked against that verifier before launching, with no final τ asked."""
    folder = edited(folders["full"], tmp_path / "deep",
                    config=lambda r: r.__setitem__("aux_hidden_state_layer_ids", [1, 3, 99]))
    code = main(["train", "recipes/tiny/dflash.yaml", "dflash=null", f"drafter.path={folder}",
                 "train.final_eval_prompts=0", f"train.out={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and not started and not built and err.count("\n") == 1, err
    assert "must be below the verifier's 7 layers" in err and not (tmp_path / "run").exists()
