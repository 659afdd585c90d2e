"""`align export`: a Hub-ready folder for an aligned drafter, with the numbers that justify it; optionally pushed.

The folder holds the merged weights, `config.json` with the DrafterSpec under `drafter_spec`, the tokenizer,
`draft_graph.json` when a Spiffy graph was calibrated, `eval.json`, and a model card whose table comes from eval.json.
It loads with `transformers` alone. Pushing uses `huggingface_hub`; the local folder is written first and kept
whatever happens to the upload.

The card is written by align/cards.py, and nothing in the folder names a path of the machine that exported it
(align/provenance.py: a model from the Hub is named by its id, a local one by its manifest, and the run records' paths
are cut to what a reader can use).
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Optional

from align.cards import check_eval_rows, licence, model_card, ships_custom_generate, speculators_card
from align.checkpoint import ADAPTER_CONFIG, ADAPTER_WEIGHTS, BASE_RECORD, adapter_base, is_adapter_folder
from align.config import ExportSection, Recipe, RecipeError
from align.disk import CHECKSUMS, MARKER, atomic_folder, non_finite_weights
from align.drafters.kind import TrainedDrafter
from align.hub import hub_offline
from align.preflight import check_file, check_inputs, drafter_kind, load_model_config, model_section, read_eval
from align.provenance import Origin, origin, scrub, scrub_folder

EXIT_UPLOAD_FAILED = 1


def hub_token() -> Optional[str]:
    from huggingface_hub import get_token

    return get_token()


def check_push(recipe: Recipe) -> None:
    """Refuse a push that cannot happen, or whose card could not name its verifier, before any work."""
    if recipe.export.push_to_hub is None:
        return
    if hub_offline():
        raise RecipeError("export.push_to_hub: the Hub is offline (HF_HUB_OFFLINE=1); unset it to push")
    if not hub_token():
        raise RecipeError("export.push_to_hub: no Hugging Face token: set HF_TOKEN or run `hf auth login`")
    if recipe.export.format == "speculators" and recipe.export.verifier_hub_id is None \
            and origin(recipe.verifier.path).hub_id is None:
        # A speculators config names the verifier vLLM serves the drafter with: a local folder's name would leave
        # the Hub's readers nothing to load (the align format's card shows a placeholder for the reader's copy).
        raise RecipeError(f"export.verifier_hub_id: the verifier ({recipe.verifier.path}) is a local folder with no "
                          "Hub id on record; name the Hub model it is (export.verifier_hub_id=org/name) to push")


def model_folder(path: str) -> Path:
    """A model's files on this machine: `path` itself, or the Hub snapshot of an id (downloaded unless offline)."""
    if Path(path).is_dir():
        return Path(path)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(path, local_files_only=hub_offline()))


def copy_run_records(recipe: Recipe, source: Path, tmp: Path) -> tuple[Optional[dict[str, Any]], dict[str, Any]]:
    """Copy export.eval (as eval.json) and the training run's resolved recipe (as recipe.yaml) into the folder;
    return the evaluation and the checkpoint's meta.json (empty when the drafter was not trained by align)."""
    evaluation = None
    if recipe.export.eval:
        evaluation = json.loads(Path(recipe.export.eval).read_text())
        shutil.copy2(recipe.export.eval, tmp / "eval.json")
    meta = json.loads((source / "meta.json").read_text()) if (source / "meta.json").is_file() else {}
    if meta.get("recipe"):
        import yaml

        (tmp / "recipe.yaml").write_text(yaml.safe_dump(scrub(meta["recipe"]), sort_keys=False, allow_unicode=True))
    return evaluation, meta


def build_folder(recipe: Recipe, command: str, out: Path) -> None:
    """Write the export folder atomically: a previous export stays until the new one is complete."""
    source = model_folder(recipe.drafter.path)  # a Hub id's files are in the Hub cache
    if is_adapter_folder(source):  # a LoRA step_<N>/ of align train: exported merged, once its base is checked
        adapter_base(source)
    elif (source / ADAPTER_CONFIG).is_file():
        raise RecipeError(f"drafter.path: {source} is a LoRA adapter align did not write (no {BASE_RECORD}); merge it "
                          "into its base and export that folder")
    poisoned = non_finite_weights(source)  # align train never saves such weights; a folder from elsewhere may hold them
    if poisoned:
        raise RecipeError(f"drafter.path: {poisoned} holds NaN or infinite weights; a Hub folder of it would decode "
                          "garbage: export a checkpoint with finite weights")
    with atomic_folder(out, "export") as tmp:
        if recipe.export.format == "speculators":
            fill_speculators_folder(recipe, command, source, tmp)
        else:
            fill_folder(recipe, command, source, tmp)
        if recipe.decode.suffix_corpus is not None:
            # SuffixDecoding's index over the verifier's trajectories travels with the drafter it was measured with:
            # decode.suffix_corpus=<the export> runs the suffix methods without the trajectories.
            from align.methods import suffix_index

            suffix_index(recipe).save(tmp)
        scrub_folder(tmp)  # the run records and loading hints name this machine's paths


