"""The recipe schema: every shipped recipe loads; bad recipes and overrides are refused with one clear line."""

from pathlib import Path

import pytest

from align.config import Recipe, RecipeError
from align.preflight import check_inputs
from align.recipe_files import load_recipe, parse_override

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").rglob("*.yaml"))


def refused(overrides=(), recipe=None) -> str:
    with pytest.raises(RecipeError) as err:
        load_recipe(recipe, list(overrides))
    message = str(err.value)
    assert "\n" not in message, "errors are one line"
    return message


def test_recipes_exist():
    names = {p.relative_to(ROOT / "recipes").as_posix() for p in RECIPES}
    assert {"tiny/bootstrap.yaml", "tiny/eval.yaml", "tiny/align.yaml", "tiny/spiffy.yaml"} <= names


def test_defaults_live_in_the_schema():
    recipe = load_recipe(None)
    assert recipe == Recipe()
    assert recipe.verifier.path == "checkpoints/tiny/verifier"
    assert recipe.drafter.path == "checkpoints/tiny/drafter-base"
    assert recipe.bootstrap.drafter.objective == "mdlm"


def test_overrides_are_typed_and_nested():
    recipe = load_recipe(None, ["decode.gamma=12", "train.lr=3e-4", "bootstrap.drafter.block_sizes=[8, 16]",
                                "decode.temperature=0.7", "train.bf16=false", "eval.num_prompts=null"])
    assert recipe.decode.gamma == 12
    assert recipe.train.lr == pytest.approx(3e-4) and isinstance(recipe.train.lr, float)
    assert recipe.bootstrap.drafter.block_sizes == [8, 16]
    assert recipe.decode.temperature == 0.7 and recipe.train.bf16 is False and recipe.eval.num_prompts is None


def test_partial_nested_override_keeps_the_other_defaults():
    recipe = load_recipe(None, ["bootstrap.verifier.lr=1e-4"])
    assert recipe.bootstrap.verifier.lr == pytest.approx(1e-4)
    assert recipe.bootstrap.verifier.hidden_size == Recipe().bootstrap.verifier.hidden_size


