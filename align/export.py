"""`align export`: a Hub-ready folder for an aligned drafter, with the numbers that justify it; optionally pushed.

The folder holds the merged weights, `config.json` with the DrafterSpec under `drafter_spec`, the tokenizer,
`draft_graph.json` when a Spiffy graph was calibrated, `eval.json`, and a model card whose table comes from eval.json.
It loads with `transformers` alone. Pushing uses `huggingface_hub`; the local folder is written first and kept
whatever happens to the upload.

The card's metadata is written with huggingface_hub's `ModelCardData` (base model, licence, datasets, `model-index`
with the measured τ and speedup), and nothing in the folder names a path of the machine that exported it: a model
that came from the Hub is named by its id, a local one by its manifest (what built it, its hashes), a local file by
its name and sha256, and the run records' paths are cut to what a reader can use (`scrub`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from align.checkpoint import CHECKSUMS, MARKER, atomic_folder, non_finite_weights
from align.config import HUB_LICENSES, Recipe, RecipeError
from align.families import CANVAS_DECODER_FAMILIES
from align.hub import hub_offline, hub_snapshot, is_hub_id
from align.preflight import check_file, check_inputs

EXIT_UPLOAD_FAILED = 1


def hub_token() -> Optional[str]:
    from huggingface_hub import get_token

    return get_token()


def check_push(recipe: Recipe) -> None:
    """Refuse a push that cannot happen, before any work."""
    if recipe.export.push_to_hub is None:
        return
    if hub_offline():
        raise RecipeError("export.push_to_hub: the Hub is offline (HF_HUB_OFFLINE=1); unset it to push")
    if not hub_token():
        raise RecipeError("export.push_to_hub: no Hugging Face token: set HF_TOKEN or run `hf auth login`")


# --------------------------------------------------------------------------------------------------------------------
# where the models and data came from, as a card may say it (never a path of this machine)
# --------------------------------------------------------------------------------------------------------------------
HUB = "https://huggingface.co"
# A Hub cache snapshot (HF_HUB_CACHE/models--org--name/snapshots/<commit>): the folder of a model loaded by id.
_SNAPSHOT = re.compile(r"(?:^|/)(models|datasets)--([^/]+?)--([^/]+)/snapshots/[^/]+")


@dataclass(frozen=True)
class Origin:
    """A model as the card names it: `hub_id` when it came from the Hub; otherwise `name` (its manifest's part, or its
    folder's basename) and `described` (what its manifest says built it). `folder`: its files on this machine (a
    local folder or a Hub cache snapshot), only to read its licence; never written anywhere."""

    hub_id: Optional[str]
    name: str
    described: str
    folder: Optional[Path]

    @property
    def short(self) -> str:
        return self.hub_id.split("/")[-1] if self.hub_id else self.name

    def markdown(self) -> str:
        """A short mention: a link to its Hub page, or its name (`described` says the rest, once per card)."""
        return f"[{self.hub_id}]({HUB}/{self.hub_id})" if self.hub_id else f"`{self.name}`"


def snapshot_hub_id(path: str) -> Optional[str]:
    m = _SNAPSHOT.search(Path(path).as_posix())
    return f"{m.group(2)}/{m.group(3)}" if m else None


def origin(path: str) -> Origin:
    """Who `path` (a model's recipe path: a local folder or a Hub id) is. A local folder built by align is cited by
    its manifest.json (the command and recipe that built it, the hashes of its settings and corpus) and, when that
    manifest records one, by the Hub id it came from."""
    local = Path(path)
    if not local.is_dir():
        if is_hub_id(path):
            return Origin(path, path, f"[{path}]({HUB}/{path})", hub_snapshot(path))
        return Origin(None, local.name or path, f"`{local.name or path}`", None)
    hub_id = snapshot_hub_id(str(local.resolve()))
    manifest = {}
    if (local / "manifest.json").is_file():
        try:
            manifest = json.loads((local / "manifest.json").read_text())
        except ValueError:
            manifest = {}
    hub_id = hub_id or next((manifest[k] for k in ("hub_id", "base_model", "source") if isinstance(manifest.get(k), str)
                             and is_hub_id(manifest[k])), None)
    name = str(manifest.get("part") or local.resolve().name)
    if hub_id:
        return Origin(hub_id, name, f"[{hub_id}]({HUB}/{hub_id})", local)
    if manifest:
        facts = [f"built by `{scrub_text(manifest['command'])}`" if manifest.get("command") else "",
                 f"recipe `{manifest['recipe']}`" if manifest.get("recipe") else "",
                 *(f"{label} `{manifest[key]}`" for key, label in
                   (("config_hash", "settings hash"), ("corpus_hash", "corpus sha256"))
                   if manifest.get(key)),
                 f"{manifest['parameters']:,} parameters" if isinstance(manifest.get("parameters"), int) else ""]
        described = f"`{name}`, a local model ({', '.join(f for f in facts if f)}; from its manifest.json)"
    else:
        architectures = _architectures(local)
        described = f"`{name}`, a local model" + (f" ({architectures})" if architectures else "") + " with no manifest"
    return Origin(None, name, described, local)


def _architectures(folder: Path) -> str:
    try:
        return ", ".join(json.loads((folder / "config.json").read_text()).get("architectures") or [])
    except (OSError, ValueError):
        return ""


def model_folder(path: str) -> Path:
    """A model's files on this machine: `path` itself, or the Hub snapshot of an id (downloaded unless offline)."""
    if Path(path).is_dir():
        return Path(path)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(path, local_files_only=hub_offline()))


