"""`align export`: a folder that loads with transformers alone and decodes identically; pushes to a local Hub."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import metadata_load
from transformers import AutoModelForCausalLM

from align.cli import main
from align.decoding.specdiff import specdiff_generate
from align.disk import record_checksums
from align.drafters.spec import DrafterSpec
from hub_server import FakeHub

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def exported(toy_family, tmp_path_factory):
    root, _ = toy_family
    tmp = tmp_path_factory.mktemp("export")
    ck = root / "ck"
    common = [f"verifier.path={ck / 'verifier'}", f"drafter.path={ck / 'drafter-base'}", f"data.dir={root / 'data'}"]
    assert main(["eval", "recipes/tiny/eval.yaml", *common, f"ar_drafter.path={ck / 'ar-drafter'}",
                 f"eval.out={tmp / 'eval'}", "eval.num_prompts=2", "decode.max_new_tokens=8", "eval.warmup=0",
                 "eval.methods=[specdiff]", "eval.sampling_temperature=0"]) == 0
    args = ["export", "recipes/tiny/align.yaml", *common, f"export.out={tmp / 'out'}",
            f"export.eval={tmp / 'eval' / 'eval.json'}"]
    assert main(args) == 0
    return root, tmp / "out", args


def test_folder_contents_and_model_card(exported):
    _, out, _ = exported
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "README.md", "eval.json"} <= names
    config = json.loads((out / "config.json").read_text())
    assert config["drafter_spec"]["attention"] == "block_causal"
    card = (out / "README.md").read_text()
    metadata = metadata_load(out / "README.md")
    # The tiny recipe sets the licence (the family's checkpoints have no model card to inherit one from), and the card
    # names no base_model (a local folder is no Hub id; the card cites its manifest instead).
    assert metadata["license"] == "apache-2.0" and metadata["library_name"] == "transformers"
    assert "base_model" not in metadata and "set by the export recipe" in card
    tau = json.loads((out / "eval.json").read_text())["methods"]["specdiff"]["tau"]
    assert f"| specdiff | {tau:.2f} |" in card and "align export recipes/tiny/align.yaml" in card
    first = metadata["model-index"][0]["results"][0]["metrics"][0]
    assert first == {"type": "mean_accepted_length", "value": round(tau, 4), "args": first["args"],
                     "name": "specdiff: τ (tokens per verifier forward)"} and first["args"]["method"] == "specdiff"
    assert not (out / "tokenizer_config.json").read_text().count("local_files_only")


def test_no_path_of_the_exporting_machine_in_the_folder(exported, tmp_path, monkeypatch):
    """Every file, text or binary (safetensors headers included), is searched for the run's absolute paths."""
    root, out, _ = exported
    needles = {str(p) for p in (root, out.parent, ROOT, Path.cwd(), root / "ck" / "drafter-base")}
    hits = [f"{f.relative_to(out)}: {n}" for f in sorted(out.rglob("*")) if f.is_file()
            for n in needles if n.encode() in f.read_bytes()]
    assert hits == []


def test_the_card_passes_the_hubs_metadata_validation(exported, monkeypatch):
    from huggingface_hub import ModelCard

    _, out, _ = exported
    with FakeHub() as hub:
        monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
        monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", hub.url)
        ModelCard.load(out / "README.md").validate()
        assert hub.validated == [[]]


@pytest.mark.slow
def test_loads_in_a_fresh_process_and_decodes_identically(exported):
    root, out, _ = exported
    code = ("import sys, torch; from transformers import AutoModelForCausalLM; "
            "m = AutoModelForCausalLM.from_pretrained(sys.argv[1]); "
            "print(m.config.drafter_spec['mask_token_id'], m(torch.arange(10)[None]).logits.sum().item())")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    fresh = subprocess.run([sys.executable, "-c", code, str(out)], env=env, capture_output=True, text=True, timeout=120)
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    original = AutoModelForCausalLM.from_pretrained(root / "ck" / "drafter-base")
    mask_id, total = fresh.stdout.split()
    assert int(mask_id) == original.config.drafter_spec["mask_token_id"]
    assert float(total) == pytest.approx(original(torch.arange(10)[None]).logits.sum().item(), rel=1e-6)
    verifier = AutoModelForCausalLM.from_pretrained(root / "ck" / "verifier", dtype=torch.float32)
    spec = DrafterSpec(**original.config.drafter_spec)
    copy = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    prompt = torch.tensor([[5, 6, 7, 8]])
    a = specdiff_generate(verifier, original.float(), spec, prompt, 4, 16)
    b = specdiff_generate(verifier, copy, spec, prompt, 4, 16)
    assert a[0] == b[0] and a[1].accept_counts == b[1].accept_counts