def fill_speculators_folder(recipe: Recipe, command: str, source: Path, tmp: Path) -> None:
    """A DFlash drafter as speculators saves one: config.json (speculators_config, aux_hidden_state_layer_ids,
    mask_token_id, block_size), model.safetensors under vLLM's qwen3_dflash weight names with the verifier's
    embeddings and LM head copied in, the tokenizer, and a card that says how to serve it."""
    from align.drafters.speculators_format import write_speculators_folder
    from align.drafters.dflash import is_dflash
    from align.drafters.loading import load_drafter
    from align.models import load_tokenizer, load_verifier

    tokenizer = load_tokenizer(str(source))
    drafter, _ = load_drafter(recipe.drafter, tokenizer)
    if not is_dflash(drafter):
        raise RecipeError(f"export.format: speculators takes a DFlash drafter; {source} is a standalone diffusion "
                          "drafter (export.format=align)")
    # The config names its verifier: by export.verifier_hub_id when set (a local verifier's path is cut to its
    # folder's name with the machine's other paths).
    config = write_speculators_folder(drafter, load_verifier(recipe.verifier),
                                      recipe.export.verifier_hub_id or recipe.verifier.path, tokenizer, tmp,
                                      recipe.export.num_speculative_tokens)
    evaluation, meta = copy_run_records(recipe, source, tmp)
    (tmp / "README.md").write_text(speculators_card(config, meta, evaluation, recipe, command))
    copy_licence_file(recipe, origin(recipe.verifier.path), tmp)


def write_merged_weights(recipe: Recipe, source: Path, tmp: Path) -> None:
    """The LoRA checkpoint `source` merged into its base, in the checkpoint's dtype, as a standalone model's weights
    in `tmp` (Hub users load the export with transformers alone)."""
    from align.checkpoint import _tied_keys_as_mapping, adapter_dtype
    from align.models import load_ar_drafter

    dtype = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}[adapter_dtype(source)]
    model = load_ar_drafter(recipe.drafter.model_copy(update={"device": "cpu", "dtype": dtype}))  # merged on load
    _tied_keys_as_mapping(model)
    model.save_pretrained(tmp)


def fill_folder(recipe: Recipe, command: str, source: Path, tmp: Path) -> None:
    from align.drafters.spec import drafter_spec_from_config
    from align.models import load_tokenizer

    # meta.json becomes the card; the checksums (checked when read) would no longer match the files written here
    adapter = is_adapter_folder(source)
    shutil.copytree(source, tmp, ignore=shutil.ignore_patterns("meta.json", CHECKSUMS, "*.tmp", MARKER, *(
        (ADAPTER_CONFIG, ADAPTER_WEIGHTS, BASE_RECORD) if adapter else ())), dirs_exist_ok=True)
    if adapter:
        write_merged_weights(recipe, source, tmp)
    config = json.loads((tmp / "config.json").read_text())
    updates = {}  # what config.json gains here, written once
    if "drafter_spec" not in config:
        from transformers import AutoConfig

        remote = recipe.drafter.trust_remote_code  # Dream, DiffuCoder, LLaDA: their config class ships with them
        spec = drafter_spec_from_config(AutoConfig.from_pretrained(source, trust_remote_code=remote),
                                        load_tokenizer(str(source), remote),
                                        recipe.drafter.mask_token_id, recipe.drafter.logits_shift,
                                        recipe.drafter.attention)
        updates["drafter_spec"] = spec.to_dict()
    if config.get("auto_map"):
        # Dream, DiffuCoder, LLaDA: their code needs align's shims under transformers 5; the folder carries them
        from align.remote_code import write_loader

        updates["auto_map"] = write_loader(tmp, config["auto_map"])
    if updates:
        config.update(updates)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
    if recipe.calibrate.graph:
        shutil.copy2(recipe.calibrate.graph, tmp / "draft_graph.json")
    if ships_custom_generate(config):
        # transformers' Hub mechanism for decoding loops: SpecDiff from this folder with transformers alone.
        (tmp / "custom_generate").mkdir()
        shutil.copy2(Path(__file__).parents[1] / "custom_generate.py", tmp / "custom_generate" / "generate.py")
    evaluation, meta = copy_run_records(recipe, source, tmp)
    # A DFlash drafter was built on the verifier (meta.json's drafter_base is None): that is its base.
    base_model = meta.get("drafter_base") or TrainedDrafter.of(recipe).card_base
    (tmp / "README.md").write_text(model_card(config, meta, evaluation, recipe, command, base_model))
    copy_licence_file(recipe, origin(base_model), tmp)