# --------------------------------------------------------------------------------------------------------------------
# the licence, inherited from the base model
# --------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Licence:
    license: str
    name: Optional[str]
    link: Optional[str]
    why: str  # one sentence for the card: where the licence comes from

    def card_line(self) -> str:
        """The card's "Models and data" line on the licence."""
        return f"- Licence: `{self.license}`" + (f" ({self.name}, {self.link})" if self.name else "") + f", {self.why}"


def card_metadata(base: Origin) -> Optional[dict[str, Any]]:
    """The front matter of the base model's README.md: in its folder, in the Hub cache, or (online) from the Hub."""
    from huggingface_hub import metadata_load, try_to_load_from_cache

    readme = base.folder / "README.md" if base.folder else None
    if (readme is None or not readme.is_file()) and base.hub_id:
        cached = try_to_load_from_cache(base.hub_id, "README.md")
        readme = Path(cached) if isinstance(cached, str) else None
        if readme is None and not hub_offline():
            from huggingface_hub import hf_hub_download

            try:
                readme = Path(hf_hub_download(base.hub_id, "README.md"))
            except Exception:  # no README, a gated or private repo, no network: the licence stays unknown
                readme = None
    if readme is None or not readme.is_file():
        return None
    try:
        return metadata_load(readme) or {}
    except Exception:  # front matter that is not YAML: treated as none
        return {}


def licence(recipe: Recipe, base: Origin) -> Licence:
    """export.license when the recipe sets one; otherwise the base model's (its card's `license`, with
    `license_name`/`license_link` for `other`); otherwise `unknown`, said so in the card: a licence is not guessed."""
    e = recipe.export
    if e.license is not None:
        return Licence(e.license, e.license_name, e.license_link, "set by the export recipe (`export.license`).")
    metadata = card_metadata(base)
    found = (metadata or {}).get("license")
    if isinstance(found, list):
        found = found[0] if len(found) == 1 else None
    if isinstance(found, str) and found in HUB_LICENSES and found != "unknown":
        link = metadata.get("license_link")
        if isinstance(link, str) and not re.match(r"^[a-z]+://", link) and base.hub_id:
            link = f"{HUB}/{base.hub_id}/blob/main/{link}"  # the base's own LICENSE file, not a copy here
        name = metadata.get("license_name") if found == "other" else None
        if found == "other" and not (name and isinstance(link, str)):
            return Licence("unknown", None, None, f"unknown: the base model {base.markdown()} says `other` without "
                           "license_name and license_link, so this card cannot say which; set `export.license`.")
        return Licence(found, name, link if found == "other" else None,
                       f"inherited from the base model {base.markdown()} (its model card's `license`).")
    if isinstance(found, str) and found != "unknown" and base.hub_id:
        # A licence id the Hub added after align's list: kept by name, linked to the base's card, which shows it.
        link = metadata.get("license_link")
        link = link if isinstance(link, str) and re.match(r"^[a-z]+://", link) else f"{HUB}/{base.hub_id}"
        slug = re.sub(r"[^a-z0-9.-]+", "-", found.lower()).strip("-.") or "base-model-license"
        return Licence("other", slug, link, f"inherited from the base model {base.markdown()}, whose card says "
                       f"`{found}` (not in align's list of Hub licence ids, so written as `other`).")
    if isinstance(found, str) and found != "unknown":
        return Licence("unknown", None, None, f"unknown: the base model {base.markdown()} says `{found}`, which is "
                       "not a Hub licence id; set `export.license` to choose.")
    where = "states no licence (its model card has no `license`)" if metadata is not None else "has no model card"
    return Licence("unknown", None, None,
                   f"unknown: the base model {base.markdown()} {where}, and the export recipe sets none, so this card "
                   "does not guess one. Set `export.license` (a Hub licence id) to choose.")


# --------------------------------------------------------------------------------------------------------------------
# data sets and measurements
# --------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DataSource:
    hub_id: Optional[str]  # a Hub dataset id, for the card's `datasets`
    name: str
    described: str