def test_override_wins_over_yaml(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("decode:\n  gamma: 4\n")
    assert load_recipe(path).decode.gamma == 4
    assert load_recipe(path, ["decode.gamma=6"]).decode.gamma == 6


@pytest.mark.parametrize("override, expected", [
    ("train.lrr=1", "unknown key 'train.lrr' (did you mean 'train.lr'?)"),
    ("decod.gamma=3", "unknown key 'decod' (did you mean 'decode'?)"),
    ("bootstrap.verifier.hiden_size=3", "did you mean 'bootstrap.verifier.hidden_size'?"),
])
def test_unknown_key_suggests_the_closest(override, expected):
    assert expected in refused([override])


def test_unknown_key_in_yaml(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("train:\n  zero_stag: 2\n")
    assert "unknown key 'train.zero_stag' (did you mean 'train.zero_stage'?)" in refused(recipe=path)


@pytest.mark.parametrize("override, key", [
    ("decode.gamma=abc", "decode.gamma"),
    ("train.bf16=maybe", "train.bf16"),
    ("train.losses=5", "train.losses"),
    ("bootstrap.parts=tokenizer", "bootstrap.parts"),
])
def test_wrong_type(override, key):
    message = refused([override])
    assert message.startswith(key + ":"), message


@pytest.mark.parametrize("override, key, allowed", [
    ("decode.gamma=0", "decode.gamma", "greater than or equal to 1"),
    ("decode.temperature=-0.5", "decode.temperature", "greater than or equal to 0"),
    ("train.zero_stage=4", "train.zero_stage", "0, 1, 2 or 3"),
    ("decode.top_p=1.5", "decode.top_p", "less than or equal to 1"),
    ("drafter.attention=causal", "drafter.attention", "'bidirectional' or 'block_causal'"),
    ("bootstrap.verifier.num_heads=7", "bootstrap.verifier", "divisible"),
    ("bootstrap.drafter.block_sizes=[5]", "bootstrap.drafter", "divisors of seq_len"),
    ("eval.compare_drafters={a b: x}", "eval.compare_drafters", "must be letters, digits"),
    ("trajectories.temperature=0", "trajectories", "needs temperature > 0"),
])
def test_impossible_values(override, key, allowed):
    message = refused([override])
    assert message.startswith(key) and allowed in message, message


@pytest.mark.parametrize("override", ["gamma", "=3", "decode..gamma=3", "decode.gamma"])
def test_malformed_override(override):
    assert "key.sub=value" in refused([override])


def test_override_through_a_value(tmp_path):
    assert refused(["decode.gamma.x=1"]) == "decode.gamma: Input should be a valid integer"
    path = tmp_path / "r.yaml"
    path.write_text("decode:\n  gamma: 4\n")
    assert refused(["decode.gamma.x=1"], recipe=path) == "decode.gamma.x: decode.gamma is a value, not a section"


def test_parse_override_reads_yaml_values():
    assert parse_override("a.b=1e-4") == (["a", "b"], 1e-4)
    assert parse_override("a.b=[1, 2]") == (["a", "b"], [1, 2])
    assert parse_override("a.b=hello world") == (["a", "b"], "hello world")
    assert parse_override("a.b=") == (["a", "b"], None)


def test_missing_and_malformed_recipe_files(tmp_path):
    assert "recipe not found" in refused(recipe=tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lr: [1, 2\n")
    assert "invalid YAML" in refused(recipe=bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("just a string\n")
    assert "mapping of sections" in refused(recipe=scalar)


def test_missing_inputs_are_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = load_recipe(None, ["eval.prompts=missing.jsonl", "verifier.path=nowhere/at/all"])
    with pytest.raises(RecipeError, match=r"^eval.prompts: no such file: missing.jsonl$"):
        check_inputs(recipe, file_keys=("eval.prompts",))
    with pytest.raises(RecipeError, match=r"^verifier.path: no such model folder: nowhere/at/all$"):
        check_inputs(recipe, model_keys=("verifier.path",))
    # A Hub id cannot be fetched offline: say so rather than fail deep inside transformers.
    hub = load_recipe(None, ["verifier.path=Qwen/Qwen2.5-7B-Instruct"])
    with pytest.raises(RecipeError, match="Hub is offline"):
        check_inputs(hub, model_keys=("verifier.path",))
    # A folder that is not a model.
    (tmp_path / "empty").mkdir()
    with pytest.raises(RecipeError, match="has no config.json"):
        check_inputs(load_recipe(None, ["verifier.path=empty"]), model_keys=("verifier.path",))
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "def f():"}\n')
    check_inputs(load_recipe(None, ["eval.prompts=prompts.jsonl"]), file_keys=("eval.prompts",))


@pytest.mark.parametrize("override, key", [
    ("train.lr=1e6", "train.lr"), ("train.lr=0", "train.lr"), ("gkd.lr=1e3", "gkd.lr"), ("gkd.lr=-1e-4", "gkd.lr"),
    ("bootstrap.verifier.lr=50", "bootstrap.verifier.lr"), ("bootstrap.drafter.lr=1.5", "bootstrap.drafter.lr"),
    ("bootstrap.ar_drafter.lr=2", "bootstrap.ar_drafter.lr"),
])
def test_learning_rates_that_cannot_train(override, key):
    message = refused([override])
    assert message.startswith(f"{key}: ") and "(0, 1]" in message, message


def test_learning_rate_at_the_edge_of_the_range():
    recipe = load_recipe(None, ["train.lr=1", "gkd.lr=1e-9", "bootstrap.verifier.lr=1.0"])
    assert recipe.train.lr == 1.0 and recipe.gkd.lr == 1e-9


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
def test_numbers_are_finite(value):
    message = refused([f"decode.temperature={value}"])
    assert message.startswith("decode.temperature: ") and "finite" in message, message


def schema_keys(model=Recipe, prefix=""):
    """Every field of every section, recursively: ('bootstrap.verifier.lr', 'lr'), ..."""
    from pydantic import BaseModel

    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from schema_keys(field.annotation, f"{prefix}{name}.")
        else:
            yield prefix + name, name


def test_every_schema_key_is_read():
    """A key nobody reads silently ignores what the user set (data.test_prompts once hid an eval set this way)."""
    import re

    # The schema and its preflight checks do not count: a key only they read reaches no stage.
    skipped = ("config.py", "config_inputs.py", "preflight.py")
    source = "\n".join(p.read_text() for p in (ROOT / "align").rglob("*.py") if p.name not in skipped)
    # Read as an attribute (`recipe.eval.prompts`) or by name (getattr, a dict of the dumped recipe).
    dead = [key for key, name in schema_keys() if not re.search(rf"\.{name}\b|[\"']{name}[\"']", source)]
    assert not dead, f"schema keys read nowhere in align/: {', '.join(dead)}"


def test_empty_recipe_file_is_refused(tmp_path):
    for text in ("", "\n", "# a comment only\n"):
        (tmp_path / "r.yaml").write_text(text)
        assert "empty recipe" in refused(recipe=tmp_path / "r.yaml")
    (tmp_path / "r.yaml").write_text("{}\n")  # an explicit empty mapping: all defaults
    assert load_recipe(tmp_path / "r.yaml") == Recipe()


@pytest.mark.parametrize("text, line", [
    # a second section drops the first; a repeated key replaces the earlier value; nested and flow mappings alike
    ("train:\n  lr: 1.0e-3\ndecode:\n  gamma: 4\ntrain:\n  max_steps: 5\n", "line 5: key 'train' is given twice "
     "(first at line 1)"),
    ("train:\n  lr: 1.0e-3\n  max_steps: 4\n  lr: 1.0e-2\n", "line 4: key 'lr' is given twice (first at line 2)"),
    ("train: {losses: {streak: 1.0, streak: 2.0}}\n", "line 1: key 'streak' is given twice (first at line 1)"),
])
def test_a_key_given_twice_in_a_recipe_is_refused_naming_it_and_its_lines(tmp_path, text, line):
    (tmp_path / "r.yaml").write_text(text)
    assert refused(recipe=tmp_path / "r.yaml") == f"{tmp_path / 'r.yaml'}: {line}; give each key once"


def test_a_key_given_twice_in_an_override_value_is_refused():
    assert refused(["train.losses={streak: 1, streak: 2}"]) == \
        "train.losses: {streak: 1, streak: 2}: key 'streak' is given twice"


@pytest.mark.parametrize("spelt, key, says", [
    # PyYAML is YAML 1.1: 010 is octal (8) and 1:30 base 60 (90), where YAML 1.2 and a reader see 10 and a time
    ("decode.gamma=010", "decode.gamma", "010 is a number only in YAML 1.1, which reads it as 8 (octal); write 8 or 10"),
    ("train.max_steps=1:30", "train.max_steps", "reads it as 90 (base 60); write 90"),
    ("train.lr=1:30.5", "train.lr", "reads it as 90.5 (base 60)"),
    ("dflash.aux_layer_ids=[1, 010]", "dflash.aux_layer_ids", "reads it as 8 (octal)"),
    ("train.losses={streak: 010}", "train.losses", "reads it as 8 (octal)"),
])
def test_yaml_1_1_octal_and_base_60_numbers_are_refused_where_a_number_is_wanted(tmp_path, spelt, key, says):
    assert refused([spelt]).startswith(f"{key}: ") and says in refused([spelt])
    section, _, value = spelt.partition("=")
    (tmp_path / "r.yaml").write_text(f"{section.split('.')[0]}:\n  {section.split('.')[1]}: {value}\n")
    assert says in refused(recipe=tmp_path / "r.yaml")
    # where a text is wanted it is the text as written, and unambiguous spellings are numbers
    assert load_recipe(None, ["name=010", "train.out=1:30"]).name == "010"
    assert load_recipe(None, ["train.out=1:30"]).train.out == "1:30"
    assert load_recipe(None, ["decode.gamma=0x10", "train.max_steps=1_000"]).decode.gamma == 16


def test_a_merge_key_may_be_overridden(tmp_path):
    # `<<: *base` then one of base's keys is YAML's way to override, not a repeat.
    (tmp_path / "r.yaml").write_text("decode: &d {gamma: 4, top_k: 3}\ngkd:\n  <<: {max_steps: 3, lr: 1.0e-3}\n"
                                     "  max_steps: 5\n")
    recipe = load_recipe(tmp_path / "r.yaml")
    assert recipe.gkd.max_steps == 5 and recipe.gkd.lr == 1e-3 and recipe.decode.gamma == 4


SEED_KEYS = [key for key, name in schema_keys() if name.endswith("seed")]


def test_every_seed_is_a_seed():
    assert SEED_KEYS == ["train.seed", "gkd.seed", "decode.seed", "prompts.seed", "sharegpt.seed", "derive.seed", "bootstrap.seed"]


@pytest.mark.parametrize("key", SEED_KEYS)
def test_seeds_out_of_range_are_refused(key):
    # -1 once passed and crashed training at its first step (numpy refuses negative seeds); 2**70 crashed mid-eval.
    for value in (-1, 2**32, 2**70):
        message = refused([f"{key}={value}"])
        assert message.startswith(f"{key}: a seed is an integer in [0, 4294967295]"), message
    assert load_recipe(None, [f"{key}={2**32 - 1}"]) and load_recipe(None, [f"{key}=0"])