def copy_licence_file(recipe: Recipe, base: Origin, tmp: Path) -> None:
    """A licence `other` whose link is a file of a local base (`license_link: LICENSE`): the file comes along, so
    that the card's link resolves in the exported repo."""
    chosen = licence(recipe, base)
    if chosen.link and not re.match(r"^[a-z]+://", chosen.link) and base.folder and not (tmp / chosen.link).exists():
        text = base.folder / chosen.link
        if text.is_file() and text.resolve().is_relative_to(base.folder.resolve()):
            shutil.copy2(text, tmp / chosen.link)


def push(folder: Path, recipe: Recipe) -> None:
    from huggingface_hub import HfApi

    e = recipe.export
    api = HfApi()
    api.create_repo(e.push_to_hub, private=e.private, exist_ok=True)
    if e.revision != "main":
        api.create_branch(e.push_to_hub, branch=e.revision, exist_ok=True)
    # The marker says the local folder is an export align may replace; it means nothing on the Hub.
    api.upload_folder(folder_path=str(folder), repo_id=e.push_to_hub, revision=e.revision,
                      commit_message=e.commit_message, ignore_patterns=[MARKER])


def models(recipe: Recipe) -> tuple[str, ...]:
    return ("drafter.path", *(("verifier.path",) if recipe.export.format == "speculators" else ()))


def check(recipe: Recipe) -> None:
    """`align export`'s checks beyond its models' (only configs and the files named are read): a speculators export
    takes a DFlash drafter; export.eval is an eval.json of speculative methods (the card's table reads τ and speedup);
    the checkpoint's meta.json, when there, is readable; calibrate.graph is a draft graph."""
    if recipe.export.push_to_hub is None:  # push settings without a push would be ignored without a word
        for key in ("revision", "commit_message"):
            if getattr(recipe.export, key) != ExportSection.model_fields[key].default:
                raise RecipeError(f"export.{key}: set, but nothing is pushed (no export.push_to_hub, --push-to-hub "
                                  "org/name): the folder is written locally only")
    if recipe.export.format == "speculators" and drafter_kind(recipe) != "dflash":
        raise RecipeError(f"export.format: speculators takes a DFlash drafter; {recipe.drafter.path} is a standalone "
                          "diffusion drafter (export.format=align)")
    tokens = recipe.export.num_speculative_tokens
    if tokens is not None:
        block_size = load_model_config("drafter.path", model_section(recipe, "drafter.path")).block_size
        if tokens > block_size - 1:
            raise RecipeError(f"export.num_speculative_tokens: {tokens}, but the drafter's blocks draft "
                              f"{block_size - 1} tokens (block_size {block_size}); set {block_size - 1} or fewer")
    if recipe.export.eval is not None:
        read_eval(recipe.export.eval, "export.eval", ("tau", "speedup"))
    # The training run's records beside a checkpoint go into the card (its recipe, base model, final τ).
    meta = Path(recipe.drafter.path) / "meta.json"
    if meta.is_file():
        try:
            readable = isinstance(json.loads(meta.read_text(encoding="utf-8")), dict)
        except (OSError, UnicodeDecodeError, ValueError):
            readable = False
        if not readable:
            raise RecipeError(f"drafter.path: {meta} is not a JSON object (align train writes it with each "
                              "checkpoint); restore it, or delete it to export without the run's records")
    if recipe.calibrate.graph is not None:
        from align.draft_graph import DraftGraph, check_graph_drafter

        graph = DraftGraph.load(Path(recipe.calibrate.graph))
        check_graph_drafter(graph, recipe.calibrate.graph, recipe.drafter.path)
    if recipe.decode.suffix_corpus is not None:
        from align.methods import check_suffix_corpus

        check_suffix_corpus(recipe)


def main(recipe: Recipe, command: str) -> None:
    # The speculators format carries the verifier's embeddings and LM head, and names it as the drafter's verifier.
    speculators = ("verifier.path",) if recipe.export.format == "speculators" else ()
    check_inputs(recipe, model_keys=("drafter.path", *speculators))
    check_file("calibrate.graph", recipe.calibrate.graph)
    check_file("export.eval", recipe.export.eval)
    check_eval_rows(recipe)
    check_push(recipe)
    out = Path(recipe.export.out)
    build_folder(recipe, command, out)
    print(f"export: {out}")
    if recipe.export.push_to_hub is None:
        return
    try:
        push(out, recipe)
    except Exception as e:  # the upload can fail in many ways (network, permissions, quota); all end the same way
        print(f"align export: upload to {recipe.export.push_to_hub} failed ({type(e).__name__}: "
              f"{str(e).splitlines()[0] if str(e) else ''}); the folder {out} is intact: rerun the same command to "
              "retry", file=sys.stderr)
        raise SystemExit(EXIT_UPLOAD_FAILED) from None
    print(f"export: pushed to {recipe.export.push_to_hub} ({recipe.export.revision})")
