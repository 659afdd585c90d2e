"""`align init`: recipes for your own verifier, shaped from its config and tokenizer, every key commented with the
schema's meaning; and `align <stage> --help`, which prints the same meanings."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from align.cli import main as align
from align.config import DFlashSection, TrainSection
from align.drafters.dflash import default_aux_layers
from align.recipe_files import key_meanings, load_recipe

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "checkpoints" / "tiny" / "verifier"
CHAT = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"


@pytest.fixture
def chat_verifier(tmp_path) -> Path:
    """The tiny verifier with a chat template: an instruct model, for which init also writes the Magpie prompts."""
    folder = tmp_path / "models" / "tiny-chat"
    shutil.copytree(TINY, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT}))
    (folder / "sha256.json").unlink(missing_ok=True)
    return folder


def test_init_writes_recipes_every_stage_reads_shaped_from_the_verifier(chat_verifier, tmp_path, capsys):
    out = tmp_path / "recipes" / "mine"
    assert align(["init", str(chat_verifier), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["dflash.yaml", "diffusion.yaml", "eval.yaml", "prompts.yaml"]
    recipes = {p.stem: load_recipe(p) for p in out.iterdir()}  # as every stage reads them
    config = json.loads((chat_verifier / "config.json").read_text())
    dflash = recipes["dflash"]
    assert dflash.verifier.path == str(chat_verifier) and dflash.name == "tiny-chat-dflash"
    assert dflash.dflash.aux_layer_ids == default_aux_layers(config["num_hidden_layers"])
    assert dflash.data.chat_template == "on" and dflash.data.train_prompts == recipes["prompts"].prompts.out + \
        "/prompts.jsonl"
    assert dflash.trajectories == recipes["diffusion"].trajectories  # one folder for both drafters: same settings
    assert dflash.train.out == "checkpoints/tiny-chat/dflash/train" and dflash.export.format == "speculators"
    assert dflash.export.verifier_hub_id is None  # a local folder: the comment says to set it before a push
    assert recipes["eval"].eval.compare_drafters == {"dflash": dflash.export.out}
    assert recipes["eval"].drafter.path == recipes["diffusion"].export.out
    text = (out / "dflash.yaml").read_text()
    # each key under the schema's own words for it, and init's reason where it chose for this model
    meaning = key_meanings(DFlashSection)["num_layers"]
    assert f"  # {meaning}\n  # align init: " in text
    assert "before `align export --push-to-hub`" in text.replace("\n  # ", " ")
    assert f"align train {out}/dflash.yaml --num_gpus 2" in text  # the header's run, with this folder's paths
    assert all(len(line) <= 120 or line.startswith(("#   ", "  methods")) for line in text.splitlines())
    assert f"next: align prompts {out / 'prompts.yaml'}" in capsys.readouterr().out


def test_init_without_a_chat_template_asks_for_a_prompt_dataset(tmp_path):
    out = tmp_path / "mine"
    assert align(["init", str(TINY), "--out", str(out), "--name", "tiny-base"]) == 0
    assert not (out / "prompts.yaml").exists()  # Magpie needs the template's user turn
    recipe = load_recipe(out / "dflash.yaml")
    assert recipe.data.chat_template == "off" and recipe.data.train_prompts is None
    assert "name a prompt dataset here" in (out / "dflash.yaml").read_text().replace("\n  # ", " ")
    assert recipe.train.out == "checkpoints/tiny-base/dflash/train"


def test_init_refuses_in_one_line_and_never_writes_over_a_recipe(chat_verifier, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "eval.yaml").write_text("name: mine\n")
    assert align(["init", str(chat_verifier), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{out / 'eval.yaml'} exists; align init never writes over a recipe" in err
    assert sorted(p.name for p in out.iterdir()) == ["eval.yaml"] and (out / "eval.yaml").read_text() == "name: mine\n"
    assert align(["init", str(tmp_path / "nonexistent"), "--out", str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "cannot read its config and tokenizer" in err
    assert not (tmp_path / "other").exists()


def test_stage_help_prints_each_keys_meaning_from_the_schema():
    shown = subprocess.run([sys.executable, "-m", "align", "train", "--help"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout
    lines = shown.splitlines()
    for key, meaning in (("lr", key_meanings(TrainSection)["lr"]), ("max_steps", "optimiser steps")):
        at = next(i for i, line in enumerate(lines) if line.strip().startswith(f"train.{key}:"))
        assert lines[at + 1].strip() == meaning