def push(args, hub, token="hf_fake"):
    env = {**os.environ, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_TELEMETRY": "1",
           "HF_HOME": str(Path(args[-1].split("=", 1)[1]).parent / "hf_home")}
    env.pop("HF_TOKEN", None)
    if token:
        env["HF_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "align", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_push_to_a_local_hub(exported, tmp_path):
    _, _, args = exported
    out = tmp_path / "pushed"
    with FakeHub() as hub:
        result = push([*args[:-2], args[-1], "--push-to-hub", "me/tiny-drafter", "--revision", "v1",
                       f"export.out={out}"], hub)
        assert result.returncode == 0, result.stderr[-2000:]
        repo = hub.repos["me/tiny-drafter"]
        assert repo["private"] is True
        files = repo["branches"]["v1"]
        assert hub.validated and not any(hub.validated)  # the Hub checked the card on commit, and took it
        assert {"model.safetensors", "config.json", "README.md", "eval.json"} <= set(files)
        assert files["model.safetensors"] == (out / "model.safetensors").read_bytes()


def test_no_token_is_refused_before_any_work(exported, tmp_path, monkeypatch, capsys):
    _, _, args = exported
    out = tmp_path / "never"
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty_home"))  # no cached login either
    monkeypatch.setattr("huggingface_hub.constants.HF_TOKEN_PATH", str(tmp_path / "empty_home" / "token"))
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    capsys.readouterr()
    assert main([*args[:-2], args[-1], "--push-to-hub", "me/x", f"export.out={out}"]) == 2
    assert "no Hugging Face token" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.slow
def test_the_suffix_index_travels_with_the_export_and_the_suffix_methods_read_it_there(exported, toy_trajectories,
                                                                                     tmp_path, capsys):
    import numpy as np

    from align.decoding.suffix import SuffixIndex
    from align.methods import suffix_index
    from align.recipe_files import load_recipe

    _, _, args = exported
    _, trajectories = toy_trajectories
    out = tmp_path / "with-index"
    assert main([*args[:-2], args[-1], f"export.out={out}", f"decode.suffix_corpus={trajectories}"]) == 0
    built = suffix_index(load_recipe("recipes/tiny/align.yaml", [f"decode.suffix_corpus={trajectories}"]))
    kept = suffix_index(load_recipe("recipes/tiny/align.yaml", [f"decode.suffix_corpus={out}"]))
    assert np.array_equal(kept.tokens, built.tokens) and np.array_equal(kept.suffixes, built.suffixes)
    assert "suffix_index.npz" in (out / "README.md").read_text()
    assert np.array_equal(SuffixIndex.load(out).tokens, built.tokens)
    # neither a trajectories folder nor an export with an index: refused in one line before the folder is made
    capsys.readouterr()
    assert main([*args[:-2], args[-1], f"export.out={tmp_path / 'never'}", f"decode.suffix_corpus={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "decode.suffix_corpus" in err and err.count("\n") == 1 and not (tmp_path / "never").exists()


@pytest.mark.slow
def test_failed_upload_keeps_the_folder(exported, tmp_path):
    _, _, args = exported
    out = tmp_path / "kept"
    with FakeHub() as hub:
        hub.fail_commits = True
        result = push([*args[:-2], args[-1], "--push-to-hub", "me/y", f"export.out={out}"], hub)
    assert result.returncode == 1 and "is intact: rerun the same command to retry" in result.stderr
    assert (out / "model.safetensors").is_file()
    AutoModelForCausalLM.from_pretrained(out)


def test_card_shows_this_drafter_beside_the_one_it_was_compared_with():
    from align.cards import measured_table

    def entry(tau):
        return {"tau": tau, "speedup": tau / 2, "exact_match": 1.0}

    evaluation = {"methods": {"ar": entry(1.0), "specdiff": entry(1.4), "specdiff@aligned": entry(1.9),
                              "specdiff@other": entry(1.1)},
                  "meta": {"drafter": "ck/base", "compare_drafters": {"aligned": "ck/run/step_9", "other": "ck/x"}}}
    table = "\n".join(measured_table(evaluation, "ck/run/step_9"))
    assert ("| method | τ (tokens per verifier forward) | speedup | exact match with AR greedy | τ with `ck/base` |"
            in table)
    assert "| specdiff | 1.90 | 0.95× | 1.0 | 1.40 |" in table and "| ar | 1.00 | 0.50× | 1.0 | — |" in table
    assert "1.10" not in table and "@" not in table
    # Exported as the eval's own drafter.path: its plain rows, no comparison column.
    table = "\n".join(measured_table(evaluation, "ck/base"))
    assert "| specdiff | 1.40 | 0.70× | 1.0 |" in table and "τ with" not in table


def test_card_describes_the_training_run():
    from align.recipe_files import load_recipe
    from align.cards import model_card

    recipe = load_recipe("recipes/tiny/align.yaml", ["train.losses={streak: 1.0}"])
    meta = {"step": 150, "recipe": recipe.to_dict(), "drafter_base": "ck/base", "world_size": 2,
            "metrics": {"greedy_streak": 1.54, "expected_streak": 1.51}, "final_tau": 2.26, "final_tau_prompts": 8}
    card = model_card({"drafter_spec": {"mask_token_id": 2}}, meta, None, recipe, "align export x", "ck/base")
    assert "with `streak` × 1.0 (γ = 8, 2 DeepSpeed processes, ZeRO 0, full fine-tuning)" in card
    assert "greedy streak 1.54" in card and "on 8 held-out prompts 2.26" in card
    assert "align train recipe.yaml --num_gpus N" in card and "align export x" in card


@pytest.mark.parametrize("config, loader, fill", [
    ({"model_type": "llama", "drafter_spec": {"mask_token_id": 2}}, "AutoModelForCausalLM.from_pretrained(\"THIS_FOLDER\", dtype=torch.float32)",
     "with `mask_token_id`"),
    ({"model_type": "Dream", "auto_map": {"AutoModel": "modeling_dream.DreamModel"}, "drafter_spec": {}},
     "AutoModel.from_pretrained(\"THIS_FOLDER\", trust_remote_code=True, dtype=torch.float32)", "with `mask_token_id`"),
    ({"model_type": "diffusion_gemma", "drafter_spec": {"noise": "uniform"}},
     "AutoModelForImageTextToText.from_pretrained(\"THIS_FOLDER\", dtype=torch.float32)", "one fixed uniform random draw"),
    ({"model_type": "align_dflash", "drafter_spec": {"kind": "dflash"}}, "AutoModel.from_pretrained(\"THIS_FOLDER\", dtype=torch.float32)",
     "export.format=speculators"),
])
def test_card_loads_each_family_with_the_class_that_has_its_lm_head(config, loader, fill):
    from align.recipe_files import load_recipe
    from align.cards import model_card

    card = model_card(config, {}, None, load_recipe(None, []), "align export x", "ck/base")
    assert f"drafter = {loader}" in card and fill in card


# --------------------------------------------------------------------------------------------------------------------
# the card carries the exported drafter's own rows, from whatever folder export runs in (#22 defect 6)
# --------------------------------------------------------------------------------------------------------------------
def perturbed_copy(source: Path, dest: Path, scale: float) -> Path:
    """A copy of a drafter folder with its weights changed (another drafter: its τ differs)."""
    shutil.copytree(source, dest)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale * p.std().clamp_min(1e-3))
    model.save_pretrained(dest)
    record_checksums(dest)  # as align's own save records them: other weights, intact
    return dest


def verifier_as_drafter(root: Path, dest: Path) -> Path:
    """The toy verifier's weights read as a shifted block-causal drafter: its first draft token is the verifier's own
    next token, so its τ is well above the toy drafter-base's."""
    shutil.copytree(root / "ck" / "verifier", dest)
    config = json.loads((dest / "config.json").read_text())
    spec = json.loads((root / "ck" / "drafter-base" / "config.json").read_text())["drafter_spec"]
    config["drafter_spec"] = {**spec, "logits_shift": 1, "attention": "block_causal"}
    (dest / "config.json").write_text(json.dumps(config))
    return dest


@pytest.fixture(scope="module")
def compared(toy_family, tmp_path_factory):
    """An eval run inside `run/` with relative paths, as a user runs it: drafter.path `base`, and
    eval.compare_drafters {aligned: aligned}, a drafter whose τ differs."""
    root, _ = toy_family
    tmp = tmp_path_factory.mktemp("compared")
    run = tmp / "run"
    run.mkdir()
    # The base: the toy drafter with its weights scrambled, whose τ stays low even when the toy verifier, trained for a
    # time budget, comes out degenerate (one token over and over, which any trained drafter predicts).
    perturbed_copy(root / "ck" / "drafter-base", run / "base", 3.0)
    verifier_as_drafter(root, run / "aligned")
    here = os.getcwd()
    os.chdir(run)
    try:
        assert main(["eval", str(ROOT / "recipes/tiny/eval.yaml"), f"verifier.path={root / 'ck' / 'verifier'}",
                     "drafter.path=base", "eval.compare_drafters={aligned: aligned}", f"data.dir={root / 'data'}",
                     f"ar_drafter.path={root / 'ck' / 'ar-drafter'}", "eval.out=eval", "eval.num_prompts=2",
                     "decode.max_new_tokens=8", "eval.warmup=0", "eval.methods=[specdiff]",
                     "eval.sampling_temperature=0"]) == 0
    finally:
        os.chdir(here)
    methods = json.loads((run / "eval" / "eval.json").read_text())["methods"]
    assert methods["specdiff"]["tau"] != methods["specdiff@aligned"]["tau"]
    return root, tmp


def export_from(cwd: Path, root: Path, drafter: str, out: Path, evaluation: Path) -> int:
    here = os.getcwd()
    os.chdir(cwd)
    try:
        return main(["export", str(ROOT / "recipes/tiny/align.yaml"), f"verifier.path={root / 'ck' / 'verifier'}",
                     f"drafter.path={drafter}", f"data.dir={root / 'data'}", f"export.out={out}",
                     f"export.eval={evaluation}"])
    finally:
        os.chdir(here)


@pytest.mark.parametrize("given", ["absolute", "relative from another folder", "a copy elsewhere"])
def test_the_card_carries_the_exported_drafters_rows_from_any_folder(compared, tmp_path, given):
    root, tmp = compared
    run = tmp / "run"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    drafter = {"absolute": str(run / "aligned"), "relative from another folder": os.path.relpath(run / "aligned",
                                                                                                  elsewhere),
               "a copy elsewhere": str(shutil.copytree(run / "aligned", tmp_path / "moved"))}[given]
    assert export_from(elsewhere, root, drafter, tmp_path / "out", run / "eval" / "eval.json") == 0
    methods = json.loads((run / "eval" / "eval.json").read_text())["methods"]
    aligned, base = methods["specdiff@aligned"], methods["specdiff"]
    card = (tmp_path / "out" / "README.md").read_text()
    assert "τ with `base` |" in card  # the base's column
    assert f"| specdiff | {aligned['tau']:.2f} | {aligned['speedup']:.2f}× | {aligned['exact_match']} | " \
           f"{base['tau']:.2f} |" in card
    metrics = metadata_load(tmp_path / "out" / "README.md")["model-index"][0]["results"][0]["metrics"]
    assert metrics[0]["value"] == round(aligned["tau"], 4)


def test_the_base_exported_from_another_folder_has_its_plain_rows(compared, tmp_path):
    root, tmp = compared
    run = tmp / "run"
    assert export_from(tmp_path, root, str(run / "base"), tmp_path / "out", run / "eval" / "eval.json") == 0
    base = json.loads((run / "eval" / "eval.json").read_text())["methods"]["specdiff"]
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"| specdiff | {base['tau']:.2f} |" in card and "τ with" not in card


@pytest.mark.parametrize("case", ["another drafter", "trained further since the eval", "an old eval.json elsewhere"])
def test_an_eval_without_rows_for_the_exported_drafter_is_refused(compared, tmp_path, case, capsys):
    # Before any work: nothing is written, one line says why, exit 2.
    root, tmp = compared
    run = tmp / "run"
    evaluation = run / "eval" / "eval.json"
    drafter = run / "aligned"
    if case == "another drafter":
        drafter = perturbed_copy(root / "ck" / "drafter-base", tmp_path / "other", 0.2)
    elif case == "trained further since the eval":  # the same folder, other weights: the eval measured the old ones
        perturbed_copy(run / "aligned", tmp_path / "perturbed", 0.1)
        weights = (run / "aligned" / "model.safetensors").read_bytes()
        shutil.copy2(tmp_path / "perturbed" / "model.safetensors", run / "aligned" / "model.safetensors")
        record_checksums(run / "aligned", ["model.safetensors"])
    else:  # schema 2 names drafters by the paths as given, which only resolve in the folder the eval ran in
        old = json.loads(evaluation.read_text())
        del old["meta"]["drafters"]
        evaluation = tmp_path / "old-eval.json"
        evaluation.write_text(json.dumps(old))
    capsys.readouterr()
    try:
        assert export_from(tmp_path, root, str(drafter), tmp_path / "out", evaluation) == 2
    finally:
        if case == "trained further since the eval":
            (run / "aligned" / "model.safetensors").write_bytes(weights)
            record_checksums(run / "aligned", ["model.safetensors"])
    err = capsys.readouterr().err.strip()
    assert "has no rows for the exported drafter" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_eval_json_names_each_drafter_so_that_it_resolves_from_anywhere(compared):
    from align.checkpoint import weights_sha256

    _, tmp = compared
    run = tmp / "run"
    meta = json.loads((run / "eval" / "eval.json").read_text())["meta"]
    assert meta["drafters"] == [
        {"rows": "", "path": "base", "resolved": str((run / "base").resolve()),
         "weights_sha256": weights_sha256(run / "base")},
        {"rows": "@aligned", "path": "aligned", "resolved": str((run / "aligned").resolve()),
         "weights_sha256": weights_sha256(run / "aligned")}]
    assert weights_sha256(run / "base") == hashlib.sha256((run / "base" / "model.safetensors").read_bytes()).hexdigest()
    assert meta["exact_match_semantics"]["dtype"] == "float32" and meta["exact_match_semantics"]["device"] == "cpu"


def test_a_speculators_export_carries_the_draft_tokens_chosen_for_serving(tmp_path, capsys):
    """export.num_speculative_tokens is written where `vllm serve <folder>` reads it (the first proposal method's
    speculative_tokens) and into the card's commands; more than a block drafts, or on an align-format export, is
    refused in one line before anything is written."""
    from align.checkpoint import save_merged
    from align.config import DFlashSection, VerifierSection
    from align.drafters.loading import new_dflash_drafter
    from align.models import load_tokenizer

    verifier = str(ROOT / "checkpoints" / "tiny" / "verifier")
    tokenizer = load_tokenizer(verifier)
    torch.manual_seed(0)
    section = VerifierSection(path=verifier, device="cpu", dtype="float32")
    drafter, _ = new_dflash_drafter(section, DFlashSection(aux_layer_ids=[1]), section, tokenizer.mask_token_id, 4)
    save_merged(drafter, tokenizer, tmp_path / "step_1", {})  # blocks of 5: 4 draft tokens
    common = ["recipes/tiny/dflash.yaml", f"verifier.path={verifier}", f"drafter.path={tmp_path / 'step_1'}",
              "export.format=speculators"]

    assert main(["export", *common, f"export.out={tmp_path / 'two'}", "export.num_speculative_tokens=2"]) in (0, None)
    config = json.loads((tmp_path / "two" / "config.json").read_text())
    assert config["block_size"] == 5 and config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2
    card = (tmp_path / "two" / "README.md").read_text()
    assert card.count('"num_speculative_tokens": 2') == 2 and "2 draft tokens a step of the 4" in card
    assert main(["export", *common, f"export.out={tmp_path / 'all'}"]) in (0, None)
    config = json.loads((tmp_path / "all" / "config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert "draft tokens a step of the" not in (tmp_path / "all" / "README.md").read_text()

    capsys.readouterr()
    for extra, said in [(["export.num_speculative_tokens=5"], "export.num_speculative_tokens: 5, but the drafter's "
                                                               "blocks draft 4 tokens"),
                        (["export.num_speculative_tokens=2", "export.format=align"], "format=speculators"),
                        (["export.num_speculative_tokens=0"], "export.num_speculative_tokens")]:
        assert main(["export", *common, f"export.out={tmp_path / 'refused'}", *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert said in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "refused").exists()
