"""`~` is the user's home in every recipe key that names a file or folder, by one rule (align/config.py, PATH_KEYS),
in recipes, overrides and the Python API alike (issue 52: `eval.out=~/x` made a folder named `~` in the working
directory, while train.deepspeed_config and sharegpt.file expanded it)."""

from __future__ import annotations

import os
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from align.cli import main
from align.config import PATH_KEYS, Recipe
from align.recipe_files import get_key, load_recipe

ROOT = Path(__file__).resolve().parents[1]
HOME = os.path.expanduser("~")

# Every other string field of the schema, which is not a path: a new string key must be named in one list or the other.
NOT_PATHS = {
    "name", "data.train_split", "data.prompt_column", "train.project", "train.run_name", "gkd.project",
    "gkd.run_name", "calibrate.split", "calibrate.prompt_column", "eval.split", "eval.prompt_column",
    "train.losses", "eval.dataset_config", "eval.categories", "eval.id_field", "eval.methods", "export.push_to_hub",
    "export.revision", "export.commit_message", "export.license", "export.license_name", "export.license_link",
    "export.verifier_hub_id", "convert.gguf_file", "convert.sha256", "convert.license", "prompts.system_prompts",
}


def string_fields(model: type[BaseModel] = Recipe, prefix: str = "") -> set[str]:
    """Dotted keys of every field holding strings (a string, a list or mapping of them), sections walked into."""
    found = set()
    for name, field in model.model_fields.items():
        args = typing.get_args(field.annotation) or (field.annotation,)
        sections = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        if sections and name != "train_prompts":
            found |= string_fields(sections[0], f"{prefix}{name}.")
        elif "str" in str(field.annotation) or field.annotation is str:
            found.add(prefix + name)
    return found


def test_every_string_key_is_a_path_key_or_named_as_none():
    paths = {key.split(".*")[0] for key in PATH_KEYS}
    unnamed = string_fields() - paths - NOT_PATHS
    assert not unnamed, f"{sorted(unnamed)}: add a path key to align/config.py's PATH_KEYS, any other to NOT_PATHS"
    assert not paths & NOT_PATHS


@pytest.mark.parametrize("key", [k for k in PATH_KEYS if "*" not in k])
def test_a_leading_tilde_is_the_home_in_every_path_key(key):
    recipe = load_recipe(str(ROOT / "recipes/tiny/eval.yaml"), [f"{key}=~/align-x"])
    assert get_key(recipe, key) == f"{HOME}/align-x"


def test_lists_mappings_and_mixtures_expand_too_and_other_keys_keep_their_tilde():
    recipe = load_recipe(str(ROOT / "recipes/tiny/eval.yaml"), [
        "eval.compare_drafters={a: ~/d}", "sharegpt.decontaminate=[~/b.jsonl]",
        "data.train_prompts=[{path: ~/p.jsonl, weight: 1}]", "name=~home", "train.run_name=~r"])
    assert recipe.eval.compare_drafters == {"a": f"{HOME}/d"}
    assert recipe.sharegpt.decontaminate == [f"{HOME}/b.jsonl"]
    assert recipe.data.train_prompts[0].path == f"{HOME}/p.jsonl"
    assert recipe.name == "~home" and recipe.train.run_name == "~r"  # not paths: left as written


def test_the_cli_and_the_api_read_the_same_rule(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["validate", str(ROOT / "recipes/tiny/eval.yaml"), "eval.out=~/x", "--get", "eval.out"]) == 0
    assert capsys.readouterr().out.strip() == f"{HOME}/x"
    assert not (tmp_path / "~").exists()
    from align.api import _validate

    assert _validate({"verifier": {"path": "~/v"}}).verifier.path == f"{HOME}/v"