def data_source(value: Optional[str], default: str) -> DataSource:
    """A prompt source as the card names it: a Hub dataset id stays; a local file becomes its name and sha256."""
    if not value or value == default:
        return DataSource(None, default, default)
    local = Path(value)
    if local.is_file():
        with local.open("rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()  # in chunks: prompt files can be large
        return DataSource(None, local.name, f"`{local.name}` (a local file, sha256 `{digest}`)")
    if local.is_dir():
        return DataSource(None, local.resolve().name, f"`{local.resolve().name}` (a local dataset folder)")
    if is_hub_id(value):
        return DataSource(value, value, f"[{value}]({HUB}/datasets/{value})")
    return DataSource(None, local.name, f"`{local.name}` (a local file, not found at export)")


def hardware(machine: dict[str, Any]) -> str:
    """Where eval.json's numbers were measured: the accelerator when one ran them, else the CPU model."""
    device = str(machine.get("device") or "")
    gpu = next((machine[k] for k in ("gpu_name", "gpu") if machine.get(k)), None)
    cpu = next((machine[k] for k in ("cpu_model", "cpu", "processor") if machine.get(k)), None) or "?"
    if gpu and not device.startswith("cpu"):
        return str(gpu)
    return f"{cpu}" + (f", {machine['torch_threads']} threads" if machine.get("torch_threads") else "")


def recorded_drafters(evaluation: dict[str, Any]) -> list[dict[str, Any]]:
    """The drafters eval.json has rows for (meta.drafters, schema 3): {rows ("" or "@<label>"), path, resolved,
    weights_sha256}. An older file names them only by the paths the recipe gave (meta.drafter, meta.compare_drafters),
    read as they are, against this folder."""
    meta = evaluation.get("meta") or {}
    if isinstance(meta.get("drafters"), list):
        return meta["drafters"]
    return ([{"rows": "", "path": meta["drafter"]}] if meta.get("drafter") else []) + [
        {"rows": f"@{label}", "path": path} for label, path in (meta.get("compare_drafters") or {}).items()]


_WEIGHTS_SHA256: dict[tuple, Optional[str]] = {}


def exported_weights_sha256(drafter_path: str) -> Optional[str]:
    """drafter_identity's weights_sha256 of the exported drafter, hashed once per state of its files (the card's
    functions each ask)."""
    from align.checkpoint import drafter_identity

    folder = Path(drafter_path)
    key = (str(folder.resolve()), tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns)
                                        for f in sorted(folder.glob("*")) if f.is_file())) if folder.is_dir() else (
        drafter_path,)
    if key not in _WEIGHTS_SHA256:
        _WEIGHTS_SHA256[key] = drafter_identity(drafter_path)["weights_sha256"]
    return _WEIGHTS_SHA256[key]


def drafter_suffix(evaluation: dict[str, Any], drafter_path: str) -> Optional[str]:
    """Which of eval.json's rows measured the exported drafter: "" for its plain rows (it was the eval's drafter.path),
    `@<label>` for eval.compare_drafters' `<method>@<label>` rows, None when none did. Where eval.json recorded the
    weights' sha256 they decide (a moved or copied folder is the same drafter; a folder trained further since is
    not); else the resolved path (schema 3's absolute one; an older file's path as given, against this folder)."""
    for entry in recorded_drafters(evaluation):
        if entry.get("weights_sha256"):
            if entry["weights_sha256"] == exported_weights_sha256(drafter_path):
                return entry["rows"]
        elif _same_model(entry.get("resolved") or entry.get("path"), drafter_path):
            return entry["rows"]
    return None


def _same_model(recorded: Optional[str], path: str) -> bool:
    if not recorded:
        return False
    if is_hub_id(recorded) and not Path(recorded).is_dir():
        return recorded == path
    return Path(recorded).expanduser().resolve() == Path(path).expanduser().resolve()


def check_eval_rows(recipe: Recipe) -> None:
    """Refuse, before any work, an export.eval without rows of the exported drafter: its card would carry another
    drafter's numbers as this one's."""
    if not recipe.export.eval:
        return
    try:
        evaluation = json.loads(Path(recipe.export.eval).read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise RecipeError(f"export.eval: {recipe.export.eval} is not JSON ({type(e).__name__}); give the eval.json "
                          "that align eval wrote") from None
    if not isinstance(evaluation, dict) or not isinstance(evaluation.get("methods"), dict):
        raise RecipeError(f"export.eval: {recipe.export.eval} is not an eval.json of align eval (no `methods`)")
    if drafter_suffix(evaluation, recipe.drafter.path) is None:
        measured = ", ".join(f"{e.get('path')} ({'drafter.path' if not e['rows'] else 'eval.compare_drafters.' + e['rows'][1:]})"
                             for e in recorded_drafters(evaluation)) or "no diffusion drafter"
        raise RecipeError(f"export.eval: {recipe.export.eval} has no rows for the exported drafter "
                          f"{recipe.drafter.path} (it measured {measured}); run align eval with it as drafter.path or "
                          "in eval.compare_drafters")


def _rows_of(evaluation: dict[str, Any], drafter_path: str) -> str:
    """drafter_suffix, refused when None (export checked it before any work: check_eval_rows)."""
    suffix = drafter_suffix(evaluation, drafter_path)
    if suffix is None:
        raise RecipeError(f"eval.json has no rows for the exported drafter {drafter_path}")
    return suffix


def drafter_rows(evaluation: dict[str, Any], drafter_path: str) -> dict[str, dict[str, Any]]:
    """eval.json's rows of the exported drafter by method name: its own (`specdiff@<label>`) when eval.json compared
    it with other drafters under a label, else the plain ones."""
    methods = evaluation["methods"]
    suffix = _rows_of(evaluation, drafter_path)
    return {name: methods[name + suffix] for name in methods
            if name.startswith("specdiff") and "@" not in name and name + suffix in methods}


def eval_results(evaluation: dict[str, Any], drafter_path: str, verifier: Origin) -> list[Any]:
    """model-index entries: τ and speedup of each of the drafter's methods on eval.json's prompts, with the hardware
    and settings they were measured with."""
    from huggingface_hub import EvalResult

    m = evaluation.get("meta", {})
    prompts = data_source(m.get("prompts"), "tiny test split")
    decode = (m.get("recipe") or {}).get("decode") or {}
    settings = {"verifier": verifier.hub_id or verifier.name, "hardware": hardware(m.get("machine") or {}),
                "temperature": 0, "num_prompts": m.get("num_prompts"), "gamma": decode.get("gamma"),
                "max_new_tokens": decode.get("max_new_tokens"), "baseline": m.get("baseline")}
    settings = {k: v for k, v in settings.items() if v is not None}
    results = []
    for method, row in drafter_rows(evaluation, drafter_path).items():
        common = dict(task_type="text-generation", task_name=f"Speculative decoding ({method}) with {verifier.short}",
                      dataset_type=prompts.hub_id or re.sub(r"[^\w.-]+", "-", prompts.name).strip("-"),
                      dataset_name=prompts.name, metric_args=settings)
        results.append(EvalResult(metric_type="mean_accepted_length", metric_name="τ (tokens per verifier forward)",
                                  metric_value=round(float(row["tau"]), 4), **common))
        results.append(EvalResult(metric_type="speedup", metric_name=f"speedup vs the {m.get('baseline', 'AR baseline')}",
                                  metric_value=round(float(row["speedup"]), 4), **common))
    return results


def front_matter(*, title: str, base: Origin, relation: Optional[str], licence_: Licence, library: str,
                 tags: list[str], datasets: list[str], results: list[Any]) -> str:
    """The card's YAML front matter, written by huggingface_hub's ModelCardData (the Hub's own field names)."""
    from huggingface_hub import ModelCardData

    data = ModelCardData(
        model_name=title if results else None, license=licence_.license, license_name=licence_.name, license_link=licence_.link,
        # `other`, not text-generation: a drafter only proposes tokens for a verifier (alone its text is no model's
        # output), and without a tag the Hub would infer text-generation from the architecture and offer a widget.
        library_name=library, pipeline_tag="other", tags=tags, datasets=datasets or None,
        base_model=base.hub_id, base_model_relation=relation if base.hub_id else None,
        eval_results=results or None,
    )
    return f"---\n{data.to_yaml()}\n---\n"


# --------------------------------------------------------------------------------------------------------------------
# no paths of this machine in the folder
# --------------------------------------------------------------------------------------------------------------------
# An absolute path of two or more parts (POSIX, home-relative or a Windows drive), not inside a URL, an org/name id
# or markup: `/tmp/run/ck` is one, `</s>`, `/no_think`, `https://huggingface.co/org/name` and `tokens/s` are not.
_PART = r"[^\s'\"`,;=()\[\]{}<>|*/\\]+"
_ABSOLUTE = re.compile(rf"(?<![\w.:/~<\\-])((?:~|[A-Za-z]:)?[/\\]{_PART}(?:[/\\]{_PART})+[/\\]?)")
# Tokenizer data and chat templates hold vocabulary and markup, never paths, and must stay byte for byte.
_VERBATIM_FILES = {"tokenizer.json", "vocab.json", "merges.txt", "added_tokens.json"}
_VERBATIM_KEYS = {"chat_template", "added_tokens_decoder", "vocab", "merges"}
# Keys that only say how this machine loaded a file: transformers reads them back, and `local_files_only: true`
# would stop a tokenizer downloaded from the Hub from fetching anything.
_MACHINE_KEYS = {"_name_or_path", "name_or_path", "local_files_only", "is_local", "_commit_hash"}


def path_identity(path: str) -> str:
    """What a reader may see of a path of this machine: a Hub cache snapshot's id, a path relative to the working
    folder (the align checkout, where recipes name checkpoints/ and data/), or the basename."""
    hub_id = snapshot_hub_id(path)
    if hub_id:
        return hub_id
    expanded = Path(os.path.expanduser(path))
    basename = re.split(r"[/\\]", path.rstrip("/\\"))[-1] or "."  # a Windows path's parts too
    if not expanded.is_absolute():
        return basename
    try:
        return expanded.resolve().relative_to(Path.cwd().resolve()).as_posix() or "."
    except (ValueError, OSError):
        return basename


def scrub_text(text: str) -> str:
    return _ABSOLUTE.sub(lambda m: path_identity(m.group(1)), text)


def scrub(value: Any) -> Any:
    """`value` (JSON-like) with every path of this machine cut to `path_identity`."""
    if isinstance(value, str):
        return scrub_text(value)
    if isinstance(value, dict):
        return {k: v if k in _VERBATIM_KEYS else scrub(v) for k, v in value.items()}
    if isinstance(value, list):
        return [scrub(v) for v in value]
    return value


def scrub_folder(folder: Path) -> None:
    """Rewrite the folder's JSON, YAML and text files without this machine's paths (code is left as written)."""
    for path in sorted(folder.rglob("*")):
        if not path.is_file() or path.name in _VERBATIM_FILES:
            continue
        if path.suffix == ".json":
            data = json.loads(path.read_text())
            clean = scrub(data)
            if isinstance(clean, dict):  # a model's or tokenizer's own config: its loading hints go
                clean = {k: v for k, v in clean.items() if k not in _MACHINE_KEYS}
            if clean != data:
                path.write_text(json.dumps(clean, indent=2, ensure_ascii=False) + "\n")
        elif path.suffix in (".yaml", ".yml", ".md", ".txt"):
            text = path.read_text()
            if scrub_text(text) != text:
                path.write_text(scrub_text(text))


def title(recipe: Recipe, what: str) -> str:
    """The card's title: the Hub repo's name when pushed, else what the drafter is (never the output folder's name)."""
    return recipe.export.push_to_hub.split("/")[-1] if recipe.export.push_to_hub else what


def training_data(meta: dict[str, Any]) -> DataSource:
    """The prompts the verifier continued for the training trajectories (data.train_prompts of the training run)."""
    return data_source(((meta.get("recipe") or {}).get("data") or {}).get("train_prompts"),
                       "the tiny train split (functions of the Python standard library's source)")


def model_card(config: dict[str, Any], meta: dict[str, Any], evaluation: Optional[dict[str, Any]], recipe: Recipe,
               command: str, base_model: str) -> str:
    """README.md of an align-format export. `base_model`: the drafter it was trained from (meta.json's
    drafter_base), or the exported drafter itself when align did not train it (no meta.json)."""
    spec = config.get("drafter_spec", {})
    trained_with = meta.get("verifier")  # the training run's verifier, when its path still resolves here
    usable = trained_with and (Path(trained_with).is_dir() or is_hub_id(trained_with))
    base, verifier = origin(base_model), origin(trained_with if usable else recipe.verifier.path)
    trained = bool(meta)
    data = training_data(meta) if trained else None
    name = title(recipe, f"{base.short} aligned to {verifier.short}" if trained
                 else f"{base.short}, a diffusion drafter for {verifier.short}")
    licence_ = licence(recipe, base)
    results = eval_results(evaluation, recipe.drafter.path, verifier) if evaluation else []
    front = front_matter(title=name, base=base, relation="finetune" if trained else None, licence_=licence_,
                         library="transformers", tags=["speculative-decoding", "diffusion-drafter", "align"],
                         datasets=[data.hub_id] if data and data.hub_id else [], results=results)
    body = [
        f"# {name}", "",
        f"A discrete-diffusion drafter for speculative decoding with **{verifier.hub_id or verifier.name}** as the "
        + (f"verifier, aligned with align from {base.markdown()}." if trained
           else f"verifier: {base.markdown()}, exported by align with its DrafterSpec."), "",
        f"DrafterSpec: mask token id {spec.get('mask_token_id')}, logits shift {spec.get('logits_shift')}, "
        f"attention `{spec.get('attention')}` (stored in `config.json` under `drafter_spec`).", "",
        "## Models and data", "",
        f"- Drafter base: {base.described}" + (" (this folder holds it fine-tuned)." if trained else "."),
        f"- Verifier: {verifier.described}: the model whose output this drafter's decoding reproduces exactly.",
        *([f"- Training prompts: {data.described}, continued by the verifier (align trajectories)."] if data else []),
        licence_.card_line(), "",
    ]
    if evaluation:
        body += measured_table(evaluation, recipe.drafter.path)
    if meta:
        train = meta.get("recipe", {}).get("train", {})
        losses = ", ".join(f"`{name}` × {weight}" for name, weight in (train.get("losses") or {}).items())
        tuning = f"LoRA r={train['lora_r']}" if train.get("lora_r") else "full fine-tuning"
        metrics = meta.get("metrics", {})
        body += ["## Training", "",
                 f"Step {meta.get('step')} of `{base.hub_id or base.name}`, aligned to the verifier on "
                 f"its own continuations with {losses} (γ = {train.get('gamma')}, {meta.get('world_size')} "
                 f"DeepSpeed processes, ZeRO {train.get('zero_stage')}, {tuning}).",
                 ""]
        if "greedy_streak" in metrics:
            body += [f"Held-out simulated accepted length at the end: greedy streak {metrics['greedy_streak']:.2f}, "
                     f"expected streak {metrics['expected_streak']:.2f} draft tokens per window"
                     + (f"; real τ of SpecDiff greedy decoding on {meta['final_tau_prompts']} held-out prompts "
                        f"{meta['final_tau']:.2f}." if "final_tau" in meta else "."), ""]
    name = recipe.export.push_to_hub or "THIS_FOLDER"
    verifier_ref = verifier_reference(recipe, verifier)
    kind = spec.get("kind", "standalone")
    auto_class = drafter_auto_class(config)
    remote = ", trust_remote_code=True" if config.get("auto_map") else ""
    training = (["`recipe.yaml` in this folder is the resolved recipe that trained the drafter (every default filled "
                 "in):", "", "```bash", "align trajectories recipe.yaml --num_gpus N",
                 "align train recipe.yaml --num_gpus N        # or: deepspeed --num_gpus N align/train.py recipe.yaml"]
                if meta.get("recipe") else ["align did not train this drafter; the commands that measured and exported "
                                            "it:", "", "```bash"])
    body += ["## Reproduce", "", *training,
             *([evaluation["meta"]["command"]] if evaluation and evaluation.get("meta", {}).get("command") else []),
             command, "```", "",
             "## Use", "", how_to_read(config, spec), "",
             *(custom_generate_usage(name, auto_class, remote, recipe, verifier_ref) if ships_custom_generate(config)
               else []),
             "With align's lossless runtime (install align from its repository: `pip install -e <align checkout>`; "
             "the PyPI package named `align` is an unrelated project):", "",
             "```python", "import torch", "from transformers import AutoModelForCausalLM, AutoTokenizer"
             + (f", {auto_class}" if auto_class != "AutoModelForCausalLM" else ""),
             *(["import align.dflash  # registers the DFlash drafter with AutoModel"] if kind == "dflash" else []),
             "from align.decoding.specdiff import specdiff_generate", "from align.models import DrafterSpec", "",
             f"drafter = {auto_class}.from_pretrained(\"{name}\"{remote}, dtype=torch.float32)",
             "spec = DrafterSpec(**drafter.config.drafter_spec)",
             f"verifier = AutoModelForCausalLM.from_pretrained(\"{verifier_ref}\", dtype=torch.float32)  # {FLOAT32_WHY}",
             f"ids = AutoTokenizer.from_pretrained(\"{name}\")(\"def add(a, b):\", return_tensors=\"pt\").input_ids",
             "tokens, stats = specdiff_generate(verifier, drafter, spec, ids, gamma=8, max_new_tokens=64)",
             "print(stats.tau)  # tokens per verifier forward; tokens are exactly the verifier's greedy output", "```",
             ""]
    return front + "\n".join(body)


def ships_custom_generate(config: dict[str, Any]) -> bool:
    """Whether the folder carries custom_generate/generate.py: it decodes standalone drafters that read masks (not
    DFlash drafters, which read the verifier's hidden states, nor DiffusionGemma's encoder-decoder noise canvas)."""
    spec = config.get("drafter_spec", {})
    return (spec.get("kind", "standalone") == "standalone" and spec.get("noise", "mask") == "mask"
            and config.get("model_type") not in CANVAS_DECODER_FAMILIES)


# Why the snippets load the verifier in float32 (transformers' default is the checkpoint's dtype, often bf16).
FLOAT32_WHY = "float32: greedy output identical to the verifier's own"
BF16_CAVEAT = ("In bf16 (or fp16) greedy output is identical up to those numerics: a verifier forward scores γ + 1 "
               "positions where `generate()` scores one, kernels that are not batch-invariant round the two "
               "differently, and a near-tie can flip an argmax (measured on the tiny family on a CPU: 3 prompts of 16 "
               "diverged from `generate()` in bf16 at 64 new tokens).")


def verifier_reference(recipe: Recipe, verifier: Origin) -> str:
    """How the card's snippets name the verifier: export.verifier_hub_id, else its Hub id, else a placeholder for
    the reader's own copy of a local verifier (whose path the folder never names)."""
    return recipe.export.verifier_hub_id or verifier.hub_id or "VERIFIER_FOLDER"


def custom_generate_usage(name: str, auto_class: str, remote: str, recipe: Recipe, verifier_ref: str) -> list[str]:
    """The card's first snippet: SpecDiff decoding with transformers alone, through this folder's custom_generate."""
    return ["With `transformers` alone (this folder's `custom_generate/generate.py` runs SpecDiff decoding: greedy "
            "output identical to the verifier's `generate()` in float32, sampling by speculative sampling, so "
            "lossless either way; one prompt at a time):", "",
            "```python", "import torch", "from transformers import AutoModelForCausalLM, AutoTokenizer"
            + (f", {auto_class}" if auto_class != "AutoModelForCausalLM" else ""), "",
            f"drafter = {auto_class}.from_pretrained(\"{name}\"{remote}, dtype=torch.float32)",
            f"verifier = AutoModelForCausalLM.from_pretrained(\"{verifier_ref}\", dtype=torch.float32)  # {FLOAT32_WHY}",
            f"ids = AutoTokenizer.from_pretrained(\"{name}\")(\"def add(a, b):\", return_tensors=\"pt\").input_ids",
            f"out = verifier.generate(ids, assistant_model=drafter, custom_generate=\"{name}\", trust_remote_code=True,",
            f"                        max_new_tokens=64, gamma={recipe.decode.gamma}, return_dict_in_generate=True)",
            "print(out.sequences, out.tau)  # τ: tokens per verifier forward", "```", "",
            "`trust_remote_code=True` lets transformers run `custom_generate/generate.py` (torch and transformers "
            "only; read it first). `gamma` is the number of draft tokens per verifier forward. `do_sample=True` "
            "samples as `generate()` does, with its defaults and every logits processor it builds (`temperature`, "
            "`top_k` (50 when unset), `top_p`, `min_p`, `typical_p`, `repetition_penalty`, `no_repeat_ngram_size`, "
            "`bad_words_ids`, ...); what it cannot reproduce (beams, stop strings, guidance, a `logits_processor` "
            "list) it refuses by name.", "", BF16_CAVEAT, ""]


def drafter_auto_class(config: dict[str, Any]) -> str:
    """The transformers Auto class that loads the drafter with its LM head (align/models.py `_load` tries the same)."""
    if config.get("model_type") in CANVAS_DECODER_FAMILIES:
        return "AutoModelForImageTextToText"  # DiffusionGemma: AutoModel would build it without its LM head
    auto_map = config.get("auto_map") or {}
    if config.get("drafter_spec", {}).get("kind") == "dflash" or (auto_map and "AutoModelForCausalLM" not in auto_map):
        return "AutoModel"  # DFlash drafters; Dream/DiffuCoder register their LM under AutoModel only
    return "AutoModelForCausalLM"


def how_to_read(config: dict[str, Any], spec: dict[str, Any]) -> str:
    """One paragraph: how the drafter proposes a block, for its kind (the card's "Use" section)."""
    if spec.get("kind") == "dflash":
        return ("A DFlash-style drafter: it denoises `[last accepted token] ⊕ mask×(b−1)` in one forward, conditioned "
                "on the verifier's hidden states at `aux_hidden_state_layer_ids`, with the verifier's embeddings and "
                "LM head. To serve it in vLLM, export it with `export.format=speculators`.")
    fill = ("one fixed uniform random draw (`noise_fill`, seed `noise_seed`), the noise it was trained to denoise"
            if spec.get("noise") == "uniform" else "`mask_token_id`")
    return (f"`config.drafter_spec` says how to draft: fill γ positions after the context with {fill} and read their "
            "logits (shifted by `logits_shift`).")


def measured_table(evaluation: dict[str, Any], drafter_path: str) -> list[str]:
    """The card's table from eval.json: the baselines, and the exported drafter's rows. When eval.json compared it
    with another drafter in the same run (eval.compare_drafters, e.g. before/after alignment), the other's τ is shown
    beside it."""
    m = evaluation.get("meta", {})
    methods = evaluation["methods"]
    suffix = _rows_of(evaluation, drafter_path)
    before = origin(m["drafter"]).name if suffix and m.get("drafter") else None  # its name, not its path
    header = "| method | τ (tokens per verifier forward) | speedup | exact match with AR greedy |"
    rule = "|---|---|---|---|"
    if before:
        header, rule = header + f" τ with `{before}` |", rule + "---|"
    prompts = data_source(m.get("prompts"), "tiny test split")
    lines = [f"## Measured ({m.get('num_prompts', '?')} prompts from {prompts.described}, temperature 0, on "
             f"{hardware(m.get('machine') or {})}; speedup vs the {m.get('baseline', 'AR baseline')})", "",
             header, rule]
    for name, r in methods.items():
        drafted = name.startswith("specdiff")  # a diffusion-drafter method: one row per drafter compared
        row = methods.get(name + suffix) if drafted else r
        if "@" in name or row is None:
            continue  # other drafters' rows
        line = f"| {name} | {row['tau']:.2f} | {row['speedup']:.2f}× | {row['exact_match']} |"
        if before:
            line += f" {r['tau']:.2f} |" if drafted else " — |"
        lines.append(line)
    return lines + ["", exact_match_line(m), ""]


def exact_match_line(meta: dict[str, Any]) -> str:
    """What the table's exact match means, from eval.json's exact_match_semantics (schema 3), else its machine."""
    semantics = meta.get("exact_match_semantics")
    if semantics:
        return (f"Exact match: the fraction of prompts whose output equals AR greedy's, measured on "
                f"{semantics['device']} in {semantics['dtype']}: {semantics['guarantee']}.")
    machine = meta.get("machine") or {}
    return (f"Exact match: the fraction of prompts whose output equals AR greedy's, measured in "
            f"{machine.get('dtype', 'the dtype eval ran in')} (in float32 identity is exact; in bf16 it holds up to "
            "bf16's numerics).")


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
    if (source / "adapter_config.json").is_file():
        raise RecipeError(f"drafter.path: {source} is a LoRA adapter; export a merged step_<N> folder from align train")
    poisoned = non_finite_weights(source)  # align train never saves such weights; a folder from elsewhere may hold them
    if poisoned:
        raise RecipeError(f"drafter.path: {poisoned} holds NaN or infinite weights; a Hub folder of it would decode "
                          "garbage: export a checkpoint with finite weights")
    with atomic_folder(out, "export") as tmp:
        if recipe.export.format == "speculators":
            fill_speculators_folder(recipe, command, source, tmp)
        else:
            fill_folder(recipe, command, source, tmp)
        scrub_folder(tmp)  # the run records and loading hints name this machine's paths


def fill_speculators_folder(recipe: Recipe, command: str, source: Path, tmp: Path) -> None:
    """A DFlash drafter as speculators saves one: config.json (speculators_config, aux_hidden_state_layer_ids,
    mask_token_id, block_size), model.safetensors under vLLM's qwen3_dflash weight names with the verifier's
    embeddings and LM head copied in, the tokenizer, and a card that says how to serve it."""
    from align.dflash import write_speculators_folder
    from align.models import is_dflash, load_drafter, load_tokenizer, load_verifier

    tokenizer = load_tokenizer(str(source))
    drafter, _ = load_drafter(recipe.drafter, tokenizer)
    if not is_dflash(drafter):
        raise RecipeError(f"export.format: speculators takes a DFlash drafter; {source} is a standalone diffusion "
                          "drafter (export.format=align)")
    # The config names its verifier: by export.verifier_hub_id when set (a local verifier's path is cut to its
    # folder's name with the machine's other paths).
    config = write_speculators_folder(drafter, load_verifier(recipe.verifier),
                                      recipe.export.verifier_hub_id or recipe.verifier.path, tokenizer, tmp)
    evaluation, meta = copy_run_records(recipe, source, tmp)
    (tmp / "README.md").write_text(speculators_card(config, meta, evaluation, recipe, command))
    copy_licence_file(recipe, origin(recipe.verifier.path), tmp)


def speculators_card(config: dict[str, Any], meta: dict[str, Any], evaluation: Optional[dict[str, Any]],
                     recipe: Recipe, command: str) -> str:
    """README.md of a speculators-format export. Its base model is the verifier: the folder carries the verifier's
    embeddings and LM head, so their licence is the folder's (unless export.license says otherwise)."""
    name = recipe.export.push_to_hub or "THIS_FOLDER"
    k = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    verifier = origin(recipe.verifier.path)
    verifier_ref = verifier_reference(recipe, verifier)
    data = training_data(meta) if meta else None
    heading = title(recipe, f"DFlash drafter for {verifier.short}")
    licence_ = licence(recipe, verifier)
    results = eval_results(evaluation, recipe.drafter.path, verifier) if evaluation else []
    front = front_matter(title=heading, base=verifier, relation=None, licence_=licence_, library="speculators",
                         tags=["speculative-decoding", "dflash", "speculators", "align"],
                         datasets=[data.hub_id] if data and data.hub_id else [], results=results)
    body = [
        f"# {heading}", "",
        f"A DFlash-style block-diffusion drafter for **{verifier.hub_id or verifier.name}**, trained with align, in the "
        "`speculators` format: one forward denoises `[anchor] ⊕ MASK×(block_size−1)` conditioned on the verifier's "
        f"hidden states entering layers {config['aux_hidden_state_layer_ids']} (projected by `fc`), with the "
        f"verifier's embeddings and LM head (copied in). Block size {config['block_size']}, mask token id "
        f"{config['mask_token_id']}, {config['transformer_layer_config']['num_hidden_layers']} draft layer(s).", "",
        "## Models and data", "",
        f"- Verifier (and base model: its embeddings and LM head are in this folder): {verifier.described}.",
        *([f"- Training prompts: {data.described}, continued by the verifier (align trajectories)."] if data else []),
        licence_.card_line(), "",
    ]
    if evaluation:
        body += measured_table(evaluation, recipe.drafter.path)
    if meta.get("final_tau") is not None:
        body += [f"align's real τ of SpecDiff greedy decoding on {meta.get('final_tau_prompts')} held-out prompts at "
                 f"the end of training: {meta['final_tau']:.2f}.", ""]
    body += ["## Serve with vLLM", "",
             "`\"method\": \"dflash\"` is needed unless the drafter's path contains `dflash` (vLLM 0.32 guesses the "
             "method from the path, and runs any other as a standalone draft model).", "",
             "```bash", f"vllm serve {verifier_ref} --speculative-config "
             f"'{{\"method\": \"dflash\", \"model\": \"{name}\", \"num_speculative_tokens\": {k}}}'", "```", "",
             "```python", "from vllm import LLM, SamplingParams", "",
             'if __name__ == "__main__":  # the engine runs in a child process',
             f"    llm = LLM(model=\"{verifier_ref}\", speculative_config={{\"method\": \"dflash\", "
             f"\"model\": \"{name}\", \"num_speculative_tokens\": {k}}},",
             "              # a 1 GiB KV cache: on a CPU vLLM otherwise reserves 92% of the memory, and refuses to",
             "              # start when less is free (on a GPU, drop it to let vLLM size the cache)",
             "              kv_cache_memory_bytes=1 << 30)",
             "    print(llm.generate([\"def add(a, b):\"], SamplingParams(temperature=0, max_tokens=64)))", "```", "",
             "With align's lossless runtime instead: `align.dflash.load_speculators_dflash(folder)` gives the drafter "
             "back, and `align.decoding.specdiff.specdiff_generate(verifier, drafter, spec, ids, gamma, n)` decodes "
             "with it.", "", "## Reproduce", "", "```bash", *([meta["command"]] if meta.get("command") else []),
             command, "```", ""]
    return front + "\n".join(body)


def fill_folder(recipe: Recipe, command: str, source: Path, tmp: Path) -> None:
    from align.models import drafter_spec_from_config, load_tokenizer

    # meta.json becomes the card; the checksums (checked when read) would no longer match the files written here
    shutil.copytree(source, tmp, ignore=shutil.ignore_patterns("meta.json", CHECKSUMS, "*.tmp", MARKER), dirs_exist_ok=True)
    config = json.loads((tmp / "config.json").read_text())
    if "drafter_spec" not in config:
        from transformers import AutoConfig

        remote = recipe.drafter.trust_remote_code  # Dream, DiffuCoder, LLaDA: their config class ships with them
        spec = drafter_spec_from_config(AutoConfig.from_pretrained(source, trust_remote_code=remote),
                                        load_tokenizer(str(source), remote),
                                        recipe.drafter.mask_token_id, recipe.drafter.logits_shift,
                                        recipe.drafter.attention)
        config["drafter_spec"] = spec.to_dict()
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
    if recipe.calibrate.graph:
        shutil.copy2(recipe.calibrate.graph, tmp / "draft_graph.json")
    if ships_custom_generate(config):
        # transformers' Hub mechanism for decoding loops: SpecDiff from this folder with transformers alone.
        (tmp / "custom_generate").mkdir()
        shutil.copy2(Path(__file__).with_name("custom_generate.py"), tmp / "custom_generate" / "generate.py")
    evaluation, meta = copy_run_records(recipe, source, tmp)
    base_model = meta.get("drafter_base") or recipe.drafter.path
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
